"""vramplan.planner"""

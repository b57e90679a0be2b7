"""vramplan.hardware"""

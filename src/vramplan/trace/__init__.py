"""vramplan.trace"""

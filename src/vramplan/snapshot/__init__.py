"""vramplan.snapshot"""

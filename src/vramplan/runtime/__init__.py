"""vramplan.runtime"""

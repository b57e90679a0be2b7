"""vramplan.analytic"""

"""vramplan.allocator"""

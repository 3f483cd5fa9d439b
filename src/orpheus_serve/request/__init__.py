"""request"""

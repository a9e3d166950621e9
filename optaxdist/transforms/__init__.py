"""Gradient transformations, one algorithm family per module."""

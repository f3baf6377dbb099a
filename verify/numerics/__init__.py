"""Numerics: the float64 reference and stock baseline, tolerances, and the three-tier comparison."""

"""Reductions: sums, means, variances, extrema, norms, logical reductions."""

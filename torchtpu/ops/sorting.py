"""Sorting, top-k, scans (cumsum, cumprod, cummax, ...), searchsorted."""

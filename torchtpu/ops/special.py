"""Special functions (erf, gamma family, Bessel, ...)."""

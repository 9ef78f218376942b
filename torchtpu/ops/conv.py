"""Convolution and its backward."""

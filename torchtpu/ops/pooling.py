"""Pooling and upsampling, with their backward ops."""

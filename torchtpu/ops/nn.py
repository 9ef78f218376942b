"""Normalisation, softmax, losses and other neural-network ops, with their backward ops."""

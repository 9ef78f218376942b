"""Ops whose output shape depends on values: nonzero, masked_select, unique, boolean indexing."""

"""Indexing: gather, scatter, index, index_put, index_select, masked ops, embedding."""

"""Functional lowerings of view ops (view, permute, slice, select, expand, as_strided, ...), used where views are values (compiled graphs, decompositions)."""

"""Shape and layout ops that produce new tensors: cat, pad, flip, roll, repeat, tril/triu, *_scatter, clone."""

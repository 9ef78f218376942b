"""Matrix products (mm, bmm, addmm, ... with TPU precision modes) and linear algebra."""

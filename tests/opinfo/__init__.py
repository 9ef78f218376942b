"""PyTorch's OpInfo database run on `tpu` against CPU (see README.md)."""

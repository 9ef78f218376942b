"""Imports every family of lowerings, which fills the registry."""

from torchtpu.ops import pointwise  # noqa: F401

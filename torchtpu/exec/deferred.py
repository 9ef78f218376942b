"""DeferAndFuse: record ops, fuse everything pending into one XLA program when a value is needed."""

from __future__ import annotations


def flush(reason: str) -> None:
    """Run everything pending."""


def materialize(buffer, reason: str) -> None:
    """Make `buffer.value` a concrete array."""


def forget(buffer) -> None:
    """`buffer` is about to be overwritten from the host: drop its pending value."""

"""Entry point of the `torch.backends` group: `import torch` registers the tpu device."""


def register() -> None:
    import torchtpu  # noqa: F401  (importing registers the device)

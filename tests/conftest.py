"""Test-session set-up shared by every test package.

The CPU stand-in for TPU chips is JAX's CPU platform with several virtual devices. The device
count must be fixed before the JAX runtime starts, so it is set here, before any test imports jax.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TORCHTPU_NUM_DEVICES", "4")

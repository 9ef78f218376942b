"""`torch.compile(model)` with PyTorch's default backend, Inductor, on `tpu` tensors: a clear error.

Inductor generates code per device type, and for "tpu" it has Pallas kernels that call into
Google's `torch_tpu` package; on torchtpu's device its generated code failed with "No module
named 'torch_tpu'", which sends a user looking for a package they must not install. torchtpu
compiles through its own backend (`torch.compile(model, backend="tpu")`, torchtpu.exec.compile),
so it registers, as an out-of-tree device does, Inductor code generation for "tpu" whose first
use raises `InductorOnTpuError` saying so. Inductor fills its registry of devices on first use
and leaves a device it finds registered alone.

The registry lives in Inductor, which `import torch` does not import (importing Inductor costs
~1 s, and `import torch` imports torchtpu): the entry is registered once Inductor's `compile_fx`,
which every Inductor compilation goes through, has been imported, by a one-shot import hook
(`_after_import`; registering while Inductor's own modules are still being imported would meet
them half made).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable

_COMPILE_FX = "torch._inductor.compile_fx"  # imported before Inductor compiles anything


class InductorOnTpuError(RuntimeError):
    """Inductor was asked to generate code for the tpu device."""


def install() -> None:
    """Register Inductor's code generation for "tpu" now, or once Inductor's `compile_fx` is imported."""
    if _COMPILE_FX in sys.modules:
        _register()
    else:
        sys.meta_path.insert(0, _after_import(_COMPILE_FX, _register))


def _register() -> None:
    from torch._inductor.codegen.common import register_backend_for_device
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    from torch._inductor.scheduler import BaseScheduling

    class RefusedScheduling(BaseScheduling):
        def __init__(self, *args, **kwargs) -> None:
            _refuse()

    class RefusedWrapper(PythonWrapperCodegen):
        @classmethod
        def create(cls, *args, **kwargs):
            _refuse()

    register_backend_for_device("tpu", RefusedScheduling, RefusedWrapper)


def _refuse() -> None:
    """Whichever of Inductor's code generators for the tpu device it makes first for a graph."""
    raise InductorOnTpuError(
        "torch.compile's default backend, Inductor, cannot compile for torchtpu's tpu device (its TPU code "
        "generation is for Google's torch_tpu package): compile with torch.compile(model, backend=\"tpu\")"
    )


def _after_import(name: str, then: Callable[[], None]) -> importlib.abc.MetaPathFinder:
    """A finder that, on the first import of module `name`, lets the usual finders load it, then
    calls `then()`, and leaves `sys.meta_path`."""

    class AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            load = spec.loader.exec_module

            def exec_module(module) -> None:
                load(module)
                then()

            spec.loader.exec_module = exec_module
            return spec

    return AfterImport()

"""The kernel object and the twins (`_kernels`): the same calls with the same signatures, each twin
in the module of its kernel call."""

from __future__ import annotations

import inspect

import pytest

from mamba_stream.scan.exact import TWIN_OPS, TWIN_OPS_FMA
from mamba_stream.scan.exact._kernels import _Kernels

#: the kernel calls without a twin of their own: the one-call decode steps, a layer's (whose twin
#: is the primitives' path through the mixer) and a model's (whose twin is the forward pass's loop
#: over the layers; tests/scan/exact/test_step.py holds both)
NO_TWIN = {"step", "step_model"}


def _calls() -> dict[str, tuple[type, object]]:
    """Every public kernel call of `_Kernels`: name -> (the part that defines it, the function)."""
    found = {}
    for part in _Kernels.__mro__:
        for name, fn in vars(part).items():
            if not name.startswith("_") and inspect.isfunction(fn):
                found.setdefault(name, (part, fn))
    return found


def test_every_kernel_call_has_a_twin_and_every_twin_a_kernel_call():
    twins = {name for name in dir(TWIN_OPS) if not name.startswith("_")}
    assert set(_calls()) - NO_TWIN == twins


@pytest.mark.parametrize("twins", [TWIN_OPS, TWIN_OPS_FMA], ids=["exact-1", "exact-2"])
@pytest.mark.parametrize("name", sorted(set(_calls()) - NO_TWIN))
def test_a_twin_has_its_kernel_calls_signature_and_sits_in_its_module(name, twins):
    part, kernel = _calls()[name]
    twin = getattr(twins, name)
    params = list(inspect.signature(kernel).parameters.values())
    assert params[0].name == "self"
    assert inspect.signature(kernel).replace(parameters=params[1:]) == inspect.signature(twin), name
    assert twin.__module__ == part.__module__ == kernel.__module__, (name, twin.__module__, part.__module__)
    assert twin.__name__ in (f"{name}_ref", "linear_fma_ref"), twin.__name__
    assert twin.__doc__ and kernel.__module__.startswith("mamba_stream.scan.exact._")

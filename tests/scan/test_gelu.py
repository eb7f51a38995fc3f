"""The exact (erf) GELU of `scan._ops.gelu` (Zamba2's MLP activation), built of IEEE-exact
elementwise operations and the backend's exp: close to the true function, elementwise (the same bits
whatever the tensor's shape, slice or batch), and the same bits under every instruction set torch
dispatches to (with the exact backend's exp, which is the same on every CPU)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mamba_stream.scan._ops import gelu
from mamba_stream.scan.exact._kernels import TWIN_OPS, _kernel_ops

ROOT = Path(__file__).resolve().parents[2]


def _grid() -> torch.Tensor:
    """Float32 inputs of every magnitude without any arithmetic (int32 bit patterns read as float32,
    so the grid is the same bits everywhere): a dense sweep of [-12, 12] (about 2.1M values, every
    binade down to the subnormals), a coarse one out to the largest finite float, both signs, and
    +-inf."""
    dense = torch.arange(0, 0x41400001, 1031, dtype=torch.int32)  # +0 .. 12.0
    coarse = torch.arange(0x41400000, 0x7F800000, 65537, dtype=torch.int32)  # 12.0 .. max finite
    bits = torch.cat([dense, coarse, torch.tensor([0x7F7FFFFF, 0x7F800000], dtype=torch.int32)])
    pos = bits.view(torch.float32)
    return torch.cat([pos, -pos])


def _truth(x: torch.Tensor) -> torch.Tensor:
    """GELU in float64 through erfc (no 1 + erf cancellation in the negative tail)."""
    xd = x.double()
    return xd * 0.5 * torch.special.erfc(-xd * 0.5**0.5)


def _exps() -> dict[str, object]:
    out: dict[str, object] = {"torch": torch.exp, "exact-twin": TWIN_OPS.exp}
    ops = _kernel_ops()
    if ops is not None:
        out["exact"] = ops.exp
    return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("name", sorted(_exps()))
def test_the_gelu_is_within_4e_7_of_the_truth(name):
    """Measured (this grid of 2.16M finite inputs, every exp): max |error| 3.75e-7 over [-12, 12]
    (torch's own float32 F.gelu: 3.74e-7, the rounding of the result); relative error at most 2.0e-6
    for |x| <= 5 and 1.6e-5 anywhere the result is above 1e-30 (the far negative tail, where the
    rounding of z*z moves exp(-z*z)); +-inf, +-0 and the largest floats exact."""
    exp = _exps()[name]
    x = _grid()
    got = gelu(x, exp)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert got[x == float("inf")].eq(float("inf")).all()
    x, got = x[torch.isfinite(x)], got[torch.isfinite(x)]
    want = _truth(x)
    err = (got.double() - want).abs()
    inner = x.abs() <= 12
    assert float(err[inner].max()) < 4e-7
    torch_err = float((torch.nn.functional.gelu(x[inner]).double() - want[inner]).abs().max())
    assert float(err[inner].max()) < 1.1 * torch_err + 1e-9  # no worse than torch's own, to 10%
    normal = want.abs() > 1e-30
    relative = err[normal] / want[normal].abs()
    assert float(relative.max()) < 2e-5
    assert float((err / want.abs())[(x.abs() <= 5) & normal].max()) < 3e-6
    special = torch.tensor([0.0, -0.0, float("inf"), -3.0e38, 3.0e38])
    out = gelu(special, exp)
    assert out[0] == 0 and out[1] == 0 and out[2] == float("inf") and out[3] == 0 and out[4] == 3.0e38
    assert not bool(got.isnan().any())


@pytest.mark.parametrize("name", sorted(_exps()))
def test_the_gelu_is_elementwise_whatever_the_shape(name):
    """The same bits for each element whatever tensor it sits in: the whole grid, a (B, L, D)
    reshape, unaligned slices (another vector/tail split), a strided view, one element at a time."""
    exp = _exps()[name]
    x = _grid()[:30011]  # odd: no vector width divides it
    whole = gelu(x, exp)
    assert torch.equal(gelu(x.reshape(1, 30011, 1), exp).flatten(), whole)
    assert torch.equal(gelu(x[:30000].reshape(3, 100, 100), exp).flatten(), whole[:30000])
    for lo, hi in ((1, 30011), (3, 29995), (7, 8)):
        assert torch.equal(gelu(x[lo:hi], exp), whole[lo:hi]), (lo, hi)
    assert torch.equal(gelu(x[::3], exp), whole[::3])
    picks = torch.tensor([0, 5, 777, 15000, 30010])
    for i in picks.tolist():
        assert torch.equal(gelu(x[i : i + 1], exp), whole[i : i + 1]), i


_PROBE = r"""
import hashlib, json, sys, torch
sys.path.insert(0, sys.argv[1])
from tests.scan.test_gelu import _digest, _exps, _grid
from mamba_stream.scan._ops import gelu
x = _grid()
out = {name: _digest(gelu(x, exp)) for name, exp in _exps().items() if name != "torch"}
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "digests": out}))
"""


def _cpu_has_avx512() -> bool:
    try:
        return " avx512f " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


@pytest.mark.parametrize("capability", ["avx2", "default"] + (["avx512"] if _cpu_has_avx512() else []))
def test_the_same_bits_under_every_instruction_set(capability):
    """With the exact backend's exp (twins and kernels), a subprocess under ATEN_CPU_CAPABILITY=avx2,
    =default (torch's scalar build) and, where the CPU has it, =avx512 gives this process's bits."""
    x = _grid()
    here = {name: _digest(gelu(x, exp)) for name, exp in _exps().items() if name != "torch"}
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(ROOT)], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=300, check=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["capability"] == capability.upper()  # the override took effect
    assert got["digests"] == here
    if "exact" in here:
        assert here["exact"] == here["exact-twin"]  # and the kernels' exp is the twins'

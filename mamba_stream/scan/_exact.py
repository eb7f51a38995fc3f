"""The exact backend: the same bits under every chunking, batching, thread count and CPU.

Every output element is computed by one fixed sequence of IEEE-754 basic operations (+, -, *,
/, sqrt, rint, exact scaling by powers of two) whatever else is computed beside it:

    products     out[m, n] = x[m] . w[n] + bias[n]: k split into 16 lanes, each summed in order (a
                 multiply then an add, never fused), the lanes added by a fixed tree; the same for
                 one row or a thousand. The weight is read in its stored format (float32, or
                 bfloat16 / float16 widened exactly as it is read); block-int8 weights ("q8")
                 take integer block sums, the blocks added in order (`scan._quant`).
    reductions   sequential, in index order (the means of the norms, the scans' contractions).
    exp, log1p, tanh, sin, cos
                 computed in double from basic operations (a Taylor polynomial after an exact
                 range reduction), then rounded to the compute dtype: no libm, no vector library,
                 so no vector-or-scalar split and no dependence on the instruction set.
    scans        in time order, one token after the other, the same code for a prefill and a
                 decode step.

Since none of these operations depends on the instruction set, the results are the same on
AVX-512, AVX2 and scalar builds: a checksum means the same tokens on any x86-64 worker.

That is arithmetic `exact-1` (backend "exact"). `exact-2` (backend "exact-fma") is the same but
for one operation: each step of a product's lane sums (and of a q8 product's block sums) is one
fused multiply-add, rounded once (IEEE fusedMultiplyAdd), where exact-1 rounds the product and
then the sum. A fused multiply-add has one result on every machine that has the instruction
(x86-64's FMA3, AVX-512) and on every machine that has not (C's fmaf computes it in software), so
exact-2 is as machine-independent as exact-1; it takes one instruction where exact-1 takes two,
which is what an Intel core's two vector ports are short of in a prefill. Its twin computes the
fused multiply-add exactly in float64 (`scan._fma`). exact-2 computes in float32 only.

Two implementations with the same signatures compute this arithmetic: C kernels (`_exact.c`,
compiled at first use by the system C compiler or the `ziglang` wheel, vectorized across
independent elements only) and their pure-PyTorch twins. They give the same bits
(tests/scan/test_exact.py); where the kernels cannot be built, or the probe run at load finds a
kernel that disagrees with its twin or depends on its batch, the backend runs the twins and says
so (path "exact-twin"): slower, with the same results.

Dimension letters as in the mixer modules.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from mamba_stream.scan._backends import EXACT_BACKENDS, Backend, FixedBackend, RoundState, labelled
from mamba_stream.scan._fma import fma_product
from mamba_stream.scan._mamba1 import Mamba1Mixer
from mamba_stream.scan._mamba2 import Mamba2Mixer
from mamba_stream.scan._mamba3 import Mamba3Mixer
from mamba_stream.scan._mixer import States
from mamba_stream.scan._ops import Primitives
from mamba_stream.scan._quant import QB, Q8Weight, linear_q8_twin

__all__ = [
    "ARITHMETIC",
    "ARITHMETIC_FMA",
    "TWIN_OPS",
    "TWIN_OPS_FMA",
    "TWIN_PRIMITIVES",
    "TWIN_STEP_PRIMITIVES",
    "Probe",
    "build_kernels",
    "cache_dir",
    "exact_backend",
    "exact_primitives",
    "exact_step_backend",
    "linear_fma_twin",
    "probe",
    "twin_primitives",
]

log = logging.getLogger(__name__)

Tensor = torch.Tensor

#: The versions of the arithmetic below (`scan._backends.EXACT_BACKENDS`): exact-1, and exact-2
#: with every step of a product's sums one fused multiply-add (module docstring).
ARITHMETIC = EXACT_BACKENDS["exact"]
ARITHMETIC_FMA = EXACT_BACKENDS["exact-fma"]

_SOURCE = Path(__file__).with_name("_exact.c")
# No fused multiply-add, no reassociation: vectorization may only run independent elements side
# by side, which changes no bit. (-fno-fast-math first: it resets the options after it.) Unrolling
# repeats the same operations in the same order: 12-17% on the products (AVX2, Zen 3).
_FLAGS = ["-O3", "-fno-fast-math", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-funroll-loops",
          "-fPIC", "-shared", "-std=gnu11"]


def _march() -> str:
    """The instruction set the kernels are built for ($MAMBA_STREAM_EXACT_MARCH, default native):
    it changes their speed, never their results."""
    return os.environ.get("MAMBA_STREAM_EXACT_MARCH", "native")


_UNARY = {"exp": 0, "silu": 1, "sigmoid": 2, "softplus": 3, "tanh": 4, "sin": 5, "cos": 6, "rsqrt": 7}
#: below this many multiply-adds a scan runs on the calling thread alone: handing half of it to
#: Python's thread pool costs 0.1-0.4 ms on a 2-core VM
_PARALLEL_WORK = 1 << 23
#: below this many multiply-adds a product runs on the calling thread alone. The products split
#: their outputs in C, across helper threads that wait spinning between products (`pool_run` in
#: _exact.c): a hand-off costs microseconds, not the 0.1-0.4 ms of Python's pool.
_THREADED_WORK = 1 << 18

# --- the arithmetic in torch: the twins ---------------------------------------------------------

_INV_LN2 = 1.44269504088896338700
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_SQRT_HALF = 0.70710678118654752440
_TWO_OVER_PI = 6.36619772367581382433e-01
_PIO2 = (1.57079632673412561417e00, 6.07710050650619224932e-11, 2.02226624879595063154e-21)
_EXP_POLY = [1.0 / math.factorial(k) for k in range(15)]  # low order first
_EXPM1_POLY = [1.0 / math.factorial(k + 1) for k in range(18)]
_LOG_POLY = [1.0 / (2 * k + 1) for k in range(12)]
_SIN_POLY = [(-1.0) ** k / math.factorial(2 * k + 1) for k in range(10)]
_COS_POLY = [(-1.0) ** k / math.factorial(2 * k + 2) for k in range(9)]


def _horner(x: Tensor, coeffs: list[float]) -> Tensor:
    """coeffs[0] + coeffs[1] x + ..., highest power first, one rounding per operation (as the C)."""
    acc = torch.full_like(x, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * x + c
    return acc


_ROUNDER = 6755399441055744.0  # 1.5 * 2**52: v + _ROUNDER rounds v to an integer (ties to even)


def _exp64(x: Tensor) -> Tensor:
    xc = torch.where(x > 709.0, torch.full_like(x, 709.0), x)
    xc = torch.where(xc < -708.0, torch.full_like(x, -708.0), xc)
    t = xc * _INV_LN2 + _ROUNDER
    k = t - _ROUNDER
    r = (xc - k * _LN2_HI) - k * _LN2_LO
    scale = ((t.view(torch.int64) + 1023) << 52).view(torch.float64)
    out = _horner(r, _EXP_POLY) * scale
    out = torch.where(x > 709.0, torch.full_like(out, math.inf), out)
    return torch.where(x < -708.0, torch.zeros_like(out), out)


def _expm1_64(x: Tensor) -> Tensor:
    small = (x > -0.5) & (x < 0.5)
    series = x * _horner(torch.where(small, x, torch.zeros_like(x)), _EXPM1_POLY)
    return torch.where(small, series, _exp64(x) - 1.0)


def _log_ge1_64(u: Tensor) -> Tensor:
    bits = u.view(torch.int64)
    e = ((bits >> 52) & 0x7FF) - 1023
    m = ((bits & 0x000FFFFFFFFFFFFF) | 0x3FF0000000000000).view(torch.float64)
    big = m > 2.0 * _SQRT_HALF
    m = torch.where(big, m * 0.5, m)
    k = (e + big.to(torch.int64)).to(torch.float64)
    f = m - 1.0
    s = f / (2.0 + f)
    return k * _LN2_HI + (k * _LN2_LO + 2.0 * s * _horner(s * s, _LOG_POLY))


def _log1p_pos64(y: Tensor) -> Tensor:
    u = 1.0 + y
    one = u == 1.0
    safe = torch.where(one, torch.full_like(u, 2.0), u)
    return torch.where(one, y, _log_ge1_64(safe) * (y / (safe - 1.0)))


def _sincos64(x: Tensor) -> tuple[Tensor, Tensor]:
    t = x * _TWO_OVER_PI + _ROUNDER
    n = t - _ROUNDER
    r = ((x - n * _PIO2[0]) - n * _PIO2[1]) - n * _PIO2[2]
    z = r * r
    s = r * _horner(z, _SIN_POLY)
    c = 1.0 - z * _horner(z, _COS_POLY)
    q = t.view(torch.int64) & 3
    sn = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cs = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sn, cs


def _tanh64(x: Tensor) -> Tensor:
    a = x.abs()
    e = _expm1_64(2.0 * torch.where(a > 20.0, torch.zeros_like(a), a))
    t = torch.where(a > 20.0, torch.ones_like(a), e / (e + 2.0))
    return torch.where(x < 0.0, -t, t)


def _rsqrt64(v: Tensor) -> Tensor:
    y = (0x5FE6EB50C7B537A9 - (v.view(torch.int64) >> 1)).view(torch.float64)
    h = 0.5 * v
    for _ in range(5):
        y = y * (1.5 - (h * y) * y)
    return y


def _unary64(x: Tensor, op: str) -> Tensor:
    if op == "rsqrt":
        return _rsqrt64(x)
    if op == "exp":
        return _exp64(x)
    if op == "silu":
        return x / (1.0 + _exp64(-x))
    if op == "sigmoid":
        return 1.0 / (1.0 + _exp64(-x))
    if op == "softplus":
        small = torch.where(x > 20.0, torch.zeros_like(x), x)
        return torch.where(x > 20.0, x, _log1p_pos64(_exp64(small)))
    if op == "tanh":
        return _tanh64(x)
    sn, cs = _sincos64(x)
    return sn if op == "sin" else cs


def unary_twin(x: Tensor, op: str) -> Tensor:
    """`op` of every element, computed in double from basic operations, rounded to x's dtype."""
    return _unary64(x.double(), op).to(x.dtype)


def linear_twin(x: Tensor, weight: Tensor | Q8Weight, bias: Tensor | None = None) -> Tensor:
    """x (..., K) @ weight (N, K)^T in the kernel's order: 16 lanes (lane j sums k = j, j + 16, ...
    in order from 0, a multiply then an add; zeros past K), then the lanes by the fixed tree
    (j, j + 8), (j, j + 4), (j, j + 2), (0, 1); then + bias. A weight stored narrower (bfloat16,
    float16) is widened to x's dtype first, which is exact: the kernel widens each value as it
    reads it. Block-int8 weights take their own arithmetic (`scan._quant`)."""
    return _lane_product(x, weight, bias, fused=False)


def linear_fma_twin(x: Tensor, weight: Tensor | Q8Weight, bias: Tensor | None = None) -> Tensor:
    """`linear_twin` in the exact-2 arithmetic: each lane step one fused multiply-add
    (`scan._fma.fma_product`), as each q8 block's term; float32 only."""
    if x.dtype != torch.float32:
        raise TypeError(f"exact-2 products compute in float32, not {x.dtype}")
    return _lane_product(x, weight, bias, fused=True)


def _lane_product(x: Tensor, weight: Tensor | Q8Weight, bias: Tensor | None, fused: bool) -> Tensor:
    if isinstance(weight, Q8Weight):
        return linear_q8_twin(x, weight, bias, fused=fused)
    if weight.dtype != x.dtype:
        if weight.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"no exact product of {x.dtype} inputs with {weight.dtype} weights")
        weight = weight.to(x.dtype)
    lead, k = x.shape[:-1], x.shape[-1]
    pad = (-k) % 16
    rows = torch.nn.functional.pad(x.reshape(-1, k), (0, pad)).reshape(-1, 1, (k + pad) // 16, 16)
    w = torch.nn.functional.pad(weight, (0, pad)).reshape(1, weight.shape[0], (k + pad) // 16, 16)
    if fused:
        lanes = _fused_lanes(rows, w)
    else:
        lanes = torch.zeros((rows.shape[0], weight.shape[0], 16), dtype=x.dtype)
        for b in range((k + pad) // 16):
            lanes = lanes + rows[:, :, b] * w[:, :, b]
    s8 = lanes[..., :8] + lanes[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    s2 = s4[..., :2] + s4[..., 2:]
    acc = s2[..., 0] + s2[..., 1]
    if bias is not None:
        acc = acc + bias
    return acc.reshape(*lead, weight.shape[0])


#: lane sums of a fused product's twin are taken this many (row, output, lane) values at a time:
#: a block's float64 temporaries stay in cache (the load-time probe runs this twin at 1.4B)
_FMA_BLOCK = 1 << 15


def _fused_lanes(rows: Tensor, w: Tensor) -> Tensor:
    """The 16 lanes of each (row, output), each lane step one fused multiply-add: rows
    (M, 1, KB, 16), w (1, N, KB, 16) float32 -> (M, N, 16) float32. The operands are widened to
    float64 once (exactly), their products taken there exactly, and each sum rounded once
    (`scan._fma.fma_product`); outputs in blocks, which changes no bit."""
    m, n, kb = rows.shape[0], w.shape[1], rows.shape[2]
    rows64 = rows.double()
    step = max(1, _FMA_BLOCK // (16 * max(m, 1)))
    out = []
    for n0 in range(0, n, step):
        w64 = w[:, n0 : n0 + step].double()
        lanes = torch.zeros((m, w64.shape[1], 16), dtype=torch.float32)
        for b in range(kb):
            lanes = fma_product(rows64[:, :, b] * w64[:, :, b], lanes)
        out.append(lanes)
    return torch.cat(out, dim=1) if out else torch.zeros((m, 0, 16), dtype=torch.float32)


def mean_twin(x: Tensor) -> Tensor:
    """Mean over the last dimension (kept), summed in order from 0."""
    acc = torch.zeros_like(x[..., :1])
    for j in range(x.shape[-1]):
        acc = acc + x[..., j : j + 1]
    return acc / x.shape[-1]


def _seq_contract(h: Tensor, c: Tensor) -> Tensor:
    """(((0 + h_0 c_0) + h_1 c_1) + ...) over the last dimension."""
    acc = torch.zeros_like(h[..., 0] * c[..., 0])
    for n in range(h.shape[-1]):
        acc = acc + h[..., n] * c[..., n]
    return acc


def selective_scan_twin(dt: Tensor, at: Tensor, x: Tensor, b: Tensor, cc: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel `selective_scan`: dt, x (B, L, C); at (N, C); b, cc (B, L, N); h0 (B, C, N)."""
    a = at.t()
    h, ys = h0, []
    for t in range(dt.shape[1]):
        decay = unary_twin(dt[:, t].unsqueeze(-1) * a, "exp")
        h = h * decay + (dt[:, t] * x[:, t]).unsqueeze(-1) * b[:, t].unsqueeze(1)
        ys.append(_seq_contract(h, cc[:, t].unsqueeze(1)))
    return torch.stack(ys, dim=1), h


def ssd_twin(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel `ssd_scan`: x (B, L, H, P); dt (B, L, H); a (H,); b, c (B, L, G, N); h0 (B, H, P, N)."""
    _bsz, length, h, _p = x.shape
    g = b.shape[2]
    hg = h // g
    s, ys = h0, []
    for t in range(length):
        d = dt[:, t]
        decay = unary_twin(d * a, "exp")  # (B, H)
        dx = d.unsqueeze(-1) * x[:, t]  # (B, H, P)
        bt = b[:, t].repeat_interleave(hg, dim=1)  # (B, H, N)
        s = s * decay[:, :, None, None] + dx.unsqueeze(-1) * bt.unsqueeze(2)
        ys.append(_seq_contract(s, c[:, t].repeat_interleave(hg, dim=1).unsqueeze(2)))
    return torch.stack(ys, dim=1), s


def angle_twin(inc: Tensor, angle: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel `angle_scan`: inc (B, L, H, S); angle (B, H, S). Returns theta (B, L, H, S), last angle."""
    two_pi = torch.tensor(6.283185307179586, dtype=inc.dtype)
    out = []
    for t in range(inc.shape[1]):
        v = angle + inc[:, t]
        angle = v - two_pi * torch.floor(v / two_pi)
        out.append(angle)
    return torch.stack(out, dim=1), angle


def trapezoid_twin(q: Tensor, k: Tensor, xr: Tensor, alpha: Tensor, beta: Tensor, gamma: Tensor, d: Tensor,
                   s0: Tensor, kp: Tensor, xp: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel `trapezoid_scan`: q, k (B, L, R, H, N); xr (B, L, R, H, P); alpha, beta, gamma
    (B, L, H); d (H,); s0 (B, H, P, N); kp (B, R, H, N), xp (B, R, H, P) the previous token's."""
    s, ys = s0, []
    for t in range(q.shape[1]):
        bx = beta[:, t, None, :, None] * xp  # (B, R, H, P)
        gx = gamma[:, t, None, :, None] * xr[:, t]
        terms = bx.unsqueeze(-1) * kp.unsqueeze(-2) + gx.unsqueeze(-1) * k[:, t].unsqueeze(-2)  # (B, R, H, P, N)
        upd = terms[:, 0]
        for r in range(1, terms.shape[1]):
            upd = upd + terms[:, r]
        s = s * alpha[:, t, :, None, None] + upd
        ys.append(_seq_contract(s.unsqueeze(1), q[:, t].unsqueeze(-2)) + d[:, None] * xr[:, t])
        kp, xp = k[:, t], xr[:, t]
    return torch.stack(ys, dim=1), s


# --- the kernels --------------------------------------------------------------------------------


def cache_dir() -> Path:
    """$MAMBA_STREAM_CACHE, else $XDG_CACHE_HOME/mamba-stream, else ~/.cache/mamba-stream."""
    if os.environ.get("MAMBA_STREAM_CACHE"):
        return Path(os.environ["MAMBA_STREAM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mamba-stream"


def _compilers() -> list[list[str]]:
    found: list[list[str]] = []
    if os.environ.get("MAMBA_STREAM_CC"):
        found.append(os.environ["MAMBA_STREAM_CC"].split())
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            found.append([path])
    try:
        import ziglang  # noqa: F401 - a C compiler shipped as a wheel

        found.append([sys.executable, "-m", "ziglang", "cc"])
    except ImportError:
        pass
    return found


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()}|{hashlib.sha256(flags.encode()).hexdigest()[:16]}"


@functools.cache
def build_kernels() -> tuple[Any, str]:
    """(the loaded kernel library or None, what built it / why there is none). Built once per
    source, compiler and CPU, cached under $MAMBA_STREAM_CACHE (default ~/.cache/mamba-stream)."""
    if os.environ.get("MAMBA_STREAM_EXACT_KERNELS", "1") == "0":
        return None, "kernels disabled (MAMBA_STREAM_EXACT_KERNELS=0)"
    source = _SOURCE.read_bytes()
    errors = []
    flags = [f"-march={_march()}", *_FLAGS]
    for cc in _compilers():
        key = hashlib.sha256(source + " ".join([*cc, *flags]).encode() + _cpu_signature().encode()).hexdigest()[:20]
        target = cache_dir() / f"exact-{key}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
            os.close(fd)
            try:
                proc = subprocess.run([*cc, *flags, "-o", tmp, str(_SOURCE), "-lm", "-pthread"], capture_output=True,
                                      text=True, timeout=300)
                if proc.returncode != 0:
                    errors.append(f"{' '.join(cc)}: {proc.stderr.strip()[:300]}")
                    Path(tmp).unlink(missing_ok=True)
                    continue
                os.replace(tmp, target)
            except (OSError, subprocess.SubprocessError) as exc:
                errors.append(f"{' '.join(cc)}: {exc}")
                Path(tmp).unlink(missing_ok=True)
                continue
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as exc:
            errors.append(f"{target}: {exc}")
            continue
        _declare(lib)
        return lib, f"{Path(cc[-1]).name} -O3 -march={_march()} -ffp-contract=off ({target.name})"
    reason = "; ".join(errors) if errors else "no C compiler (cc, gcc, clang or the ziglang wheel) was found"
    return None, reason


_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
#: every kernel of _exact.c and its arguments (each exists as name_f32 and name_f64)
_SIGNATURES = {
    "unary": [_P, _P, _I, ctypes.c_int],
    "mean_rows": [_P, _P, _I, _I],
    "rms_norm": [_P, _P, _P, _I, _I, _D],
    "gated_norm": [_P, _P, _P, _P, _I, _I, _I, _D, ctypes.c_int],
    "conv": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I],
    "selective_scan": [_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I],
    "ssd_scan": [_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I],
    "angle_scan": [_P, _P, _P, _I, _I, _I, _I, _I],
    "trapezoid_scan": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I],
}
_SUFFIX = {torch.float32: "_f32", torch.float64: "_f64"}
#: the products by the format their weights are stored in: linear_same_f32 reads weights of the
#: computation's dtype, linear_bf16_f32 bfloat16 ones, ...
_WEIGHT_FORMATS = {"same": None, "bf16": torch.bfloat16, "f16": torch.float16}
_LINEAR = [_P, _I, _I, _P, _I, _P, _P, _I, _I]


class _ExactWeight(ctypes.Structure):
    """`struct exact_weight` of _exact.c: a product's weight as held, and its bias."""

    _fields_ = [("format", _I), ("fused", _I), ("w", _P), ("q", _P), ("d", _P), ("d8", _P), ("bias", _P), ("n", _I),
                ("k", _I)]


class _Mamba1Layer(ctypes.Structure):
    """`struct mamba1_layer` of _exact.c: what a Mamba-1 mixer's decode step reads."""

    _fields_ = [("in_proj", _ExactWeight), ("x_proj", _ExactWeight), ("dt_proj", _ExactWeight),
                ("out_proj", _ExactWeight), ("conv_taps", _P), ("conv_bias", _P), ("at", _P), ("dskip", _P),
                ("c", _I), ("n", _I), ("r", _I), ("w", _I), ("threaded_work", _I), ("threads", _I)]


class _Mamba2Layer(ctypes.Structure):
    """`struct mamba2_layer` of _exact.c: what a Mamba-2 mixer's decode step reads."""

    _fields_ = [("in_proj", _ExactWeight), ("out_proj", _ExactWeight), ("conv_taps", _P), ("conv_bias", _P),
                ("dt_bias", _P), ("a", _P), ("dskip", _P), ("norm_w", _P), ("norm_eps", _D), ("e", _I), ("h", _I),
                ("p", _I), ("g", _I), ("n", _I), ("w", _I), ("d_per_channel", _I), ("norm_before_gate", _I),
                ("threaded_work", _I), ("threads", _I)]


_WEIGHT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _declare(lib: Any) -> None:
    for name, args in _SIGNATURES.items():
        for suf in _SUFFIX.values():
            fn = getattr(lib, name + suf)
            fn.argtypes = args
            fn.restype = None
    for fmt in _WEIGHT_FORMATS:
        for name in [f"linear_{fmt}{suf}" for suf in _SUFFIX.values()] + [f"linear_fma_{fmt}_f32"]:
            fn = getattr(lib, name)
            fn.argtypes = _LINEAR
            fn.restype = None
    lib.quantize_rows_q8.argtypes = [_P, _I, _I, _P, _P]
    for fn in (lib.linear_q8_f32, lib.linear_q8_fma_f32):
        fn.argtypes = [_P, _P, _I, _I, _P, _P, _P, _I, _P, _P, _I, _I]
        fn.restype = None
    lib.linear_threads.argtypes = [_P, _P, _I, _I, _P, _I, _P, _P, ctypes.c_int]
    lib.linear_q8_threads.argtypes = [_P, _P, _P, _I, _I, _P, _P, _P, _I, _P, _P, ctypes.c_int]
    for kind in ("mamba1", "mamba2"):
        getattr(lib, f"{kind}_step_work").argtypes = [_P, _I]
        getattr(lib, f"{kind}_step_work").restype = _I
        getattr(lib, f"{kind}_step_f32").argtypes = [_P, _P, _I, _P, _P, _P, _P, _P, _P]
    threaded = []
    for suf in _SUFFIX.values():
        for name in ("conv", "unary"):
            fn = getattr(lib, f"{name}_threads{suf}")
            fn.argtypes = [*_SIGNATURES[name], ctypes.c_int]
            threaded.append(fn)
    for fn in (lib.quantize_rows_q8, lib.linear_threads, lib.linear_q8_threads,
               lib.mamba1_step_f32, lib.mamba2_step_f32, *threaded):
        fn.restype = None

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_THREADS = max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def _threads(work: int) -> int:
    """How many threads a product of `work` multiply-adds runs on."""
    return _THREADS if work >= _THREADED_WORK else 1


def _parallel(fn: Callable[[int, int], None], units: int, work: int) -> None:
    """fn(u0, u1) over [0, units), split across threads when the work is worth it. Each unit is
    computed whole by one thread: the split never changes a result."""
    t = min(_THREADS, units)
    if t <= 1 or work < _PARALLEL_WORK:
        fn(0, units)
        return
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="exact")
    bounds = [units * j // t for j in range(t + 1)]
    futures = [_pool.submit(fn, bounds[j], bounds[j + 1]) for j in range(1, t)]
    fn(bounds[0], bounds[1])
    for f in futures:
        f.result()


def _version(t: Any) -> int | None:
    """A tensor's version counter; None for a value without one (an inference tensor, a
    `Q8Weight`), which is then never taken as unchanged."""
    try:
        return t._version if isinstance(t, Tensor) else (0 if t is None or isinstance(t, Q8Weight) else None)
    except RuntimeError:  # inference tensors count no versions
        return None


_ABSENT = object()


def _field(mod: torch.nn.Module, name: str) -> Any:
    """`getattr(mod, name)` for a parameter, buffer or plain attribute, by the dicts nn.Module
    keeps them in (it keeps a name in one of them only), without its `__getattr__`."""
    v = mod._parameters.get(name, _ABSENT)
    if v is _ABSENT:
        v = mod._buffers.get(name, _ABSENT)
        if v is _ABSENT:
            v = getattr(mod, name)
    return v


def _address(fn: Any) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


class _Kernels:
    """The C kernels behind the signatures of the twins (thin: decode is bound by call overhead).
    `fused`: the exact-2 products (fused multiply-adds; float32 only), else exact-1's."""

    def __init__(self, lib: Any, fused: bool = False) -> None:
        self.fn = {(name, dt): getattr(lib, name + suf) for name in _SIGNATURES for dt, suf in _SUFFIX.items()}
        self.fused = fused
        #: (compute dtype, weight dtype) -> the product's address, for `linear_threads` to call
        if fused:
            self.linears = {(torch.float32, wdt or torch.float32): _address(getattr(lib, f"linear_fma_{fmt}_f32"))
                            for fmt, wdt in _WEIGHT_FORMATS.items()}
        else:
            self.linears = {(dt, wdt or dt): _address(getattr(lib, f"linear_{fmt}{suf}"))
                            for fmt, wdt in _WEIGHT_FORMATS.items() for dt, suf in _SUFFIX.items()}
        #: the q8 product's address, for `linear_q8_threads` to call
        self.linear_q8 = _address(lib.linear_q8_fma_f32 if fused else lib.linear_q8_f32)
        #: the conv over a chunk, the tokens split between threads (same bits as `conv`)
        self.convs = {dt: getattr(lib, "conv_threads" + suf) for dt, suf in _SUFFIX.items()}
        #: the elementwise functions, split between threads (same bits as `unary`)
        self.unarys = {dt: getattr(lib, "unary_threads" + suf) for dt, suf in _SUFFIX.items()}
        self.lib = lib
        #: mixer -> (its tensors, their versions, its C description): beside the module, not on it,
        #: so that a copy of the module (deepcopy, pickle) never carries pointers into the original
        self._layers: weakref.WeakKeyDictionary[torch.nn.Module, tuple[list[Any], list[int | None], Any]] = (
            weakref.WeakKeyDictionary())

    def _linear_q8(self, x: Tensor, weight: Q8Weight, bias: Tensor | None) -> Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"q8 products compute in float32, not {x.dtype}")
        k, n = x.shape[-1], weight.shape[0]
        x = x.contiguous()
        m = x.numel() // k if k else 0
        out = x.new_empty((*x.shape[:-1], n))
        if m:
            nb = (k + QB - 1) // QB
            qx = torch.empty((m, nb * QB), dtype=torch.int8)
            sx = torch.empty((m, nb), dtype=torch.float32)
            self.lib.quantize_rows_q8(x.data_ptr(), m, k, qx.data_ptr(), sx.data_ptr())
            self.lib.linear_q8_threads(self.linear_q8, qx.data_ptr(), sx.data_ptr(), m, k, weight.q.data_ptr(),
                                       weight.d.data_ptr(),
                                       weight.d8.data_ptr(), n, None if bias is None else bias.data_ptr(),
                                       out.data_ptr(), _threads(m * k * n))
        return out

    @staticmethod
    def _cached(weight: Tensor, what: str, make: Callable[[], Tensor]) -> Tensor:
        """A tensor derived from a weight, kept on it while the weight is unchanged."""
        key = "_exact_" + what
        hit = getattr(weight, key, None)
        if hit is not None and hit[0] == weight._version:
            return hit[1]
        value = make()
        setattr(weight, key, (weight._version, value))
        return value

    def linear(self, x: Tensor, weight: Tensor | Q8Weight, bias: Tensor | None = None) -> Tensor:
        if isinstance(weight, Q8Weight):
            return self._linear_q8(x, weight, bias)
        k, n = x.shape[-1], weight.shape[0]
        if not x.is_contiguous():
            x = x.contiguous()
        m = x.numel() // k if k else 0
        out = x.new_empty((*x.shape[:-1], n))
        if m:
            w = weight if weight.is_contiguous() else self._cached(weight, "contiguous", weight.contiguous)
            fn = self.linears.get((x.dtype, w.dtype))
            if fn is None:
                raise TypeError(f"no exact product of {x.dtype} inputs with {w.dtype} weights")
            self.lib.linear_threads(fn, x.data_ptr(), m, k, w.data_ptr(), n,
                                    None if bias is None else bias.data_ptr(), out.data_ptr(), _threads(m * k * n))
        return out

    def _weight(self, lin: torch.nn.Module, keep: list[Tensor]) -> _ExactWeight | None:
        w, bias = lin.weight, lin.bias
        if bias is not None and bias.dtype != torch.float32:
            return None
        if isinstance(w, Q8Weight):
            keep += [w.q, w.d, w.d8]
            out = _ExactWeight(3, int(self.fused), None, w.q.data_ptr(), w.d.data_ptr(), w.d8.data_ptr(), None,
                               w.shape[0], w.shape[1])
        else:
            if w.dtype not in _WEIGHT_CODES:
                return None
            if not w.is_contiguous():
                w = self._cached(w, "contiguous", w.contiguous)
            keep.append(w)
            out = _ExactWeight(_WEIGHT_CODES[w.dtype], int(self.fused), w.data_ptr(), None, None, None, None,
                               w.shape[0], w.shape[1])
        if bias is not None:
            keep.append(bias)
            out.bias = bias.data_ptr()
        return out

    @staticmethod
    def _step_tensors(m: Mamba1Mixer | Mamba2Mixer) -> list[Any]:
        """The tensors a mixer's decode step reads, as `m.in_proj.weight`... finds them, taken from
        the modules' dicts: checked before every decode step of every layer, where nn.Module's
        `__getattr__` cost a 130M model 0.8 ms a token."""
        mods = m._modules
        if isinstance(m, Mamba1Mixer):
            ip, cv, xp, dp, op = mods["in_proj"], mods["conv1d"], mods["x_proj"], mods["dt_proj"], mods["out_proj"]
            return [_field(ip, "weight"), _field(ip, "bias"), _field(cv, "weight"), _field(cv, "bias"),
                    _field(xp, "weight"), _field(dp, "weight"), _field(dp, "bias"), _field(m, "A_log"),
                    _field(m, "D"), _field(op, "weight"), _field(op, "bias")]
        ip, cv, op = mods["in_proj"], mods["conv1d"], mods["out_proj"]
        return [_field(ip, "weight"), _field(ip, "bias"), _field(cv, "weight"), _field(cv, "bias"),
                _field(m, "dt_bias"), _field(m, "A_log"), _field(m, "D"),
                _field(mods["norm"], "weight") if m.cfg.rmsnorm else None, _field(op, "weight"), _field(op, "bias")]

    def _layer(self, m: Mamba1Mixer | Mamba2Mixer) -> tuple[str, ctypes.Structure, list[Tensor]] | None:
        """The C description of a float32 Mamba-1 or Mamba-2 mixer for its one-call decode step
        (None: the mixer has a tensor or a layout the call does not take), kept on the mixer while
        none of its tensors changes."""
        tensors = self._step_tensors(m)
        versions = [_version(t) for t in tensors]
        hit = self._layers.get(m)
        # the entry holds the tensors it was made from: none of them can be freed and its id reused
        if (hit is not None and None not in versions
                and all(a is b for a, b in zip(hit[0], tensors, strict=False)) and hit[1] == versions):
            return hit[2]
        built = None
        linears = ([m.in_proj, m.x_proj, m.dt_proj, m.out_proj] if isinstance(m, Mamba1Mixer)
                   else [m.in_proj, m.out_proj])
        vectors = [t for t in tensors if isinstance(t, Tensor) and not any(t is lin.weight for lin in linears)]
        keep: list[Tensor] = []
        ws = [self._weight(lin, keep) for lin in linears]
        if all(t.dtype == torch.float32 for t in vectors) and all(w is not None for w in ws):
            cfg = m.cfg
            taps = self._cached(m.conv1d.weight, "taps", lambda: m.conv1d.weight.detach()[:, 0, :].contiguous())
            neg_a = -self.exp(m.A_log)  # what the mixer hands its scan
            dskip = m.D.detach().contiguous()
            conv_bias = None if m.conv1d.bias is None else m.conv1d.bias.data_ptr()
            keep += [taps, neg_a, dskip, *vectors]
            if isinstance(m, Mamba1Mixer):
                at = neg_a.t().contiguous()
                keep.append(at)
                built = ("mamba1", _Mamba1Layer(*ws, taps.data_ptr(), conv_bias, at.data_ptr(), dskip.data_ptr(),
                                                cfg.d_inner, cfg.d_state, cfg.resolved_dt_rank, cfg.d_conv, 0, 1), keep)
            elif (cfg.rmsnorm and cfg.d_inner == cfg.resolved_d_ssm and cfg.dt_min_clamp == 0.0
                  and cfg.dt_max_clamp is None):
                built = ("mamba2", _Mamba2Layer(*ws, taps.data_ptr(), conv_bias, m.dt_bias.data_ptr(), neg_a.data_ptr(),
                                                dskip.data_ptr(), m.norm.weight.data_ptr(), cfg.mixer_norm_eps,
                                                cfg.resolved_d_ssm, cfg.nheads, cfg.headdim, cfg.ngroups, cfg.d_state,
                                                cfg.d_conv, int(cfg.D_has_hdim), int(cfg.norm_before_gate), 0, 1),
                         keep)
        self._layers[m] = (tensors, versions, built)
        return built

    def step(self, m: Mamba1Mixer | Mamba2Mixer, u: Tensor, states: States, in_place: bool
             ) -> tuple[Tensor, States] | None:
        """`forward` of a Mamba-1 or Mamba-2 mixer over one token of B streams, u (B, 1, D)
        float32, in one kernel call (`mamba1_step_f32`, `mamba2_step_f32`): the primitives'
        bits. None where it does not apply (then the primitives run). `in_place`: the new states
        are written over `states`."""
        conv, ssm = states
        if u.dtype != torch.float32 or conv.dtype != torch.float32 or ssm.dtype != torch.float32:
            return None
        built = self._layer(m)
        if built is None:
            return None
        kind, layer, _ = built
        bsz = u.shape[0]
        u = u.contiguous()
        if in_place and conv.is_contiguous() and ssm.is_contiguous():
            new_conv, new_ssm = conv, ssm
        else:
            conv, ssm = conv.contiguous(), ssm.contiguous()
            new_conv, new_ssm = torch.empty_like(conv), torch.empty_like(ssm)
        layer.threaded_work, layer.threads = _THREADED_WORK, _THREADS
        ref = ctypes.addressof(layer)
        work = torch.empty(getattr(self.lib, f"{kind}_step_work")(ref, bsz), dtype=torch.float32)
        out = torch.empty((bsz, 1, layer.out_proj.n), dtype=torch.float32)
        getattr(self.lib, f"{kind}_step_f32")(ref, u.data_ptr(), bsz, conv.data_ptr(), new_conv.data_ptr(),
                                              ssm.data_ptr(), new_ssm.data_ptr(), out.data_ptr(), work.data_ptr())
        if in_place and new_conv is not states[0]:
            states[0].copy_(new_conv)
            states[1].copy_(new_ssm)
            new_conv, new_ssm = states
        return out, (new_conv, new_ssm)

    def unary(self, x: Tensor, op: str) -> Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty_like(x)
        # an exact exp is some 20 multiply-adds in double: a prefill's are worth two threads
        self.unarys[x.dtype](x.data_ptr(), out.data_ptr(), x.numel(), _UNARY[op], _threads(x.numel() * 20))
        return out

    def exp(self, x: Tensor) -> Tensor:
        if isinstance(x, torch.nn.Parameter):  # A_log: the same every call
            return self._cached(x, "exp", lambda: self.unary(x.detach(), "exp"))
        return self.unary(x, "exp")

    def mean(self, x: Tensor) -> Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        d = x.shape[-1]
        out = x.new_empty((*x.shape[:-1], 1))
        self.fn["mean_rows", x.dtype](x.data_ptr(), out.data_ptr(), x.numel() // d if d else 0, d)
        return out

    def norm(self, x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, rms: bool) -> Tensor:
        if not rms or bias is not None:
            return _exact_norm(x, weight, bias, eps, rms, self.mean, lambda t: self.unary(t, "rsqrt"))
        if not x.is_contiguous():
            x = x.contiguous()
        d = x.shape[-1]
        out = torch.empty_like(x)
        w = weight.contiguous()
        self.fn["rms_norm", x.dtype](x.data_ptr(), w.data_ptr(), out.data_ptr(), x.numel() // d if d else 0, d, eps)
        return out

    def gated_norm(self, x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int,
                   norm_before_gate: bool) -> Tensor:
        x, z = x.contiguous(), z.contiguous()
        d = x.shape[-1]
        if d % group_size:
            raise ValueError(f"group size {group_size} does not divide {d}")
        out = torch.empty_like(x)
        self.fn["gated_norm", x.dtype](x.data_ptr(), z.data_ptr(), weight.contiguous().data_ptr(), out.data_ptr(),
                                      x.numel() // d if d else 0, d, group_size, eps, int(norm_before_gate))
        return out

    def conv(self, conv_state: Tensor, xs: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        return self._conv(conv_state, xs, weight, bias, into=None)

    def conv_into(self, conv_state: Tensor, xs: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        """`conv`, the new state written over `conv_state` (returned): the kernel reads each stream's
        window before it writes it, and shifts it front to back, so aliasing changes no bit."""
        if not conv_state.is_contiguous():
            out, new = self.conv(conv_state, xs, weight, bias)
            return out, conv_state.copy_(new)
        return self._conv(conv_state, xs, weight, bias, into=conv_state)

    def _conv(self, conv_state: Tensor, xs: Tensor, weight: Tensor, bias: Tensor | None,
              into: Tensor | None) -> tuple[Tensor, Tensor]:
        bsz, length, c = xs.shape
        w = weight.shape[-1]
        st, xs = conv_state.contiguous(), xs.contiguous()
        taps = self._cached(weight, "taps", lambda: weight.detach()[:, 0, :].contiguous())
        out = torch.empty_like(xs)
        new = torch.empty_like(st) if into is None else into
        self.convs[xs.dtype](st.data_ptr(), xs.data_ptr(), taps.data_ptr(),
                             None if bias is None else bias.data_ptr(), out.data_ptr(), new.data_ptr(),
                             bsz, length, c, w, _threads(bsz * length * c * w))
        return out, new

    def selective_scan(self, dt: Tensor, at: Tensor, x: Tensor, b: Tensor, cc: Tensor,
                       h0: Tensor) -> tuple[Tensor, Tensor]:
        return self._selective_scan(dt, at, x, b, cc, h0, into=None)

    def selective_scan_into(self, dt: Tensor, at: Tensor, x: Tensor, b: Tensor, cc: Tensor, h0: Tensor
                            ) -> tuple[Tensor, Tensor]:
        """`selective_scan`, the new state written over `h0` (returned): each work unit reads its
        block of h0 whole before it writes it, so aliasing changes no bit."""
        if not h0.is_contiguous():
            y, h = self.selective_scan(dt, at, x, b, cc, h0)
            return y, h0.copy_(h)
        return self._selective_scan(dt, at, x, b, cc, h0, into=h0)

    def _selective_scan(self, dt: Tensor, at: Tensor, x: Tensor, b: Tensor, cc: Tensor, h0: Tensor,
                        into: Tensor | None) -> tuple[Tensor, Tensor]:
        bsz, length, c = dt.shape
        n = at.shape[0]
        dt, at, x, b, cc, h0 = (t.contiguous() for t in (dt, at, x, b, cc, h0))
        # the kernel reads h0 and writes h: the caller's state stays as it was, unless it asked for it
        h = torch.empty_like(h0) if into is None else into
        y = torch.empty_like(dt)
        fn = self.fn["selective_scan", dt.dtype]
        nblk = (c + 63) // 64
        _parallel(lambda u0, u1: fn(dt.data_ptr(), at.data_ptr(), x.data_ptr(), b.data_ptr(), cc.data_ptr(),
                                    h0.data_ptr(), h.data_ptr(), y.data_ptr(), bsz, length, c, n, u0, u1),
                  bsz * nblk, bsz * length * c * n * 8)
        return y, h

    def ssd(self, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
        return self._ssd(x, dt, a, b, c, h0, into=None)

    def ssd_into(self, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
        """`ssd`, the new state written over `h0` (returned). Each work unit (stream, head) owns
        its (P, N) block: the decode loop reads an element and writes it in one statement, the
        longer loop reads the block whole first, so aliasing changes no bit."""
        if not h0.is_contiguous():
            y, s = self.ssd(x, dt, a, b, c, h0)
            return y, h0.copy_(s)
        return self._ssd(x, dt, a, b, c, h0, into=h0)

    def _ssd(self, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor,
             into: Tensor | None) -> tuple[Tensor, Tensor]:
        bsz, length, h, p = x.shape
        g, n = b.shape[2], b.shape[3]
        x, dt, a, b, c, h0 = (t.contiguous() for t in (x, dt, a, b, c, h0))
        s = torch.empty_like(h0) if into is None else into
        y = torch.empty_like(x)
        fn = self.fn["ssd_scan", x.dtype]
        _parallel(lambda u0, u1: fn(x.data_ptr(), dt.data_ptr(), a.data_ptr(), b.data_ptr(), c.data_ptr(),
                                    h0.data_ptr(), s.data_ptr(), y.data_ptr(), bsz, length, h, p, g, n, u0, u1),
                  bsz * h, bsz * length * h * p * n * 4)
        return y, s

    def angle(self, inc: Tensor, angle: Tensor) -> tuple[Tensor, Tensor]:
        bsz, length = inc.shape[:2]
        inc = inc.contiguous()
        ang = angle.contiguous().clone()
        theta = torch.empty_like(inc)
        hs = ang[0].numel() if bsz else 0
        self.fn["angle_scan", inc.dtype](inc.data_ptr(), ang.data_ptr(), theta.data_ptr(), bsz, length, hs, 0, bsz)
        return theta, ang

    def trapezoid(self, q: Tensor, k: Tensor, xr: Tensor, alpha: Tensor, beta: Tensor, gamma: Tensor, d: Tensor,
                  s0: Tensor, kp: Tensor, xp: Tensor) -> tuple[Tensor, Tensor]:
        bsz, length, r, h, n = q.shape
        p = xr.shape[-1]
        q, k, xr, alpha, beta, gamma, d, s0 = (t.contiguous() for t in (q, k, xr, alpha, beta, gamma, d, s0))
        s = torch.empty_like(s0)
        kp, xp = kp.contiguous().clone(), xp.contiguous().clone()
        y = torch.empty_like(xr)
        fn = self.fn["trapezoid_scan", q.dtype]
        _parallel(lambda u0, u1: fn(q.data_ptr(), k.data_ptr(), xr.data_ptr(), alpha.data_ptr(), beta.data_ptr(),
                                    gamma.data_ptr(), d.data_ptr(), s0.data_ptr(), s.data_ptr(), kp.data_ptr(),
                                    xp.data_ptr(), y.data_ptr(), bsz, length, r, h, p, n, u0, u1),
                  bsz * h, bsz * length * r * h * p * n * 4)
        return y, s


def _exact_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, rms: bool,
                mean: Callable[[Tensor], Tensor], rsqrt: Callable[[Tensor], Tensor]) -> Tensor:
    """RMSNorm, x rsqrt(mean(x x) + eps) w, or LayerNorm, with the exact mean and rsqrt."""
    if not rms:
        x = x - mean(x)
    out = (x * rsqrt(mean(x * x) + eps)) * weight
    return out if bias is None else out + bias


def norm_twin(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, rms: bool) -> Tensor:
    """The kernel `rms_norm` (and the LayerNorm composed of the exact mean and rsqrt)."""
    return _exact_norm(x, weight, bias, eps, rms, mean_twin, lambda t: unary_twin(t, "rsqrt"))


def gated_norm_twin(x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int,
                    norm_before_gate: bool) -> Tensor:
    """The kernel `gated_norm`: mamba-ssm's RMSNormGated with the exact silu, mean and rsqrt."""
    silu = unary_twin(z, "silu")
    if not norm_before_gate:
        x = x * silu
    shape = x.shape
    groups = x.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    inv = unary_twin(mean_twin(groups * groups) + eps, "rsqrt")
    out = (groups * inv).reshape(shape) * weight
    return out * silu if norm_before_gate else out


def conv_twin(conv_state: Tensor, xs: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """The kernel `conv`: the causal conv over a chunk, each output's taps summed in order
    (`conv_steps`' arithmetic, all tokens side by side). conv_state (B, C, W); xs (B, L, C);
    weight (C, 1, W)."""
    w = weight.shape[-1]
    length = xs.shape[1]
    full = torch.cat([conv_state, xs.transpose(1, 2)], dim=-1)  # (B, C, W + L)
    taps = weight[:, 0, :]
    acc = full[:, :, 1 : 1 + length] * taps[:, 0:1]
    for j in range(1, w):
        acc = acc + full[:, :, 1 + j : 1 + j + length] * taps[:, j : j + 1]
    if bias is not None:
        acc = acc + bias[:, None]
    return acc.transpose(1, 2), full[:, :, -w:].contiguous()


def conv_into_twin(conv_state: Tensor, xs: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """The kernel call `conv_into`: `conv_twin`, its new state written over `conv_state` (returned)."""
    out, new = conv_twin(conv_state, xs, weight, bias)
    return out, conv_state.copy_(new)


def selective_scan_into_twin(dt: Tensor, at: Tensor, x: Tensor, b: Tensor, cc: Tensor, h0: Tensor
                             ) -> tuple[Tensor, Tensor]:
    """The kernel call `selective_scan_into`: `selective_scan_twin`, its new state written over `h0`."""
    y, h = selective_scan_twin(dt, at, x, b, cc, h0)
    return y, h0.copy_(h)


def ssd_into_twin(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel call `ssd_into`: `ssd_twin`, its new state written over `h0` (returned)."""
    y, s = ssd_twin(x, dt, a, b, c, h0)
    return y, h0.copy_(s)


class _Twins:
    """The twins, in the kernels' call shape; `linear` is the arithmetic's product."""

    def __init__(self, linear: Callable[..., Tensor]) -> None:
        self.linear = linear

    unary = staticmethod(unary_twin)
    exp = staticmethod(lambda x: unary_twin(x, "exp"))
    mean = staticmethod(mean_twin)
    norm = staticmethod(norm_twin)
    gated_norm = staticmethod(gated_norm_twin)
    selective_scan = staticmethod(selective_scan_twin)
    ssd = staticmethod(ssd_twin)
    angle = staticmethod(angle_twin)
    trapezoid = staticmethod(trapezoid_twin)
    conv = staticmethod(conv_twin)
    conv_into = staticmethod(conv_into_twin)
    selective_scan_into = staticmethod(selective_scan_into_twin)
    ssd_into = staticmethod(ssd_into_twin)


TWIN_OPS = _Twins(linear_twin)
TWIN_OPS_FMA = _Twins(linear_fma_twin)


def _kernel_ops(fused: bool = False) -> _Kernels | None:
    """The kernels, once built (None where they cannot be: `build_kernels` says why); `fused`:
    with the exact-2 products. One object per arithmetic, however it is asked for."""
    return _kernels(bool(fused))


@functools.cache
def _kernels(fused: bool) -> _Kernels | None:
    lib = build_kernels()[0]
    return None if lib is None else _Kernels(lib, fused)


# --- the primitives ------------------------------------------------------------------------------


def exact_primitives(ops: Any, path: str, *, in_place: bool = False) -> Primitives:
    """The exact arithmetic, computed by `ops` (the kernels or the twins).

    `in_place`: the conv and the Mamba-1/2 scans write the new state over the state they are
    given and return it (`*_into`), for a caller that steps states where they live (the slot
    table's decode step: no copy-back) and owns them; the same bits either way. Mamba-3's
    states are written anew.
    """
    conv = ops.conv_into if in_place else ops.conv
    scan_ssd = ops.ssd_into if in_place else ops.ssd
    scan_selective = ops.selective_scan_into if in_place else ops.selective_scan

    def silu(x: Tensor) -> Tensor:
        return ops.unary(x, "silu")

    def sigmoid(x: Tensor) -> Tensor:
        return ops.unary(x, "sigmoid")

    def softplus(x: Tensor) -> Tensor:
        return ops.unary(x, "softplus")

    def selective_scan(dt: Tensor, a: Tensor, x: Tensor, b: Tensor, cc: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
        return scan_selective(dt, a.t().contiguous(), x, b, cc, h0)

    def ssd(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor, chunk_size: int = 0
            ) -> tuple[Tensor, Tensor]:
        return scan_ssd(x, dt, a, b, c, h0)

    def mamba3(m: Mamba3Mixer, qn: Tensor, kn: Tensor, v: Tensor, a: Tensor, dt: Tensor, trap: Tensor,
               ang: Tensor, states: States) -> tuple[Tensor, States]:
        angle, ssm, k_prev, v_prev = states
        lam = ops.unary(trap, "sigmoid")
        inc = ops.unary(ang, "tanh").unsqueeze(-2) * math.pi * dt.unsqueeze(-1)  # (B, L, H, S)
        theta, angle_end = ops.angle(inc, angle)
        cos, sin = ops.unary(theta, "cos"), ops.unary(theta, "sin")
        q = m._heads_rotated(qn, m.C_bias, cos, sin)  # (B, L, R, H, N)
        k = m._heads_rotated(kn, m.B_bias, cos, sin)
        alpha = ops.unary(a * dt, "exp")
        beta = alpha * dt * (1.0 - lam)
        gamma = lam * dt
        xr = m._xr(v)
        y, s = ops.trapezoid(q, k, xr, alpha, beta, gamma, m.D, ssm, k_prev, m._xr(v_prev))
        return y, (angle_end, s, k[:, -1].contiguous(), v[:, -1].contiguous())

    return Primitives(
        name=path, linear=ops.linear, silu=silu, sigmoid=sigmoid, softplus=softplus,
        exp=ops.exp, norm=ops.norm, gated_norm=ops.gated_norm, conv=conv,
        selective_scan=labelled(selective_scan, path), ssd=labelled(ssd, path),
        mamba3_scan=labelled(mamba3, path),
    )


TWIN_PRIMITIVES = exact_primitives(TWIN_OPS, "exact-twin")
TWIN_STEP_PRIMITIVES = exact_primitives(TWIN_OPS, "exact-twin", in_place=True)
_TWIN_FMA = {False: exact_primitives(TWIN_OPS_FMA, "exact-twin"),
             True: exact_primitives(TWIN_OPS_FMA, "exact-twin", in_place=True)}


def twin_primitives(fused: bool = False, in_place: bool = False) -> Primitives:
    """The twins' primitives: exact-1's, or with `fused` exact-2's (`exact_primitives`' `in_place`)."""
    if fused:
        return _TWIN_FMA[in_place]
    return TWIN_STEP_PRIMITIVES if in_place else TWIN_PRIMITIVES


@functools.cache
def _kernel_primitives(in_place: bool = False, fused: bool = False) -> Primitives | None:
    ops = _kernel_ops(fused)
    return None if ops is None else exact_primitives(ops, "exact", in_place=in_place)


@functools.cache
def _openmp() -> Any:
    """The OpenMP runtime torch runs its parallel operations on (None: not found, or not OpenMP)."""
    root = Path(torch.__file__).parent  # torch/lib, or torch.libs beside it in a manylinux wheel
    found = [p for d in (root / "lib", root.parent / "torch.libs") for name in ("libgomp", "libiomp5", "libomp")
             for p in sorted(d.glob(name + "*.so*"))]
    for path in found:
        try:
            lib = ctypes.CDLL(str(path))  # already loaded by torch: the same library
            lib.omp_set_num_threads.argtypes, lib.omp_get_max_threads.restype = [ctypes.c_int], ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    log.info("torch's OpenMP runtime was not found beside %s: its threads stay on during exact forward "
             "passes (a speed matter only)", root)
    return None


@contextlib.contextmanager
def _torch_threads_off() -> Iterator[None]:
    """torch's OpenMP threads off for the calling thread alone (`omp_set_num_threads` sets that
    thread's own value; `torch.set_num_threads` would also change what threads that start
    meanwhile begin with), while the kernels split their work on their own pool. After each of
    torch's parallel operations its OpenMP workers spin a while, waiting for the next one: spinning
    beside the pool's threads on a 2-core machine they took a fifth to a third of a 130M prefill's
    speed (a run with OMP_WAIT_POLICY=PASSIVE gained as much). torch's operations here are copies
    and elementwise passes, which one thread does at memory speed."""
    omp = _openmp() if _THREADS > 1 else None
    n = omp.omp_get_max_threads() if omp is not None else 1
    if n <= 1:
        yield
        return
    omp.omp_set_num_threads(1)
    try:
        yield
    finally:
        omp.omp_set_num_threads(n)


class _KernelBackend(FixedBackend):
    """The kernels' primitives, and a Mamba-1 or Mamba-2 layer's decode step (one token) in one
    kernel call (`_Kernels.step`: the same bits as the primitives' path, verified by the probe)."""

    def running(self) -> contextlib.AbstractContextManager[None]:
        return _torch_threads_off()

    def __init__(self, in_place: bool = False, fused: bool = False) -> None:
        prims = _kernel_primitives(in_place, fused)
        assert prims is not None
        super().__init__(prims, "exact-fma" if fused else "exact")
        self._ops, self._in_place = _kernel_ops(fused), in_place

    def mix(self, mixer: Any, u: Tensor, states: States, round_state: RoundState = None
            ) -> tuple[Tensor, States, str]:
        if u.shape[1] == 1 and isinstance(mixer, (Mamba1Mixer, Mamba2Mixer)):
            done = self._ops.step(mixer, u, states, self._in_place)
            if done is not None:  # one token: what `_token_by_token` does, in one call
                out, new = done
                return out, (new if round_state is None else round_state(new)), self._prims.name
        return super().mix(mixer, u, states, round_state)


# --- the probe ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Probe:
    """What the load-time check found: whether the kernels reproduce the twins on this model."""

    kernels: bool
    reason: str
    seconds: float

    @property
    def path(self) -> str:
        return "exact" if self.kernels else "exact-twin"


#: rows of the head the probe runs: past two blocks of outputs, with a remainder for every tile width
_PROBE_HEAD_ROWS = 213


def _probe_view(lm: torch.nn.Module) -> Any:
    """What the probe runs of a model: its first two layers (every layer has the same shapes, the
    same code and the same weight format) and the first rows of its head. The twins take minutes
    over a billion-parameter model's every layer; two layers check the same kernels."""
    from types import SimpleNamespace

    bb = lm.backbone
    return SimpleNamespace(cfg=lm.cfg, backbone=SimpleNamespace(layers=list(bb.layers)[:2], norm_f=bb.norm_f,
                                                                embedding=bb.embedding),
                           lm_head=SimpleNamespace(weight=lm.lm_head.weight[:_PROBE_HEAD_ROWS]))


def probe(lm: torch.nn.Module, dtype: torch.dtype, fused: bool = False) -> Probe:
    """Run the model's layers, shapes, weight format, dtype and threads through the kernels and
    the twins (`_probe_view`: its first two layers and a slice of its head), in exact-1 or, with
    `fused`, exact-2.

    Two streams of three tokens, from random states: the kernels must give the twins' bits, one
    stream alone must give its bits in the pair, and the three tokens one at a time must give
    the chunk's. Any difference means the kernels cannot be trusted here (a compiler that fused
    or reordered, a build for another machine): the backend then runs the twins.
    """
    from mamba_stream.scan._forward import forward

    t0 = time.perf_counter()
    prims = _kernel_primitives(False, fused)
    if prims is None:
        return Probe(False, build_kernels()[1], time.perf_counter() - t0)
    lm = _probe_view(lm)
    kernels, twins = _KernelBackend(fused=fused), FixedBackend(twin_primitives(fused))
    g = torch.Generator().manual_seed(0)
    states = [tuple((torch.randn((2, *shape), generator=g) * 0.5).to(dtype) for _, shape in blk.mixer.state_shapes())
              for blk in lm.backbone.layers]
    hidden = (torch.randn((2, 3, lm.cfg.d_model), generator=g)).to(dtype)
    try:
        with torch.inference_mode():
            k_logits, k_states, _ = forward(lm, hidden, states, kernels)
            t_logits, t_states, _ = forward(lm, hidden, states, twins)
            solo, solo_states, _ = forward(lm, hidden[:1], _first(states), kernels)
            steps, st1 = [], _first(states)
            for i in range(3):
                lg, st1, _ = forward(lm, hidden[:1, i : i + 1], st1, kernels)
                steps.append(lg)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails is a kernel we do not use
        return Probe(False, f"the kernels failed on this model: {type(exc).__name__}: {exc}", time.perf_counter() - t0)
    checks = {
        "kernels equal their twins": torch.equal(k_logits, t_logits) and _states_equal(k_states, t_states),
        "a stream alone equals it in a batch": torch.equal(solo, k_logits[:1])
        and _states_equal(solo_states, _first(k_states)),
        "token by token equals the chunk": torch.equal(torch.cat(steps, dim=1), solo)
        and _states_equal(st1, solo_states),
    }
    failed = [name for name, ok in checks.items() if not ok]
    seconds = time.perf_counter() - t0
    if failed:
        return Probe(False, "the probe found " + "; ".join(f"not: {f}" for f in failed), seconds)
    return Probe(True, f"kernels verified on this model ({build_kernels()[1]})", seconds)


def _states_equal(a: list[States], b: list[States]) -> bool:
    return all(torch.equal(x, y) for la, lb in zip(a, b, strict=False)
               for x, y in zip(la, lb, strict=False))


def _first(states: list[States]) -> list[States]:
    """The first stream's states."""
    return [tuple(t[:1] for t in st) for st in states]


_PROBED: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[torch.dtype, bool], tuple[Backend, Probe]]] = (
    weakref.WeakKeyDictionary())


def _fused(name: str) -> bool:
    if name not in EXACT_BACKENDS:
        raise ValueError(f"{name!r} is not an exact backend ({sorted(EXACT_BACKENDS)})")
    return EXACT_BACKENDS[name] == ARITHMETIC_FMA


def exact_backend(lm: torch.nn.Module, dtype: torch.dtype, name: str = "exact") -> tuple[Backend, Probe]:
    """The exact backend `name` ("exact": exact-1, "exact-fma": exact-2) for this model: the
    kernels if the probe verified them, else the twins. Probed once per model, dtype and backend."""
    fused = _fused(name)
    if fused and dtype != torch.float32:
        raise TypeError(f"the {name} backend ({ARITHMETIC_FMA}) computes in float32, not {dtype}")
    cache = _PROBED.setdefault(lm, {})
    if (dtype, fused) in cache:
        return cache[dtype, fused]
    found = probe(lm, dtype, fused)
    if not found.kernels:
        log.warning("%s backend: %s; running the pure-PyTorch twins (same results, slower)", name, found.reason)
    else:
        log.info("%s backend: %s in %.0f ms", name, found.reason, found.seconds * 1000)
    backend = _KernelBackend(fused=fused) if found.kernels else FixedBackend(twin_primitives(fused), name)
    cache[dtype, fused] = (backend, found)
    return backend, found


_STEP: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[torch.dtype, bool], Backend]] = (
    weakref.WeakKeyDictionary())


def exact_step_backend(lm: torch.nn.Module, dtype: torch.dtype, name: str = "exact") -> Backend:
    """The exact backend whose conv and Mamba-1/2 scans write new states over the states they are
    given (`exact_primitives(..., in_place=True)`): the slot table's decode step runs it on its
    buffers and copies nothing back. Same arithmetic, same bits, same path as `exact_backend`.

    Where the probe verified the kernels, one batched step in place must give the step's
    out-of-place bits on this model (an aliasing the compiler did not expect would show here);
    otherwise the out-of-place kernels run (and the caller copies back). Checked once per model.
    """
    fused = _fused(name)
    cache = _STEP.setdefault(lm, {})
    if (dtype, fused) in cache:
        return cache[dtype, fused]
    plain, found = exact_backend(lm, dtype, name)
    if not found.kernels:
        backend: Backend = FixedBackend(twin_primitives(fused, in_place=True), name)
    else:
        backend = _KernelBackend(in_place=True, fused=fused)
        if not _in_place_agrees(lm, dtype, plain, backend):
            log.warning("%s backend: the in-place decode step gave other bits on this model; "
                        "stepping out of place", name)
            backend = plain
    cache[dtype, fused] = backend
    return backend


def _in_place_agrees(lm: torch.nn.Module, dtype: torch.dtype, plain: Backend, in_place: Backend) -> bool:
    from mamba_stream.scan._forward import forward

    lm = _probe_view(lm)
    g = torch.Generator().manual_seed(1)
    states = [tuple((torch.randn((3, *shape), generator=g) * 0.5).to(dtype) for _, shape in blk.mixer.state_shapes())
              for blk in lm.backbone.layers]
    hidden = torch.randn((3, 1, lm.cfg.d_model), generator=g).to(dtype)
    with torch.inference_mode():
        want_logits, want_states, _ = forward(lm, hidden, states, plain)
        work = [tuple(t.clone() for t in st) for st in states]
        got_logits, got_states, _ = forward(lm, hidden, work, in_place)
    return torch.equal(got_logits, want_logits) and _states_equal(got_states, want_states)

"""Weights from a seed alone, the same bytes on every machine.

torch's initializers (`nn.init.normal_`, `torch.exp`, `torch.log`) run vectorized kernels chosen
for the CPU's instruction set, and their last bits differ between AVX-512, AVX2 and the scalar
build: the same seed made different "tiny-mamba2" weights on different machines, and each
machine refused the other's checkpoints (`ModelRevisionMismatch`). Here every value comes from
integer arithmetic (a counter-based generator) and float64 arithmetic that uses only the
correctly rounded IEEE operations (+, -, *, /, sqrt, and exact scaling by powers of two), so
every CPU, thread count and numpy or torch build rounds it the same way. The few
transcendentals the initialization needs (log, exp, expm1, the inverse normal CDF) are
evaluated from those operations in a fixed order, not taken from libm or a vector library.

Each parameter draws from its own stream, keyed by (seed, parameter name): a value does not
depend on the order parameters are visited in, and changing one parameter's recipe (the dt range,
say) leaves every other parameter's bytes alone.

The recipe follows mamba-ssm's initialization: embeddings N(0, 0.02); linear and conv weights
and conv biases U(+-1/sqrt(fan_in)) (PyTorch's default, kaiming-uniform with a = sqrt(5)); linear
biases zero; out_proj divided by sqrt(n_layer); dt biases the inverse softplus of a log-uniform
dt in [dt_min, dt_max]; A_log = log(1..d_state) (Mamba-1, S4D-real) or log U(1, 16) (Mamba-2);
D = 1. Norm weights and Mamba-3's B/C biases and MIMO projections keep their constructor
constants, which are exact.

A hybrid's other layers follow mamba-ssm's `_init_weights` for its attention and MLP blocks: every
projection (attention's q/k/v/o, an MLP's input_linear/output_linear, a router, the experts and
their latent projections) U(+-1/sqrt(fan_in)) with zero biases, and each residual branch's last
projection (out_proj, o_proj, output_linear) divided by sqrt(n_layer * branches), branches 2 where
some layer has an ffn sublayer (mamba-ssm's `n_residuals_per_layer`), else 1 (a plain Mamba
model's sqrt(n_layer), as before). Norm weights and the experts' correction bias keep their
constructor constants (ones, zeros). Falcon-H1's "parallel" layers take the Mamba-2 and attention
recipes under `mixer.mamba.` and `mixer.attn.`; Zamba2's "shared" layers have no recipe (refused).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["exp", "expm1", "init_weights", "log", "ndtri", "normal", "uniform"]

_DOMAIN = "mamba-stream-state/init/v1"
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
# ln 2 split so that k * _LN2_HI is exact for |k| < 2**20 (fdlibm's constants)
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700
_SQRT_HALF = 0.70710678118654752440


def _bits(seed: int, name: str, n: int) -> np.ndarray:
    """n uint64 words of the stream (seed, name): splitmix64 over a counter."""
    key = np.uint64(int.from_bytes(hashlib.sha256(f"{_DOMAIN}|{seed}|{name}".encode()).digest()[:8], "little"))
    z = (np.arange(1, n + 1, dtype=np.uint64) * _GAMMA) + key  # array arithmetic wraps mod 2**64
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _unit(seed: int, name: str, n: int) -> np.ndarray:
    """n float64 in the open interval (0, 1): the top 53 bits, centred in their cell (exact)."""
    return ((_bits(seed, name, n) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def _horner(x: np.ndarray, coeffs: list[float]) -> np.ndarray:
    """coeffs[0] + coeffs[1] x + ... evaluated in a fixed order, one rounding per operation."""
    acc = np.full_like(x, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * x + c
    return acc


_LOG_SERIES = [1.0 / (2 * k + 1) for k in range(12)]  # atanh(s)/s in s**2; 12 terms: |s| <= 0.1716
_EXP_SERIES = [1.0 / math.factorial(k) for k in range(15)]  # |r| <= ln2/2: error < 2**-56
_EXPM1_SERIES = [1.0 / math.factorial(k + 1) for k in range(19)]  # (e**x - 1)/x for |x| < 1/2


def log(x: np.ndarray) -> np.ndarray:
    """Natural log of positive float64, from IEEE basic operations only (error about 1 ulp)."""
    x = np.asarray(x, dtype=np.float64)
    if not np.all(x > 0) or not np.all(np.isfinite(x)):
        raise ValueError("log: arguments must be positive and finite")
    m, e = np.frexp(x)  # exact: x = m * 2**e, m in [1/2, 1)
    low = m < _SQRT_HALF
    m = np.where(low, m * 2.0, m)
    k = (e - low).astype(np.float64)  # m in [sqrt(1/2), sqrt(2))
    f = m - 1.0  # exact (Sterbenz)
    s = f / (2.0 + f)  # log(m) = 2 atanh(s)
    log_m = 2.0 * s * _horner(s * s, _LOG_SERIES)
    return k * _LN2_HI + (k * _LN2_LO + log_m)


def exp(x: np.ndarray) -> np.ndarray:
    """e**x of float64 (|x| < 700), from IEEE basic operations and exact scaling."""
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.abs(x) < 700.0):
        raise ValueError("exp: arguments must lie in (-700, 700)")
    k = np.rint(x * _INV_LN2)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    return np.ldexp(_horner(r, _EXP_SERIES), k.astype(np.int64))


def expm1(x: np.ndarray) -> np.ndarray:
    """e**x - 1 of float64, accurate near 0 (a series there, `exp(x) - 1` elsewhere)."""
    x = np.asarray(x, dtype=np.float64)
    small = np.abs(x) < 0.5
    series = x * _horner(np.where(small, x, 0.0), _EXPM1_SERIES)
    return np.where(small, series, exp(np.where(small, 0.0, x)) - 1.0)


# Acklam's rational approximation of the inverse normal CDF (relative error < 1.15e-9: far below
# the float32 the weights are stored in), evaluated with the functions above.
_A = [-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
      -3.066479806614716e01, 2.506628277459239e00]
_B = [-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
      -1.328068155288572e01]
_C = [-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
      4.374664141464968e00, 2.938163982698783e00]
_D = [7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00]
_P_LOW = 0.02425


def ndtri(p: np.ndarray) -> np.ndarray:
    """The standard normal quantile of p in (0, 1)."""
    p = np.asarray(p, dtype=np.float64)
    q = p - 0.5
    r = q * q
    central = q * _horner(r, _A[::-1]) / _horner(r, [1.0, *_B[::-1]])
    tail_p = np.where(p < 0.5, p, 1.0 - p)  # exact for p in [1/2, 1)
    t = np.sqrt(-2.0 * log(np.where(tail_p < _P_LOW, tail_p, 0.5)))
    tail = _horner(t, _C[::-1]) / _horner(t, [1.0, *_D[::-1]])
    tail = np.where(p < 0.5, tail, -tail)
    return np.where(np.abs(q) <= 0.5 - _P_LOW, central, tail)


def uniform(seed: int, name: str, shape: tuple[int, ...], lo: float, hi: float) -> np.ndarray:
    """float64 U(lo, hi) of `shape` from the stream (seed, name)."""
    n = math.prod(shape)
    return (lo + (hi - lo) * _unit(seed, name, n)).reshape(shape)


def normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """float64 N(0, std**2) of `shape` from the stream (seed, name), by inversion."""
    n = math.prod(shape)
    return (std * ndtri(_unit(seed, name, n))).reshape(shape)


def _inv_softplus_dt(seed: int, name: str, n: int, dt_min: float = 1e-3, dt_max: float = 0.1,
                     floor: float = 1e-4) -> np.ndarray:
    lo, hi = log(np.array([dt_min, dt_max]))
    dt = exp(lo + (hi - lo) * _unit(seed, name, n))
    dt = np.maximum(dt, floor)
    return dt + log(-expm1(-dt))  # softplus(result) = dt


def _fan_in(mod: nn.Module) -> int:
    if isinstance(mod, nn.Linear):
        return mod.in_features
    assert isinstance(mod, nn.Conv1d)
    return mod.in_channels // mod.groups * mod.kernel_size[0]


def _linear(out: dict[str, np.ndarray], seed: int, name: str, mod: nn.Linear, scale: float = 1.0) -> None:
    """PyTorch's default U(+-1/sqrt(fan_in)) for `name`.weight (divided by `scale`: a residual
    branch's last projection), a zero bias."""
    bound = 1.0 / math.sqrt(mod.in_features)
    w = name + ".weight"
    out[w] = uniform(seed, w, tuple(mod.weight.shape), -bound, bound)
    if scale != 1.0:
        out[w] = out[w] / scale
    if mod.bias is not None:
        out[name + ".bias"] = np.zeros(tuple(mod.bias.shape))


def _mamba(out: dict[str, np.ndarray], m: nn.Module, pre: str, seed: int, cfg: Any, dt_max: float,
           scale: float) -> None:
    """A Mamba-1/2/3 mixer's parameters under `pre` (its names end in a dot)."""
    from mamba_stream.scan._mamba1 import Mamba1Mixer
    from mamba_stream.scan._mamba2 import Mamba2Mixer
    from mamba_stream.scan._mamba3 import Mamba3Mixer

    for child, mod in m.named_children():
        if not isinstance(mod, (nn.Linear, nn.Conv1d)):
            continue
        bound = 1.0 / math.sqrt(_fan_in(mod))
        w = pre + child + ".weight"
        out[w] = uniform(seed, w, tuple(mod.weight.shape), -bound, bound)
        if mod.bias is not None:
            b = pre + child + ".bias"
            out[b] = (uniform(seed, b, tuple(mod.bias.shape), -bound, bound) if isinstance(mod, nn.Conv1d)
                      else np.zeros(tuple(mod.bias.shape)))
    out[pre + "out_proj.weight"] = out[pre + "out_proj.weight"] / scale
    out[pre + "D"] = np.ones(tuple(m.D.shape))
    if isinstance(m, Mamba1Mixer):
        std = cfg.resolved_dt_rank**-0.5
        w = pre + "dt_proj.weight"
        out[w] = uniform(seed, w, tuple(m.dt_proj.weight.shape), -std, std)
        out[pre + "dt_proj.bias"] = _inv_softplus_dt(seed, pre + "dt_proj.bias", cfg.d_inner, dt_max=dt_max)
        out[pre + "A_log"] = np.tile(log(np.arange(1, cfg.d_state + 1, dtype=np.float64)), (cfg.d_inner, 1))
    elif isinstance(m, (Mamba2Mixer, Mamba3Mixer)):
        out[pre + "dt_bias"] = _inv_softplus_dt(seed, pre + "dt_bias", cfg.nheads, dt_max=dt_max)
        if isinstance(m, Mamba2Mixer):
            a = pre + "A_log"
            out[a] = log(uniform(seed, a, (cfg.nheads,), 1.0, 16.0))


def _attention(out: dict[str, np.ndarray], m: nn.Module, pre: str, seed: int, scale: float) -> None:
    """An `AttentionMixer`'s q/k/v/o under `pre`; o_proj, the branch's last projection, / `scale`."""
    for child in ("q_proj", "k_proj", "v_proj"):
        _linear(out, seed, pre + child, getattr(m, child))
    _linear(out, seed, pre + "o_proj", m.o_proj, scale)


def _mlp(out: dict[str, np.ndarray], m: nn.Module, pre: str, seed: int, scale: float) -> None:
    """An `MLP`'s input_linear and output_linear (the branch's last projection, / `scale`) under `pre`."""
    _linear(out, seed, pre + "input_linear", m.input_linear)
    _linear(out, seed, pre + "output_linear", m.output_linear, scale)


def _experts(out: dict[str, np.ndarray], m: nn.Module, pre: str, seed: int, scale: float) -> None:
    """Routed experts under `pre`: the router and latent projections plain, each expert and the
    shared MLP as an MLP (their weighted sum is the branch's output)."""
    _linear(out, seed, pre + "router", m.router)
    for child in ("latent_in", "latent_out"):
        if getattr(m, child) is not None:
            _linear(out, seed, pre + child, getattr(m, child))
    for e, expert in enumerate(m.experts):
        _mlp(out, expert, f"{pre}experts.{e}.", seed, scale)
    if m.shared is not None:
        _mlp(out, m.shared, pre + "shared.", seed, scale)


def _weights(lm: nn.Module, seed: int, dt_max: float) -> dict[str, np.ndarray]:
    """name -> float64 value of every parameter the recipe sets (the rest keep constructor constants)."""
    from mamba_stream.scan._layers import MLP, AttentionMixer, Experts

    cfg = lm.cfg
    # mamba-ssm's rescale_prenorm_residual: every residual branch's last projection / sqrt(the
    # number of branches); for a plain Mamba model that is sqrt(n_layer), the same float as always
    branches = 2 if any(f != "none" for f in cfg.ffns) else 1
    scale = math.sqrt(cfg.n_layer * branches)
    out: dict[str, np.ndarray] = {}
    emb = "backbone.embedding.weight"
    out[emb] = normal(seed, emb, tuple(lm.backbone.embedding.weight.shape), 0.02)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = normal(seed, "lm_head.weight", tuple(lm.lm_head.weight.shape), 0.02)
    for i, blk in enumerate(lm.backbone.layers):
        m = blk.mixer
        pre = f"backbone.layers.{i}.mixer."
        if blk.kind in ("mamba1", "mamba2", "mamba3"):
            _mamba(out, m, pre, seed, cfg, dt_max, scale)
        elif blk.kind == "attention" and isinstance(m, AttentionMixer):
            _attention(out, m, pre, seed, scale)
        elif blk.kind == "mlp" and isinstance(m, MLP):
            _mlp(out, m, pre, seed, scale)
        elif blk.kind == "moe" and isinstance(m, Experts):
            _experts(out, m, pre, seed, scale)
        elif blk.kind == "parallel":  # Falcon-H1: one branch, its two outputs summed
            _mamba(out, m.mamba, pre + "mamba.", seed, cfg, dt_max, scale)
            _attention(out, m.attn, pre + "attn.", seed, scale)
        else:
            raise ValueError(f"layer {i}: no initialization recipe for a {blk.kind!r} layer")
        if blk.mlp is not None:
            _mlp(out, blk.mlp, f"backbone.layers.{i}.mlp.", seed, scale)
        if blk.moe is not None:
            _experts(out, blk.moe, f"backbone.layers.{i}.moe.", seed, scale)
    return out


def init_weights(lm: nn.Module, seed: int, *, dt_max: float = 0.1) -> None:
    """Set every parameter of `lm` (a `scan._lm.MambaLM`) from `seed` alone, the same bytes anywhere.

    `dt_max` is the top of the log-uniform range of initial step sizes (mamba-ssm's 0.1 by
    default); it changes the dt biases only.
    """
    params = dict(lm.named_parameters())
    with torch.no_grad():
        for name, value in _weights(lm, seed, dt_max).items():
            p = params[name]
            if tuple(p.shape) != value.shape:
                raise AssertionError(f"{name}: recipe shape {value.shape} != parameter {tuple(p.shape)}")
            # float64 -> float32 rounds to nearest even: exact and the same everywhere
            p.copy_(torch.from_numpy(np.ascontiguousarray(value, dtype=np.float64).astype(np.float32)))

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
    attention    composed of the above: each score a product over the head dimension, the row's
                 max, the exact exp, then the weighted values and their sum as one product over
                 positions (key j always in lane j % 16, later keys weighted by an exact +0.0),
                 so a query's output depends on its keys alone, not on the chunk or the batch.

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

Two implementations with the same signatures compute this arithmetic: C kernels (compiled at
first use by the system C compiler or the `ziglang` wheel, vectorized across independent
elements only) and their pure-PyTorch twins. They give the same bits (tests/scan/exact/); where
the kernels cannot be built, or the probe run at load finds a kernel that disagrees with its
twin or depends on its batch, the backend runs the twins and says so (path "exact-twin"):
slower, with the same results.

Where things are. Each op's kernel call and its twins share a module, and its C a file of the
same name (`_unary.py` and `_unary.c`, ...), which `_kernels.c` includes into one translation
unit:

    _unary       exp, silu, sigmoid, softplus, tanh, sin, cos, rsqrt (`unary`, `exp`)
    _products    the products, every weight format, exact-1 and exact-2 (`linear`)
    _norms       `mean`, `norm` (RMSNorm, LayerNorm), `gated_norm`
    _conv        the causal conv (`conv`, `conv_into`)
    _scans       `selective_scan`, `ssd` (and their `_into`), `angle`, `trapezoid`
    _step        a Mamba-1 or Mamba-2 layer's decode step in one call (`step`; its twin is the
                 primitives' path)
    _attention   causal grouped-query attention and RoPE, composed of `linear` and `unary` (no
                 kernel of its own, so no twin of its own: over the kernels or the twins)
    _kernels     `_Kernels` (the parts above, over the built library) and `TWIN_OPS`
    _primitives  either of them as a model's `Primitives`, and `_KernelBackend`
    _probe       the load-time check of the kernels against the twins
    _backend     `exact_backend`, `exact_step_backend`: what a model runs
    _build       compiling and loading the library, and its ABI
    _threading   the thread counts and pools the kernels split work on

A twin is named for its kernel call, `<call>_ref` (`linear_ref`, `ssd_ref`, ...), and takes
the same arguments. Dimension letters as in the mixer modules.
"""

from mamba_stream.scan.exact._backend import ARITHMETIC, ARITHMETIC_FMA, exact_backend, exact_step_backend
from mamba_stream.scan.exact._build import build_kernels, cache_dir
from mamba_stream.scan.exact._kernels import TWIN_OPS, TWIN_OPS_FMA
from mamba_stream.scan.exact._primitives import (
    TWIN_PRIMITIVES,
    TWIN_STEP_PRIMITIVES,
    exact_primitives,
    twin_primitives,
)
from mamba_stream.scan.exact._probe import Probe, probe
from mamba_stream.scan.exact._products import linear_fma_ref

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
    "linear_fma_ref",
    "probe",
    "twin_primitives",
]

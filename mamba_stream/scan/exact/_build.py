"""Building and loading the kernels: the C compiler, the flags, the cache, and the library's ABI.

The kernels' C source (`_kernels.c` and the parts it includes, one beside each Python module of
the same name) is compiled at first use by the system C compiler or the `ziglang` wheel, once
per source, compiler, flags and CPU, into $MAMBA_STREAM_CACHE; `build_kernels` says what built
it, or why nothing could. `_Library` is the loaded library as the kernel calls see it: its
functions by name and dtype, the base of every part of `_kernels._Kernels`.

Separate from the kernels because nothing here computes: a build changes a kernel's speed (the
instruction set it is built for), never its bits.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Tensor = torch.Tensor

_HERE = Path(__file__).parent
#: the translation unit the compiler is given; it includes the other `*.c` beside it, and a build
#: is keyed by all of them (`_source_bytes`)
_SOURCE = _HERE / "_kernels.c"
# No fused multiply-add, no reassociation: vectorization may only run independent elements side
# by side, which changes no bit. (-fno-fast-math first: it resets the options after it.) Unrolling
# repeats the same operations in the same order: 12-17% on the products (AVX2, Zen 3).
_FLAGS = ["-O3", "-fno-fast-math", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-funroll-loops",
          "-fPIC", "-shared", "-std=gnu11"]


def _march() -> str:
    """The instruction set the kernels are built for ($MAMBA_STREAM_EXACT_MARCH, default native):
    it changes their speed, never their results."""
    return os.environ.get("MAMBA_STREAM_EXACT_MARCH", "native")


def _source_bytes() -> bytes:
    """The C source a build is made from: `_kernels.c` and every part it includes, in name order."""
    return b"".join(path.read_bytes() for path in sorted(_HERE.glob("*.c")))


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
    source = _source_bytes()
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


# --- the library's ABI ---------------------------------------------------------------------------

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
#: every kernel of _kernels.c and its arguments (each exists as name_f32 and name_f64)
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
    lib.model_step_work.argtypes, lib.model_step_work.restype = [_P, _I], _I
    lib.model_step_f32.argtypes = [_P, _P, _I, _P, _P, _P, _P, _P, _P]
    threaded = []
    for suf in _SUFFIX.values():
        for name in ("conv", "unary", "rms_norm", "gated_norm"):
            fn = getattr(lib, f"{name}_threads{suf}")
            fn.argtypes = [*_SIGNATURES[name], ctypes.c_int]
            threaded.append(fn)
    for fn in (lib.quantize_rows_q8, lib.linear_threads, lib.linear_q8_threads,
               lib.mamba1_step_f32, lib.mamba2_step_f32, lib.model_step_f32, *threaded):
        fn.restype = None


def _address(fn: Any) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


class _Library:
    """The loaded library as the kernel calls find it: the base of each part of `_Kernels` (one
    per op, each in the module of its twins). `fused`: the exact-2 products (fused multiply-adds;
    float32 only), else exact-1's."""

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
        #: the norms over rows, split between threads (same bits as `rms_norm`, `gated_norm`)
        self.rms_norms = {dt: getattr(lib, "rms_norm_threads" + suf) for dt, suf in _SUFFIX.items()}
        self.gated_norms = {dt: getattr(lib, "gated_norm_threads" + suf) for dt, suf in _SUFFIX.items()}
        self.lib = lib
        #: mixer -> (its tensors, their versions, its C description): beside the module, not on it,
        #: so that a copy of the module (deepcopy, pickle) never carries pointers into the original
        self._layers: weakref.WeakKeyDictionary[torch.nn.Module, tuple[list[Any], list[int | None], Any]] = (
            weakref.WeakKeyDictionary())
        #: model -> the same, for its whole decode step (`_step.step_model`)
        self._models: weakref.WeakKeyDictionary[torch.nn.Module, tuple[list[Any], list[int | None], Any]] = (
            weakref.WeakKeyDictionary())

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

"""Block-int8 weights ("q8"): llama.cpp's Q8_0 layout, an exact arithmetic.

A matrix (N, K) is held as blocks of 32 along k, k padded with zeros to KP = 32 NB:

    q  int8 (N, KP) in [-127, 127]
    d  float16 (N, NB), one scale per block: w ~ q d

Quantizing is deterministic (the same bytes on every CPU): per block, amax = max |w| (exact),
d = fp16(amax / 127) (one division, one round to nearest even), q = rint(w / d) clamped to
[-127, 127] (0 where d is 0). Every operation is an IEEE basic operation on one element.

The product (`linear_q8_ref`, the kernel `linear_q8_f32`) quantizes each row of the activations
the same way, with a float32 scale s = max |x| / 127, and computes

    out[m, n] = (((0 + t_0) + t_1) + ... + t_{NB-1}) [+ bias[n]],   t_b = (float)isum_b * (s_b * d_b)

where isum_b is the integer dot product of the block: exact in any order, so the instruction set
(AVX2's byte multiply-adds, a scalar loop) never shows in the bits. The blocks add in order. In
the exact-2 arithmetic (`linear_q8_fma_f32`) each block's term joins the sum in one fused
multiply-add, acc = fma((float)isum_b, s_b * d_b, acc), rounded once.

A checkpoint holds such a matrix as two tensors, `<name>_q8` (int8) and `<name>_scale`
(float16), beside the float parameters (`scan.save_checkpoint` of a q8 model writes them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys

import torch

from mamba_stream.scan._fma import fma_product

__all__ = ["QB", "Q8Weight", "linear_q8_ref", "quantize_q8", "quantize_rows_ref"]

Tensor = torch.Tensor

#: values per block
QB = 32
_ROWS = 2048  # rows quantized at a time: a slab of float32 is the only copy made


class Q8Weight:
    """A (N, K) matrix in blocks of 32 along k: `q` int8 (N, KP), `d` float16 (N, NB)."""

    format = "q8"
    #: values per block
    block = QB

    def __init__(self, q: Tensor, d: Tensor, k: int) -> None:
        n, kp = q.shape
        if q.dtype != torch.int8 or d.dtype != torch.float16 or kp % QB or d.shape != (n, kp // QB):
            raise ValueError(f"q8 weights need q int8 (N, 32 NB) and d float16 (N, NB); got q {q.dtype} "
                             f"{tuple(q.shape)}, d {d.dtype} {tuple(d.shape)}")
        if not kp - QB < k <= kp:
            raise ValueError(f"k={k} does not pad to {kp}")
        self.q, self.d, self.k = q.contiguous(), d.contiguous(), k
        self._d8: Tensor | None = None

    @property
    def d8(self) -> Tensor:
        """The scales repacked for the kernels' 8-output tiles: (ceil(N / 8), NB, 8) float16, rows
        past N zero. Made once, on first use (1/16 byte per weight beside the blocks)."""
        if self._d8 is None:
            n, nb = self.d.shape
            pad = (-n) % 8
            d = torch.nn.functional.pad(self.d, (0, 0, 0, pad)) if pad else self.d
            self._d8 = d.reshape(-1, 8, nb).transpose(1, 2).contiguous()
        return self._d8

    def settle(self) -> int:
        """Make `d8` now and drop `d`'s pages from memory where `d` is a view of a checkpoint file
        just mapped (`release_pages`): the kernels and embedding lookups read `d8` only, so the
        file's copy of the scales (1/16 byte a weight, 0.45 GB of a 7B model) leaves the process
        instead of staying beside its repacked copy. What reads all of `d` later (the twins, a
        save) reads it again from the file: no value changes. Returns the bytes released."""
        self.d8  # noqa: B018 (made, from d's pages, before they go)
        return release_pages(self.d)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.q.shape[0], self.k))

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        """The bytes a product reads: the blocks and one scale per block."""
        return self.q.numel() + self.d.numel() * 2

    def __getitem__(self, rows: slice) -> Q8Weight:
        """The weights of some rows (a view)."""
        if not isinstance(rows, slice):
            raise TypeError("q8 weights are sliced by rows only")
        return Q8Weight(self.q[rows], self.d[rows], self.k)

    def dequantize(self, rows: Tensor | None = None) -> Tensor:
        """float32 q d (exact: a 7-bit integer times an 11-bit significand), of all rows or of `rows`."""
        if rows is None:
            q, d = self.q, self.d
        else:  # a few rows (an embedding lookup): their scales from d8 once it is made (`settle`)
            q = self.q[rows]
            d = self.d[rows] if self._d8 is None else self._d8[torch.div(rows, 8, rounding_mode="floor"), :, rows % 8]
        full = q.to(torch.float32).unflatten(-1, (-1, QB)) * d.to(torch.float32).unsqueeze(-1)
        return full.flatten(-2)[..., : self.k]

    def embedding(self, tokens: Tensor) -> Tensor:
        """Rows `tokens` (B, L) as float32 (B, L, K): an embedding lookup."""
        return self.dequantize(tokens)


#: madvise's advice to drop pages from the mapping: a private file mapping's page not written since
#: it was mapped is read again from the file when next touched (anonymous memory would be lost:
#: `release_pages` advises file pages only)
_MADV_DONTNEED = 4


@functools.cache
def _madvise() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def _in_a_file_mapping(lo: int, hi: int) -> bool:
    """Whether [lo, hi) lies in one mapping of a file (an inode), by /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split()
                start, end = (int(v, 16) for v in parts[0].split("-"))
                if start <= lo and hi <= end:
                    return len(parts) >= 5 and parts[4] != "0"
    except OSError:
        pass
    return False


def release_pages(t: Tensor) -> int:
    """Drop the whole pages inside `t`'s bytes from the process's memory (MADV_DONTNEED), for a view
    of a file's private mapping whose pages nothing has written since it was mapped (a checkpoint
    just loaded): touched again, they are read again from the file, so no value changes. Anything
    else (anonymous memory, a range not in one file mapping, no madvise) is left alone. Returns the
    bytes released."""
    fn = _madvise()
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if fn is None or hi <= lo or not _in_a_file_mapping(lo, hi):
        return 0
    return hi - lo if fn(lo, hi - lo, _MADV_DONTNEED) == 0 else 0  # type: ignore[operator]


def _blocks(w: Tensor) -> Tensor:
    """w (R, K) as float32 blocks (R, NB, 32), zeros past K."""
    w = w.to(torch.float32)
    pad = (-w.shape[-1]) % QB
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.unflatten(-1, (-1, QB))


def quantize_q8(w: Tensor) -> Q8Weight:
    """The deterministic q8 form of a float matrix (N, K) (read a slab of rows at a time)."""
    n, k = w.shape
    nb = (k + QB - 1) // QB
    q = torch.empty((n, nb * QB), dtype=torch.int8)
    d = torch.empty((n, nb), dtype=torch.float16)
    for r0 in range(0, n, _ROWS):
        blk = _blocks(w[r0 : r0 + _ROWS])
        amax = blk.abs().amax(dim=-1)
        scale = (amax / 127.0).to(torch.float16)
        if not bool(torch.isfinite(scale).all()):
            raise ValueError("a block's largest weight is past float16's range: it has no q8 form")
        ds = scale.to(torch.float32).unsqueeze(-1)
        safe = torch.where(ds > 0, ds, torch.ones_like(ds))
        vals = torch.where(ds > 0, torch.round(blk / safe), torch.zeros_like(blk)).clamp_(-127, 127)
        q[r0 : r0 + _ROWS] = vals.flatten(-2).to(torch.int8)
        d[r0 : r0 + _ROWS] = scale
    return Q8Weight(q, d, k)


def quantize_rows_ref(x: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel `quantize_rows_q8`: x (M, K) float32 -> qx int8 (M, KP), sx float32 (M, NB)."""
    blk = _blocks(x)
    s = blk.abs().amax(dim=-1) / 127.0  # (M, NB)
    finite = torch.isfinite(s)
    s = torch.where(finite, s, torch.full_like(s, float("nan")))  # a non-finite block: NaN scale, values 0
    ss, ok = s.unsqueeze(-1), (finite & (s != 0)).unsqueeze(-1)
    safe = torch.where(ok, ss, torch.ones_like(ss))
    vals = torch.where(ok, torch.round(blk / safe), torch.zeros_like(blk)).clamp_(-127, 127)
    return vals.flatten(-2).to(torch.int8), s


def linear_q8_ref(x: Tensor, weight: Q8Weight, bias: Tensor | None = None, *, fused: bool = False) -> Tensor:
    """x (..., K) float32 @ weight^T in the kernel's arithmetic (module docstring); `fused`: each
    block's term joins the sum in one fused multiply-add (the exact-2 arithmetic)."""
    if x.dtype != torch.float32:
        raise TypeError(f"q8 products compute in float32, not {x.dtype}")
    lead, k = x.shape[:-1], x.shape[-1]
    qx, sx = quantize_rows_ref(x.reshape(-1, k))
    m, n, nb = qx.shape[0], weight.q.shape[0], sx.shape[1]
    xb = qx.to(torch.int32).unflatten(-1, (nb, QB))  # (M, NB, 32)
    wb = weight.q.to(torch.int32).unflatten(-1, (nb, QB))  # (N, NB, 32)
    dw = weight.d.to(torch.float32)  # (N, NB)
    acc = torch.zeros((m, n), dtype=torch.float32)
    for b in range(nb):
        isum = xb[:, None, b, :].mul(wb[None, :, b, :]).sum(dim=-1)  # (M, N), exact
        c = sx[:, b, None] * dw[None, :, b]
        # fused: |isum| < 2^24 and c a float32: their product is exact in float64
        acc = fma_product(isum.double() * c.double(), acc) if fused else acc + isum.to(torch.float32) * c
    if bias is not None:
        acc = acc + bias
    return acc.reshape(*lead, n)

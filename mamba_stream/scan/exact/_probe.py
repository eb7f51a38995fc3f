"""The load-time probe: whether the kernels reproduce their twins on the model they will run.

Where the kernels cannot be built, or the probe finds a kernel that disagrees with its twin or
depends on its batch (a compiler that fused or reordered, a build for another machine), the
backend runs the twins and says so: the path "exact-twin" in every result, the reason in
`Probe.reason`. Slower, with the same bits.

Separate because it checks the kernels against the twins, as the tests do, on whatever machine
and model are loaded: it runs both and trusts neither.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from mamba_stream.scan._backends import Backend, FixedBackend
from mamba_stream.scan._mixer import States
from mamba_stream.scan.exact._build import build_kernels
from mamba_stream.scan.exact._kernels import _kernel_ops
from mamba_stream.scan.exact._primitives import _KernelBackend, twin_primitives


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
                                                                embedding=bb.embedding,
                                                                shared=getattr(bb, "shared", None)),  # Zamba2's
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
    if _kernel_ops(fused) is None:
        return Probe(False, build_kernels()[1], time.perf_counter() - t0)
    lm = _probe_view(lm)
    kernels, twins = _KernelBackend(fused=fused), FixedBackend(twin_primitives(fused))
    g = torch.Generator().manual_seed(0)
    states = [tuple((torch.randn((2, *shape), generator=g) * 0.5).to(dtype) for _, shape in blk.mixer.state_shapes())
              for blk in lm.backbone.layers]
    hidden = (torch.randn((2, 3, lm.cfg.d_model), generator=g)).to(dtype)
    # a hybrid's attention layers write and read their KV rows by position: both streams start at
    # 0 (the random rows past it are never read, as a stream's zero rows are not)
    at = torch.zeros(2, dtype=torch.long)
    try:
        with torch.inference_mode():
            k_logits, k_states, _ = forward(lm, hidden, states, kernels, positions=at)
            t_logits, t_states, _ = forward(lm, hidden, states, twins, positions=at)
            solo, solo_states, _ = forward(lm, hidden[:1], _first(states), kernels, positions=at[:1])
            steps, st1 = [], _first(states)
            for i in range(3):
                lg, st1, _ = forward(lm, hidden[:1, i : i + 1], st1, kernels, positions=at[:1] + i)
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


def _in_place_agrees(lm: torch.nn.Module, dtype: torch.dtype, plain: Backend, in_place: Backend) -> bool:
    from mamba_stream.scan._forward import forward

    lm = _probe_view(lm)
    g = torch.Generator().manual_seed(1)
    states = [tuple((torch.randn((3, *shape), generator=g) * 0.5).to(dtype) for _, shape in blk.mixer.state_shapes())
              for blk in lm.backbone.layers]
    hidden = torch.randn((3, 1, lm.cfg.d_model), generator=g).to(dtype)
    with torch.inference_mode():
        at = torch.zeros(3, dtype=torch.long)
        want_logits, want_states, _ = forward(lm, hidden, states, plain, positions=at)
        work = [tuple(t.clone() for t in st) for st in states]
        got_logits, got_states, _ = forward(lm, hidden, work, in_place, positions=at)
    return torch.equal(got_logits, want_logits) and _states_equal(got_states, want_states)

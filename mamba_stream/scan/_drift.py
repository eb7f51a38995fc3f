"""Drift of a backend against the float64 reference (the truth), by position and by layer.

Used by `bench/measure_drift.py` (which prints the tables behind `scan.TOLERANCES`), by the
tests, and by the GPU check script. A measurement scans the same tokens twice with the model
under test, as one call and in a given partition, and compares both with the float64
reference: per-position logits error, and the final state's error per tensor and per layer.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from mamba_stream.scan._model import Model
from mamba_stream.scan._state import State

__all__ = ["Drift", "DriftPair", "measure_drift", "misalignment", "random_partition"]

POSITION_BUCKETS = (1, 16, 64, 256, 1024, 4096, 16384)


@dataclass
class Drift:
    """Errors of one scan against the truth."""

    logits_abs_by_position: list[float]  # max over the vocabulary, per position
    logits_scale: float  # max |truth logits|
    state_abs: dict[str, float]  # per state tensor
    state_scale: dict[str, float]  # max |truth| per state tensor
    seconds: float = 0.0
    logits_scale_by_position: list[float] = field(default_factory=list)  # max |truth logits| per position

    @property
    def logits_abs(self) -> float:
        return max(self.logits_abs_by_position, default=0.0)

    @property
    def logits_rel(self) -> float:
        """The largest normwise relative logits error: per position, |diff| / max|truth| of its row."""
        return max((a / s for a, s in zip(self.logits_abs_by_position, self.logits_scale_by_position, strict=False)
                    if s),
                   default=0.0)

    @property
    def state_abs_max(self) -> float:
        return max(self.state_abs.values(), default=0.0)

    @property
    def state_rel(self) -> float:
        """The largest normwise relative state error: |diff| / max|truth|, per tensor."""
        return max((v / self.state_scale[n] for n, v in self.state_abs.items() if self.state_scale[n]), default=0.0)

    def state_by_layer(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for name, v in self.state_abs.items():
            layer = int(name.split(".")[1])
            out[layer] = max(out.get(layer, 0.0), v)
        return out

    def by_position_buckets(self) -> list[tuple[str, float]]:
        """(range, max logits error) for positions 1, 2-16, 17-64, ... (1-based)."""
        rows, lo = [], 1
        n = len(self.logits_abs_by_position)
        for hi in POSITION_BUCKETS:
            if lo > n:
                break
            top = min(hi, n)
            rows.append((f"{lo}-{top}" if top > lo else f"{lo}", max(self.logits_abs_by_position[lo - 1 : top])))
            lo = top + 1
        if lo <= n:
            rows.append((f"{lo}-{n}", max(self.logits_abs_by_position[lo - 1 :])))
        return rows


@dataclass
class DriftPair:
    """One call and one partition of the same tokens, each against the truth."""

    full: Drift
    chunked: Drift
    chunks: list[int] = field(default_factory=list)

    def chunked_within_rule(self, floor_logits: float, floor_state: float) -> bool:
        """The rule of the table: chunked error <= 2x the one-call error, plus a float noise floor."""
        ok = self.chunked.logits_abs <= 2 * self.full.logits_abs + floor_logits
        for name, v in self.chunked.state_abs.items():
            ok &= v <= 2 * self.full.state_abs[name] + floor_state
        return ok


def _scan(model: Model, state: State, tokens: list[int], chunks: list[int]) -> tuple[torch.Tensor, State]:
    rows, pos = [], 0
    for c in chunks:
        step = model.advance(state, tokens[pos : pos + c])
        rows.append(step.logits)
        state, pos = step.state, pos + c
    return torch.cat(rows), state


def _compare(logits: torch.Tensor, state: State, t_logits: torch.Tensor, t_state: State, secs: float) -> Drift:
    diff = (logits.double() - t_logits.double()).abs()
    by_pos = diff.max(dim=-1).values.tolist() if diff.numel() else []
    scale_by_pos = t_logits.double().abs().max(dim=-1).values.tolist() if diff.numel() else []
    st_abs, st_scale = {}, {}
    for name, t in state.tensors.items():
        truth = t_state.tensors[name].double().cpu()
        st_abs[name] = float((t.double().cpu() - truth).abs().max()) if t.numel() else 0.0
        st_scale[name] = float(truth.abs().max()) if t.numel() else 0.0
    return Drift(by_pos, float(t_logits.abs().max()) if t_logits.numel() else 0.0, st_abs, st_scale, secs,
                 scale_by_pos)


def measure_drift(model: Model, truth: Model, tokens: list[int], chunks: list[int],
                  start: list[int] | None = None) -> DriftPair:
    """Scan `tokens` with `model` as one call and in `chunks`, each against `truth` (float64).

    Args:
        model: the backend and dtype under test.
        truth: the same weights on the float64 reference backend.
        tokens: the sequence; `start` tokens are fed first (by both, in one call) so the scan
            begins from a non-trivial state.
    """
    s_truth = truth.initial_state()
    s_model = model.initial_state()
    if start:
        s_truth = truth.advance(s_truth, start).state
        s_model = model.advance(s_model, start).state
    t = truth.advance(s_truth, tokens)
    t0 = time.perf_counter()
    full = model.advance(s_model, tokens)
    t_full = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits, state = _scan(model, s_model, tokens, chunks)
    t_chunked = time.perf_counter() - t0
    return DriftPair(
        _compare(full.logits, full.state, t.logits, t.state, t_full),
        _compare(logits, state, t.logits, t.state, t_chunked),
        chunks,
    )


def misalignment(model: Model, truth: Model, tokens: list[int], start: list[int], other: list[int]) -> dict[str, float]:
    """Logits error of three deliberately wrong states, same continuation, against the truth.

    Returns the max logits error of: the state one position behind; another stream's state;
    the right state with one layer's tensors taken from another stream.
    """
    t = truth.advance(truth.advance(truth.initial_state(), start).state, tokens).logits
    right = model.advance(model.initial_state(), start).state
    behind = model.advance(model.initial_state(), start[:-1]).state
    stranger = model.advance(model.initial_state(), other).state
    last = max(int(n.split(".")[1]) for n in right.tensors)
    swapped = State(right.position, {n: (stranger.tensors[n] if n.startswith(f"layers.{last}.") else v)
                                     for n, v in right.tensors.items()}, right.origin)
    out = {}
    for label, state in (("one position behind", behind), ("another stream", stranger),
                         (f"layer {last} swapped", swapped)):
        got = model.advance(state, tokens).logits
        out[label] = float((got.double() - t.double()).abs().max())
    return out


def random_partition(n: int, seed: int = 0) -> list[int]:
    """A partition of n with one-token, prime, short and long chunks (deterministic in seed)."""
    rng = random.Random(seed)
    out, total = [], 0
    while total < n:
        c = min(rng.choice([1, 1, 2, 3, 7, 16, 17, 64, 129, 257]), n - total)
        out.append(c)
        total += c
    return out

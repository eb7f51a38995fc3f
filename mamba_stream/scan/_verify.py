"""The chunk-equivalence report: one full scan against many partitions of the same tokens."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from mamba_stream.scan._model import Model
from mamba_stream.scan._state import State
from mamba_stream.scan._tolerance import tolerance

__all__ = ["PartitionResult", "VerifyReport", "standard_partitions", "verify_chunking"]


@dataclass(frozen=True)
class PartitionResult:
    name: str
    chunks: list[int]
    logits_max_diff: float
    state_max_diff: float
    exact: bool
    passed: bool
    seconds: float


@dataclass
class VerifyReport:
    model_id: str
    revision: str
    architecture: str
    backend: str
    dtype: str
    n_tokens: int
    full_seconds: float
    rows: list[PartitionResult] = field(default_factory=list)
    reset_differs: bool = False
    reset_equals_fresh: bool = False

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows) and self.reset_differs and self.reset_equals_fresh


def standard_partitions(n: int, d_conv: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """Partitions of n tokens that have each broken some peer: see the design's first proof."""
    rng = random.Random(seed)
    primes, total, p = [], 0, 2
    while total + p <= n:
        if all(p % q for q in range(2, int(p**0.5) + 1)):
            primes.append(p)
            total += p
        p += 1
    if n - total:
        primes.append(n - total)
    short = max(1, d_conv - 2)
    below_conv, total = [], 0
    while total < n:
        below_conv.append(min(short, n - total))
        total += below_conv[-1]
    rand, total = [], 0
    while total < n:
        c = rng.choice([0, 1, 2, 3, 5, 8, 13, 31])
        c = min(c, n - total)
        rand.append(c)
        total += c
    return [
        ("one-token chunks", [1] * n),
        ("empty chunks around", [0, n // 3, 0, n - n // 3, 0]),
        ("prime-sized", primes),
        (f"shorter than d_conv-1 ({short})", below_conv),
        ("final short chunk", [n - 1, 1]),
        ("first short chunk", [1, n - 1]),
        (f"random (seed {seed})", rand),
    ]


def _scan(model: Model, state: State, tokens: list[int], chunks: list[int]) -> tuple[torch.Tensor, State]:
    logits, pos = [], 0
    for c in chunks:
        step = model.advance(state, tokens[pos : pos + c])
        logits.append(step.logits)
        state = step.state
        pos += c
    return torch.cat(logits), state


def verify_chunking(model: Model, n_tokens: int = 97, seed: int = 0) -> VerifyReport:
    """Compare the full scan of n_tokens random ids with every standard partition."""
    rng = random.Random(seed)
    tokens = [rng.randrange(model.vocab_size) for _ in range(n_tokens)]
    s0 = model.initial_state()
    t = time.perf_counter()
    full = model.advance(s0, tokens)
    report = VerifyReport(
        model.model_id, model.revision, model.schema.architecture, model.backend, model.schema.dtype,
        n_tokens, time.perf_counter() - t,
    )
    # The reference backend promises bit-equality across partitions; any other backend, the sum
    # of its bound against the truth for the two scans compared.
    exact_only = model.backend == "reference"
    if not exact_only:
        dtype = model.schema.dtype + (f"/{model.schema.weights}" if model.schema.weights else "")
        one = tolerance(model.schema.architecture, model.backend, dtype)
        tol = one + one
    for name, chunks in standard_partitions(n_tokens, model.config.d_conv or 4, seed):
        t = time.perf_counter()
        logits, state = _scan(model, s0, tokens, chunks)
        secs = time.perf_counter() - t
        exact = torch.equal(logits, full.logits) and state.equal(full.state)
        passed = exact or (
            not exact_only
            and tol.logits_excess(logits, full.logits) <= 1.0
            and state.position == full.state.position
            and all(tol.state_excess(a, b) <= 1.0
                    for a, b in zip(state.tensors.values(), full.state.tensors.values(), strict=False))
        )
        report.rows.append(PartitionResult(
            name, chunks, float((logits - full.logits).abs().max()), state.max_abs_diff(full.state),
            exact, passed, secs,
        ))
    # the reset inequality control: A then B differs from B alone; reset then B equals B alone
    half = n_tokens // 2
    a_then_b = model.advance(model.advance(s0, tokens[:half]).state, tokens[half:]).logits
    fresh_b = model.advance(s0, tokens[half:]).logits
    reset_b = model.advance(model.initial_state(), tokens[half:]).logits
    report.reset_differs = not torch.equal(a_then_b, fresh_b)
    report.reset_equals_fresh = torch.equal(reset_b, fresh_b)
    return report

"""Helpers shared by the scan tests: presets loaded once per session, chunked feeding."""

from __future__ import annotations

import random

import torch

from mamba_stream.scan import Model, State, load_model

ARCH_PRESETS = ["tiny-mamba1", "tiny-mamba2", "tiny-mamba3", "tiny-mamba3-mimo"]
DTYPES = {"float32": torch.float32, "float64": torch.float64}

_cache: dict[tuple[str, str, str], Model] = {}


def model_for(preset: str, backend: str = "reference", dtype: str = "float32") -> Model:
    """`dtype` names the computation, or the computation and the weight format: "float32/bfloat16"."""
    key = (preset, backend, dtype)
    if key not in _cache:
        compute, _, weights = dtype.partition("/")
        _cache[key] = load_model(preset, backend=backend, dtype=DTYPES[compute], weights=weights or None)
    return _cache[key]


def tokens(n: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def scan_chunks(model: Model, state: State, toks: list[int], chunks: list[int]) -> tuple[torch.Tensor, State]:
    """Feed `toks` in the given chunk sizes; returns concatenated logits and the final state."""
    assert sum(chunks) == len(toks)
    rows, pos = [], 0
    for c in chunks:
        step = model.advance(state, toks[pos : pos + c])
        assert step.logits.shape == (c, model.vocab_size)
        rows.append(step.logits)
        state, pos = step.state, pos + c
    return torch.cat(rows), state

"""The shipped presets trained on the memory tasks (recall-*): they load by name, they remember,
chunking changes no prediction, and a reset takes the memory away. (kjv-mamba2 learned text:
tests/quality/test_text_preset.py.)"""

from __future__ import annotations

import random

import pytest

from mamba_stream.quality.evaluate import (
    EvalConfig,
    chance_band,
    predict,
    predict_after_reset,
    predict_chunked,
    recall_set,
)
from mamba_stream.scan import TRAINED_PRESETS, load_model

CFG = EvalConfig(n=100)
RECALL_PRESETS = sorted(n for n in TRAINED_PRESETS if n.startswith("recall-"))


def _accuracy(samples, preds) -> float:
    hits = [p == a for s, ps in zip(samples, preds, strict=False) for p, a in zip(ps, s.answers(), strict=False)]
    return sum(hits) / len(hits)


@pytest.fixture(scope="module", params=RECALL_PRESETS)
def preset(request):
    return request.param, load_model(request.param, backend="chunked")


def test_a_trained_preset_loads_by_name_with_its_card(preset):
    name, model = preset
    assert model.model_id == name and model.config.architecture == TRAINED_PRESETS[name]
    assert model.transform is not None and model.transform.encode("k7") == [107, 55]


def test_recall_at_the_shortest_delay_is_at_least_90_percent(preset):
    name, model = preset
    samples = recall_set(CFG, 0)
    acc = _accuracy(samples, predict(model, samples))
    assert acc >= 0.90, f"{name}: held-out recall {acc:.3f} < 0.90"


def test_random_chunkings_give_identical_predictions(preset):
    _, model = preset
    samples = recall_set(CFG, 32)
    assert predict_chunked(model, samples, random.Random(3)) == predict(model, samples)


def test_after_a_reset_the_facts_are_gone(preset):
    name, model = preset
    samples = recall_set(CFG, 0)
    after = predict_after_reset(model, samples)
    acc = _accuracy(samples, after)
    lo, hi = chance_band(sum(len(p) for p in after))
    assert lo <= acc <= hi, f"{name}: accuracy {acc:.3f} after reset is outside the chance band [{lo:.3f}, {hi:.3f}]"


@pytest.mark.parametrize("name", sorted(TRAINED_PRESETS))  # every trained preset: kjv-mamba2 too
def test_the_reference_backend_agrees_bit_for_bit_across_chunkings(name):
    model = load_model(name, backend="reference")
    s = recall_set(EvalConfig(n=2), 8)[1]
    whole = model.advance(model.initial_state(), s.tokens)
    a = model.advance(model.initial_state(), s.tokens[:7])
    b = model.advance(a.state, s.tokens[7:])
    import torch

    assert torch.equal(torch.cat([a.logits, b.logits]), whole.logits) and b.state.equal(whole.state)

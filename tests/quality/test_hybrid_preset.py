"""The shipped hybrid preset (recall-hybrid: three Mamba-2 layers and one attention layer, trained
by `quality.train --arch hybrid`): it loads by name on the default (exact) backend with its
pinned revision, it recalls there, chunking is invisible to its logits and state bit for bit, and
its state grows with the context by its attention layer's KV rows. (tests/quality/test_presets.py
holds it, with the other recall presets, to the 90% bar, chunked predictions and the reset.)"""

from __future__ import annotations

import json

import pytest
import torch

from mamba_stream.quality.evaluate import EvalConfig, predict, recall_set
from mamba_stream.scan import TRAINED_PRESETS, load_model
from mamba_stream.scan._presets import trained_preset_dir

NAME = "recall-hybrid"
#: the shipped weights' revision; a change here is a new model for every deployed stream
PINNED = "sha256:60aeba9744fe03a70adaf4a57f0bb49b86b9dd6db0f5e8b8262a039d81806072"


@pytest.fixture(scope="module")
def model():
    return load_model(NAME)


def test_it_loads_by_name_on_the_default_exact_backend_with_its_pinned_revision(model):
    card = json.loads((trained_preset_dir(NAME) / "card.json").read_text())
    assert model.backend == "exact" and model.model_id == NAME
    assert model.revision == PINNED == card["revision"]
    assert model.config.has_attention and model.config.kinds.count("attention") == 1
    assert model.config.model_dump() == load_model(NAME, backend="chunked").config.model_dump()
    assert TRAINED_PRESETS[NAME] == model.config.architecture == "mamba2"
    assert list(TRAINED_PRESETS)[-1] == NAME  # new presets go last: the order seeds bench/measure_drift.py
    assert card["final_recall_acc_4_pairs_delay_0"] >= 0.90


def test_it_recalls_on_the_exact_backend(model):
    samples = recall_set(EvalConfig(n=20), 32)
    hits = [p == a for s, ps in zip(samples, predict(model, samples), strict=True)
            for p, a in zip(ps, s.answers(), strict=True)]
    assert sum(hits) / len(hits) >= 0.90


@pytest.mark.parametrize("cuts", [[7], [1, 2, 30, 31], [12, 40, 41, 50]])
def test_chunking_changes_no_bit_of_the_logits_or_the_state(model, cuts):
    tokens = recall_set(EvalConfig(n=3), 32)[2].tokens
    whole = model.advance(model.initial_state(), tokens)
    state, rows = model.initial_state(), []
    for a, b in zip([0, *cuts], [*cuts, len(tokens)], strict=True):
        step = model.advance(state, tokens[a:b])
        state = step.state
        rows.append(step.logits)
    assert torch.equal(torch.cat(rows), whole.logits)
    assert state.equal(whole.state)


def test_its_state_grows_by_its_kv_rows(model):
    cfg = model.config
    assert cfg.n_kv_heads is not None and cfg.attn_head_dim is not None
    tokens = recall_set(EvalConfig(n=1), 64)[0].tokens
    short = model.advance(model.initial_state(), tokens[:10]).state
    long = model.advance(model.initial_state(), tokens).state
    row = 2 * cfg.n_kv_heads * cfg.attn_head_dim * 4  # k and v, float32
    assert long.nbytes - short.nbytes == (len(tokens) - 10) * row

"""The hybrid recipe of `quality.train` (Mamba-2 layers and one attention layer): it builds at the
others' size with room for the evaluation's longest sample, it learns, what it fits is what
`load_model` serves from the Hugging Face layout it is saved in, and the evaluation measures it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from mamba_stream.quality._forward import sequence_logits
from mamba_stream.quality.evaluate import EvalConfig, evaluate_preset, recall_set, render_run
from mamba_stream.quality.train import (
    ARCH_CONFIGS,
    RECIPES,
    TrainConfig,
    _param_groups,
    build,
    forward,
    make_batch,
    nemotron_h_config,
    parse_args,
    train,
    write,
)
from mamba_stream.scan import ModelConfig, embed, load_model, tolerance, zero_states
from mamba_stream.scan import forward as scan_forward


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A hybrid trained 2 steps and written as `quality.train` writes a preset: (model, card, dir)."""
    model, card = train(TrainConfig(arch="hybrid", steps=2, batch=4, eval_every=0, repeat_share=0.5))
    out = tmp_path_factory.mktemp("hybrid") / "h"
    write(model, card, out)
    return model, card, out


def test_the_recipe_is_a_hybrid_of_the_others_size_with_room_for_the_longest_sample():
    lm = build("hybrid", 0)
    cfg = lm.cfg
    assert cfg.is_hybrid and cfg.kinds.count("attention") == 1 and cfg.kinds.count("mamba2") == 3
    n = sum(p.numel() for p in lm.parameters())
    mamba2 = sum(p.numel() for p in build("mamba2", 0).parameters())
    assert 900_000 <= n <= 1_000_000 and abs(n - mamba2) / mamba2 < 0.05, n
    ev = EvalConfig()
    longest = max(len(s.tokens) for s in recall_set(ev, max(ev.delays)))
    assert longest >= 2048 and cfg.max_positions is not None and cfg.max_positions >= longest
    a = parse_args(["--arch", "hybrid", "--out", "x"])
    assert (a.batch, a.lr, a.steps, a.repeat_share) == tuple(RECIPES["hybrid"][k] for k in
                                                             ("batch", "lr", "steps", "repeat_share"))


def test_a_few_steps_on_a_batch_lower_its_loss_through_the_attention_layer():
    model = build("hybrid", 0)
    x, tgt, _ = make_batch(TrainConfig(arch="hybrid", batch=8, repeat_share=0.5), 0)
    opt = torch.optim.AdamW(_param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))

    def loss() -> torch.Tensor:
        logits = forward(model, x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)

    first = loss()
    first.backward()
    q = model.backbone.layers[2].mixer.q_proj.weight
    assert q.grad is not None and q.grad.abs().sum() > 0  # the attention layer is in the graph
    opt.step()
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()
    with torch.no_grad():
        last = loss().item()
    assert last < 0.8 * first.item(), (first.item(), last)


def test_the_training_forward_reads_an_empty_kv_as_the_zero_state_would():
    model = build("hybrid", 0)
    x, _, _ = make_batch(TrainConfig(arch="hybrid", batch=2), 3)
    with torch.no_grad():
        hidden = embed(model, x)
        full, _, _ = scan_forward(model, hidden, zero_states(model, 2, hidden), "chunked",
                                  positions=torch.zeros(2, dtype=torch.long))
        assert torch.equal(sequence_logits(model, x), full)


def test_it_is_saved_as_a_nemotron_h_checkpoint_that_serves_what_was_trained(saved):
    model, card, out = saved
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "nemotron_h" and raw["layers_block_type"].count("full_attention") == 1
    served = load_model(out, backend="chunked")
    assert served.config == model.cfg and served.revision == card["revision"]
    x, _, samples = make_batch(TrainConfig(arch="hybrid", batch=3, seed=5), 0)
    with torch.no_grad():
        trained = forward(model, x)
    tol = tolerance("mamba2", "chunked", "float32")
    for b, s in enumerate(samples):
        got = served.advance(served.initial_state(), s.tokens).logits
        assert tol.logits_excess(got, trained[b, : len(s.tokens)]) <= 1.0
    default = load_model(out)
    assert default.backend == "exact" and default.revision == card["revision"]


def test_a_config_the_layout_cannot_express_is_refused():
    for change, field in [({"tie_embeddings": True}, "tie_embeddings"),
                          ({"attention_multiplier": 0.5}, "attention_multiplier"),
                          ({"position_embedding": "rope", "rope_theta": 10000.0}, "position_embedding")]:
        cfg = ModelConfig.create(**{**ARCH_CONFIGS["hybrid"], **change})
        with pytest.raises(ValueError, match=field):
            nemotron_h_config(cfg)


def test_the_evaluation_measures_a_hybrid_and_its_kv_grows_with_the_context(saved):
    _, _, out = saved
    cfg = EvalConfig(n=12, delays=(0, 64), parity_bits=(4,), chunked_delays=(0,))  # 12: two batches of predict
    rep = evaluate_preset(str(out), cfg)
    assert rep.architecture == "mamba2+attention" and set(rep.recall) == {0, 64}
    assert rep.chunked_identical[0][1] == 12 * cfg.pairs
    small, large = sorted(rep.memory_bytes)
    assert rep.memory_bytes[large] > rep.memory_bytes[small]
    assert f"| {rep.name} | mamba2+attention | {rep.schema} | {rep.revision} |" in render_run([rep], cfg)

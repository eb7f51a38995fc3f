"""The training script: what it fits is what `load_model` serves, and a seed fixes the weights."""

from __future__ import annotations

import json

import pytest
import torch

from mamba_stream.quality.train import ARCH_CONFIGS, TrainConfig, build, forward, make_batch, parse_args, train, write
from mamba_stream.scan import load_model, tolerance


@pytest.mark.parametrize("arch", ["mamba1", "mamba2", "mamba3"])
def test_the_training_forward_is_the_served_arithmetic(arch, tmp_path):
    model, card = train(TrainConfig(arch=arch, steps=2, batch=4, eval_every=0))
    write(model, card, tmp_path / f"m-{arch}")
    served = load_model(tmp_path / f"m-{arch}", backend="chunked")
    x, _, samples = make_batch(TrainConfig(arch=arch, batch=3, seed=5), 0)
    with torch.no_grad():
        trained = forward(model, x)
    tol = tolerance(arch, "chunked", "float32")
    for b, s in enumerate(samples):
        got = served.advance(served.initial_state(), s.tokens).logits
        assert tol.logits_excess(got, trained[b, : len(s.tokens)]) <= 1.0
    assert served.revision == card["revision"]


def test_the_same_seed_gives_the_same_weights_and_another_seed_does_not():
    cfg = TrainConfig(arch="mamba2", steps=3, batch=4, eval_every=0)
    a, card_a = train(cfg)
    b, _ = train(cfg)
    c, _ = train(TrainConfig(arch="mamba2", steps=3, batch=4, eval_every=0, seed=1))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert card_a["steps"] == 3 and [p["step"] for p in card_a["loss_curve"]] == [3]


def test_the_card_records_the_run(tmp_path):
    model, card = train(TrainConfig(arch="attention", steps=2, batch=4, eval_every=2))
    write(model, card, tmp_path / "att")
    saved = json.loads((tmp_path / "att" / "card.json").read_text())
    assert saved["model_config"] == ARCH_CONFIGS["attention"] and saved["train_config"]["steps"] == 2
    assert saved["parameters"] == sum(p.numel() for p in build("attention", 0).parameters())
    assert 0.0 <= saved["loss_curve"][-1]["recall_acc"] <= 1.0
    assert "# Training card: att" in (tmp_path / "att" / "card.md").read_text()


def test_the_batches_are_a_function_of_seed_and_step():
    cfg = TrainConfig(batch=8)
    x1, t1, _ = make_batch(cfg, 4)
    x2, t2, _ = make_batch(cfg, 4)
    assert torch.equal(x1, x2) and torch.equal(t1, t2)
    x3, _, _ = make_batch(cfg, 5)
    assert not torch.equal(x1[:, : x3.shape[1]], x3[:, : x1.shape[1]])
    assert bool((t1 != -100).any()) and bool(((t1 == -100) | ((t1 >= 48) & (t1 <= 57))).all())  # digit targets


@pytest.mark.parametrize("argv", [["--arch", "rwkv", "--out", "x"], ["--arch", "mamba2"],
                                  ["--arch", "mamba2", "--out", "x", "--steps", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_an_architecture_alone_runs_its_recipe_and_flags_override_it():
    from mamba_stream.quality.train import RECIPES

    a = parse_args(["--arch", "mamba1", "--out", "x"])
    assert (a.batch, a.lr, a.steps) == (RECIPES["mamba1"]["batch"], RECIPES["mamba1"]["lr"], RECIPES["mamba1"]["steps"])
    b = parse_args(["--arch", "mamba1", "--out", "x", "--lr", "0.5", "--batch", "3"])
    assert (b.batch, b.lr, b.steps) == (3, 0.5, RECIPES["mamba1"]["steps"])
    assert RECIPES.keys() == ARCH_CONFIGS.keys()


def test_a_wider_initial_dt_range_changes_only_the_step_sizes():
    narrow, wide = build("mamba3", 0).state_dict(), build("mamba3", 0, dt_max=1.0).state_dict()
    changed = sorted(k for k in narrow if not torch.equal(narrow[k], wide[k]))
    assert changed == sorted(k for k in narrow if k.endswith("dt_bias"))
    for k in changed:
        dt_n, dt_w = torch.nn.functional.softplus(narrow[k]), torch.nn.functional.softplus(wide[k])
        assert float(dt_n.min()) >= 1e-3 * 0.99 and float(dt_n.max()) <= 0.1 * 1.01
        assert float(dt_w.min()) >= 1e-3 * 0.99 and float(dt_w.max()) <= 1.0 * 1.01
    assert max(float(torch.nn.functional.softplus(wide[k]).max()) for k in changed) > 0.1

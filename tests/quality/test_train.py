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


# --- --task text: next-byte prediction on quality.corpus (kjv-mamba2) ---


def _tiny_corpus():
    import hashlib

    from mamba_stream.quality.corpus import Corpus

    train_text = "In the beginning God created the heaven and the earth.\n" * 12
    held = "And God said, Let there be light: and there was light.\n" * 3
    return Corpus(train_text, held, {"bible-kjv-text": "4.38", "bible-kjv": "4.38"},
                  hashlib.sha256((train_text + held).encode()).hexdigest())


def test_the_text_batches_are_a_function_of_seed_and_step_and_their_targets_the_next_bytes():
    from mamba_stream.quality.train import make_text_batch

    data = torch.arange(10_000)  # every position its own id: a window's ids say where it came from
    cfg = TrainConfig(task="text", batch=8, window=64)
    x1, t1 = make_text_batch(data, cfg, 3)
    x2, t2 = make_text_batch(data, cfg, 3)
    assert torch.equal(x1, x2) and torch.equal(t1, t2)
    assert not torch.equal(x1, make_text_batch(data, cfg, 4)[0])
    assert not torch.equal(x1, make_text_batch(data, TrainConfig(task="text", batch=8, window=64, seed=1), 3)[0])
    assert x1.shape == t1.shape == (8, 64)
    assert torch.equal(x1 - x1[:, :1], torch.arange(64).expand(8, 64))  # each row a window of the text
    assert torch.equal(t1, x1 + 1)  # each target the byte after its input
    assert len(set(x1[:, 0].tolist())) > 1 and int(t1.max()) < len(data)
    with pytest.raises(ValueError, match="not longer than a window"):
        make_text_batch(torch.arange(64), cfg, 0)


def test_bits_per_byte_predicts_every_byte_after_the_first_once():
    from mamba_stream.quality.train import bits_per_byte

    model = build("mamba2", 0, fields={**ARCH_CONFIGS["mamba2"], "n_layer": 1})
    data = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(1))
    nll, count = 0.0, 0
    for start in range(0, 49, 16):  # windows of 16 from the zero state; the last one a single byte
        x, y = data[start : min(start + 16, 49)], data[start + 1 : min(start + 17, 50)]
        with torch.no_grad():
            logits = forward(model, x[None])[0]
        nll += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
        count += len(y)
    assert count == 49
    assert bits_per_byte(model, data, window=16, batch=2) == pytest.approx(nll / count / 0.6931471805599453, rel=1e-5)


def test_text_mode_trains_on_the_corpus_and_its_card_says_what_it_read(tmp_path):
    from mamba_stream.quality.train import SAMPLE_PROMPT, TEXT_ARCH_CONFIGS, greedy_text

    corpus = _tiny_corpus()
    model, card = train(TrainConfig(task="text", steps=2, batch=2, window=32, eval_every=2), corpus)
    write(model, card, tmp_path / "t")
    saved = json.loads((tmp_path / "t" / "card.json").read_text())
    assert saved["task"] == "text" and saved["model_config"] == TEXT_ARCH_CONFIGS["mamba2"]
    assert saved["corpus"]["sha256"] == corpus.sha256 and saved["corpus"]["train_bytes"] == len(corpus.train)
    assert saved["held_out_bits_per_byte"] > 0.0 and saved["loss_curve"][-1]["val_bpb"] > 0.0
    served = load_model(tmp_path / "t")  # the default path: what the card's sample was made on
    assert served.revision == saved["revision"] and saved["sample"]["backend"] == served.backend
    assert saved["sample"]["prompt"] == SAMPLE_PROMPT
    assert greedy_text(served, SAMPLE_PROMPT, saved["sample"]["bytes"]) == saved["sample"]["text"]
    md = (tmp_path / "t" / "card.md").read_text()
    for fact in ("`bible-kjv-text` 4.38", "public domain", corpus.sha256, "held-out bits per byte",
                 f"{saved['held_out_bits_per_byte']:.3f}", "--task text", "Greedy sample"):
        assert fact in md, fact


def test_the_text_recipe_runs_with_task_text_alone_and_the_memory_recipes_stay_the_default():
    from mamba_stream.quality.train import RECIPES, TEXT_RECIPES

    a = parse_args(["--arch", "mamba2", "--task", "text", "--out", "x"])
    r = TEXT_RECIPES["mamba2"]
    assert (a.batch, a.lr, a.steps, a.window, a.max_minutes) == (r["batch"], r["lr"], r["steps"], r["window"],
                                                                  r["max_minutes"])
    assert r["max_minutes"] <= 30  # the budget: 30 minutes on 2 cores, fetching included
    m = parse_args(["--arch", "mamba2", "--out", "x"])
    assert m.task == "memory" and (m.batch, m.lr, m.steps) == (RECIPES["mamba2"]["batch"], RECIPES["mamba2"]["lr"],
                                                               RECIPES["mamba2"]["steps"])
    assert m.max_minutes == TrainConfig.max_minutes and m.repeat_share == RECIPES["mamba2"]["repeat_share"]
    with pytest.raises(SystemExit):
        parse_args(["--arch", "mamba1", "--task", "text", "--out", "x"])

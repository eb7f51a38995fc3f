"""`ModelRegistry.check`: every configured model looked at without loading weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mamba_stream.activities import ModelRegistry
from mamba_stream.scan import CheckpointError, load_model, save_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return save_checkpoint(load_model("tiny-mamba1"), tmp_path_factory.mktemp("good") / "ckpt")


def _copy(good: Path, to: Path, drop: tuple[str, ...] = ()) -> Path:
    to.mkdir()
    for f in good.iterdir():
        if f.name not in drop:
            (to / f.name).write_bytes(f.read_bytes())
    return to


def test_presets_and_a_checkpoint_pass_without_loading_anything(good, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("check must not load a model")

    monkeypatch.setattr("mamba_stream.activities._registry.load_model", refuse)
    registry = ModelRegistry.from_spec(f"tiny-mamba1,recall-mamba2,tiny-mamba3#float32,mine={good}#bfloat16")
    registry.check()


def _missing(tmp: Path, good: Path) -> str:
    return str(tmp / "nope")


def _a_file(tmp: Path, good: Path) -> str:
    (tmp / "file").write_text("x")
    return str(tmp / "file")


def _no_config(tmp: Path, good: Path) -> str:
    return str(_copy(good, tmp / "c", drop=("config.json",)))


def _bad_json(tmp: Path, good: Path) -> str:
    d = _copy(good, tmp / "c")
    (d / "config.json").write_text("{not json")
    return str(d)


def _unsupported(tmp: Path, good: Path) -> str:
    d = _copy(good, tmp / "c")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "attn_layer_idx": [1]}))
    return str(d)


def _no_weights(tmp: Path, good: Path) -> str:
    return str(_copy(good, tmp / "c", drop=("model.safetensors",)))


def _missing_shard(tmp: Path, good: Path) -> str:
    d = _copy(good, tmp / "c", drop=("model.safetensors",))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    return str(d)


@pytest.mark.parametrize(("make", "reason"), [
    (_missing, "no such preset (kjv-mamba2, recall-mamba1, recall-mamba2, recall-mamba3, tiny-mamba1"),
    (_a_file, "not a checkpoint directory"),
    (_no_config, "no config.json in the directory"),
    (_bad_json, "config.json is not valid JSON"),
    (_unsupported, "config.json: attn_layer_idx: attention layers are not supported"),
    (_no_weights, "holds no model.safetensors or pytorch_model.bin"),
    (_missing_shard, "names shards that are not there: ['model-00001-of-00002.safetensors']"),
])
def test_a_model_that_cannot_load_is_named_with_what_is_wrong(tmp_path, good, make: Callable, reason: str):
    source = make(tmp_path, good)
    registry = ModelRegistry.from_spec(f"tiny-mamba1,mine={source}")
    with pytest.raises(CheckpointError) as err:
        registry.check()
    msg = str(err.value)
    assert msg.startswith(f"model 'mine' ({source}): ") and reason in msg and "\n" not in msg
    assert registry.ids == ["mine", "tiny-mamba1"]  # nothing changed, nothing loaded


def test_an_unknown_preset_or_weight_format_and_every_bad_model_are_named_at_once(good):
    registry = ModelRegistry.from_spec(f"tiny-mamba9,mine={good}#int4,tiny-mamba1")
    with pytest.raises(CheckpointError) as err:
        registry.check()
    assert str(err.value) == (
        f"model 'mine' ({good}): unknown weight format 'int4'; expected one of "
        "['bfloat16', 'float16', 'float32', 'float64', 'q8']; "
        "model 'tiny-mamba9' (tiny-mamba9): no such preset (kjv-mamba2, recall-mamba1, recall-mamba2, recall-mamba3, "
        "tiny-mamba1, tiny-mamba2, tiny-mamba3, tiny-mamba3-mimo) or directory")


def test_weights_the_check_cannot_see_are_broken_fail_the_warm_up_naming_the_model(tmp_path, good):
    from mamba_stream.activities import MemoryStateStore, StreamActivities
    from mamba_stream.state_codec.codec import Keyring

    d = _copy(good, tmp_path / "c")
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100])  # cut short
    registry = ModelRegistry.from_spec(f"mine={d}")
    registry.check()  # the names are all there: only reading the weights tells
    acts = StreamActivities(models=registry, store=MemoryStateStore(), keyring=Keyring.generate())
    try:
        with pytest.raises(CheckpointError) as err:
            acts.warm()
    finally:
        acts.close()
    assert str(err.value).startswith("model 'mine' cannot be loaded: CheckpointError: ")
    assert str(d / "model.safetensors") in str(err.value)


#: a dense GraniteMoeHybrid's config.json as transformers 5.24 saves it (trimmed to what matters)
_GRANITE = {"model_type": "granitemoehybrid", "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 0,
            "shared_intermediate_size": 128, "position_embedding_type": "nope", "max_position_embeddings": 128,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
            "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1,
            "tie_word_embeddings": True, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
            "attention_multiplier": 0.25, "logits_scaling": 4.0}


def test_a_hybrid_model_is_refused_at_the_check_in_one_typed_line(tmp_path, monkeypatch):
    """GraniteMoeHybrid loads at the scan level, but a worker does not serve it through streams yet:
    the check says so before the worker starts, without loading anything."""
    def refuse(*a, **k):
        raise AssertionError("check must not load a model")

    monkeypatch.setattr("mamba_stream.activities._registry.load_model", refuse)
    d = tmp_path / "granite"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_GRANITE))
    (d / "model.safetensors").write_bytes(b"")  # the check looks for the file, never reads it
    registry = ModelRegistry.from_spec(f"tiny-mamba1,granite={d}")
    with pytest.raises(CheckpointError) as err:
        registry.check()
    assert str(err.value) == (
        f"model 'granite' ({d}): hybrid models are not served through streams yet: this one has attention "
        "layers [1, 3] and MLP sublayers (scan.load_model runs it; the worker's slot table and state codec do not)")


def test_an_unchecked_registry_refuses_a_hybrid_at_its_load(tmp_path):
    from tests.scan._mamba_ssm import require

    require("transformers")
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    fields = {k: v for k, v in _GRANITE.items() if k != "model_type"}
    torch.manual_seed(0)
    GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**fields)).save_pretrained(str(tmp_path / "g"))
    registry = ModelRegistry.from_spec(f"granite={tmp_path / 'g'}")
    with pytest.raises(CheckpointError, match="hybrid models are not served through streams yet"):
        registry.get("granite")
    load_model(tmp_path / "g")  # the scan loads it

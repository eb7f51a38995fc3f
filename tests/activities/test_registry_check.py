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
    (_missing, "no such preset (kjv-mamba2, recall-hybrid, recall-mamba1, recall-mamba2, recall-mamba3, tiny-mamba1"),
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
        "model 'tiny-mamba9' (tiny-mamba9): no such preset (kjv-mamba2, recall-hybrid, recall-mamba1, recall-mamba2, "
        "recall-mamba3, tiny-mamba1, tiny-mamba2, tiny-mamba3, tiny-mamba3-mimo) or directory")


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


def test_a_hybrid_model_passes_the_check_without_loading_and_loads_at_its_first_use(tmp_path, monkeypatch):
    """GraniteMoeHybrid is served like any model: the check reads its config.json only (an
    unmappable field is named there, one line), and `get` loads it, its KV bound the checkpoint's."""
    from tests.scan._mamba_ssm import require

    require("transformers")
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    fields = {k: v for k, v in _GRANITE.items() if k != "model_type"}
    torch.manual_seed(0)
    GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**fields)).save_pretrained(str(tmp_path / "g"))
    registry = ModelRegistry.from_spec(f"tiny-mamba1,granite={tmp_path / 'g'}")
    with monkeypatch.context() as mp:
        mp.setattr("mamba_stream.activities._registry.load_model", lambda *a, **k: pytest.fail("check loaded"))
        registry.check()
    model = registry.get("granite")
    assert model.model_id == "granite" and model.config.kinds == ("mamba2", "attention", "mamba2", "attention")
    assert model.config.max_positions == 128
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**_GRANITE, "layer_types": ["mamba", "sliding_attention"] * 2}))
    (bad / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError) as err:
        ModelRegistry.from_spec(f"granite={bad}").check()
    assert str(err.value).startswith(f"model 'granite' ({bad}): config.json: layer_types: unknown layer kinds")
    assert "\n" not in str(err.value)


def test_the_workers_position_bound_caps_a_hybrids_kv_and_a_slot_that_does_not_fit_is_refused(tmp_path, monkeypatch):
    """MAMBA_STREAM_MAX_POSITIONS lowers a hybrid's bound below its checkpoint's (never raises it;
    a plain model ignores it); a bad value is refused naming the variable; an engine whose one slot
    would not fit its slot memory is refused typed, naming max_positions."""
    from tests.scan._mamba_ssm import require

    require("transformers")
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    from mamba_stream.activities._engine import StreamEngine
    from mamba_stream.scan import ConfigError
    from mamba_stream.serving import WorkerConfig, model_registry

    fields = {k: v for k, v in _GRANITE.items() if k != "model_type"}
    torch.manual_seed(0)
    GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**fields)).save_pretrained(str(tmp_path / "g"))
    monkeypatch.setenv("MAMBA_STREAM_MODELS", f"tiny-mamba2,granite={tmp_path / 'g'}")
    for cap, want in (("40", 40), ("1000", 128), ("", 128)):
        monkeypatch.setenv("MAMBA_STREAM_MAX_POSITIONS", cap)
        registry = model_registry(WorkerConfig())
        assert registry.get("granite").config.max_positions == want, cap
        assert registry.get("tiny-mamba2").config.max_positions is None
    for bad in ("0", "-3", "lots"):
        monkeypatch.setenv("MAMBA_STREAM_MAX_POSITIONS", bad)
        with pytest.raises(ValueError, match="MAMBA_STREAM_MAX_POSITIONS must be a positive integer"):
            WorkerConfig()
    model = ModelRegistry({"granite": str(tmp_path / "g")}).get("granite")
    per_slot = model.schema.state_bytes + model.vocab_size * 4
    with pytest.raises(ConfigError) as err:
        StreamEngine(model, slot_memory=per_slot - 1)
    assert err.value.field == "max_positions" and "MAMBA_STREAM_MAX_POSITIONS" in str(err.value)
    engine = StreamEngine(model, slot_memory=per_slot, capacity=4)  # exactly one slot fits
    try:
        assert engine.slots.capacity == 1
    finally:
        engine.close()

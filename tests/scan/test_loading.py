"""load_model: presets, both checkpoint layouts, revision, schema, and clear errors."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from mamba_stream.scan import (
    PRESETS,
    ByteTransform,
    CheckpointError,
    ConfigError,
    HFTokenizerTransform,
    ModelConfig,
    Q8Weight,
    UnsupportedBackend,
    init_model,
    load_model,
    save_checkpoint,
)
from tests._pages import pages_in_memory
from tests.scan._helpers import tokens


def test_presets_are_deterministic_and_do_not_touch_the_global_rng():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = load_model("tiny-mamba2")
    after = torch.rand(3)
    assert torch.equal(before, after)
    b = load_model("tiny-mamba2")
    assert a.revision == b.revision and a.revision.startswith("sha256:") and len(a.revision) == 71
    for (ka, va), (kb, vb) in zip(a.module.state_dict().items(), b.module.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)
    assert len({load_model(p).revision for p in PRESETS}) == len(PRESETS)


def test_parameter_names_are_mamba_ssm_names():
    names = set(load_model("tiny-mamba2").module.state_dict())
    for expected in ("backbone.embedding.weight", "backbone.layers.0.norm.weight", "backbone.norm_f.weight",
                     "backbone.layers.1.mixer.in_proj.weight", "backbone.layers.1.mixer.conv1d.weight",
                     "backbone.layers.1.mixer.conv1d.bias", "backbone.layers.1.mixer.dt_bias",
                     "backbone.layers.1.mixer.A_log", "backbone.layers.1.mixer.D",
                     "backbone.layers.1.mixer.norm.weight", "backbone.layers.1.mixer.out_proj.weight",
                     "lm_head.weight"):
        assert expected in names
    m1 = set(load_model("tiny-mamba1").module.state_dict())
    assert {"backbone.layers.0.mixer.x_proj.weight", "backbone.layers.0.mixer.dt_proj.bias"} <= m1
    m3 = set(load_model("tiny-mamba3-mimo").module.state_dict())
    assert {"backbone.layers.0.mixer.B_bias", "backbone.layers.0.mixer.C_norm.weight",
            "backbone.layers.0.mixer.mimo_x", "backbone.layers.0.mixer.norm.weight"} <= m3


@pytest.mark.parametrize("preset", list(PRESETS))
def test_save_and_load_round_trip_is_exact(tmp_path, preset):
    m = load_model(preset, backend="reference")
    save_checkpoint(m, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["ssm_cfg"]["layer"].startswith("Mamba")
    back = load_model(tmp_path, backend="reference")
    assert back.revision == m.revision and back.schema == m.schema
    toks = tokens(20, 3)
    a, b = m.advance(m.initial_state(), toks), back.advance(back.initial_state(), toks)
    assert torch.equal(a.logits, b.logits) and a.state.equal(b.state)


def test_pytorch_model_bin_loads_with_weights_only(tmp_path):
    m = load_model("tiny-mamba1")
    save_checkpoint(m, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    sd["lm_head.weight"] = sd["backbone.embedding.weight"].clone()  # mamba-ssm saves the tied head too
    torch.save(sd, tmp_path / "pytorch_model.bin")
    assert load_model(tmp_path).revision == m.revision


def test_pickled_code_in_pytorch_model_bin_is_refused(tmp_path):
    save_checkpoint(load_model("tiny-mamba1"), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({"payload": _Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only"):
        load_model(tmp_path)


class _Evil:
    def __reduce__(self):  # would run on a plain torch.load
        return (print, ("pwned",))


def test_float64_model_has_float64_state_and_same_revision():
    a, b = load_model("tiny-mamba3"), load_model("tiny-mamba3", dtype=torch.float64)
    assert a.revision == b.revision
    assert b.schema.dtype == "float64" and all(t.dtype == torch.float64 for t in b.initial_state().tensors.values())
    assert a.schema.fingerprint() != b.schema.fingerprint()


def _write(tmp_path, cfg: dict, sd: dict | None = None):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if sd is not None:
        save_file(sd, str(tmp_path / "model.safetensors"))
    return tmp_path


def _mamba2_cfg(**ssm):
    return {"d_model": 64, "n_layer": 2, "vocab_size": 256, "ssm_cfg": {"layer": "Mamba2", "d_state": 32,
            "headdim": 16, "ngroups": 2, **ssm}}


@pytest.mark.parametrize(
    "cfg,field",
    [
        ({"d_model": 64, "n_layer": 2, "vocab_size": 256, "ssm_cfg": {"layer": "Mamba4"}}, "ssm_cfg.layer"),
        (_mamba2_cfg(headdim=24), "headdim"),
        (_mamba2_cfg(ngroups=3), "ngroups"),
        (_mamba2_cfg(flash=True), "ssm_cfg.flash"),
        ({**_mamba2_cfg(), "d_intermediate": 128}, "d_intermediate"),
        ({**_mamba2_cfg(), "attn_layer_idx": [1]}, "attn_layer_idx"),
        ({"d_model": 64, "vocab_size": 256}, "n_layer"),
        ({"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256,
          "num_heads": 5, "head_dim": 16, "n_groups": 1}, "num_heads"),
        ({"model_type": "plamo2", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256}, "model_type"),
        ({"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256,
          "hidden_act": "gelu"}, "hidden_act"),
        ({"d_model": 64, "n_layer": 2, "vocab_size": 256,
          "ssm_cfg": {"layer": "Mamba3", "rope_fraction": 0.3, "d_state": 32, "headdim": 16}}, "rope_fraction"),
        ({"hello": 1}, "config.json"),
    ],
)
def test_bad_configs_name_the_field(tmp_path, cfg, field):
    with pytest.raises(ConfigError) as exc:
        load_model(_write(tmp_path, cfg))
    assert exc.value.field == field
    assert field in str(exc.value)


def test_checkpoint_errors_name_the_tensor(tmp_path):
    m = load_model("tiny-mamba2")
    save_checkpoint(m, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    missing = {k: v for k, v in sd.items() if k != "backbone.layers.1.mixer.dt_bias"}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"backbone.layers.1.mixer.dt_bias"):
        load_model(tmp_path)
    wrong = dict(sd, **{"backbone.layers.0.mixer.A_log": torch.zeros(3)})
    save_file(wrong, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"A_log has shape \(3,\)"):
        load_model(tmp_path)
    extra = dict(sd, **{"backbone.layers.0.mixer.surprise": torch.zeros(3)})
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="surprise"):
        load_model(tmp_path)
    untied = dict(sd, **{"lm_head.weight": torch.zeros_like(sd["backbone.embedding.weight"])})
    save_file(untied, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tie_embeddings"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="neither a preset"):
        load_model(tmp_path / "nowhere")


def test_model_config_validation_names_fields():
    with pytest.raises(ConfigError) as exc:
        ModelConfig.create(architecture="mamba2", d_model=64, n_layer=2, vocab_size=256, expand=1.5, headdim=64)
    assert exc.value.field == "headdim"
    with pytest.raises(ConfigError) as exc:
        ModelConfig.create(architecture="mamba1", d_model=64, n_layer=0, vocab_size=256)
    assert exc.value.field == "n_layer"
    with pytest.raises(ConfigError) as exc:
        ModelConfig.create(architecture="mamba1", d_model="wide", n_layer=2, vocab_size=256)
    assert exc.value.field == "d_model"
    with pytest.raises(ConfigError) as exc:
        ModelConfig.create(architecture="mamba3", d_model=64, n_layer=2, vocab_size=256, d_conv=4)
    assert exc.value.field == "d_conv"


def test_transforms(tmp_path):
    bt = ByteTransform()
    ids = bt.encode("héllo, 世界")
    assert all(0 <= i < 256 for i in ids) and bt.decode(ids) == "héllo, 世界"
    assert load_model("tiny-mamba1").transform.transform_id == "bytes"
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    save_checkpoint(load_model("tiny-mamba2"), tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    m = load_model(tmp_path)
    assert isinstance(m.transform, HFTokenizerTransform)
    assert m.transform.encode("hello world again") == [1, 2, 0]
    assert m.transform.revision.startswith("sha256:")
    assert tokenizers is not None


# --- weights as stored ----------------------------------------------------------------------------


def _narrow_checkpoint(directory, preset: str, dtype: torch.dtype):
    """`preset` written with every tensor in `dtype` (as Hugging Face ships bfloat16 checkpoints)."""
    save_checkpoint(load_model(preset, backend="reference"), directory)
    sd = {k: v.to(dtype) for k, v in load_file(str(directory / "model.safetensors")).items()}
    save_file(sd, str(directory / "model.safetensors"))
    return directory


def _mapped_ranges(path) -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(str(path)):
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("preset", ["tiny-mamba1", "tiny-mamba2", "tiny-mamba3"])
def test_a_narrow_checkpoint_is_read_as_stored_from_its_mapping_with_the_bits_of_its_float32_copy(
        tmp_path, preset, stored):
    d = _narrow_checkpoint(tmp_path, preset, stored)
    kept = load_model(d, backend="exact")
    wide = load_model(d, backend="exact", weights="float32")
    assert kept.weight_format == str(stored).removeprefix('torch.') and kept.dtype == torch.float32 \
        and wide.weight_format == 'float32'
    lm = kept.module
    # the matrices are views of the file's own pages; the small parameters are float32 copies
    ranges = _mapped_ranges(d / "model.safetensors")
    assert ranges
    for name in ("lm_head.weight", "backbone.layers.0.mixer.in_proj.weight", "backbone.layers.1.mixer.out_proj.weight"):
        t = lm.get_parameter(name)
        assert t.dtype == stored and any(lo <= t.data_ptr() < hi for lo, hi in ranges), name
    assert lm.backbone.norm_f.weight.dtype == torch.float32
    assert not any(lo <= lm.backbone.norm_f.weight.data_ptr() < hi for lo, hi in ranges)
    # one revision (the same checkpoint), two schemas and arithmetics, the same bits
    assert kept.revision == wide.revision
    assert kept.schema.weights == str(stored).removeprefix("torch.") and wide.schema.weights is None
    assert kept.arithmetic().id == wide.arithmetic().id + f"/weights-{kept.schema.weights}"
    toks = tokens(41, 3)
    a, b = kept.advance(kept.initial_state(), toks), wide.advance(wide.initial_state(), toks)
    assert torch.equal(a.logits, b.logits) and a.path == b.path == "exact"
    assert all(torch.equal(a.state.tensors[k], b.state.tensors[k]) for k in a.state.tensors)
    # on a backend that does not read stored weights, the default widens them
    assert load_model(d, backend="chunked").weight_format == "float32"


def test_rounding_at_load_equals_a_checkpoint_stored_rounded(tmp_path):
    """weights="bfloat16" on a float32 checkpoint rounds its matrices (only they are held narrow):
    the bits of a checkpoint whose matrices were stored rounded."""
    save_checkpoint(load_model("tiny-mamba2", backend="reference"), tmp_path)
    f = tmp_path / "model.safetensors"
    matrix = ("proj.weight", "embedding.weight", "lm_head.weight")
    save_file({k: v.to(torch.bfloat16) if k.endswith(matrix) else v for k, v in load_file(str(f)).items()}, str(f))
    rounded = load_model("tiny-mamba2", backend="exact", weights="bfloat16")
    stored = load_model(tmp_path, backend="exact")
    assert stored.weight_format == 'bfloat16' and rounded.schema == stored.schema
    assert rounded.revision != stored.revision  # other checkpoints (float32 values, bfloat16 ones), one schema
    toks = tokens(20, 4)
    a, b = rounded.advance(rounded.initial_state(), toks), stored.advance(stored.initial_state(), toks)
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(a.state.tensors[k], b.state.tensors[k]) for k in a.state.tensors)


def test_weight_formats_that_cannot_be_served_are_refused_at_load(tmp_path):
    with pytest.raises(UnsupportedBackend, match="unknown weight format"):
        load_model("tiny-mamba2", weights="int4")
    with pytest.raises(UnsupportedBackend, match="exact backend only"):
        load_model("tiny-mamba2", backend="chunked", weights="bfloat16")
    with pytest.raises(UnsupportedBackend, match="exact backend only"):
        load_model("tiny-mamba2", backend="reference", weights="float16")
    with pytest.raises(UnsupportedBackend, match="compute dtype or narrower"):
        load_model("tiny-mamba2", weights="float64")
    assert load_model("tiny-mamba2", dtype=torch.float64, weights="bfloat16").schema.dtype == "float64"


def test_a_safetensors_file_that_lies_about_its_tensors_is_refused(tmp_path):
    save_checkpoint(load_model("tiny-mamba2", backend="reference"), tmp_path)
    f = tmp_path / "model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    for bad in ({**header[name], "data_offsets": [0, 10**12]}, {**header[name], "shape": [10**6]},
                {**header[name], "dtype": "Q4"}):
        body = json.dumps({**header, name: bad}).encode()
        f.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n :])
        with pytest.raises(CheckpointError, match=name):
            load_model(tmp_path)
    f.write_bytes((10**9).to_bytes(8, "little") + raw[8:])
    with pytest.raises(CheckpointError, match="does not fit"):
        load_model(tmp_path)


@pytest.mark.parametrize("preset", ["tiny-mamba1", "tiny-mamba3-mimo"])
def test_a_q8_checkpoint_holds_the_blocks_and_is_read_back_as_q8_with_the_same_bits(tmp_path, preset):
    quantized = load_model(preset, backend="exact", weights="q8")
    assert quantized.weight_format == "q8" and quantized.schema.weights == "q8"
    save_checkpoint(quantized, tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "backbone.layers.0.mixer.in_proj.weight_q8" in names \
        and "backbone.layers.0.mixer.in_proj.weight_scale" in names
    assert not any(n.endswith("proj.weight") for n in names) and "lm_head.weight_q8" not in names  # tied: once
    back = load_model(tmp_path, backend="exact")
    assert back.weight_format == "q8" and back.schema == quantized.schema
    assert back.revision != quantized.revision  # the q8 file is a checkpoint of its own
    ranges = _mapped_ranges(tmp_path / "model.safetensors")
    q = back.module.backbone.layers[0].mixer.in_proj.weight.q
    assert any(lo <= q.data_ptr() < hi for lo, hi in ranges)  # the blocks are the file's pages
    toks = tokens(33, 6)
    a, b = quantized.advance(quantized.initial_state(), toks), back.advance(back.initial_state(), toks)
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(a.state.tensors[k], b.state.tensors[k]) for k in a.state.tensors)
    # another backend gets the blocks' values in float32 (exactly q d)
    wide = load_model(tmp_path, backend="chunked")
    assert wide.weight_format == "float32"
    w = wide.module.backbone.layers[0].mixer.in_proj.weight
    assert torch.equal(w, back.module.backbone.layers[0].mixer.in_proj.weight.dequantize())


def test_a_q8_file_missing_its_scales_or_a_q8_model_in_float64_is_refused(tmp_path):
    save_checkpoint(load_model("tiny-mamba2", backend="exact", weights="q8"), tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    sd.pop("backbone.layers.0.mixer.in_proj.weight_scale")
    save_file(sd, str(f))
    with pytest.raises(CheckpointError, match=r"in_proj.weight_scale"):
        load_model(tmp_path)
    with pytest.raises(UnsupportedBackend, match="float32"):
        load_model("tiny-mamba2", dtype=torch.float64, weights="q8")
    with pytest.raises(UnsupportedBackend, match="exact backend only"):
        load_model("tiny-mamba2", backend="chunked", weights="q8")


def test_a_checkpoints_revision_is_remembered_by_its_files_and_recomputed_when_they_change(tmp_path, monkeypatch):
    from mamba_stream.scan import _loading

    monkeypatch.setenv("MAMBA_STREAM_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "ckpt"
    save_checkpoint(load_model("tiny-mamba2", backend="reference"), d)
    calls = []
    real = _loading.weights_revision
    monkeypatch.setattr(_loading, "weights_revision", lambda sd: calls.append(1) or real(sd))
    # a checkpoint written a moment ago is hashed on every load: it may still be written again
    load_model(d), load_model(d)
    assert len(calls) == 2
    monkeypatch.setattr(_loading, "_SETTLED_S", 0.0)
    calls.clear()
    first = load_model(d).revision
    assert load_model(d).revision == first and len(calls) == 1  # the second load reads no weight bytes
    # the file written again (other weights): a new key, a new hash
    save_checkpoint(load_model("tiny-mamba3", backend="reference"), tmp_path / "other")
    calls.clear()  # (a preset's revision is hashed as it is built)
    (d / "config.json").write_text((tmp_path / "other" / "config.json").read_text())
    (d / "model.safetensors").write_bytes((tmp_path / "other" / "model.safetensors").read_bytes())
    again = load_model(d).revision
    assert len(calls) == 1 and again != first and again == load_model(tmp_path / "other").revision
    # a cache entry that is not a revision is not believed
    for entry in (tmp_path / "cache" / "revisions").iterdir():
        entry.write_text("not a revision")
    assert load_model(d).revision == again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT and pagemap are Linux's")
def test_a_q8_checkpoints_scales_leave_memory_once_repacked_and_no_bit_changes(tmp_path, monkeypatch):
    """The kernels read the repacked scales (d8) only, so the file's own scales are paged out after
    load: a q8 model does not hold its scales twice (1/16 byte a weight, 0.45 GB at 7B). The blocks
    stay; the logits and states equal those of the same file loaded without paging out; and the
    scales read again (a twin, a save) are the file's values."""
    cfg = load_model("tiny-mamba2").config.model_copy(update={"d_model": 256, "vocab_size": 4096})
    save_checkpoint(init_model(cfg, seed=3, backend="exact", weights="q8"), tmp_path)
    settled = load_model(tmp_path, backend="exact")
    emb = settled.module.backbone.embedding.weight
    file_scales = load_file(str(tmp_path / "model.safetensors"))["backbone.embedding.weight_scale"]
    ranges = _mapped_ranges(tmp_path / "model.safetensors")
    assert any(lo <= emb.d.data_ptr() < hi for lo, hi in ranges)  # the file's own scales
    toks = tokens(40, 7)
    a = settled.advance(settled.initial_state(), toks)
    blocks, scales = pages_in_memory(emb.q), pages_in_memory(emb.d)
    assert len(scales) >= 8 and not any(scales)  # 15 pages of scales, none mapped in after a chunk
    assert all(blocks)  # the check sees pages that are in: the blocks the head read
    monkeypatch.setattr(Q8Weight, "settle", lambda self: 0)
    kept = load_model(tmp_path, backend="exact")
    b = kept.advance(kept.initial_state(), toks)
    assert any(pages_in_memory(kept.module.backbone.embedding.weight.d))
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(a.state.tensors[k], b.state.tensors[k]) for k in a.state.tensors)
    assert torch.equal(emb.d, file_scales) and any(pages_in_memory(emb.d))  # read again: the file's values

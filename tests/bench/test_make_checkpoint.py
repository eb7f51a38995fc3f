"""bench/make_checkpoint.py's hybrid and FalconMamba shapes: the full-size configs parse to the
published layouts, and a tiny checkpoint of each (`--tiny`: the same code and layer pattern at hidden
64) loads with `load_model` in bfloat16 and q8, under transformers' tensor names (and, for Bamba and
FalconMamba, with transformers itself, to the same logits)."""

from __future__ import annotations

import json

import pytest
import torch

from mamba_stream.scan import config_from_json, load_model, parameter_shapes
from tests.bench._load import load_bench
from tests.scan._hybrid import hf_logits

mc = load_bench("make_checkpoint")


def test_granite_micro_is_granite_4_h_micros_layout():
    cfg_json = mc.hf_config("granite-micro")
    cfg, layout = config_from_json(cfg_json)
    assert layout == "hf" and cfg.n_layer == 40 and cfg.d_model == 2048 and cfg.vocab_size == 100352
    assert [i for i, k in enumerate(cfg.kinds) if k == "attention"] == [5, 15, 25, 35]
    assert set(cfg.kinds) == {"mamba2", "attention"} and cfg.ffns == ("mlp",) * 40
    assert (cfg.n_q_heads, cfg.n_kv_heads, cfg.attn_head_dim, cfg.position_embedding) == (32, 8, 64, "nope")
    assert (cfg.nheads, cfg.headdim, cfg.d_state, cfg.ngroups, cfg.d_conv) == (64, 64, 128, 1, 4)
    assert cfg.tie_embeddings and cfg.max_positions == 131072
    shapes = parameter_shapes(cfg)
    assert "lm_head.weight" not in shapes and shapes["backbone.embedding.weight"] == (100352, 2048)
    assert shapes["backbone.layers.0.mixer.in_proj.weight"] == (2 * 4096 + 2 * 128 + 64, 2048)
    assert shapes["backbone.layers.5.mixer.k_proj.weight"] == (8 * 64, 2048)
    assert shapes["backbone.layers.5.mlp.input_linear.weight"] == (2 * 8192, 2048)
    assert 3.0e9 < sum(torch.Size(s).numel() for s in shapes.values()) < 3.4e9  # "3B"
    names = mc.layout(cfg_json, "bfloat16")
    assert "model.embed_tokens.weight" in names and "model.layers.5.self_attn.q_proj.weight" in names
    assert "model.layers.4.mamba.in_proj.weight" in names and "model.layers.4.shared_mlp.output_linear.weight" in names


def test_nemotron_h_8b_is_nemotron_h_8bs_layout():
    cfg_json = mc.hf_config("nemotron-h-8b")
    cfg, _ = config_from_json(cfg_json)
    assert cfg.n_layer == 52 and cfg.d_model == 4096 and cfg.vocab_size == 131072 and not cfg.tie_embeddings
    assert [cfg.kinds.count(k) for k in ("mamba2", "attention", "mlp")] == [24, 4, 24]
    assert "".join({"mamba2": "M", "attention": "*", "mlp": "-"}[k] for k in cfg.kinds) == mc._NEMOTRON_8B
    assert (cfg.n_q_heads, cfg.n_kv_heads, cfg.attn_head_dim) == (32, 8, 128)
    assert (cfg.nheads, cfg.headdim, cfg.d_state, cfg.ngroups) == (128, 64, 128, 8)
    assert (cfg.mlp_intermediate_size, cfg.mlp_activation, cfg.mlp_gated) == (21504, "relu2", False)
    shapes = parameter_shapes(cfg)
    assert 7.5e9 < sum(torch.Size(s).numel() for s in shapes.values()) < 8.5e9  # "8B"
    names = mc.layout(cfg_json, "q8")
    assert names["backbone.layers.1.mixer.up_proj.weight"] == ((21504, 4096), "backbone.layers.1.mixer.up_proj.weight")
    assert names["backbone.embeddings.weight"][1] == "backbone.embeddings.weight"


def test_bamba_9b_is_bamba_9bs_layout():
    cfg_json = mc.hf_config("bamba-9b")
    cfg, layout = config_from_json(cfg_json)
    assert layout == "hf" and cfg.n_layer == 32 and cfg.d_model == 4096 and cfg.vocab_size == 128256
    assert [i for i, k in enumerate(cfg.kinds) if k == "attention"] == [9, 18, 27]
    assert set(cfg.kinds) == {"mamba2", "attention"} and cfg.ffns == ("mlp",) * 32
    assert (cfg.n_q_heads, cfg.n_kv_heads, cfg.attn_head_dim, cfg.position_embedding) == (32, 8, 128, "rope")
    assert (cfg.rope_theta, cfg.rotary_dim) == (10000.0, 64)  # half of each head, as the hub's attn_rotary_emb
    assert (cfg.nheads, cfg.headdim, cfg.d_state, cfg.ngroups, cfg.d_conv) == (128, 64, 128, 1, 4)
    assert (cfg.mlp_intermediate_size, cfg.mlp_activation) == (14336, "silu") and cfg.mlp_gated is not False
    assert not cfg.tie_embeddings and cfg.max_positions == 4096
    shapes = parameter_shapes(cfg)
    assert 9.5e9 < sum(torch.Size(s).numel() for s in shapes.values()) < 10.0e9  # "9B" (9.78B, embeddings untied)
    names = mc.layout(cfg_json, "q8")
    # transformers' MLP: gate_proj and up_proj apart, each a q8 pair of its own (joined on load)
    for proj in ("gate_proj", "up_proj"):
        name = f"model.layers.0.feed_forward.{proj}.weight"
        assert names[name] == ((14336, 4096), name)
    assert "backbone.layers.0.mlp.input_linear.weight" not in names
    assert names["model.layers.9.self_attn.k_proj.weight"] == ((1024, 4096), "model.layers.9.self_attn.k_proj.weight")
    assert names["model.final_layernorm.weight"] == ((4096,), None)
    assert names["lm_head.weight"][1] == "lm_head.weight"


def test_falcon_mamba_7b_is_falcon_mamba_7bs_layout():
    cfg_json = mc.hf_config("falcon-mamba-7b")
    assert cfg_json["architectures"] == ["FalconMambaForCausalLM"] and cfg_json["intermediate_size"] == 8192
    cfg, layout = config_from_json(cfg_json)
    assert layout == "hf" and cfg.architecture == "mamba1" and cfg.bcdt_rms_eps == 1e-6
    assert (cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.d_state, cfg.d_conv, cfg.dt_rank) == (
        64, 4096, 65024, 16, 4, 256)
    assert not cfg.tie_embeddings
    shapes = parameter_shapes(cfg)
    assert 7.0e9 < sum(torch.Size(s).numel() for s in shapes.values()) < 7.5e9  # "7B"
    names = mc.layout(cfg_json, "bfloat16")
    assert names["backbone.embeddings.weight"] == ((65024, 4096), None) and "lm_head.weight" in names
    assert names["backbone.layers.0.mixer.x_proj.weight"] == ((256 + 2 * 16, 8192), None)


def test_the_tiny_falcon_mamba_loads_in_each_format(tmp_path):
    for fmt in ("bfloat16", "q8"):
        d = mc.make("falcon-mamba-7b", fmt, tmp_path / fmt, tiny=True)
        model = load_model(d)
        cfg = model.config
        assert model.weight_format == fmt and cfg.d_model == 64 and cfg.bcdt_rms_eps == 1e-6
        assert json.loads((d / "config.json").read_text())["model_type"] == "falcon_mamba"
        if fmt == "q8":
            buffers = dict(model.module.named_buffers())
            assert "backbone.embedding.weight_q8" in buffers and "lm_head.weight_q8" in buffers
        out = model.advance(model.initial_state(), [1, 2, 3])
        assert out.logits.shape == (3, cfg.vocab_size) and torch.isfinite(out.logits).all()


@pytest.mark.crosscheck
@pytest.mark.parametrize("shape", ["bamba-9b", "falcon-mamba-7b"])
def test_transformers_reads_the_tiny_checkpoint_as_we_do(shape, tmp_path):
    """The file is one transformers itself loads (no missing or unused tensors) to our logits: its
    MLP halves, norms and names are where transformers keeps them."""
    transformers = pytest.importorskip("transformers")
    d = mc.make(shape, "float32", tmp_path / "f32", tiny=True)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids = torch.randint(0, 512, (8,), generator=torch.Generator().manual_seed(1))
    truth = hf_logits(hf.eval(), ids.tolist())  # its pure-PyTorch path, whatever else a test run imported
    model = load_model(d, backend="reference", **({"max_positions": 64} if shape == "bamba-9b" else {}))
    got = model.advance(model.initial_state(), ids.tolist()).logits
    assert float(((got - truth).abs().amax(-1) / truth.abs().amax(-1)).max()) < 1e-4


@pytest.mark.parametrize("shape", ["granite-micro", "nemotron-h-8b", "bamba-9b"])
def test_a_tiny_checkpoint_of_each_hybrid_loads_in_each_format(shape, tmp_path):
    full, _ = config_from_json(mc.hf_config(shape))
    for fmt in ("bfloat16", "q8"):  # the formats bench_sizes.py measures them in (float32 is the q8 file's rest)
        d = mc.make(shape, fmt, tmp_path / fmt, tiny=True)
        stored = json.loads((d / "config.json").read_text())
        assert stored["model_type"] == mc.HYBRIDS[shape]["model_type"]
        model = load_model(d, max_positions=64)
        cfg = model.config
        assert model.weight_format == fmt
        assert (cfg.kinds, cfg.ffns, cfg.tie_embeddings) == (full.kinds, full.ffns, full.tie_embeddings)
        assert cfg.d_model == 64 and cfg.n_kv_heads * 2 == cfg.n_q_heads
        if fmt == "q8":  # every matrix held as blocks, the embedding too, under the checkpoint's own names
            from safetensors import safe_open

            with safe_open(str(d / "model.safetensors"), "pt") as fh:
                emb = {"granite-micro": "model.embed_tokens.weight", "bamba-9b": "model.embed_tokens.weight",
                       "nemotron-h-8b": "backbone.embeddings.weight"}[shape]
                assert {emb + "_q8", emb + "_scale"} <= set(fh.keys())
            buffers = dict(model.module.named_buffers())
            assert "backbone.embedding.weight_q8" in buffers and "backbone.layers.0.mixer.in_proj.weight_q8" in buffers
        out = model.advance(model.initial_state(), [1, 2, 3])
        assert out.logits.shape == (3, cfg.vocab_size) and torch.isfinite(out.logits).all()

"""Falcon-H1 from a Hugging Face directory: every layer a "parallel" one (Mamba-2 and attention side
by side on the same normed input, outputs summed), then a gated MLP; muP multipliers throughout.

The truth is transformers' own FalconH1, a tiny random one saved with `save_pretrained` and run in
float32 on its slow (pure PyTorch) path: hidden 64, 3 layers, 4 query heads sharing 2 key/value
heads of 16 (RoPE), Mamba-2 with 8 heads of 16 and state 16 (mamba_d_ssm 128), gated RMS norm,
biases on every projection, and every multiplier set to a value that is not 1. Ours must match it
within 1e-4 of each row's logit scale on every backend, give the same bits (logits and every state
tensor: conv, SSM, k, v of each layer) under any chunking and batching on the exact backend, miss
the bound by far more than 10x with any one multiplier dropped (so the comparison sees each), and
refuse typed what it does not compute.
"""

from __future__ import annotations

import json

import pytest
import torch

from mamba_stream.scan import PositionLimit, load_model
from mamba_stream.scan._errors import ConfigError
from tests.scan._helpers import scan_chunks
from tests.scan._hybrid import (
    BOUND,
    CHUNKINGS,
    N_TOKENS,
    assert_exact_chunking_and_batching,
    assert_matches,
    assert_q8_chunks_exactly,
    assert_refused,
    assert_schema_round_trips,
    assert_step_rows_bits,
    edited,
    hf_logits,
    load_bfloat16_as_stored,
    perturb,
    rel,
    rel_of,
    save_bfloat16,
    saved_with_truth,
    state_equal,
)
from tests.scan._mamba_ssm import require

pytestmark = pytest.mark.crosscheck

MAX_POSITIONS = 128
D_SSM, GN = 128, 16  # the Mamba-2's channels (8 heads of 16), its B (and C) columns (1 group of 16)
#: every multiplier not 1 (and exact in bfloat16, so that a rounded copy means the same function)
SCALARS = {"embedding_multiplier": 1.75, "lm_head_multiplier": 0.625, "key_multiplier": 1.375,
           "attention_in_multiplier": 0.75, "attention_out_multiplier": 1.25, "ssm_in_multiplier": 1.125,
           "ssm_out_multiplier": 0.6875}
SSM_MULTIPLIERS = [0.5, 1.5, 0.375, 2.5, 3.0]  # z, x, B, C, dt: transformers' mup_vector
MLP_MULTIPLIERS = [0.75, 1.375]  # gate, down
OURS = {"embedding_multiplier": "embedding_multiplier", "lm_head_multiplier": "logits_multiplier",
        "key_multiplier": "key_multiplier", "attention_in_multiplier": "attention_in_multiplier",
        "attention_out_multiplier": "attention_out_multiplier", "ssm_in_multiplier": "ssm_in_multiplier",
        "ssm_out_multiplier": "ssm_out_multiplier"}


def _hf_falcon_h1(seed: int = 0, **overrides):
    """A seeded tiny FalconH1 of transformers' own making (`overrides`: config fields)."""
    require("transformers")
    from transformers import FalconH1Config, FalconH1ForCausalLM

    fields = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, mamba_d_ssm=D_SSM, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=32, max_position_embeddings=MAX_POSITIONS,
        mamba_rms_norm=True, mamba_norm_before_gate=True, mamba_proj_bias=True, projectors_bias=True,
        attention_bias=True, mlp_bias=True, ssm_multipliers=SSM_MULTIPLIERS, mlp_multipliers=MLP_MULTIPLIERS,
        **SCALARS)
    fields.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FalconH1ForCausalLM(FalconH1Config(**fields)).eval()
        # transformers initializes A_log, D, dt_bias and the norms to constants: random values, so
        # that a mixed-up head or a norm's weight shows. Long memories (A small), a small D skip and
        # larger B, C, dt columns of in_proj, so that the SSM's own path (and each of its in_proj
        # multipliers) moves the logits; larger q and k, so that the scores (and key_multiplier) do
        perturb(model, ("dt_bias", "norm.weight", "layernorm.weight"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.copy_(torch.log(torch.rand_like(p) * 0.5 + 0.05))
                elif name.endswith("mamba.D"):
                    p.copy_(0.1 * torch.randn_like(p))
                elif name.endswith("in_proj.weight"):
                    p[2 * D_SSM :].mul_(8.0)
                elif name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(4.0)
        return model


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    """(transformers' model, its float32 directory, the token ids, transformers' logits (L, V))."""
    return saved_with_truth(_hf_falcon_h1(), tmp_path_factory.mktemp("falcon-h1-f32"))


def test_the_checkpoint_loads_as_parallel_layers(falcon):
    _, d, _, _ = falcon
    saved = json.loads((d / "config.json").read_text())
    assert saved["ssm_multipliers"] == SSM_MULTIPLIERS and "layer_types" not in saved  # as transformers saves it
    model = load_model(d, backend="exact")
    cfg = model.config
    assert cfg.kinds == ("parallel",) * 3 and cfg.ffns == ("mlp",) * 3 and cfg.is_hybrid and cfg.has_attention
    assert (cfg.n_q_heads, cfg.n_kv_heads, cfg.attn_head_dim, cfg.max_positions) == (4, 2, 16, MAX_POSITIONS)
    assert (cfg.d_inner, cfg.resolved_d_ssm, cfg.nheads, cfg.headdim, cfg.rmsnorm, cfg.norm_before_gate) == (
        D_SSM, D_SSM, 8, 16, True, True)
    assert cfg.attention_multiplier == 0.25 and cfg.position_embedding == "rope" and cfg.rope_theta == 10000.0
    assert all(getattr(cfg, OURS[k]) == v for k, v in SCALARS.items())
    assert cfg.ssm_multipliers == tuple(SSM_MULTIPLIERS)
    assert (cfg.mlp_gate_multiplier, cfg.mlp_down_multiplier) == tuple(MLP_MULTIPLIERS)
    blk = model.module.backbone.layers[0]
    assert blk.kind == "parallel" and blk.mixer.mamba.in_proj.bias is not None
    assert blk.mixer.mamba.out_proj.bias is not None and blk.mixer.attn.q_proj.bias is not None
    assert blk.mlp is not None and blk.mlp.input_linear.weight.shape == (2 * 96, 64)
    roles = [(t.layer, t.role, t.shape) for t in model.schema.tensors]
    kv = (MAX_POSITIONS, 2, 16)
    assert roles == [(i, role, shape) for i in range(3)
                     for role, shape in (("conv", (D_SSM + 2 * GN, 4)), ("ssm", (8, 16, 16)), ("k", kv), ("v", kv))]
    layers = model.schema.layers
    assert layers is not None and layers.kinds == cfg.kinds and layers.ssm_multipliers == tuple(SSM_MULTIPLIERS)
    assert layers.key_multiplier == SCALARS["key_multiplier"] and layers.logits_multiplier == 0.625
    assert_schema_round_trips(model)


def test_the_multipliers_are_in_the_schema_not_only_in_the_weights(falcon, tmp_path):
    """transformers saves none of them (mup_vector is a buffer it derives): the same weights under
    another multiplier are another function, so the schema (the states' fingerprint) differs while
    the weights' revision does not."""
    _, d, _, _ = falcon
    a = load_model(d, backend="exact")
    b = load_model(edited(d, tmp_path / "m", ssm_multipliers=[0.5, 1.5, 0.375, 2.5, 2.0]), backend="exact")
    assert a.revision == b.revision
    assert a.schema.fingerprint() != b.schema.fingerprint()


@pytest.mark.parametrize("backend", ["reference", "chunked", "exact", "exact-fma"])
def test_logits_match_transformers_falcon_h1(falcon, backend):
    _, d, toks, truth = falcon
    assert_matches(load_model(d, backend=backend), toks, truth, "falcon_h1")


@pytest.mark.parametrize("backend", ["exact", "exact-fma"])
def test_exact_chunking_and_batching_give_the_same_bits(falcon, backend):
    """[96], [1, 7, 30, 58] and 96 x 1: the same logits and every state tensor of every layer (conv,
    SSM, k, v) bit for bit; streams batched at positions 5 and 40 keep their own bits; the KV rows
    past the position stay zero."""
    _, d, toks, truth = falcon
    model = load_model(d, backend=backend)
    state = assert_exact_chunking_and_batching(model, toks)
    assert state.position == N_TOKENS
    for i in range(3):
        for role in ("k", "v"):
            t = state.tensors[f"layers.{i}.{role}"]
            assert t.shape[0] == N_TOKENS and bool(t.ne(0).any())
        assert bool(state.tensors[f"layers.{i}.ssm"].ne(0).any())
    logits, _ = scan_chunks(model, model.initial_state(), toks, CHUNKINGS[-1])
    assert rel(logits, truth) <= BOUND
    assert model.advance(model.initial_state(), toks[:1]).path == model.exact_probe.path


def _dropped(name: str) -> dict:
    """The config edit that sets one multiplier (or one entry of a list of them) back to 1.0."""
    if name.startswith(("ssm_multipliers.", "mlp_multipliers.")):
        key, index = name.split(".")
        values = list(SSM_MULTIPLIERS if key == "ssm_multipliers" else MLP_MULTIPLIERS)
        values[int(index)] = 1.0
        return {key: values}
    return {name: 1.0}


DROPPED = [*sorted(SCALARS), *(f"ssm_multipliers.{i}" for i in range(5)), "mlp_multipliers.0", "mlp_multipliers.1"]


@pytest.mark.parametrize("dropped", DROPPED)
def test_a_dropped_multiplier_misses_the_bound(falcon, tmp_path, dropped):
    """The negative controls: each multiplier (each entry of ssm_multipliers and mlp_multipliers)
    set back to transformers' default 1.0 fails the comparison by more than 10x."""
    _, d, toks, truth = falcon
    r = rel_of(edited(d, tmp_path / "m", **_dropped(dropped)), toks, truth)
    print(f"CROSSCHECK HF falcon_h1 vs ours without {dropped}: max rel {r:.2e}")
    assert r > 10 * BOUND


def test_the_one_call_decode_step_refuses_the_mup_layers(falcon, tmp_path, monkeypatch, caplog):
    """`mamba2_step_f32` computes no in_proj multipliers: a Falcon-H1 Mamba-2 (ssm_multipliers set)
    decodes through the primitives (logged), with the chunk's bits. The same checkpoint with the
    multipliers all 1.0 (no operation: None) is a plain gated-norm Mamba-2 and takes the call,
    three a token (its in/out multipliers are applied around the mixer)."""
    from mamba_stream.scan.exact import _step
    from mamba_stream.scan.exact._kernels import _kernel_ops

    _, d, toks, _ = falcon
    model = load_model(d, backend="exact")
    ops = _kernel_ops()
    if ops is None or not model.exact_probe.kernels:
        pytest.skip("the exact kernels do not run here: the twins take every token")
    monkeypatch.setattr(_step, "_REFUSED_LOGGED", set())
    calls: list[int] = []
    real = ops.lib.mamba2_step_f32
    monkeypatch.setattr(ops.lib, "mamba2_step_f32", lambda *a: (calls.append(1), real(*a))[1])
    with caplog.at_level("INFO", logger=_step.__name__):
        one = model.advance(model.initial_state(), toks[:1])
    assert calls == [] and one.path == "exact"
    assert "ssm_multipliers" in caplog.text
    assert ops._layer(model.module.backbone.layers[0].mixer.mamba) is None
    chunk = model.advance(model.initial_state(), toks[:2])
    two = model.advance(one.state, toks[1:2])
    assert torch.equal(two.logits[0], chunk.logits[1]) and state_equal(two.state, chunk.state)
    plain = load_model(edited(d, tmp_path / "plain", ssm_multipliers=[1.0] * 5), backend="exact")
    assert plain.config.ssm_multipliers is None and plain.exact_probe.kernels
    calls.clear()  # the load's probe stepped too
    one = plain.advance(plain.initial_state(), toks[:1])
    assert len(calls) == 3 and one.path == "exact"
    chunk = plain.advance(plain.initial_state(), toks[:2])
    two = plain.advance(one.state, toks[1:2])
    assert torch.equal(two.logits[0], chunk.logits[1]) and state_equal(two.state, chunk.state)


def test_the_plain_variant_matches(tmp_path):
    """transformers' defaults for the Mamba-2 (no gated norm: y * silu(z); no biases) with tied
    embeddings; and the gated norm after the gate (mamba_norm_before_gate false), which read as
    before the gate misses the bound."""
    toks = torch.randint(0, 256, (N_TOKENS,), generator=torch.Generator().manual_seed(6)).tolist()
    for name, overrides in (
        ("no-norm", dict(mamba_rms_norm=False, mamba_proj_bias=False, projectors_bias=False, attention_bias=False,
                         mlp_bias=False, tie_word_embeddings=True)),
        ("gate-first", dict(mamba_norm_before_gate=False)),
    ):
        hf = _hf_falcon_h1(seed=1, **overrides)
        hf.save_pretrained(str(tmp_path / name))
        truth = hf_logits(hf, toks)
        for backend in ("reference", "exact"):
            model = load_model(tmp_path / name, backend=backend)
            assert_matches(model, toks, truth, f"falcon_h1 {name}", chunkings=([1, 7, 30, 58],))
        assert_exact_chunking_and_batching(model, toks)
    assert model.config.norm_before_gate is False
    flipped = load_model(edited(tmp_path / name, tmp_path / "flipped", mamba_norm_before_gate=True), backend="exact")
    assert rel(flipped.advance(flipped.initial_state(), toks).logits, truth) > 10 * BOUND


def test_max_positions_is_refused_typed(falcon):
    _, d, toks, _ = falcon
    model = load_model(d, backend="exact")
    state = model.advance(model.initial_state(), toks).state  # 96 of 128
    with pytest.raises(PositionLimit) as err:
        model.advance(state, toks[:33])
    assert (err.value.limit, err.value.actual) == (MAX_POSITIONS, 129)


@pytest.mark.parametrize("in_place", [False, True])
def test_the_slot_tables_step_gives_each_row_its_own_bits(falcon, in_place):
    """`step_rows` on buffers of three streams at positions 3, 17 and 40 (rows 0, 2, 1: not a span,
    then a span): each row the bits of its own `advance` by that token, logits and every state tensor
    of the parallel layers (conv and SSM written in place where `in_place`, the KV row at its
    position)."""
    _, d, toks, _ = falcon
    assert_step_rows_bits(load_model(d, backend="exact"), toks, in_place)


@pytest.mark.parametrize(("changes", "field"), [
    ({"projectors_bias": False}, "projectors_bias"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mamba_n_heads": 5}, "mamba_n_heads"),
    ({"ssm_multipliers": [1.0, 2.0, 3.0, 4.0]}, "ssm_multipliers"),
    ({"key_multiplier": "2"}, "key_multiplier"),
    ({"attn_layer_indices": [0]}, "attn_layer_indices"),
    ({"layer_types": ["hybrid", "attention", "hybrid"]}, "layer_types"),
    ({"some_new_field": 1}, "some_new_field"),
])
def test_what_is_not_computed_is_refused_typed_naming_the_field(falcon, tmp_path, changes, field):
    assert_refused(falcon[1], tmp_path / "bad", changes, field, "FalconH1")


def test_bfloat16_and_q8_matrices_compute_their_own_function(falcon, tmp_path):
    """transformers' bfloat16 save is read as stored (every matrix, the joined MLP input included),
    with the bits of its float32 widening, and matches transformers' float32 run of those rounded
    weights; q8 holds every matrix as block-int8 and still chunks exactly."""
    from transformers import FalconH1ForCausalLM

    hf, d, toks, truth = falcon
    bf = tmp_path / "bf16"
    save_bfloat16(_hf_falcon_h1, hf, bf)
    kept, a = load_bfloat16_as_stored(bf, toks)
    blk = kept.module.backbone.layers[1]
    assert blk.mixer.attn.q_proj.weight.dtype == torch.bfloat16 and blk.mlp.input_linear.weight.dtype == torch.bfloat16
    # transformers' own float32 model of the rounded weights (its buffers, rope's and mup's, derived afresh)
    rounded = FalconH1ForCausalLM.from_pretrained(str(bf), dtype=torch.float32).eval()
    r = rel(a.logits, hf_logits(rounded, toks))
    print(f"CROSSCHECK HF falcon_h1 vs ours (exact, bfloat16 matrices): max rel {r:.2e}")
    assert r <= BOUND
    assert_q8_chunks_exactly(d, toks, truth, "falcon_h1", 0.05)


@pytest.mark.parametrize(("fields", "field"), [
    ({"ssm_in_multiplier": 2.0}, "ssm_in_multiplier"),  # no parallel layer reads it
    ({"attention_out_multiplier": 2.0}, "attention_out_multiplier"),
    ({"key_multiplier": 2.0}, "key_multiplier"),  # no layer attends
    ({"mlp_down_multiplier": 2.0}, "mlp_down_multiplier"),  # no MLP
    ({"ssm_multipliers": (1.0, 1.0, 1.0, 1.0, float("nan"))}, "ssm_multipliers"),
    ({"layer_types": ("parallel", "mamba2"), "architecture": "mamba1"}, "layer_types"),  # a Mamba-2 layer only
    ({"logits_multiplier": 0.0}, "logits_multiplier"),
])
def test_the_config_refuses_a_multiplier_no_layer_reads(fields, field):
    from mamba_stream.scan import ModelConfig

    base = {"architecture": "mamba2", "d_model": 64, "n_layer": 2, "vocab_size": 256, "headdim": 16, "d_state": 16}
    with pytest.raises(ConfigError) as err:
        ModelConfig.create(**{**base, **fields})
    assert err.value.field == field


def test_the_hubs_config_spelling_loads_to_the_same_model(falcon, tmp_path):
    """The hub's Falcon-H1 config.json (transformers 4.x): rope_theta at the top with rope_scaling
    null, head_dim, mamba_use_mlp, attn_layer_indices null, mlp_expansion_factor: the same config,
    schema and logits as transformers 5.24's save."""
    import shutil

    _, d, toks, _ = falcon
    hub = tmp_path / "hub"
    shutil.copytree(d, hub)
    cfg = json.loads((hub / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg.update(rope_theta=theta, rope_scaling=None, head_dim=16, mamba_use_mlp=True, attn_layer_indices=None,
               mlp_expansion_factor=8)
    (hub / "config.json").write_text(json.dumps(cfg))
    new, old = load_model(d, backend="exact"), load_model(hub, backend="exact")
    assert old.config == new.config and old.schema.fingerprint() == new.schema.fingerprint()
    assert torch.equal(old.advance(old.initial_state(), toks).logits, new.advance(new.initial_state(), toks).logits)

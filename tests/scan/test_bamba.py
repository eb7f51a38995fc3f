"""Bamba from a Hugging Face directory: Mamba-2 and partial-rotary attention layers, each followed by
its own norm and a gated SiLU MLP.

The truth is transformers' own Bamba, a tiny random one saved with `save_pretrained` and run in
float32 on its slow (pure PyTorch) path: layers mamba, attention, mamba, attention (4 query heads
sharing 2 key/value heads of 16, RoPE over the first 8 features of each head: BambaConfig's
partial_rotary_factor 0.5), Mamba-2 with 8 heads of 16 in 1 or 2 groups. Ours must match it within
1e-4 of each row's logit scale on every backend, give the same bits (logits and every state tensor)
under any chunking and batching on the exact backends, see the features it maps (read with a full
rotation, or with gate and up swapped, it misses), and refuse typed what it does not compute.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mamba_stream.scan import load_model
from tests.scan._helpers import scan_chunks
from tests.scan._hybrid import (
    BOUND,
    CHUNKINGS,
    N_TOKENS,
    assert_exact_chunking_and_batching,
    assert_matches,
    assert_q8_chunks_exactly,
    assert_refused,
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
BACKENDS = ["reference", "chunked", "exact", "exact-fma"]
#: q_proj and k_proj scaled by this: scores large enough for positions (rope) to move them (read
#: with a full rotation: ~0.7), yet not so sharp that the weights' rounding swamps the comparison
QK_SCALE = 6
#: transformers initializes these to constants (ones; A_log to log(1..H)): noise, so that a
#: mixed-up head, group or norm weight shows
CONSTANT_INIT = ("A_log", "D", "dt_bias", "norm.weight", "layernorm.weight")


def _hf_bamba(ngroups: int = 1, seed: int = 0, **overrides):
    """A seeded tiny Bamba of transformers' own making: hidden 64, layers mamba, attention, mamba,
    attention; GQA 4 q / 2 kv heads of 16; Mamba-2 8 heads of 16, state 16, `ngroups` groups. q and
    k are scaled by QK_SCALE so that the scores are large enough for positions (rope) to move them."""
    require("transformers")
    from transformers import BambaConfig, BambaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fields = dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            attn_layer_indices=[1, 3], intermediate_size=128, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
            mamba_n_groups=ngroups, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=32,
            max_position_embeddings=MAX_POSITIONS)
        model = BambaForCausalLM(BambaConfig(**{**fields, **overrides})).eval()
        perturb(model, CONSTANT_INIT)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(QK_SCALE)
        return model


def _build(tmp_path_factory, ngroups: int):
    return saved_with_truth(_hf_bamba(ngroups), tmp_path_factory.mktemp(f"bamba-g{ngroups}"))


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    """(transformers' model, its float32 directory, the token ids, transformers' logits (L, V)); one group."""
    return _build(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def bamba_g2(tmp_path_factory):
    """As `bamba`, with B and C in two groups (and the gated norm over two groups of 64)."""
    return _build(tmp_path_factory, 2)


def test_the_checkpoint_loads_as_typed_layers(bamba):
    _, d, _, _ = bamba
    saved = json.loads((d / "config.json").read_text())
    assert saved["rope_parameters"]["partial_rotary_factor"] == 0.5  # BambaConfig's hard-coded factor
    assert not saved["tie_word_embeddings"]
    cfg = load_model(d, backend="exact").config
    assert cfg.kinds == ("mamba2", "attention", "mamba2", "attention") and cfg.ffns == ("mlp",) * 4
    assert (cfg.n_q_heads, cfg.n_kv_heads, cfg.attn_head_dim, cfg.max_positions) == (4, 2, 16, MAX_POSITIONS)
    assert (cfg.position_embedding, cfg.rope_theta, cfg.rotary_dim) == ("rope", 10000.0, 8)
    assert cfg.attention_multiplier == 16 ** -0.5 and not cfg.tie_embeddings
    assert (cfg.headdim, cfg.nheads, cfg.ngroups, cfg.d_state, cfg.mlp_intermediate_size) == (16, 8, 1, 16, 128)
    assert (cfg.norm_eps, cfg.mixer_norm_eps, cfg.dt_min_clamp, cfg.dt_max_clamp) == (1e-5, 1e-5, 0.0, None)
    assert cfg.embedding_multiplier is None and cfg.residual_multiplier is None and cfg.logits_scaling is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_transformers_bamba(bamba, backend):
    _, d, toks, truth = bamba
    assert_matches(load_model(d, backend=backend), toks, truth, "bamba")


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_transformers_bamba_two_groups(bamba_g2, backend):
    _, d, toks, truth = bamba_g2
    model = load_model(d, backend=backend)
    assert model.config.ngroups == 2
    assert_matches(model, toks, truth, "bamba ngroups 2")


@pytest.mark.parametrize("backend", ["exact", "exact-fma"])
@pytest.mark.parametrize("groups", [1, 2])
def test_exact_chunking_and_batching_give_the_same_bits(bamba, bamba_g2, backend, groups):
    """[96], [1, 7, 30, 58] and 96 x 1: the same logits and every state tensor (conv, SSM, k, v)
    bit for bit; two streams advanced together keep their own bits."""
    _, d, toks, _ = bamba if groups == 1 else bamba_g2
    model = load_model(d, backend=backend)
    state = assert_exact_chunking_and_batching(model, toks)
    assert state.position == N_TOKENS
    assert {"layers.0.conv", "layers.0.ssm", "layers.1.k", "layers.1.v"} <= set(state.tensors)
    for name in ("layers.1.k", "layers.3.k"):
        assert state.tensors[name].shape[0] == N_TOKENS and bool(state.tensors[name].ne(0).any())


def test_read_with_a_full_rotation_misses_the_bound(bamba, tmp_path):
    """The negative control for partial rotary: the same checkpoint with partial_rotary_factor 1.0
    (every feature of each head rotated) misses the bound."""
    _, d, toks, truth = bamba
    saved = json.loads((d / "config.json").read_text())
    full = edited(d, tmp_path / "full", rope_parameters={**saved["rope_parameters"], "partial_rotary_factor": 1.0})
    model = load_model(full, backend="exact")
    assert model.config.rotary_dim is None  # the whole head
    r = rel(model.advance(model.initial_state(), toks).logits, truth)
    print(f"CROSSCHECK HF bamba vs ours read with a full rotation: max rel {r:.2e}")
    assert r > 10 * BOUND


def test_gate_and_up_swapped_misses_the_bound(bamba, tmp_path):
    """The negative control for the MLP's join: gate_proj and up_proj exchanged in the checkpoint
    (so ours would stack them the other way round) misses the bound."""
    from safetensors.torch import load_file, save_file

    _, d, toks, truth = bamba
    dst = edited(d, tmp_path / "swapped")
    sd = load_file(str(dst / "model.safetensors"))
    for i in range(4):
        p = f"model.layers.{i}.feed_forward."
        sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"] = sd[p + "up_proj.weight"], sd[p + "gate_proj.weight"]
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    r = rel_of(dst, toks, truth)
    print(f"CROSSCHECK HF bamba vs ours with gate and up swapped: max rel {r:.2e}")
    assert r > 10 * BOUND


def test_biases_tied_head_dt_clamps_and_theta_are_mapped(tmp_path):
    """mlp_bias and attention_bias (the MLP's joined bias, gate first), a tied head, a
    time_step_limit that clamps dt on both sides and rope_theta 500: all within the bound."""
    hf = _hf_bamba(1, seed=3, mlp_bias=True, attention_bias=True, tie_word_embeddings=True,
                   time_step_limit=(0.5, 1.2), rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    perturb(hf, ("bias",))  # transformers initializes biases to zero
    _, d, toks, truth = saved_with_truth(hf, tmp_path / "variant", seed=7)
    for backend in ("reference", "exact"):
        model = load_model(d, backend=backend)
        cfg = model.config
        assert cfg.mlp_bias and cfg.attention_bias and cfg.tie_embeddings
        assert (cfg.dt_min_clamp, cfg.dt_max_clamp, cfg.rope_theta, cfg.rotary_dim) == (0.5, 1.2, 500.0, 8)
        assert_matches(model, toks, truth, "bamba variant", chunkings=([1, 7, 30, 58],))
    model = load_model(d, backend="exact")
    r = rel_of(edited(d, tmp_path / "unclamped", time_step_limit=None), toks, truth)
    print(f"CROSSCHECK HF bamba variant vs ours without the dt clamps: max rel {r:.2e}")
    assert r > 10 * BOUND
    runs = [scan_chunks(model, model.initial_state(), toks, chunks) for chunks in CHUNKINGS[:2]]
    assert torch.equal(runs[0][0], runs[1][0]) and state_equal(runs[0][1], runs[1][1])


def test_a_hub_style_config_loads_to_the_same_model(bamba, tmp_path):
    """The hub's older config.json (top-level rope_theta, no rope_parameters, the conversion
    script's attn_rotary_emb, num_experts 1): the same config, hence the same logits."""
    _, d, toks, _ = bamba
    new = load_model(d, backend="exact")
    hub = load_model(edited(d, tmp_path / "hub", rope_parameters=None, rope_theta=10000.0, attn_rotary_emb=8,
                            num_experts=1), backend="exact")
    assert hub.config == new.config and hub.schema.fingerprint() == new.schema.fingerprint()
    assert torch.equal(hub.advance(hub.initial_state(), toks).logits, new.advance(new.initial_state(), toks).logits)


@pytest.mark.parametrize(("changes", "field"), [
    ({"attn_layer_indices": [1, 4]}, "attn_layer_indices"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.1}},
     "rope_parameters.partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "beta": 1.0}}, "rope_parameters.beta"),
    ({"attn_rotary_emb": 16}, "attn_rotary_emb"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_experts": 4}, "num_experts"),
    ({"mamba_n_heads": 5}, "mamba_n_heads"),
    ({"some_new_field": 1}, "some_new_field"),
])
def test_what_is_not_computed_is_refused_typed_naming_the_field(bamba, tmp_path, changes, field):
    assert_refused(bamba[1], tmp_path / "bad", changes, field, "Bamba")


def test_bfloat16_and_q8_matrices_compute_their_own_function(bamba, tmp_path: Path):
    """transformers' bfloat16 save is read as stored (the joined MLP matrix included), with the
    bits of its float32 widening; q8 holds every matrix as block-int8, still chunks exactly, and
    stays within 0.1 of transformers' logits."""
    hf, d, toks, truth = bamba
    bf = tmp_path / "bf16"
    save_bfloat16(lambda: _hf_bamba(1), hf, bf)
    kept, a = load_bfloat16_as_stored(bf, toks)
    layer = kept.module.backbone.layers[1]
    assert layer.mixer.q_proj.weight.dtype == torch.bfloat16 and layer.mlp.input_linear.weight.dtype == torch.bfloat16
    # a fresh float32 model holding the rounded weights: `rounded.float()` would also keep its
    # rotary inv_freq buffer rounded to bfloat16 (which `.to(torch.bfloat16)` casts, and a
    # bfloat16 checkpoint does not hold)
    ref_model = _hf_bamba(1)
    ref_model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in hf.state_dict().items()})
    ref = hf_logits(ref_model, toks)
    r = rel(a.logits, ref)
    print(f"CROSSCHECK HF bamba bfloat16 vs ours (exact, weights as stored): max rel {r:.2e}")
    assert r <= BOUND
    # q8 rounds the activations as well as the weights, each to 8 bits of its block's max: about
    # 3-4x what rounding the weights to bfloat16 does to transformers' own logits (~0.013 here);
    # over seeds of this tiny Bamba the max row is 0.033-0.057, so the bound is 0.1
    assert_q8_chunks_exactly(d, toks, truth, "bamba", 0.1, rounding=rel(ref, truth))

"""Jamba from a Hugging Face directory: Mamba-1 layers with weighted dt/B/C norms, attention layers,
each followed by a gated MLP or routed experts.

The truth is transformers' own Jamba, a tiny random one saved with `save_pretrained` and run in
float32 on its slow (pure PyTorch) path: layers mamba, attention, mamba, attention (attention
period 2, offset 1; 4 query heads sharing 2 key/value heads of 16, no position embedding); experts
on layers 1 and 3 (period 2, offset 1: 4 experts of 96, top 2, the softmax over all 4 then the
top 2, not renormalized), the MLP on layers 0 and 2. Its norms (the dt/B/C norms' weights among
them), A_log, D and the dt and conv biases are perturbed away from transformers' constants. Ours
must match it within 1e-4 of each row's logit scale on every backend, give the same bits under any
chunking and batching on the exact backend, and miss the bound with the dt/B/C norms' weights
ignored or the router's rule swapped, so the comparison sees both.
"""

from __future__ import annotations

import json

import pytest
import torch

from mamba_stream.scan import ModelConfig, init_model, load_model, save_checkpoint
from mamba_stream.scan._errors import CheckpointError, ConfigError, UnsupportedBackend
from mamba_stream.scan._loading import config_from_json
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
    save_bfloat16,
    saved_with_truth,
    state_equal,
)
from tests.scan._mamba_ssm import require

pytestmark = pytest.mark.crosscheck

MAX_POSITIONS = 128
INTERMEDIATE = 96
KINDS = ("mamba1", "attention", "mamba1", "attention")
FFNS = ("mlp", "moe", "mlp", "moe")
EPS = 1e-6  # JambaConfig's rms_norm_eps


def _hf_jamba():
    """A seeded tiny Jamba of transformers' own making (see the module's docstring), its constants
    perturbed and its router spread so that every feature shows in the logits."""
    require("transformers")
    from transformers import JambaConfig, JambaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = JambaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=INTERMEDIATE, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
            expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=MAX_POSITIONS, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
            tie_word_embeddings=False, rms_norm_eps=EPS)
        model = JambaForCausalLM(cfg).eval()
        # transformers initializes A_log, D and the norms (dt/B/C's included) to constants and the
        # dt and conv biases to zero: random values, so that a skipped norm weight or D shows
        perturb(model, ("A_log", "D", "dt_proj.bias", "conv1d.bias", "layernorm.weight"))
        # transformers' init leaves the router near zero: spread the choices (not so far that
        # q8's rounding of the matrices flips many of them: test_bfloat16_and_q8_...)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("router.weight"):
                    p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def jamba(tmp_path_factory):
    """(transformers' model, its float32 directory, the token ids, transformers' logits (L, V))."""
    # config.json + model.safetensors (experts one by one, as the hub's)
    return saved_with_truth(_hf_jamba(), tmp_path_factory.mktemp("jamba-f32"))


def test_the_checkpoint_loads_as_typed_layers(jamba):
    hf, d, _, _ = jamba
    model = load_model(d, backend="exact")
    cfg = model.config
    assert cfg.architecture == "mamba1" and cfg.kinds == KINDS and cfg.ffns == FFNS and cfg.is_hybrid
    assert (cfg.bcdt_rms_eps, cfg.bcdt_norm_weights, cfg.resolved_dt_rank) == (EPS, True, 4)
    assert (cfg.n_q_heads, cfg.n_kv_heads, cfg.attn_head_dim, cfg.max_positions) == (4, 2, 16, MAX_POSITIONS)
    assert cfg.position_embedding == "nope" and cfg.attention_multiplier == 16**-0.5
    assert (cfg.moe_experts, cfg.moe_top_k, cfg.moe_intermediate_size, cfg.moe_router) == (4, 2, 96, "softmax_topk")
    assert cfg.mlp_intermediate_size == INTERMEDIATE and not cfg.moe_shared_mlp and not cfg.tie_embeddings
    blocks = model.module.backbone.layers
    assert [(blk.mlp is not None, blk.moe is not None) for blk in blocks] == [(True, False), (False, True)] * 2
    sd = hf.state_dict()
    mixer = blocks[2].mixer
    for ours, theirs in (("dt_norm", "dt_layernorm"), ("b_norm", "b_layernorm"), ("c_norm", "c_layernorm")):
        assert torch.equal(getattr(mixer, ours).weight, sd[f"model.layers.2.mamba.{theirs}.weight"])
    ff = "model.layers.0.feed_forward."
    assert torch.equal(blocks[0].mlp.input_linear.weight,
                       torch.cat([sd[ff + "gate_proj.weight"], sd[ff + "up_proj.weight"]]))
    gate_up = sd["model.layers.3.feed_forward.experts.gate_up_proj"]  # (E, 2I, D), gate first
    assert torch.equal(blocks[3].moe.experts[2].input_linear.weight, gate_up[2])
    roles = [(t.layer, t.role, t.shape) for t in model.schema.tensors]
    kv = (MAX_POSITIONS, 2, 16)
    assert roles == [(0, "conv", (128, 4)), (0, "ssm", (128, 16)), (1, "k", kv), (1, "v", kv),
                     (2, "conv", (128, 4)), (2, "ssm", (128, 16)), (3, "k", kv), (3, "v", kv)]
    disc = model.schema.discretization
    assert (disc.bcdt_rms_eps, disc.bcdt_norm_weights) == (EPS, True)
    assert '"bcdt_norm_weights":true' in model.schema.canonical_json()
    layers = model.schema.layers
    assert layers is not None and layers.kinds == KINDS and layers.ffns == FFNS and layers.moe_router == "softmax_topk"
    assert_schema_round_trips(model)


@pytest.mark.parametrize("backend", ["reference", "chunked", "exact", "exact-fma"])
def test_logits_match_transformers_jamba(jamba, backend):
    _, d, toks, truth = jamba
    assert_matches(load_model(d, backend=backend), toks, truth, "jamba")


@pytest.mark.parametrize("backend", ["exact", "exact-fma"])
def test_exact_chunking_and_batching_give_the_same_bits(jamba, backend, monkeypatch):
    """[96], [1, 7, 30, 58] and 96 x 1, and two streams batched: the same logits and every state
    tensor (conv, SSM, k, v) bit for bit. The one-call decode step (`mamba1_step_f32`) has no dt/B/C
    norms, so a Jamba's Mamba-1 tokens go through the primitives, and the path they report is the
    primitives' (the probe's)."""
    from mamba_stream.scan.exact._kernels import _kernel_ops

    _, d, toks, truth = jamba
    model = load_model(d, backend=backend)
    ops = _kernel_ops()
    calls: list[int] = []
    if ops is not None:
        real = ops.lib.mamba1_step_f32
        monkeypatch.setattr(ops.lib, "mamba1_step_f32", lambda *a: (calls.append(1), real(*a))[1])
    state = assert_exact_chunking_and_batching(model, toks)
    assert state.position == N_TOKENS
    for name in ("layers.1.k", "layers.3.v"):
        assert state.tensors[name].shape[0] == N_TOKENS and bool(state.tensors[name].ne(0).any())
    one = model.advance(model.initial_state(), toks[:1])
    assert one.path == model.exact_probe.path
    assert calls == []
    one_by_one, _ = scan_chunks(model, model.initial_state(), toks, CHUNKINGS[-1])
    assert rel(one_by_one, truth) <= BOUND


def test_the_dt_b_c_norm_weights_ignored_miss_the_bound(jamba):
    """The negative control of the weighted norms: the same model with each dt/B/C norm's weight
    set to ones (FalconMamba's weightless norms) fails the comparison."""
    _, d, toks, truth = jamba
    model = load_model(d, backend="exact")
    with torch.no_grad():
        for blk in model.module.backbone.layers:
            if blk.kind == "mamba1":
                for norm in (blk.mixer.dt_norm, blk.mixer.b_norm, blk.mixer.c_norm):
                    norm.weight.fill_(1.0)
    r = rel(model.advance(model.initial_state(), toks).logits, truth)
    print(f"CROSSCHECK HF jamba vs ours with the dt/B/C norms' weights ignored (exact): max rel {r:.2e}")
    assert r > 10 * BOUND


def test_the_router_rule_swapped_misses_the_bound(jamba, tmp_path):
    """The negative controls of the routing: GraniteMoe's rule (the top k of the logits, then their
    softmax) in place of Jamba's, and top-1 in place of top-2, each fail the comparison."""
    _, d, toks, truth = jamba
    model = load_model(d, backend="exact")
    for blk in model.module.backbone.layers:
        if blk.moe is not None:
            blk.moe.rule = "topk_softmax"
    r = rel(model.advance(model.initial_state(), toks).logits, truth)
    print(f"CROSSCHECK HF jamba vs ours with the router rule topk_softmax (exact): max rel {r:.2e}")
    assert r > 10 * BOUND
    top1 = load_model(edited(d, tmp_path / "top1", num_experts_per_tok=1), backend="exact")
    r1 = rel(top1.advance(top1.initial_state(), toks).logits, truth)
    print(f"CROSSCHECK HF jamba vs ours read as top-1 (exact): max rel {r1:.2e}")
    assert r1 > 10 * BOUND


def test_tied_router_rows_route_to_the_lower_expert_on_every_chunking(jamba, tmp_path):
    """Experts 1 and 2 given the same router row tie on every token (the same logit, so the same
    softmax entry): the lower index is chosen whatever the chunking or batch, so the bits do not
    move (their MLPs differ, so a choice that flipped would show)."""
    from mamba_stream.scan._backends import REFERENCE

    hf, _, toks, _ = jamba
    tied = _hf_jamba()
    tied.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for name, p in tied.named_parameters():
            if name.endswith("router.weight"):
                p[2].copy_(p[1])
    tied.save_pretrained(str(tmp_path / "tied"))
    model = load_model(tmp_path / "tied", backend="exact")
    assert_exact_chunking_and_batching(model, toks)
    moe = model.module.backbone.layers[1].moe
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))
    weights, chosen = moe.route(x, REFERENCE.primitives(1))
    has1, has2 = (chosen == 1).any(-1), (chosen == 2).any(-1)
    assert bool(has2.any())  # the tie is reached (both of the top two on some rows)
    assert bool((has1 | ~has2).all())  # 2 is never taken over 1
    both = has1 & has2
    assert chosen[both].tolist() == [[1, 2]] * int(both.sum())  # and 1 comes first
    assert bool(torch.equal(weights[both, 0], weights[both, 1]))


def test_the_stacked_expert_layout_loads_to_the_same_bits(jamba, tmp_path):
    """transformers holds the experts stacked in memory (`experts.gate_up_proj` (E, 2I, D),
    `experts.down_proj` (E, D, I)) and saves them one by one; a file of the stacked layout loads too,
    to the same bits."""
    from safetensors.torch import save_file

    hf, d, toks, _ = jamba
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((d / "config.json").read_text())
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.feed_forward.experts.gate_up_proj" in sd
    save_file(sd, str(stacked / "model.safetensors"))
    a, b = load_model(d, backend="exact"), load_model(stacked, backend="exact")
    assert a.revision == b.revision
    ra, rb = a.advance(a.initial_state(), toks), b.advance(b.initial_state(), toks)
    assert torch.equal(ra.logits, rb.logits) and state_equal(ra.state, rb.state)


@pytest.mark.parametrize(("changes", "field"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"sliding_window": 16}, "sliding_window"),
    ({"attn_layer_offset": 2}, "attn_layer_offset"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"layers_block_type": ["mamba", "mamba", "attention", "attention"]}, "layers_block_type"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"mamba_expand": 1.5}, "mamba_expand"),
    ({"mamba_inner_layernorms": False}, "mamba_inner_layernorms"),
    ({"some_new_field": 1}, "some_new_field"),
])
def test_what_is_not_computed_is_refused_typed_naming_the_field(jamba, tmp_path, changes, field):
    assert_refused(jamba[1], tmp_path / "bad", changes, field, "Jamba")


def test_the_layout_follows_the_periods_and_offsets():
    """config.json alone: the periods and offsets place the layers as transformers does; one expert
    (num_experts 1) is the MLP on every layer; a stated layer list that agrees is accepted."""
    base = {"model_type": "jamba", "hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 256,
            "intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
            "max_position_embeddings": 64}
    cfg, layout = config_from_json(base)  # JambaConfig's defaults: attention 4 of 8, experts on odd layers
    assert layout == "hf" and cfg.kinds == ("mamba1",) * 4 + ("attention",) + ("mamba1",) * 3
    assert cfg.ffns == ("mlp", "moe") * 4 and (cfg.moe_experts, cfg.moe_top_k) == (16, 2)
    assert cfg.dt_rank == 4 and cfg.norm_eps == cfg.bcdt_rms_eps == 1e-6 and cfg.bcdt_norm_weights
    dense, _ = config_from_json({**base, "num_experts": 1, "num_experts_per_tok": 1})
    assert dense.ffns == ("mlp",) * 8 and dense.moe_experts is None
    shifted, _ = config_from_json({**base, "attn_layer_period": 3, "attn_layer_offset": 0,
                                   "expert_layer_period": 1, "expert_layer_offset": 0,
                                   "layer_types": ["full_attention", "linear_attention", "linear_attention"] * 2
                                   + ["full_attention", "linear_attention"]})
    assert shifted.kinds == ("attention", "mamba1", "mamba1") * 2 + ("attention", "mamba1")
    assert shifted.ffns == ("moe",) * 8 and shifted.mlp_intermediate_size is None
    assert config_from_json({**base, "attn_layer_period": 8, "attn_layer_offset": 7})[0].kinds[-1] == "attention"
    assert config_from_json({**base, "mamba_dt_rank": 7, "head_dim": 8})[0].dt_rank == 7
    # AI21's remote-code config fields: the norms' switch on (what is computed), the context by its old name
    legacy = {k: v for k, v in base.items() if k != "max_position_embeddings"}
    old, _ = config_from_json({**legacy, "mamba_inner_layernorms": True, "n_ctx": 96,
                               "calc_logits_for_entire_prompt": False})
    assert old.max_positions == 96 and old.bcdt_norm_weights


@pytest.mark.parametrize("in_place", [False, True])
def test_the_slot_tables_step_gives_each_row_its_own_bits(jamba, in_place):
    """`step_rows` on buffers of three streams at positions 3, 40 and 17 (rows 0, 2, 1: not a span,
    then a span): each row the bits of its own `advance` by that token, logits and every state
    tensor (the Mamba-1 layers' conv and SSM through their weighted norms, the KV row written at its
    position); without positions it is refused."""
    from mamba_stream.failures import InvalidInput

    _, d, toks, _ = jamba
    model = load_model(d, backend="exact")
    buffers = assert_step_rows_bits(model, toks, in_place)
    with pytest.raises(InvalidInput, match="positions"):
        model.step_rows(buffers, torch.tensor([0]), torch.tensor([7]))


def test_mamba_ssm_checkpoints_and_triton_refuse_it_typed(jamba, tmp_path):
    _, d, _, _ = jamba
    model = load_model(d, backend="exact")
    with pytest.raises(CheckpointError, match="hybrid"):
        save_checkpoint(model, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()
    with pytest.raises(UnsupportedBackend, match="no attention kernel"):
        load_model(d, backend="triton")


def test_bfloat16_and_q8_matrices_compute_their_own_function(jamba, tmp_path):
    """transformers' bfloat16 save is read as stored (the Mamba, attention, MLP and expert matrices
    alike), with the bits of its float32 widening; q8 holds every matrix as block-int8 and still
    chunks exactly."""
    hf, d, toks, truth = jamba
    bf = tmp_path / "bf16"
    rounded = save_bfloat16(_hf_jamba, hf, bf)
    kept, a = load_bfloat16_as_stored(bf, toks)
    assert kept.schema.weights == "bfloat16"
    blocks = kept.module.backbone.layers
    assert blocks[0].mixer.x_proj.weight.dtype == torch.bfloat16
    assert blocks[1].moe.experts[0].input_linear.weight.dtype == torch.bfloat16
    assert blocks[0].mixer.dt_norm.weight.dtype == torch.float32  # a vector: in the compute dtype
    assert kept.schema.discretization.bcdt_norm_weights
    r = rel(a.logits, hf_logits(rounded.float(), toks))
    print(f"CROSSCHECK HF jamba bf16 checkpoint (float32 forward) vs ours (exact, bf16 kept): max rel {r:.2e}")
    assert r <= BOUND
    assert_q8_chunks_exactly(d, toks, truth, "jamba", 0.05)


# --- the weighted dt/B/C norms as a Mamba-1 option ------------------------------------------------


def test_the_schema_tells_weighted_norms_from_weightless_ones_and_plain_models_keep_their_fingerprint(jamba):
    from mamba_stream.scan._model import build_schema

    _, d, _, _ = jamba
    model = load_model(d, backend="exact")
    weightless = model.config.model_copy(update={"bcdt_norm_weights": None})
    other = build_schema(weightless, torch.float32, model.module)
    assert other.tensors == model.schema.tensors and other.discretization.bcdt_norm_weights is None
    assert other.fingerprint() != model.schema.fingerprint()
    assert "bcdt_norm_weights" not in other.canonical_json()
    plain = load_model("tiny-mamba1")  # its fingerprint as docs/release/state-schema-reference.md records it
    assert plain.schema.fingerprint().startswith("sha256:f442f13da314f133")
    assert "bcdt" not in plain.schema.canonical_json() and "bcdt_norm_weights" not in plain.config.model_dump()
    assert not any("_norm." in name for name, _ in plain.module.named_parameters())


def test_the_norm_weights_are_a_validated_option_that_round_trips_our_checkpoints(tmp_path):
    base = {"architecture": "mamba1", "d_model": 64, "n_layer": 2, "vocab_size": 256}
    for bad in ({"bcdt_norm_weights": True}, {"bcdt_norm_weights": False, "bcdt_rms_eps": 1e-6}):
        with pytest.raises(ConfigError) as err:
            ModelConfig.create(**base, **bad)
        assert err.value.field == "bcdt_norm_weights"
    cfg = ModelConfig.create(**base, bcdt_rms_eps=1e-6, bcdt_norm_weights=True)
    model = init_model(cfg, seed=3, backend="exact")
    mixer = model.module.backbone.layers[1].mixer
    assert tuple(mixer.dt_norm.weight.shape) == (4,) and tuple(mixer.c_norm.weight.shape) == (16,)
    with torch.no_grad():
        for name, p in model.module.named_parameters():
            if name.endswith("_norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    save_checkpoint(model, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["ssm_cfg"]["bcdt_norm_weights"] is True and written["ssm_cfg"]["bcdt_rms_eps"] == 1e-6
    back = load_model(tmp_path / "ours", backend="exact")
    assert back.config == cfg.model_copy(update={"dt_rank": 4}) and back.schema == model.schema
    toks = list(range(3, 40))
    a, b = model.advance(model.initial_state(), toks), back.advance(back.initial_state(), toks)
    assert torch.equal(a.logits, b.logits) and state_equal(a.state, b.state)

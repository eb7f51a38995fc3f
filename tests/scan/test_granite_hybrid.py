"""GraniteMoeHybrid (dense, NoPE) from a Hugging Face directory: a model as a list of typed layers.

The truth is transformers' own GraniteMoeHybrid, a tiny random one saved with `save_pretrained` and
run in float32 on its slow (pure PyTorch) path: Mamba-2 and attention layers (4 query heads sharing
2 key/value heads of 16), each followed by the shared MLP, with multipliers that are not 1 (a missed
one misses the bound). Ours must match it within 1e-4 of each row's logit scale, give the same bits
(logits and every state tensor: conv, SSM, k, v) under any chunking and batching on the exact
backend, and refuse typed what it does not compute: MoE, unknown layer kinds, positions past
`max_positions`, the slot table, a mamba-ssm checkpoint of a hybrid.
"""

from __future__ import annotations

import json

import pytest
import torch

from mamba_stream.scan import PositionLimit, load_model, save_checkpoint
from mamba_stream.scan._errors import CheckpointError, ConfigError, InvalidInput, UnsupportedBackend
from tests.scan._helpers import scan_chunks
from tests.scan._hybrid import (
    BOUND,
    CHUNKINGS,
    N_TOKENS,
    assert_batching_keeps_bits,
    assert_exact_chunking,
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

KINDS_NEW = ["linear_attention", "full_attention", "linear_attention", "full_attention"]  # transformers >= 5.13
KINDS_HUB = ["mamba", "attention", "mamba", "attention"]  # the hub's Granite-4.0-H checkpoints
MULTIPLIERS = {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.25,
               "logits_scaling": 4.0}
MAX_POSITIONS = 128


def _hf_granite():
    """A seeded tiny dense GraniteMoeHybrid of transformers' own making: hidden 64, layers mamba,
    attention, mamba, attention; NoPE; Mamba-2 with 8 heads of 16, state 16."""
    require("transformers")
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = GraniteMoeHybridConfig(
            vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            layer_types=KINDS_HUB, num_local_experts=0, shared_intermediate_size=128, intermediate_size=128,
            position_embedding_type="nope", mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=32, max_position_embeddings=MAX_POSITIONS,
            tie_word_embeddings=True, **MULTIPLIERS)
        model = GraniteMoeHybridForCausalLM(cfg).eval()
        # transformers initializes A_log, D and dt_bias to constants and the norms to ones: random
        # values, so that a mixed-up head, a skipped D or a norm's weight shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("A_log", "D", "dt_bias", "norm.weight", "layernorm.weight")):
                    p.copy_(p + 0.3 * torch.randn_like(p))
        return model


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """(transformers' model, its float32 directory, the token ids, transformers' logits (L, V))."""
    # config.json (layer_types in the new spelling) + model.safetensors
    return saved_with_truth(_hf_granite(), tmp_path_factory.mktemp("granite-f32"))


_rel, _edited, _state_equal = rel, edited, state_equal


def test_the_checkpoint_loads_as_typed_layers(granite):
    _, d, _, _ = granite
    assert json.loads((d / "config.json").read_text())["layer_types"] == KINDS_NEW  # as transformers saves it
    model = load_model(d, backend="exact")
    cfg = model.config
    assert cfg.kinds == ("mamba2", "attention", "mamba2", "attention") and cfg.is_hybrid
    assert (cfg.n_q_heads, cfg.n_kv_heads, cfg.attn_head_dim, cfg.max_positions) == (4, 2, 16, MAX_POSITIONS)
    assert [blk.kind for blk in model.module.backbone.layers] == list(cfg.kinds)
    roles = [(t.layer, t.role, t.shape) for t in model.schema.tensors]
    kv = (MAX_POSITIONS, 2, 16)
    assert roles == [(0, "conv", (160, 4)), (0, "ssm", (8, 16, 16)), (1, "k", kv), (1, "v", kv),
                     (2, "conv", (160, 4)), (2, "ssm", (8, 16, 16)), (3, "k", kv), (3, "v", kv)]
    assert model.schema.state_bytes == 4 * (2 * (160 * 4 + 8 * 16 * 16) + 4 * MAX_POSITIONS * 2 * 16)
    layers = model.schema.layers
    assert layers is not None and layers.kinds == cfg.kinds and layers.max_positions == MAX_POSITIONS
    assert layers.residual_multiplier == 0.5 and layers.position_embedding == "nope"
    assert '"layers":' in model.schema.canonical_json()
    assert_schema_round_trips(model)


def test_a_plain_mamba_models_schema_and_config_have_no_hybrid_fields():
    model = load_model("tiny-mamba2")
    assert model.schema.layers is None and '"layers"' not in model.schema.canonical_json()
    assert not model.config.is_hybrid and "layer_types" not in model.config.model_dump()
    assert [blk.kind for blk in model.module.backbone.layers] == ["mamba2"] * model.config.n_layer
    assert all(blk.mlp is None for blk in model.module.backbone.layers)


@pytest.mark.parametrize("backend", ["reference", "chunked", "exact", "exact-fma"])
def test_logits_match_transformers_granite_hybrid(granite, backend):
    _, d, toks, truth = granite
    assert_matches(load_model(d, backend=backend), toks, truth, "granitemoehybrid")


@pytest.mark.parametrize("dropped", sorted(MULTIPLIERS))
def test_a_dropped_multiplier_misses_the_bound(granite, tmp_path, dropped):
    """The negative controls: each multiplier left at transformers' default 1.0 fails the comparison."""
    _, d, toks, truth = granite
    model = load_model(_edited(d, tmp_path / "m", **{dropped: None}), backend="exact")
    rel = _rel(model.advance(model.initial_state(), toks).logits, truth)
    print(f"CROSSCHECK HF granitemoehybrid vs ours without {dropped}: max rel {rel:.2e}")
    assert rel > 10 * BOUND  # attention_multiplier, the least: ~1e-2 (random weights give small scores)


@pytest.mark.parametrize("backend", ["exact", "exact-fma"])
def test_exact_chunking_gives_the_same_bits(granite, backend):
    """[96], [1, 7, 30, 58] and 96 x 1: the same logits and every state tensor (conv, SSM, k, v)
    bit for bit; the KV rows past the position stay zero."""
    _, d, toks, truth = granite
    model = load_model(d, backend=backend)
    runs = assert_exact_chunking(model, toks)
    state = runs[0][1]
    assert state.position == N_TOKENS
    for name in ("layers.1.k", "layers.1.v", "layers.3.k", "layers.3.v"):
        assert state.tensors[name].shape[0] == N_TOKENS and bool(state.tensors[name].ne(0).any())
    assert _rel(runs[-1][0], truth) <= BOUND
    assert model.advance(model.initial_state(), toks[:1]).path == model.exact_probe.path


def test_streams_at_different_positions_advanced_together_keep_their_own_bits(granite):
    """advance_batch of two streams at positions 5 and 40 (one forward, one chunk length): each the
    bits of its own advance."""
    _, d, toks, _ = granite
    sa, sb = assert_batching_keeps_bits(load_model(d, backend="exact"), toks)
    assert (sa.position, sb.position) == (15, 50)


def test_max_positions_is_refused_typed_and_nothing_advances(granite):
    _, d, toks, _ = granite
    model = load_model(d, backend="exact")
    state = model.advance(model.initial_state(), toks).state  # 96 of 128
    before = {k: v.clone() for k, v in state.tensors.items()}
    with pytest.raises(PositionLimit) as err:
        model.advance(state, toks[:33])
    assert (err.value.field, err.value.limit, err.value.actual) == ("max_positions", MAX_POSITIONS, 129)
    with pytest.raises(PositionLimit):  # one bad stream fails the batch, the other does not advance either
        model.advance_batch([model.initial_state(), state], [toks[:2], toks[:40]])
    assert state.position == N_TOKENS and all(torch.equal(before[k], state.tensors[k]) for k in before)
    full = model.advance(state, toks[:32])  # exactly up to the bound: taken
    assert full.state.position == MAX_POSITIONS


def test_both_layer_type_spellings_load_to_the_same_logits(granite, tmp_path):
    _, d, toks, _ = granite
    new = load_model(d, backend="exact")
    hub = load_model(_edited(d, tmp_path / "hub", layer_types=KINDS_HUB), backend="exact")
    assert hub.config == new.config and hub.schema.fingerprint() == new.schema.fingerprint()
    assert torch.equal(hub.advance(hub.initial_state(), toks).logits, new.advance(new.initial_state(), toks).logits)


@pytest.mark.parametrize(("changes", "field"), [
    ({"layer_types": ["mamba", "attention", "mamba", "sliding_attention"]}, "layer_types"),
    ({"num_local_experts": -1}, "num_local_experts"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type"),
    ({"mamba_n_heads": 5}, "mamba_n_heads"),
    ({"mamba_n_heads": 0}, "mamba_n_heads"),
    ({"mamba_d_head": 1.5}, "mamba_d_head"),
    ({"position_embedding_type": "rope", "rope_parameters": [10000]}, "rope_parameters"),
    ({"position_embedding_type": "rope", "rope_parameters": {"rope_theta": 1e4, "beta_fast": 32}},
     "rope_parameters.beta_fast"),
    ({"position_embedding_type": "rope", "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"some_new_field": 1}, "some_new_field"),
])
def test_what_is_not_computed_is_refused_typed_naming_the_field(granite, tmp_path, changes, field):
    assert_refused(granite[1], tmp_path / "bad", changes, field, "GraniteMoeHybrid")


@pytest.mark.parametrize("in_place", [False, True])
def test_the_slot_tables_step_writes_each_rows_kv_at_its_position(granite, in_place):
    """`step_rows` on buffers of three streams at positions 3, 17 and 40 (rows 0, 2, 1: not a span,
    then a span): each row the bits of its own `advance` by that token, logits and every state tensor
    (conv, SSM, and the KV row written at its position)."""
    _, d, toks, _ = granite
    model = load_model(d, backend="exact")
    buffers = assert_step_rows_bits(model, toks, in_place)
    with pytest.raises(InvalidInput, match="positions"):
        model.step_rows(buffers, torch.tensor([0]), torch.tensor([7]))


def test_the_slot_tables_step_refuses_a_row_at_the_bound_before_anything_runs(granite):
    _, d, toks, _ = granite
    model = load_model(d, backend="exact", max_positions=8)
    full = model.advance(model.initial_state(), toks[:8]).state
    buffers = {k: v.unsqueeze(0).clone() for k, v in full.tensors.items()}
    with pytest.raises(PositionLimit) as err:
        model.step_rows(buffers, torch.tensor([0]), torch.tensor([7]), in_place=True, positions=torch.tensor([8]))
    assert (err.value.limit, err.value.actual) == (8, 9)
    assert all(torch.equal(buffers[k][0], full.tensors[k]) for k in buffers)


def test_mamba_ssm_checkpoints_refuse_a_hybrid(granite, tmp_path):
    _, d, _, _ = granite
    model = load_model(d, backend="exact")
    with pytest.raises(CheckpointError, match="hybrid"):
        save_checkpoint(model, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


def test_bfloat16_and_q8_matrices_compute_their_own_function(granite, tmp_path):
    """transformers' bfloat16 save is read as stored (the attention and MLP matrices included), with
    the bits of its float32 widening; q8 holds every matrix as block-int8 and still chunks exactly."""
    hf, d, toks, truth = granite
    bf = tmp_path / "bf16"
    rounded = save_bfloat16(_hf_granite, hf, bf)
    kept, a = load_bfloat16_as_stored(bf, toks)
    assert kept.module.backbone.layers[1].mixer.q_proj.weight.dtype == torch.bfloat16
    assert _rel(a.logits, hf_logits(rounded.float(), toks)) <= BOUND
    assert_q8_chunks_exactly(d, toks, truth, "granitemoehybrid", 0.05)


def test_the_one_call_decode_step_runs_the_mamba2_layers_only(granite, monkeypatch):
    """A Granite Mamba-2 layer is a plain Mamba-2 mixer (the same function: gated RMS norm over
    d_ssm / ngroups, no dt clamp), so the exact backend's one-call step (`mamba2_step_f32`) takes
    its decode tokens, two calls a token here; the attention layers and the MLP sublayers run on
    the primitives around it. The bits are the chunk's (test_exact_chunking_gives_the_same_bits)."""
    from mamba_stream.scan.exact._kernels import _kernel_ops

    _, d, toks, _ = granite
    model = load_model(d, backend="exact")
    ops = _kernel_ops()
    if ops is None or not model.exact_probe.kernels:
        pytest.skip("the exact kernels do not run here: the twins take every token")
    calls: list[int] = []
    real = ops.lib.mamba2_step_f32
    monkeypatch.setattr(ops.lib, "mamba2_step_f32", lambda *a: (calls.append(1), real(*a))[1])
    one = model.advance(model.initial_state(), toks[:1])
    assert len(calls) == 2 and one.path == "exact"
    chunk = model.advance(model.initial_state(), toks[:2])
    two = model.advance(one.state, toks[1:2])
    assert torch.equal(two.logits[0], chunk.logits[1]) and _state_equal(two.state, chunk.state)


def test_a_rope_checkpoint_matches_and_read_as_nope_misses(tmp_path):
    """position_embedding_type "rope" (rope_parameters default, theta 10000): the exact RoPE on q and
    k at each token's own position. q and k scaled up so that positions move the scores; the same
    checkpoint read as NoPE misses the bound."""
    require("transformers")
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        cfg = GraniteMoeHybridConfig(
            vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            layer_types=["attention", "mamba"], num_local_experts=0, shared_intermediate_size=64,
            position_embedding_type="rope", mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
            max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, **MULTIPLIERS)
        hf = GraniteMoeHybridForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(20)
    _, _, toks, truth = saved_with_truth(hf, tmp_path / "rope")
    for backend in ("reference", "exact"):
        model = load_model(tmp_path / "rope", backend=backend)
        assert (model.config.position_embedding, model.config.rope_theta) == ("rope", 10000.0)
        assert_matches(model, toks, truth, "granitemoehybrid rope", chunkings=([1, 7, 30, 58],))
    nope = load_model(_edited(tmp_path / "rope", tmp_path / "nope", position_embedding_type="nope"), backend="exact")
    assert _rel(nope.advance(nope.initial_state(), toks).logits, truth) > 100 * BOUND


def test_the_hybrid_config_fields_are_validated_naming_the_field(granite):
    from mamba_stream.scan import ModelConfig, init_model

    _, d, _, _ = granite
    cfg = load_model(d, backend="exact").config
    fields = {k: v for k, v in cfg.model_dump().items()}
    for change, field in [({"layer_types": ("mamba2", "attention")}, "layer_types"),
                          ({"layer_types": ("mamba2", "mamba1", "mamba2", "attention")}, "layer_types"),
                          ({"max_positions": None}, "max_positions"),
                          ({"n_kv_heads": 3}, "n_q_heads"),
                          ({"rope_theta": 10000.0}, "rope_theta"),
                          ({"mlp_activation": None}, "mlp_activation"),
                          ({"logits_scaling": 0.0}, "logits_scaling")]:
        with pytest.raises(ConfigError) as err:
            ModelConfig.create(**{**fields, **change})
        assert err.value.field == field, change
    plain = {k: v for k, v in fields.items() if k not in ("layer_types", "n_q_heads", "n_kv_heads")}
    with pytest.raises(ConfigError) as err:  # attention fields without an attention layer
        ModelConfig.create(**plain)
    assert err.value.field == "attn_head_dim"
    # a freshly initialized hybrid (`scan._init`'s attention and MLP recipes): deterministic in its
    # seed, and exact under chunking like a loaded one
    one, again, other = (init_model(cfg, seed, backend="exact") for seed in (1, 1, 2))
    assert one.revision == again.revision != other.revision
    toks = [(7 * i) % 256 for i in range(48)]
    runs = [scan_chunks(one, one.initial_state(), toks, chunks) for chunks in ([48], [1, 7, 30, 10])]
    assert torch.equal(runs[0][0], runs[1][0]) and _state_equal(runs[0][1], runs[1][1])
    with pytest.raises(ConfigError) as err:  # Zamba2's weight-shared blocks: no recipe
        init_model(cfg.model_copy(update={"layer_types": ("mamba2", "shared", "mamba2", "shared")}))
    assert err.value.field == "layer_types"


@pytest.mark.parametrize("backend", ["reference", "exact"])
def test_a_bfloat16_state_rounds_the_kv_rows_before_they_are_read(granite, backend):
    """A narrow state dtype: the chunk's own k and v rows are rounded before its queries read them,
    as a later chunk reads them, so the bits still do not depend on the chunking."""
    _, d, toks, _ = granite
    model = load_model(d, backend=backend, state_dtype=torch.bfloat16)
    runs = [scan_chunks(model, model.initial_state(), toks, chunks) for chunks in CHUNKINGS[:2]]
    assert torch.equal(runs[0][0], runs[1][0]) and _state_equal(runs[0][1], runs[1][1])
    assert runs[0][1].tensors["layers.1.k"].dtype == torch.bfloat16


def test_the_triton_backend_refuses_a_hybrid_at_load(granite):
    _, d, _, _ = granite
    with pytest.raises(UnsupportedBackend, match="no attention kernel"):
        load_model(d, backend="triton")


# --- mixture of experts ---------------------------------------------------------------------------


def _hf_granite_moe(**changes):
    """A seeded tiny GraniteMoeHybrid with routed experts: 4 experts of 32, top 2, beside the shared
    MLP of 64 on every layer; the dense fixture's shape otherwise."""
    require("transformers")
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        cfg = GraniteMoeHybridConfig(**{
            "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "layer_types": KINDS_HUB, "num_local_experts": 4, "num_experts_per_tok": 2,
            "intermediate_size": 32, "shared_intermediate_size": 64, "position_embedding_type": "nope",
            "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1,
            "max_position_embeddings": MAX_POSITIONS, "tie_word_embeddings": True, **MULTIPLIERS, **changes})
        model = GraniteMoeHybridForCausalLM(cfg).eval()
        perturb(model, ("A_log", "D", "dt_bias", "norm.weight", "layernorm.weight"))
        with torch.no_grad():  # transformers' init leaves the router near zero: spread the choices
            for name, p in model.named_parameters():
                if name.endswith("router.weight"):
                    p.normal_(0.0, 1.0)
                elif "experts" in name:
                    p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def granite_moe(tmp_path_factory):
    """(transformers' MoE model, its float32 directory, the token ids, transformers' logits)."""
    return saved_with_truth(_hf_granite_moe(), tmp_path_factory.mktemp("granite-moe"), seed=6)


def test_moe_checkpoint_loads_experts_as_typed_ffns(granite_moe):
    _, d, _, _ = granite_moe
    model = load_model(d, backend="exact")
    cfg = model.config
    assert cfg.ffns == ("moe",) * 4 and (cfg.moe_experts, cfg.moe_top_k, cfg.moe_intermediate_size) == (4, 2, 32)
    assert cfg.moe_router == "topk_softmax" and cfg.moe_shared_mlp and cfg.mlp_intermediate_size == 64
    blk = model.module.backbone.layers[0]
    assert blk.moe is not None and blk.mlp is not None and len(blk.moe.experts) == 4
    assert tuple(blk.moe.experts[3].input_linear.weight.shape) == (64, 64)  # [gate; up] of 32 each
    layers = model.schema.layers
    assert layers is not None and layers.ffns == ("moe",) * 4 and layers.moe_router == "topk_softmax"
    dense = load_model(_edited(d, d.parent / "as-top1", num_experts_per_tok=1), backend="exact")
    assert dense.schema.fingerprint() != model.schema.fingerprint()  # the routing is part of the function


@pytest.mark.parametrize("backend", ["reference", "chunked", "exact", "exact-fma"])
def test_moe_logits_match_transformers(granite_moe, backend):
    _, d, toks, truth = granite_moe
    assert_matches(load_model(d, backend=backend), toks, truth, "granitemoehybrid MoE")


def test_moe_exact_chunking_and_batching_give_the_same_bits(granite_moe):
    _, d, toks, _ = granite_moe
    model = load_model(d, backend="exact")
    state = assert_exact_chunking_and_batching(model, toks)
    assert state.position == N_TOKENS


def test_moe_negative_controls_miss_the_bound(granite_moe, tmp_path):
    """The comparison sees the routing: top-1 instead of top-2, the other weighting rule (softmax
    over all experts, then the top k), and the shared MLP left out each miss by far."""
    _, d, toks, truth = granite_moe
    top1 = load_model(_edited(d, tmp_path / "top1", num_experts_per_tok=1), backend="exact")
    assert _rel(top1.advance(top1.initial_state(), toks).logits, truth) > 10 * BOUND
    model = load_model(d, backend="exact")
    for blk in model.module.backbone.layers:
        blk.moe.rule = "softmax_topk"
    assert _rel(model.advance(model.initial_state(), toks).logits, truth) > 10 * BOUND
    model = load_model(d, backend="exact")
    for blk in model.module.backbone.layers:
        blk.mlp = None
    assert _rel(model.advance(model.initial_state(), toks).logits, truth) > 10 * BOUND


def test_top_k_breaks_ties_by_the_lower_expert_index():
    from mamba_stream.scan._layers import top_k

    scores = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0], [3.0, -0.0, 0.0, 3.0, 1.0]])
    values, idx = top_k(scores, 2)
    assert idx.tolist() == [[1, 2], [0, 1], [0, 3]]
    assert values.tolist() == [[2.0, 2.0], [1.0, 1.0], [3.0, 3.0]]
    # the same rows in another batch composition choose the same experts
    assert top_k(scores[[2, 0]], 2)[1].tolist() == [[0, 3], [1, 2]]


def test_moe_tied_router_rows_route_identically_under_every_chunking(granite_moe, tmp_path):
    """Experts 1 and 2 given the same router row tie on every token: the lower index is chosen
    whatever the chunking or batch, so the bits still do not move (their MLPs differ, so a choice
    that flipped would show)."""
    hf, _, toks, _ = granite_moe
    tied = _hf_granite_moe()
    tied.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for name, p in tied.named_parameters():
            if name.endswith("router.weight"):
                p[2].copy_(p[1])
    tied.save_pretrained(str(tmp_path / "tied"))
    model = load_model(tmp_path / "tied", backend="exact")
    assert_exact_chunking_and_batching(model, toks)
    from mamba_stream.scan._layers import top_k

    blk = model.module.backbone.layers[0]
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(0))
    logits = x @ blk.moe.router.weight.float().T
    assert torch.equal(logits[:, 1], logits[:, 2])
    _, chosen = top_k(logits, 2)
    for row in chosen.tolist():  # expert 2 only ever second, right after its twin 1
        assert 2 not in row or row == [1, 2], row
    assert [1, 2] in chosen.tolist()  # the tie did occur among these tokens


def test_max_positions_lowered_at_load_keeps_the_bits_and_bounds_the_kv(granite):
    """load_model(max_positions=40): 40 KV rows a stream instead of the checkpoint's 128, the same
    logits and KV rows bit for bit (a query reads its rows only), another schema (a state made
    under one bound does not resume under another), and the refusal past it."""
    _, d, toks, _ = granite
    full = load_model(d, backend="exact")
    short = load_model(d, backend="exact", max_positions=40)
    assert short.config.max_positions == 40 and short.schema.layers.max_positions == 40
    assert short.schema.spec("layers.1.k").shape == (40, 2, 16)
    assert short.schema.fingerprint() != full.schema.fingerprint()
    a = scan_chunks(short, short.initial_state(), toks[:40], [3, 37])
    b = full.advance(full.initial_state(), toks[:40])
    assert torch.equal(a[0], b.logits)
    for name, t in a[1].tensors.items():
        assert torch.equal(t, b.state.tensors[name][: t.shape[0]] if name.endswith((".k", ".v")) else
                           b.state.tensors[name]), name
    with pytest.raises(PositionLimit):
        short.advance(a[1], toks[40:41])
    for bad in (0, MAX_POSITIONS + 1, True, "8"):
        with pytest.raises(ConfigError) as err:
            load_model(d, backend="exact", max_positions=bad)
        assert err.value.field == "max_positions", bad
    with pytest.raises(ConfigError) as err:
        load_model("tiny-mamba2", max_positions=8)
    assert err.value.field == "max_positions" and "no attention layer" in str(err.value)


# --- the KV grows with the position -------------------------------------------------------------


def test_a_states_kv_holds_a_row_per_position_and_nothing_past_it(granite):
    """k and v of a state at position p are (p, Hkv, Dh): the schema marks them (`rows`
    "position", shape[0] the bound), the conv and SSM tensors stay fixed; a state whose KV row count
    is not its position is refused typed; bytes at rest follow the position."""
    from mamba_stream.scan import InvalidState, State

    _, d, toks, _ = granite
    model = load_model(d, backend="exact")
    rows = {t.name: t.rows for t in model.schema.tensors}
    assert rows == {"layers.0.conv": None, "layers.0.ssm": None, "layers.1.k": "position", "layers.1.v": "position",
                    "layers.2.conv": None, "layers.2.ssm": None, "layers.3.k": "position", "layers.3.v": "position"}
    assert '"rows":"position"' in model.schema.canonical_json()
    assert model.initial_state().tensors["layers.1.k"].shape == (0, 2, 16)
    state = model.advance(model.initial_state(), toks[:10]).state
    assert state.tensors["layers.3.v"].shape == (10, 2, 16) and state.tensors["layers.0.ssm"].shape == (8, 16, 16)
    fixed = 4 * (2 * (160 * 4 + 8 * 16 * 16))
    assert model.schema.bytes_at(10) == fixed + 4 * 4 * 10 * 2 * 16
    assert model.schema.state_bytes == model.schema.bytes_at(MAX_POSITIONS)
    bad = dict(state.tensors)
    bad["layers.1.k"] = torch.cat([bad["layers.1.k"], torch.zeros(1, 2, 16)])
    with pytest.raises(InvalidState) as err:
        model.validate_state(State(10, bad, "sha256:other"))
    assert err.value.field == "layers.1.k.shape" and err.value.actual == (11, 2, 16)
    with pytest.raises(InvalidState) as err:  # a position past the bound, whatever the rows
        model.validate_state(State(MAX_POSITIONS + 1, state.tensors, "sha256:other"))
    assert err.value.field == "position"


def test_a_sealed_hybrid_state_round_trips_with_its_rows_only(granite):
    """The KV's rows past the last full segment in the checkpoint, the full segments apart (16 rows
    at this bound): the checkpoint of 90 rows is the checkpoint of 10 rows and five digests."""
    from mamba_stream.state_codec.codec import (
        Keyring,
        plaintext_checksum,
        seal,
        seal_segment,
        segment_key,
        split_state,
        unseal,
    )

    _, d, toks, _ = granite
    model = load_model(d, backend="exact")
    assert model.schema.layers is not None and model.schema.layers.kv_segment_rows == 16
    ring = Keyring.generate()
    sizes, stored = {}, {}
    for n in (10, 90):
        state = model.advance(model.initial_state(), toks[:n]).state
        receipt, blob = seal(model, state, stream_id="s", principal="alice", chunk_seq=1, epoch=0, keyring=ring)
        for seg in split_state(model.schema, state.tensors, n)[1]:
            key = segment_key(ring, ring.principal_tag("alice"), model.schema.fingerprint(), seg.first, seg.digest)
            stored[key] = seal_segment(seg, key, ring)
        back = unseal(blob, receipt, ring, model=model, principal="alice", segments=lambda ref: stored.get(ref.key))
        assert back.position == n and state_equal(back, state)
        assert receipt.checksum == plaintext_checksum(state.tensors, schema=model.schema)
        sizes[n] = len(blob)
        nxt = model.advance(back, toks[n : n + 3])
        assert state_equal(nxt.state, model.advance(state, toks[n : n + 3]).state)
    # 80 more rows of 4 KV tensors of 2 x 16 float32 (40 KB) are five segments apart: the checkpoint
    # grows by their five digests only
    assert len(stored) == 5 and 0 < sizes[90] - sizes[10] <= 5 * 34 + 64


def test_the_slot_table_holds_the_bounds_rows_and_hands_out_the_positions(granite):
    """A slot holds max_positions rows; its view is the state's rows; a shorter state written over a
    longer one (a rewind's reload) leaves no row of the longer behind; a decode step through the
    table writes the row at the stream's position."""
    from mamba_stream.activities import SlotTable

    _, d, toks, _ = granite
    model = load_model(d, backend="exact")
    long = model.advance(model.initial_state(), toks[:40]).state
    short = model.advance(model.initial_state(), toks[:12]).state
    table = SlotTable(model, 2)
    h = table.insert("s", long, epoch=0, state_key=None)
    assert table.buffers["layers.1.k"].shape == (2, MAX_POSITIONS, 2, 16)
    assert state_equal(table.view(h), long)
    h = table.insert("s", short, epoch=0, state_key=None)
    assert state_equal(table.view(h), short)
    assert bool(table.buffers["layers.1.k"][h.slot, 12:].eq(0).all())
    logits, _ = table.step([h], [toks[12]])
    want = model.advance(short, toks[12:13])
    assert torch.equal(logits[0], want.logits[0]) and state_equal(table.view(h), want.state)
    assert bool(table.buffers["layers.3.v"][h.slot, 13:].eq(0).all())

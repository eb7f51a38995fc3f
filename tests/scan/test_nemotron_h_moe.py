"""NemotronH's MoE layers ("E" in `hybrid_override_pattern`, "moe" in `layers_block_type`): our
"moe" layer kind, the experts block as the layer's mixer (`scan._layers.Experts`).

The truth is transformers' own NemotronH (its eager experts path, the one its source spells out), a
tiny random one saved with `save_pretrained` and run in float32 on its pure-PyTorch path: pattern
"MEM*E-" (Mamba, MoE, Mamba, attention, MoE, MLP); 8 experts in 2 groups of 4, the best group kept
(`topk_group` 1), 2 experts per token, `norm_topk_prob`, `routed_scaling_factor` 2.5, a shared
expert of its own size (48, the routed ones 32), and (the `latent` checkpoint) the experts in a
latent width of 24 (`fc1_latent_proj` / `fc2_latent_proj`). The routers are scaled up and the
correction biases drawn at random, so that the routing varies from token to token, both groups
win for some tokens, and the correction bias changes the choice for many of them (checked on
transformers' side, so the comparison is known to see it).

Ours must match within 1e-4 of each row's logit scale on every backend, choose the same experts
as transformers for every token, give the same bits under any chunking and batching on the exact
backends, hold no state for the MoE layers, and refuse typed what it cannot compute. Negative
controls: the correction bias dropped, the group limit dropped, `norm_topk_prob` flipped, the
scaling factor dropped: each misses the bound by more than 10x.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from mamba_stream.scan import load_model
from mamba_stream.scan._errors import ConfigError
from mamba_stream.scan._layers import Experts
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
    edited,
    hf_logits,
    load_bfloat16_as_stored,
    perturb,
    rel,
    rel_of,
    save_bfloat16,
    saved_with_truth,
    seal_and_unseal,
    state_equal,
)
from tests.scan._mamba_ssm import require

pytestmark = pytest.mark.crosscheck

PATTERN = "MEM*E-"
KINDS = ("mamba2", "moe", "mamba2", "attention", "moe", "mlp")
MOE_LAYERS = (1, 4)
MAX_POSITIONS = 128
EXPERTS, TOP_K, GROUPS, TOPK_GROUP, SCALING = 8, 2, 2, 1, 2.5
LATENT = 24


def _hf_nemotron_h_moe(latent: int | None, **routing):
    """A seeded tiny NemotronH with MoE layers, of transformers' own making (module docstring)."""
    require("transformers")
    from transformers import NemotronHConfig, NemotronHForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        cfg = NemotronHConfig(
            vocab_size=256, hidden_size=64, hybrid_override_pattern=PATTERN, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, mamba_num_heads=8, mamba_head_dim=16,
            ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=32, max_position_embeddings=MAX_POSITIONS,
            time_step_min=0.001, time_step_max=0.1, layer_norm_epsilon=1e-5, n_routed_experts=EXPERTS,
            moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, moe_latent_size=latent,
            **{"num_experts_per_tok": TOP_K, "n_group": GROUPS, "topk_group": TOPK_GROUP, "norm_topk_prob": True,
               "routed_scaling_factor": SCALING, **routing})
        model = NemotronHForCausalLM(cfg).eval()
        model.set_experts_implementation("eager")  # the loop its source spells out
        perturb(model, ("A_log", "D", "dt_bias", "norm.weight", "norm_f.weight"))
        with torch.no_grad():
            for i in MOE_LAYERS:
                gate = model.model.layers[i].mixer.gate
                # at the init's scale (std 0.02) every sigmoid score is ~0.5 and the routing is a
                # coin toss decided in the last bits; scaled up, the scores spread over (0, 1)
                gate.weight.mul_(40.0)
                # the same order of magnitude as the scores' spread: it changes many choices
                gate.e_score_correction_bias.copy_(0.3 * torch.randn(EXPERTS))
                # the routed experts' output at the init's scale is ~1e-4 of the residual stream,
                # where a wrong choice would hardly show in the logits: scaled up (relu2: x27)
                experts = model.model.layers[i].mixer.experts
                experts.up_proj.mul_(3.0)
                experts.down_proj.mul_(3.0)
        return model


def _checkpoint(tmp_path_factory, latent: int | None, name: str, **routing):
    return saved_with_truth(_hf_nemotron_h_moe(latent, **routing), tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def latent(tmp_path_factory):
    """(transformers' model with latent experts, its float32 directory, the token ids, its logits)."""
    return _checkpoint(tmp_path_factory, LATENT, "nemotron-h-moe-latent")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The other branches: no latent projection (the experts read the normed hidden state itself),
    one group (no group limit), the weights not renormalized (`norm_topk_prob` false), scaled by 1.5."""
    return _checkpoint(tmp_path_factory, None, "nemotron-h-moe", n_group=1, topk_group=1, norm_topk_prob=False,
                       routed_scaling_factor=1.5)


def _their_routing(hf, toks) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per MoE layer: the router's input (N, D), transformers' chosen experts (N, K) and their
    weights (N, K), recorded by a hook on its router."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    hooks = [hf.model.layers[i].mixer.gate.register_forward_hook(
        lambda mod, args, out, i=i: seen.__setitem__(i, (args[0].reshape(-1, 64).detach().clone(), out[2], out[1])))
        for i in MOE_LAYERS]
    try:
        hf_logits(hf, toks)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_the_checkpoint_loads_moe_layers_as_stateless_expert_blocks(latent):
    _, d, toks, _ = latent
    saved = json.loads((d / "config.json").read_text())
    assert saved["layers_block_type"][1] == "moe" and saved["moe_latent_size"] == LATENT
    model = load_model(d, backend="exact")
    cfg = model.config
    assert cfg.kinds == KINDS and cfg.ffns == ("none",) * 6 and cfg.is_hybrid
    assert (cfg.moe_experts, cfg.moe_top_k, cfg.moe_router, cfg.moe_groups, cfg.moe_topk_groups) == (
        EXPERTS, TOP_K, "sigmoid_group_topk", GROUPS, TOPK_GROUP)
    assert (cfg.moe_norm_topk, cfg.moe_scaling, cfg.moe_shared_mlp, cfg.moe_shared_intermediate_size) == (
        True, SCALING, True, 48)
    assert (cfg.moe_intermediate_size, cfg.moe_latent_size, cfg.mlp_gated, cfg.mlp_activation) == (
        32, LATENT, False, "relu2")
    for i in MOE_LAYERS:
        block = model.module.backbone.layers[i]
        assert block.kind == "moe" and isinstance(block.mixer, Experts) and block.mlp is None
        ex = block.mixer
        assert ex.correction_bias is not None and ex.correction_bias.shape == (EXPERTS,)
        assert ex.latent_in is not None and ex.latent_in.weight.shape == (LATENT, 64)
        assert ex.experts[3].input_linear.weight.shape == (32, LATENT) and ex.experts[3].input_linear.bias is None
        assert ex.shared is not None and ex.shared.input_linear.weight.shape == (48, 64)
    assert not {t.layer for t in model.schema.tensors} & {*MOE_LAYERS, 5}  # MoE and MLP layers: no state
    layers = model.schema.layers
    assert layers is not None and layers.kinds == KINDS and layers.moe_router == "sigmoid_group_topk"
    assert (layers.moe_groups, layers.moe_topk_groups, layers.moe_scaling, layers.moe_latent_size) == (
        GROUPS, TOPK_GROUP, SCALING, LATENT)
    assert_schema_round_trips(model)
    # another scaling factor is another function: another schema
    other = load_model(edited(d, d.parent / "scaled", routed_scaling_factor=2.0), backend="exact")
    assert other.schema.fingerprint() != model.schema.fingerprint()
    state = model.advance(model.initial_state(), toks[:29]).state
    restored, segments = seal_and_unseal(model, state)  # 29 positions: one 16-row KV segment and a tail
    assert segments == 1
    assert state_equal(restored, state) and restored.position == 29


def test_the_routing_varies_and_the_correction_bias_steers_it(latent):
    """The checkpoint exercises what it is meant to (on transformers' side): tokens pick many expert
    pairs, each group wins for some tokens, and without the correction bias a good share of the
    choices would differ."""
    hf, _, toks, _ = latent
    seen = _their_routing(hf, toks)
    for i in MOE_LAYERS:
        x, chosen, _ = seen[i]
        pairs = {tuple(sorted(row)) for row in chosen.tolist()}
        groups = {row[0] // (EXPERTS // GROUPS) for row in chosen.tolist()}
        gate = hf.model.layers[i].mixer.gate
        bias = gate.e_score_correction_bias.clone()
        with torch.no_grad():
            gate.e_score_correction_bias.zero_()
            unbiased = gate(x)[2]
            gate.e_score_correction_bias.copy_(bias)
        changed = sum(set(a) != set(b) for a, b in zip(chosen.tolist(), unbiased.tolist(), strict=True))
        # a group is scored by the sum of its top 2: scored by its best alone, some tokens' group
        # would differ (so ours choosing transformers' experts for every token sees the rule)
        with torch.no_grad():
            biased = (torch.sigmoid(x @ gate.weight.t()) + bias).reshape(N_TOKENS, GROUPS, -1)
        top2 = biased.topk(2, dim=-1).values
        by_sum, by_max = (top2[..., 0] + top2[..., 1]).argmax(-1), top2[..., 0].argmax(-1)
        regrouped = int((by_sum != by_max).sum())
        print(f"CROSSCHECK HF nemotron_h moe layer {i}: {len(pairs)} expert pairs, groups {sorted(groups)}, "
              f"{changed}/{N_TOKENS} choices changed by the correction bias, {regrouped} groups by the top 2's sum")
        assert len(pairs) >= 6 and groups == {0, 1} and changed >= N_TOKENS // 10
        assert regrouped >= 1


def test_ours_chooses_transformers_experts_with_its_weights(latent, monkeypatch):
    """Every token's experts (as a set) are transformers', and their weights within 1e-5."""
    hf, d, toks, _ = latent
    theirs = _their_routing(hf, toks)
    ours: list[tuple[torch.Tensor, torch.Tensor]] = []
    route = Experts.route

    def recording(self, x, be):
        out = route(self, x, be)
        ours.append(out)
        return out

    monkeypatch.setattr(Experts, "route", recording)
    model = load_model(d, backend="reference")
    model.advance(model.initial_state(), toks)
    assert len(ours) == len(MOE_LAYERS)
    for (weights, chosen), i in zip(ours, MOE_LAYERS, strict=True):
        _, their_chosen, their_weights = theirs[i]
        for row in range(N_TOKENS):
            mine = dict(zip(chosen[row].tolist(), weights[row].tolist(), strict=True))
            other = dict(zip(their_chosen[row].tolist(), their_weights[row].tolist(), strict=True))
            assert mine.keys() == other.keys(), (i, row)
            assert all(abs(mine[e] - other[e]) <= 1e-5 * SCALING for e in mine), (i, row)


@pytest.mark.parametrize("backend", ["reference", "chunked", "exact", "exact-fma"])
def test_logits_match_transformers_with_latent_experts(latent, backend):
    _, d, toks, truth = latent
    assert_matches(load_model(d, backend=backend), toks, truth, "nemotron_h_moe_latent")


@pytest.mark.parametrize("backend", ["reference", "chunked", "exact", "exact-fma"])
def test_logits_match_transformers_without_latent(plain, backend):
    _, d, toks, truth = plain
    model = load_model(d, backend=backend)
    assert model.module.backbone.layers[1].mixer.latent_in is None
    assert_matches(model, toks, truth, "nemotron_h_moe")


@pytest.mark.parametrize("backend", ["exact", "exact-fma"])
def test_exact_chunking_and_batching_give_the_same_bits(latent, plain, backend):
    """[96], [1, 7, 30, 58] and 96 x 1: the same logits and every state tensor; two streams at
    different positions advanced together keep their own bits (a token's routing, experts and
    shared expert read its own row alone)."""
    for _, d, toks, truth in (latent, plain):
        model = load_model(d, backend=backend)
        state = assert_exact_chunking_and_batching(model, toks)
        assert state.position == N_TOKENS
        one_by_one, _ = scan_chunks(model, model.initial_state(), toks, CHUNKINGS[-1])
        assert rel(one_by_one, truth) <= BOUND


def test_the_hub_spelling_and_stacked_experts_load_to_the_same_model(latent, tmp_path):
    """`hybrid_override_pattern` with `num_local_experts` (transformers' older name), and the tensors
    under `model.` with each layer's experts stacked as transformers holds them in memory
    ((E, out, in) `experts.up_proj` / `experts.down_proj`): the same config and the same bits."""
    _, d, toks, _ = latent
    hub = edited(d, tmp_path / "hub", layers_block_type=None, hybrid_override_pattern=PATTERN, num_hidden_layers=6,
                 n_routed_experts=None, num_local_experts=EXPERTS)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    out = {k.replace("backbone.", "model.", 1): v for k, v in sd.items() if ".mixer.experts." not in k}
    for i in MOE_LAYERS:
        for proj in ("up_proj", "down_proj"):
            out[f"model.layers.{i}.mixer.experts.{proj}"] = torch.stack(
                [sd[f"backbone.layers.{i}.mixer.experts.{e}.{proj}.weight"] for e in range(EXPERTS)])
    save_file(out, str(hub / "model.safetensors"))
    a, b = load_model(d, backend="exact"), load_model(hub, backend="exact")
    assert a.config == b.config and a.schema.fingerprint() == b.schema.fingerprint()
    assert torch.equal(a.advance(a.initial_state(), toks).logits, b.advance(b.initial_state(), toks).logits)


def _without_correction_bias(src, dst):
    """A copy whose MoE layers' correction biases are zero (shape kept)."""
    from safetensors.torch import load_file, save_file

    path = edited(src, dst)
    sd = load_file(str(path / "model.safetensors"))
    sd = {k: torch.zeros_like(v) if k.endswith("e_score_correction_bias") else v for k, v in sd.items()}
    save_file(sd, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize(("changes", "what"), [
    ("bias", "the correction bias"),
    ({"topk_group": GROUPS}, "the group limit"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"routed_scaling_factor": 1.0}, "the routed scaling factor"),
])
def test_a_routing_feature_dropped_misses_the_bound(latent, tmp_path, changes, what):
    """The negative controls: the checkpoint edited to drop one feature of the routing (a
    shape-compatible edit) loads, and misses the bound by more than 10x."""
    _, d, toks, truth = latent
    path = _without_correction_bias(d, tmp_path / "m") if changes == "bias" else edited(d, tmp_path / "m", **changes)
    r = rel_of(path, toks, truth)
    print(f"CROSSCHECK HF nemotron_h_moe vs ours without {what}: max rel {r:.2e}")
    assert r > 10 * BOUND


@pytest.mark.parametrize(("changes", "field"), [
    ({"n_group": 3}, "n_group"),
    ({"n_group": 8}, "n_group"),  # groups of one: no top 2 to sum
    ({"topk_group": 3}, "topk_group"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),  # more than the kept group's 4
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"routed_scaling_factor": 0.0}, "routed_scaling_factor"),
    ({"routed_scaling_factor": "2.5"}, "routed_scaling_factor"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"moe_latent_size": -4}, "moe_latent_size"),
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
    ({"layers_block_type": [*KINDS[:5], "dense_moe"]}, "layers_block_type"),
])
def test_what_is_not_computed_is_refused_typed_naming_the_field(latent, tmp_path, changes, field):
    assert_refused(latent[1], tmp_path / "bad", changes, field, "NemotronH")


def test_the_moe_config_fields_are_validated_typed():
    """`ModelConfig` itself: the group fields go with the sigmoid rule, and each limit names its field."""
    from mamba_stream.scan import ModelConfig

    base = dict(architecture="mamba2", d_model=64, n_layer=2, vocab_size=256, d_state=16, headdim=16,
                layer_types=("mamba2", "moe"), ffn_types=("none", "none"), mlp_activation="relu2", mlp_gated=False,
                moe_experts=8, moe_top_k=2, moe_intermediate_size=32, moe_router="sigmoid_group_topk",
                moe_shared_mlp=True, moe_shared_intermediate_size=48, moe_groups=2, moe_topk_groups=1,
                moe_norm_topk=True, moe_scaling=2.5)
    cfg = ModelConfig.create(**base)
    assert cfg.kinds == ("mamba2", "moe") and cfg.mlp_intermediate_size is None
    for changes, field in [
        ({"moe_groups": 3}, "moe_groups"), ({"moe_topk_groups": 0}, "moe_topk_groups"),
        ({"moe_top_k": 5}, "moe_top_k"), ({"moe_norm_topk": None}, "moe_norm_topk"),
        ({"moe_router": "softmax_topk"}, "moe_groups"), ({"moe_scaling": math.inf}, "moe_scaling"),
        ({"moe_shared_mlp": False}, "moe_shared_intermediate_size"), ({"moe_latent_size": 0}, "moe_latent_size"),
        ({**dict.fromkeys([k for k in base if k.startswith("moe_")]), "layer_types": ("mamba2", "mlp"),
          "mlp_intermediate_size": 64, "moe_latent_size": 16}, "moe_latent_size"),  # no layer has experts
    ]:
        with pytest.raises(ConfigError) as err:
            ModelConfig.create(**{**base, **changes})
        assert err.value.field == field, (changes, err.value)


def test_bfloat16_and_q8_matrices_compute_their_own_function(latent, tmp_path):
    """transformers' bfloat16 save is read as stored (the router, every expert, the latent and
    shared projections), with the bits of its float32 widening; q8 holds every matrix as
    block-int8 and still chunks exactly."""
    hf, d, toks, truth = latent
    bf = tmp_path / "bf16"
    rounded = save_bfloat16(lambda: _hf_nemotron_h_moe(LATENT), hf, bf)
    kept, a = load_bfloat16_as_stored(bf, toks)
    ex = kept.module.backbone.layers[1].mixer
    assert ex.router.weight.dtype == torch.bfloat16 and ex.experts[0].input_linear.weight.dtype == torch.bfloat16
    assert ex.latent_in.weight.dtype == torch.bfloat16 and ex.shared.output_linear.weight.dtype == torch.bfloat16
    assert ex.correction_bias.dtype == torch.float32  # not a matrix: held in the compute dtype
    r = rel(a.logits, hf_logits(rounded.float(), toks))
    print(f"CROSSCHECK HF nemotron_h_moe bf16 vs ours (exact, bf16 matrices kept): max rel {r:.2e}")
    assert r <= BOUND
    assert_q8_chunks_exactly(d, toks, truth, "nemotron_h_moe", 0.05)

"""The initialization of a hybrid's attention, MLP and expert layers: from the seed alone (the
same bits whatever torch's RNG holds, other bits from another seed), every parameter set, the
residual branches' last projections scaled, and the Mamba recipe where it was."""

from __future__ import annotations

import math

import pytest
import torch

from mamba_stream.scan import ModelConfig, init_weights, weights_revision
from mamba_stream.scan._lm import MambaLM

#: Mamba-2, attention (GQA, RoPE, biased), a Nemotron-H MLP layer, each followed by the gated MLP
HYBRID = {
    "architecture": "mamba2", "d_model": 32, "n_layer": 3, "vocab_size": 64, "d_state": 8, "headdim": 16,
    "layer_types": ("mamba2", "attention", "mlp"), "ffn_types": ("mlp", "mlp", "none"),
    "n_q_heads": 4, "n_kv_heads": 2, "attn_head_dim": 8, "attention_bias": True, "position_embedding": "rope",
    "rope_theta": 10000.0, "attention_multiplier": 8**-0.5, "max_positions": 64,
    "mlp_intermediate_size": 48, "mlp_activation": "silu",
}
#: routed experts as an ffn (Granite) and as a layer (Nemotron-H, latent width, grouped sigmoid)
EXPERTS = {
    "architecture": "mamba2", "d_model": 32, "n_layer": 2, "vocab_size": 64, "d_state": 8, "headdim": 16,
    "layer_types": ("mamba2", "moe"), "ffn_types": ("moe", "none"), "mlp_intermediate_size": 24,
    "mlp_activation": "silu", "moe_experts": 4, "moe_top_k": 2, "moe_intermediate_size": 16,
    "moe_router": "sigmoid_group_topk", "moe_shared_mlp": True, "moe_groups": 2, "moe_topk_groups": 1,
    "moe_norm_topk": True, "moe_latent_size": 16,
}
#: Falcon-H1's "parallel" layers: a Mamba-2 and attention side by side (mixer.mamba.*, mixer.attn.*)
PARALLEL = {
    "architecture": "mamba2", "d_model": 32, "n_layer": 2, "vocab_size": 64, "d_state": 8, "headdim": 16,
    "layer_types": ("parallel", "parallel"), "n_q_heads": 2, "n_kv_heads": 2, "attn_head_dim": 16,
    "attention_bias": False, "position_embedding": "nope", "attention_multiplier": 0.25, "max_positions": 32,
}
#: weights_revision(init_weights(HYBRID, seed 0)): the recipe is integer and IEEE arithmetic, so
#: this is the same on every machine; a change here is a change of the recipe
HYBRID_REVISION = "sha256:0a04556e5ec5e791393286cd0c5d0788f2e593cc2a231cab4cb41f76b6d74dc6"


def _built(fields: dict, seed: int, torch_seed: int) -> MambaLM:
    """The model of `fields` initialized from `seed`, constructed under torch seed `torch_seed`
    (the constructor's own random init is what the recipe must overwrite)."""
    torch.manual_seed(torch_seed)
    lm = MambaLM(ModelConfig.create(**fields))
    init_weights(lm, seed)
    return lm


def _differing(a: MambaLM, b: MambaLM) -> list[str]:
    sb = b.state_dict()
    return sorted(k for k, v in a.state_dict().items() if not torch.equal(v, sb[k]))


@pytest.mark.parametrize("fields", [HYBRID, EXPERTS, PARALLEL], ids=["attention-mlp", "experts", "parallel"])
def test_the_same_seed_gives_the_same_bits_whatever_torchs_rng_and_another_seed_others(fields):
    a, b = _built(fields, 3, torch_seed=1), _built(fields, 3, torch_seed=2)
    assert _differing(a, b) == []  # so no parameter kept the constructor's random values
    other = _built(fields, 4, torch_seed=1)
    differ = set(_differing(a, other))
    constants = {k for k, v in a.state_dict().items() if k.endswith(("norm.weight", "norm_f.weight", ".D",
                                                                       "correction_bias"))}
    # every parameter drawn from the seed moves with it; the constants (ones, zeros) do not
    drawn = {k for k, v in a.state_dict().items() if not k.endswith(".bias") or "conv1d" in k} - constants
    assert drawn <= differ and not differ & constants


def test_the_recipe_does_not_move_the_callers_rng():
    lm = MambaLM(ModelConfig.create(**HYBRID))
    torch.manual_seed(7)
    before = torch.rand(3)
    torch.manual_seed(7)
    init_weights(lm, 0)
    assert torch.equal(torch.rand(3), before)


def test_a_hybrids_initial_weights_are_pinned():
    assert weights_revision(_built(HYBRID, 0, torch_seed=0).state_dict()) == HYBRID_REVISION


def test_projections_are_bounded_by_fan_in_and_the_branches_last_ones_scaled():
    lm = _built(HYBRID, 0, torch_seed=0)
    sd = lm.state_dict()
    # 3 layers, each with an ffn sublayer somewhere: mamba-ssm's 2 residual branches per layer
    scale = math.sqrt(3 * 2)
    for name, fan_in, scaled in [
        ("backbone.layers.1.mixer.q_proj.weight", 32, False), ("backbone.layers.1.mixer.k_proj.weight", 32, False),
        ("backbone.layers.1.mixer.v_proj.weight", 32, False), ("backbone.layers.1.mixer.o_proj.weight", 32, True),
        ("backbone.layers.0.mixer.out_proj.weight", 64, True), ("backbone.layers.0.mlp.input_linear.weight", 32, False),
        ("backbone.layers.0.mlp.output_linear.weight", 48, True), ("backbone.layers.2.mixer.output_linear.weight", 48,
                                                                    True),
    ]:
        bound = 1.0 / math.sqrt(fan_in) / (scale if scaled else 1.0)
        w = sd[name]
        # U(-bound, bound): inside it, and filling it (the largest of hundreds of draws is near it)
        assert w.abs().max() < bound and w.abs().max() > 0.8 * bound, name
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert torch.equal(sd[f"backbone.layers.1.mixer.{name}.bias"], torch.zeros_like(
            sd[f"backbone.layers.1.mixer.{name}.bias"]))
    assert torch.equal(sd["backbone.layers.1.mlp_norm.weight"], torch.ones(32))


def test_a_layer_without_a_recipe_is_refused():
    lm = MambaLM(ModelConfig.create(**HYBRID))
    lm.backbone.layers[1].kind = "shared"  # Zamba2's shared layers have no recipe
    with pytest.raises(ValueError, match="no initialization recipe for a 'shared' layer"):
        init_weights(lm, 0)

"""Bamba (IBM's Bamba-9B, `model_type` "bamba"): Mamba-2 layers and the attention layers listed in
`attn_layer_indices`, every layer followed by its own RMS norm (`pre_ff_layernorm`) and a gated
SiLU MLP (`feed_forward`: gate_proj, up_proj, down_proj).

What transformers computes, and how it maps here:
    - the Mamba-2 layers (`BambaMixer`) are mamba-ssm's Mamba-2 with d_ssm = d_inner: in_proj rows
      [z, x, B, C, dt], the gated RMS norm over groups of d_inner / mamba_n_groups features with the
      gate applied before the norm, dt = clamp(softplus(dt + dt_bias), *time_step_limit);
    - attention: grouped-query, the softmax scale head_dim**-0.5, RoPE ("default" type) rotating the
      first head_dim * partial_rotary_factor features of each head rotate-half style (BambaConfig
      sets the factor to 0.5 wherever `rope_parameters` does not name one; our `rotary_dim`);
    - every norm (the layers', the gated norm's, the final one) has eps `rms_norm_eps`; no
      multipliers; the head is untied unless `tie_word_embeddings`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._hf._common import (
    TOP,
    base_fields,
    check_understood,
    default_rope,
    join_gate_up,
    mamba2_headdim,
    refuse,
    rename_layers,
    silu_activation,
    time_step_limit,
)

__all__ = ["bamba_fields", "bamba_tensors"]

Tensor = torch.Tensor
ARCH = "Bamba"

#: BambaConfig.__post_init__ hard-codes this factor (for checkpoints converted before
#: `rope_parameters` existed); a `rope_parameters.partial_rotary_factor` in config.json wins
DEFAULT_PARTIAL_ROTARY = 0.5
#: fields that change no inference arithmetic: the scan's block length (a training/kernel
#: choice) and the training loss's z-loss weight
_INERT = {"mamba_chunk_size", "z_loss_coefficient"}
_UNDERSTOOD = {
    "vocab_size", "tie_word_embeddings", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
    "attn_layer_indices", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
    "mamba_expand", "mamba_conv_bias", "mamba_proj_bias", "time_step_limit", "rope_parameters", "rope_theta",
    "rope_scaling", "attention_bias", "mlp_bias", "attn_rotary_emb", "num_experts"}

_refuse = partial(refuse, ARCH)


def _layer_kinds(cfg: dict[str, Any], n_layer: int) -> tuple[str, ...]:
    """`attn_layer_indices` -> each layer's kind (BambaConfig.layers_block_type)."""
    indices = cfg.get("attn_layer_indices") or []
    if not isinstance(indices, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layer for i in indices):
        raise _refuse("attn_layer_indices", f"{indices!r}: expected a list of layer indices below {n_layer}")
    return tuple("attention" if i in indices else "mamba2" for i in range(n_layer))


def _rope_fields(cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """rope_theta and rotary_dim (None: the whole head) from `rope_parameters` (transformers 5.x)
    or the older top-level `rope_theta`; `attn_rotary_emb` (the conversion script's rotary width,
    which transformers does not read) must agree with them."""
    rope, theta = default_rope(cfg, ARCH, full_rotation=None)
    factor = rope.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)
    rotary = int(head_dim * float(factor)) if isinstance(factor, int | float) and not isinstance(factor, bool) else 0
    # transformers' int(head_dim * factor): an odd width would rotate a different pairing than
    # rotate-half over `rotary` features, and none rotates nothing: both refused
    if not 0 < rotary <= head_dim or rotary % 2:
        raise _refuse("rope_parameters.partial_rotary_factor",
                      f"{factor!r} * head_dim {head_dim} must give an even width in (0, {head_dim}]")
    emb = cfg.get("attn_rotary_emb")
    if emb is not None and emb != rotary:
        raise _refuse("attn_rotary_emb", f"{emb!r} differs from the rotary width transformers computes, "
                      f"head_dim {head_dim} * partial_rotary_factor {factor} = {rotary}")
    return {"rope_theta": theta, "rotary_dim": None if rotary == head_dim else rotary}


def bamba_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json -> `ModelConfig.create` fields; a field it cannot map is refused, named."""
    n_layer = cfg["num_hidden_layers"]
    kinds = _layer_kinds(cfg, n_layer)
    d_model = cfg["hidden_size"]
    silu_activation(cfg, ARCH)  # the one activation of both the Mamba conv and the MLP
    experts = cfg.get("num_experts", 1)
    if experts != 1:
        raise _refuse("num_experts", f"{experts!r}: Bamba's layers have one dense MLP (num_experts 1)")
    eps = cfg.get("rms_norm_eps", 1e-5)
    fields: dict[str, Any] = {
        **base_fields("mamba2", d_model, n_layer, cfg["vocab_size"]),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "norm_eps": eps,
        "mixer_norm_eps": eps,
        "d_state": cfg.get("mamba_d_state", 256),
        "d_conv": cfg.get("mamba_d_conv", 4),
        "expand": cfg.get("mamba_expand", 2),
        "ngroups": cfg.get("mamba_n_groups", 1),
        "bias": bool(cfg.get("mamba_proj_bias", False)),
        "conv_bias": bool(cfg.get("mamba_conv_bias", True)),
        "norm_before_gate": False,
        "layer_types": kinds,
        "ffn_types": ("mlp",) * n_layer,
        "mlp_intermediate_size": cfg.get("intermediate_size", 14336),
        "mlp_activation": "silu",
        **time_step_limit(cfg.get("time_step_limit")),
    }
    if cfg.get("mlp_bias", False):
        fields["mlp_bias"] = True
    d_inner = int(fields["expand"] * d_model)
    fields["headdim"] = mamba2_headdim(cfg, ARCH, d_inner, "mamba_expand * hidden_size", typed=True)
    if "attention" in kinds:
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or d_model // n_heads
        fields.update(
            n_q_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads, attn_head_dim=head_dim,
            attention_bias=bool(cfg.get("attention_bias", False)),
            attention_multiplier=float(head_dim) ** -0.5,  # BambaAttention.scaling
            position_embedding="rope",
            max_positions=cfg.get("max_position_embeddings", 262144),
            **_rope_fields(cfg, head_dim),
        )
    check_understood(cfg, _UNDERSTOOD, _INERT, ARCH)
    return fields


#: their names -> ours, by prefix within a layer (the Mamba-2 layers' `mamba.*` are mamba-ssm's
#: names already); gate_proj / up_proj are joined into input_linear below
_LAYER_NAMES = (("input_layernorm.", "norm."), ("pre_ff_layernorm.", "mlp_norm."), ("mamba.", "mixer."),
                ("self_attn.", "mixer."), ("feed_forward.down_proj.", "mlp.output_linear."),
                ("feed_forward.gate_proj.", "mlp.gate_proj."), ("feed_forward.up_proj.", "mlp.up_proj."))


def bamba_tensors(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A checkpoint's tensors under our names; each MLP's gate_proj (I, D) and up_proj (I, D) (and
    their biases) stacked as input_linear (2I, D), gate rows first (`scan._layers.MLP` chunks
    [gate; up]). A layer holding only one of the two keeps it under its own name, for the shape
    check to refuse."""
    return join_gate_up(rename_layers(sd, _LAYER_NAMES, TOP), same_dtype=False)

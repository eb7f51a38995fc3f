"""Falcon-H1 (TII): every layer a "parallel" one, a Mamba-2 mixer and RoPE attention side by side on
the same normed input, their scaled outputs summed into the residual; then `pre_ff_layernorm` and a
gated SiLU MLP; muP multipliers throughout.

Where each of transformers' multipliers applies (`modeling_falcon_h1.py`), and its field here:

    embedding_multiplier        the embeddings (`embed_tokens(ids) * m`)          embedding_multiplier
    ssm_in_multiplier           the Mamba-2's input (the layer's normed input)    ssm_in_multiplier
    ssm_multipliers[0..4]       the Mamba-2's in_proj output, by part: z, x, B,   ssm_multipliers
                                C, dt (their `mup_vector`, before the conv; a
                                buffer transformers derives and never saves)
    ssm_out_multiplier          the Mamba-2's output                             ssm_out_multiplier
    attention_in_multiplier     the attention's input (the same normed input)    attention_in_multiplier
    key_multiplier              the keys, after k_proj, before rope              key_multiplier
    attention_out_multiplier    the attention's output (after o_proj)            attention_out_multiplier
    mlp_multipliers[0]          the MLP's gate (gate_proj output) before SiLU    mlp_gate_multiplier
    mlp_multipliers[1]          the MLP's output (after down_proj)               mlp_down_multiplier
    lm_head_multiplier          the logits (`lm_head(h) * m`)                    logits_multiplier

A multiplier of exactly 1.0 maps to None (no operation: x * 1.0 == x for every x). The softmax
scale is head_dim ** -0.5 (`attention_multiplier`). The Mamba-2's in_proj has a bias where
`mamba_proj_bias`, its out_proj where `projectors_bias`: one `bias` here, so the two must agree.
"""

from __future__ import annotations

import math
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

__all__ = ["falcon_h1_fields", "falcon_h1_tensors"]

Tensor = torch.Tensor
ARCH = "FalconH1"

#: fields that change no inference arithmetic here (the chunked scan's block is our own choice; the
#: hub's checkpoints carry `mlp_expansion_factor`, which transformers reads nowhere: intermediate_size is the MLP's)
_INERT = {"mamba_chunk_size", "mlp_expansion_factor"}
_UNDERSTOOD = {
    "vocab_size", "tie_word_embeddings", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
    "mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
    "mamba_conv_bias", "mamba_proj_bias", "mamba_norm_before_gate", "mamba_rms_norm", "time_step_limit",
    "projectors_bias", "rope_parameters", "rope_theta", "rope_scaling", "lm_head_multiplier", "embedding_multiplier",
    "mlp_multipliers", "key_multiplier", "attention_out_multiplier", "attention_in_multiplier", "ssm_multipliers",
    "ssm_in_multiplier", "ssm_out_multiplier", "attention_bias", "mlp_bias", "layer_types", "layers_block_type",
    "mamba_use_mlp", "attn_layer_indices"}

_refuse = partial(refuse, ARCH)


def _number(field: str, value: Any) -> float:
    """A multiplier: a finite real number (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _refuse(field, f"{value!r}: expected a finite number")
    return float(value)


def _scalar(cfg: dict[str, Any], field: str) -> float | None:
    """A scalar multiplier (transformers' default 1.0); None where it is 1.0: no operation."""
    m = _number(field, cfg.get(field, 1.0))
    return None if m == 1.0 else m


def _vector(cfg: dict[str, Any], field: str, size: int) -> tuple[float, ...] | None:
    """A list of `size` multipliers (default all 1.0); None where every one is 1.0."""
    raw = cfg.get(field)
    if raw is None:
        return None
    if not isinstance(raw, (list, tuple)) or len(raw) != size:
        raise _refuse(field, f"{raw!r}: expected {size} numbers")
    values = tuple(_number(field, v) for v in raw)
    return None if all(v == 1.0 for v in values) else values


def falcon_h1_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json -> `ModelConfig.create` fields; a field it cannot map is refused, named."""
    n_layer = cfg["num_hidden_layers"]
    for key in ("layer_types", "layers_block_type"):  # a property in transformers 5.x: every layer "hybrid"
        kinds = cfg.get(key)
        if kinds is not None and (not isinstance(kinds, list) or any(k != "hybrid" for k in kinds)):
            raise _refuse(key, f"{kinds!r}: every Falcon-H1 layer is 'hybrid' (attention and Mamba-2 side by side)")
    if cfg.get("attn_layer_indices") is not None:
        raise _refuse("attn_layer_indices", "attention in some layers only is not supported")
    if cfg.get("mamba_use_mlp", True) is not True:
        raise _refuse("mamba_use_mlp", "layers without their MLP are not supported")
    silu_activation(cfg, ARCH)
    d_model = cfg["hidden_size"]
    d_ssm = cfg.get("mamba_d_ssm", 1024)
    if d_ssm is None:
        d_ssm = int(cfg.get("mamba_expand", 2) * d_model)
    expand = d_ssm / d_model  # d_inner = d_ssm: Falcon-H1's in_proj has no gated-MLP part
    if int(expand * d_model) != d_ssm:
        raise _refuse("mamba_d_ssm", f"{d_ssm} is not representable as expand * hidden_size={d_model}")
    mamba_head = mamba2_headdim(cfg, ARCH, d_ssm, "mamba_d_ssm", typed=True)
    bias = bool(cfg.get("mamba_proj_bias", False))
    if bool(cfg.get("projectors_bias", False)) != bias:
        raise _refuse("projectors_bias", "the Mamba-2 out_proj's bias (projectors_bias) and its in_proj's "
                      "(mamba_proj_bias) must agree")
    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or d_model // n_heads
    eps = cfg.get("rms_norm_eps", 1e-5)
    mlp_mults = _vector(cfg, "mlp_multipliers", 2) or (1.0, 1.0)
    fields: dict[str, Any] = {
        **base_fields("mamba2", d_model, n_layer, cfg["vocab_size"]),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "norm_eps": eps,
        "mixer_norm_eps": eps,
        "d_state": cfg.get("mamba_d_state", 256),
        "d_conv": cfg.get("mamba_d_conv", 4),
        "expand": expand,
        "headdim": mamba_head,
        "ngroups": cfg.get("mamba_n_groups", 1),
        "bias": bias,
        "conv_bias": bool(cfg.get("mamba_conv_bias", True)),
        "rmsnorm": bool(cfg.get("mamba_rms_norm", False)),
        "norm_before_gate": bool(cfg.get("mamba_norm_before_gate", True)),
        **time_step_limit(cfg.get("time_step_limit")),
        "layer_types": ("parallel",) * n_layer,
        "ffn_types": ("mlp",) * n_layer,
        "n_q_heads": n_heads,
        "n_kv_heads": cfg.get("num_key_value_heads") or n_heads,
        "attn_head_dim": head_dim,
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "attention_multiplier": head_dim**-0.5,
        "position_embedding": "rope",
        # transformers' default rope rotates every feature of a head: a partial factor is refused
        "rope_theta": default_rope(cfg, ARCH, full_rotation="only a full rotation is supported")[1],
        "max_positions": cfg.get("max_position_embeddings", 8192),
        "mlp_intermediate_size": cfg.get("intermediate_size", 14336),
        "mlp_activation": "silu",
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "embedding_multiplier": _scalar(cfg, "embedding_multiplier"),
        "logits_multiplier": _scalar(cfg, "lm_head_multiplier"),
        "key_multiplier": _scalar(cfg, "key_multiplier"),
        "attention_in_multiplier": _scalar(cfg, "attention_in_multiplier"),
        "attention_out_multiplier": _scalar(cfg, "attention_out_multiplier"),
        "ssm_in_multiplier": _scalar(cfg, "ssm_in_multiplier"),
        "ssm_out_multiplier": _scalar(cfg, "ssm_out_multiplier"),
        "ssm_multipliers": _vector(cfg, "ssm_multipliers", 5),
        "mlp_gate_multiplier": None if mlp_mults[0] == 1.0 else mlp_mults[0],
        "mlp_down_multiplier": None if mlp_mults[1] == 1.0 else mlp_mults[1],
    }
    check_understood(cfg, _UNDERSTOOD, _INERT, ARCH)
    return fields


#: their names -> ours, by prefix within a layer; gate_proj / up_proj are joined into input_linear
_LAYER_NAMES = (("input_layernorm.", "norm."), ("pre_ff_layernorm.", "mlp_norm."), ("mamba.", "mixer.mamba."),
                ("self_attn.", "mixer.attn."), ("feed_forward.down_proj.", "mlp.output_linear."),
                ("feed_forward.gate_proj.", "mlp.gate_proj."), ("feed_forward.up_proj.", "mlp.up_proj."))


def falcon_h1_tensors(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A checkpoint's tensors under our names; each MLP's gate_proj (I, D) and up_proj (I, D) (and
    their biases) joined as input_linear (2I, D), gate first (a copy, in their stored dtype). A
    stray one is kept under its own name, for the shape check to refuse."""
    return join_gate_up(rename_layers(sd, _LAYER_NAMES, TOP), same_dtype=True)

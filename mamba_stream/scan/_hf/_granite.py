"""GraniteMoeHybrid (IBM's Granite-4.0-H): Mamba-2 and attention layers, each followed by the
shared MLP, beside routed experts where `num_local_experts` > 0; Granite's multipliers."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._hf._common import (
    base_fields,
    check_understood,
    default_rope,
    mamba2_headdim,
    refuse,
    rename_layers,
    silu_activation,
    split_experts,
    time_step_limit,
)

__all__ = ["granite_fields", "granite_tensors"]

Tensor = torch.Tensor
ARCH = "GraniteMoeHybrid"

#: the layer kinds under both spellings: the hub's checkpoints say "mamba" / "attention",
#: transformers >= 5.13 saves "linear_attention" / "full_attention"
KINDS = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "attention", "full_attention": "attention"}
#: fields that change no inference arithmetic here
_INERT = {"mamba_chunk_size", "normalization_function", "init_method"}
_UNDERSTOOD = {
    "num_local_experts", "num_experts_per_tok", "intermediate_size", "num_hidden_layers", "layer_types",
    "layers_block_type", "hidden_size", "num_attention_heads", "head_dim", "position_embedding_type", "vocab_size",
    "tie_word_embeddings", "rms_norm_eps", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_n_groups",
    "mamba_proj_bias", "mamba_conv_bias", "shared_intermediate_size", "embedding_multiplier", "residual_multiplier",
    "logits_scaling", "mamba_n_heads", "mamba_d_head", "time_step_limit", "num_key_value_heads", "attention_bias",
    "attention_multiplier", "max_position_embeddings", "rope_parameters", "rope_theta", "rope_scaling", "hidden_act"}

_refuse = partial(refuse, ARCH)


def granite_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json -> `ModelConfig.create` fields; a field it cannot map is refused, named."""
    n_layer = cfg["num_hidden_layers"]
    raw_kinds = cfg.get("layer_types", cfg.get("layers_block_type")) or ["linear_attention"] * n_layer
    unknown = sorted({str(k) for k in raw_kinds if k not in KINDS}) if isinstance(raw_kinds, list) else []
    if not isinstance(raw_kinds, list) or unknown:
        raise _refuse("layer_types", f"unknown layer kinds {unknown}; expected {sorted(KINDS)}")
    kinds = tuple(KINDS[k] for k in raw_kinds)
    d_model = cfg["hidden_size"]
    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim", d_model // n_heads)
    pe = cfg.get("position_embedding_type")
    if pe not in (None, "nope", "rope"):
        raise _refuse("position_embedding_type", f"{pe!r}; expected 'rope', 'nope' or null")
    experts = cfg.get("num_local_experts", 8)  # GraniteMoeHybridConfig's default: MoE
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 0:
        raise _refuse("num_local_experts", f"{experts!r}: expected a count of experts (0: dense)")
    fields: dict[str, Any] = {
        **base_fields("mamba2", d_model, n_layer, cfg["vocab_size"]),
        "tie_embeddings": cfg.get("tie_word_embeddings", False),
        "norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "mixer_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "d_state": cfg.get("mamba_d_state", 256),
        "d_conv": cfg.get("mamba_d_conv", 4),
        "expand": cfg.get("mamba_expand", 2),
        "ngroups": cfg.get("mamba_n_groups", 1),
        "bias": cfg.get("mamba_proj_bias", False),
        "conv_bias": cfg.get("mamba_conv_bias", True),
        "norm_before_gate": False,
        "layer_types": kinds,
        "ffn_types": ("moe" if experts else "mlp",) * n_layer,
        "mlp_intermediate_size": cfg.get("shared_intermediate_size", 1024),
        "mlp_activation": "silu",
        "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
        "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
        **time_step_limit(cfg.get("time_step_limit")),
    }
    if experts:
        fields.update(moe_experts=experts, moe_top_k=cfg.get("num_experts_per_tok", 2),
                      moe_intermediate_size=cfg.get("intermediate_size", 1024), moe_router="topk_softmax",
                      moe_shared_mlp=True)
    d_inner = int(fields["expand"] * d_model)
    fields["headdim"] = mamba2_headdim(cfg, ARCH, d_inner, "mamba_expand * hidden_size", typed=True)
    if "attention" in kinds:
        fields.update(
            n_q_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads, attn_head_dim=head_dim,
            attention_bias=bool(cfg.get("attention_bias", False)),
            attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
            position_embedding="rope" if pe == "rope" else "nope",
            max_positions=cfg.get("max_position_embeddings", 2048),
        )
        if pe == "rope":
            fields["rope_theta"] = default_rope(cfg, ARCH, "only a full rotation is supported")[1]
    silu_activation(cfg, ARCH)
    check_understood(cfg, _UNDERSTOOD, _INERT, ARCH)
    return fields


#: their names -> ours, by prefix within a layer (Mamba-2 layers: mamba-ssm's names, which
#: transformers' `mamba.*` already are)
_LAYER_NAMES = (("input_layernorm.", "norm."), ("post_attention_layernorm.", "mlp_norm."), ("shared_mlp.", "mlp."),
                ("block_sparse_moe.", "moe."), ("mamba.", "mixer."), ("self_attn.", "mixer."))
_TOP = {"model.embed_tokens.weight": "backbone.embedding.weight", "model.norm.weight": "backbone.norm_f.weight"}


def granite_tensors(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A checkpoint's tensors under our names, each expert's stacked weights as its own MLP (the
    hub's layout, which save_pretrained writes, or transformers' in-memory one)."""
    ours = rename_layers(sd, _LAYER_NAMES, _TOP)
    ours = {k.replace(".moe.router.layer.", ".moe.router."): v for k, v in ours.items()}
    return split_experts(ours, lambda name: ".moe." in name)

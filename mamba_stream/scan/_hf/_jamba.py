"""Jamba (AI21's): Mamba-1 and attention layers, each followed by an MLP or, on the expert layers,
routed experts; the Mamba-1 mixers carry RMS norms with learned weights on dt, B and C.

transformers' `JambaConfig` places its layers by period and offset: layer i is attention where
i % attn_layer_period == attn_layer_offset (else Mamba-1), and its feed-forward is routed experts
where i % expert_layer_period == expert_layer_offset and num_experts > 1 (else the gated MLP). The
attention has no position embedding and the plain softmax scale head_dim**-0.5; the router takes
the softmax over all experts, then the top k of it, not renormalized ("softmax_topk"). The MLP and
every expert share `intermediate_size` and `hidden_act` (silu), which the Mamba mixers' conv
activation is too.
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
    refuse,
    rename_layers,
    silu_activation,
    split_experts,
)

__all__ = ["jamba_fields", "jamba_tensors"]

Tensor = torch.Tensor
ARCH = "Jamba"

#: fields that change no inference arithmetic here (the Mamba kernels' and scan's choice of
#: implementation; AI21's remote-code configs' logits slicing)
_INERT = {"use_mambapy", "use_associative_scan", "calc_logits_for_entire_prompt"}
_UNDERSTOOD = {
    "vocab_size", "tie_word_embeddings", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
    "num_experts_per_tok", "num_experts", "num_local_experts", "expert_layer_period", "expert_layer_offset",
    "attn_layer_period", "attn_layer_offset", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_dt_rank",
    "mamba_conv_bias", "mamba_proj_bias", "layer_types", "layers_block_type", "attention_bias", "mlp_bias",
    "sliding_window", "mamba_inner_layernorms", "n_ctx"}

_refuse = partial(refuse, ARCH)


def _count(cfg: dict[str, Any], field: str, default: int, least: int) -> int:
    """An integer field of at least `least` (a bool is not a count)."""
    v = cfg.get(field, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise _refuse(field, f"{v!r}: expected an integer >= {least}")
    return v


def _placed(n_layer: int, period: int, offset: int, field: str) -> list[bool]:
    """Which layers a (period, offset) pair selects: i % period == offset."""
    if offset >= period:
        raise _refuse(field, f"offset {offset} must be smaller than the period {period}")
    return [i % period == offset for i in range(n_layer)]


def jamba_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json -> `ModelConfig.create` fields; a field it cannot map is refused, named."""
    n_layer = _count(cfg, "num_hidden_layers", 32, 1)
    attn = _placed(n_layer, _count(cfg, "attn_layer_period", 8, 1), _count(cfg, "attn_layer_offset", 4, 0),
                   "attn_layer_offset")
    kinds = tuple("attention" if a else "mamba1" for a in attn)
    # transformers derives these two from the periods (properties, not saved); a file that states
    # them must agree, or it means another layout than the one computed from the periods
    for key, want in (("layers_block_type", ["attention" if a else "mamba" for a in attn]),
                      ("layer_types", ["full_attention" if a else "linear_attention" for a in attn])):
        if key in cfg and cfg[key] != want:
            raise _refuse(key, f"{cfg[key]!r} disagrees with attn_layer_period/offset, which give {want}")
    if "num_experts" in cfg and "num_local_experts" in cfg and cfg["num_experts"] != cfg["num_local_experts"]:
        raise _refuse("num_local_experts", "differs from num_experts (transformers' alias of it)")
    experts = _count(cfg, "num_experts", cfg.get("num_local_experts", 16), 1)
    top_k = _count(cfg, "num_experts_per_tok", 2, 1)
    moe_at = _placed(n_layer, _count(cfg, "expert_layer_period", 2, 1), _count(cfg, "expert_layer_offset", 1, 0),
                     "expert_layer_offset")
    # JambaDecoderLayer: num_experts > 1 on an expert layer -> JambaSparseMoeBlock, else JambaMLP
    ffns = tuple("moe" if m and experts > 1 else "mlp" for m in moe_at)
    silu_activation(cfg, ARCH)  # the MLP's and the experts' activation, and the Mamba mixers' conv activation
    if cfg.get("mamba_inner_layernorms", True) is not True:
        # AI21's remote code's switch for the dt/B/C norms, which transformers always builds (and
        # we compute): a checkpoint made without them is another function
        raise _refuse("mamba_inner_layernorms", f"{cfg['mamba_inner_layernorms']!r}: only Mamba layers with their "
                      "dt/B/C norms are computed")
    if cfg.get("sliding_window") is not None:
        raise _refuse("sliding_window", f"{cfg['sliding_window']!r}: only full causal attention is computed")
    for key in ("attention_bias", "mlp_bias"):  # transformers' Jamba builds every projection without bias
        if cfg.get(key, False):
            raise _refuse(key, "Jamba's projections have no bias; a biased variant is not computed")
    d_model = _count(cfg, "hidden_size", 4096, 1)
    expand = cfg.get("mamba_expand", 2)
    if not isinstance(expand, int) or isinstance(expand, bool) or expand < 1:
        # JambaMambaMixer's intermediate size is mamba_expand * hidden_size, an integer product
        raise _refuse("mamba_expand", f"{expand!r}: expected a positive integer")
    rank = cfg.get("mamba_dt_rank", "auto")
    rank = math.ceil(d_model / 16) if rank == "auto" else rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _refuse("mamba_dt_rank", f"{rank!r}: expected a positive integer or 'auto'")
    eps = cfg.get("rms_norm_eps", 1e-6)
    intermediate = _count(cfg, "intermediate_size", 14336, 1)
    fields: dict[str, Any] = {
        **base_fields("mamba1", d_model, n_layer, cfg["vocab_size"]),
        "tie_embeddings": cfg.get("tie_word_embeddings", False),
        "norm_eps": eps,
        "d_state": cfg.get("mamba_d_state", 16),
        "d_conv": cfg.get("mamba_d_conv", 4),
        "expand": expand,
        "dt_rank": rank,
        "bias": cfg.get("mamba_proj_bias", False),
        "conv_bias": cfg.get("mamba_conv_bias", True),
        # JambaMambaMixer: dt_layernorm, b_layernorm, c_layernorm, each a JambaRMSNorm(eps=rms_norm_eps)
        "bcdt_rms_eps": eps,
        "bcdt_norm_weights": True,
        "layer_types": kinds,
        "ffn_types": ffns,
        "mlp_activation": "silu",
    }
    if "mlp" in ffns:
        fields["mlp_intermediate_size"] = intermediate
    if "moe" in ffns:
        if top_k > experts:
            raise _refuse("num_experts_per_tok", f"{top_k} of {experts} experts")
        fields.update(moe_experts=experts, moe_top_k=top_k, moe_intermediate_size=intermediate,
                      moe_router="softmax_topk", moe_shared_mlp=False)
    if "attention" in kinds:
        n_heads = _count(cfg, "num_attention_heads", 32, 1)
        # JambaAttention: getattr(config, "head_dim", hidden_size // num_attention_heads)
        head_dim = _count(cfg, "head_dim", d_model // n_heads, 1)
        fields.update(
            n_q_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads, attn_head_dim=head_dim,
            attention_bias=False, position_embedding="nope", attention_multiplier=head_dim**-0.5,
            # (n_ctx: AI21's remote-code configs' name for it)
            max_positions=_count(cfg, "max_position_embeddings", cfg.get("n_ctx", 262144), 1),
        )
    check_understood(cfg, _UNDERSTOOD, _INERT, ARCH)
    return fields


#: their names -> ours, by prefix within a layer (the Mamba-1 mixer's: mamba-ssm's names, which
#: transformers' `mamba.*` already are, but for the three norms; the MLPs' and experts' gate/up/down
#: already joined as input_linear / output_linear by `_join_mlps`)
_LAYER_NAMES = (("input_layernorm.", "norm."), ("pre_ff_layernorm.", "mlp_norm."),
                ("mamba.dt_layernorm.", "mixer.dt_norm."), ("mamba.b_layernorm.", "mixer.b_norm."),
                ("mamba.c_layernorm.", "mixer.c_norm."), ("mamba.", "mixer."), ("self_attn.", "mixer."),
                ("feed_forward.router.", "moe.router."), ("feed_forward.experts.", "moe.experts."),
                ("feed_forward.", "mlp."))
_MLP = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def _join_mlps(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every gated MLP held as three matrices (JambaMLP's `feed_forward.{gate,up,down}_proj`, and each
    expert's `feed_forward.experts.{e}.{gate,up,down}_proj`, the layout transformers saves and the
    hub's checkpoints hold) as our two: `input_linear` = [gate; up] rows, gate first, (2I, D) (one
    copy), and `output_linear` = down_proj (D, I). A pair that does not join (one half missing,
    shapes or dtypes that differ) is left under its own names, for the shape check to refuse."""
    out: dict[str, Tensor] = {}
    parts: dict[str, dict[str, Tensor]] = {}
    for name, t in sd.items():
        stem, _, leaf = name.rpartition(".")
        stem, _, proj = stem.rpartition(".")
        if name.startswith("model.layers.") and ".feed_forward" in name and f"{proj}.{leaf}" in _MLP:
            parts.setdefault(stem, {})[f"{proj}.{leaf}"] = t
        else:
            out[name] = t
    for stem, held in parts.items():
        gate, up = held.get("gate_proj.weight"), held.get("up_proj.weight")
        if gate is not None and up is not None and gate.shape == up.shape and gate.dtype == up.dtype:
            out[f"{stem}.input_linear.weight"] = torch.cat([gate, up], dim=0)
            del held["gate_proj.weight"], held["up_proj.weight"]
        if "down_proj.weight" in held:
            out[f"{stem}.output_linear.weight"] = held.pop("down_proj.weight")
        out.update({f"{stem}.{leaf}": t for leaf, t in held.items()})
    return out


def jamba_tensors(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A checkpoint's tensors under our names: the MLPs' and experts' three matrices joined as our
    two (`_join_mlps`), or transformers' stacked experts in memory (`experts.gate_up_proj` (E, 2I, D),
    `experts.down_proj` (E, D, I)) split into one MLP per expert (views)."""
    renamed = rename_layers(_join_mlps(sd), _LAYER_NAMES, TOP)
    return split_experts(renamed, lambda name: ".moe.experts." in name)

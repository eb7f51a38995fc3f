"""Zamba2 (Zyphra, `model_type` "zamba2"): a Mamba-2 backbone in which the layers marked "hybrid"
first call a weight-shared transformer block (`scan._shared`: our "shared" layers).

What transformers computes (`modeling_zamba2.py`), and how it maps here:
    - every layer is a Mamba-2 (`Zamba2MambaMixer`): mamba-ssm's layout with d_ssm = d_inner
      (in_proj rows [z, x, B, C, dt]), n_mamba_heads heads of d_inner / n_mamba_heads, a conv with
      a bias whatever `use_conv_bias` says (transformers builds it with bias=True and never reads
      the flag), the gated RMS norm (eps 1e-5, gate before the norm, groups of d_inner /
      mamba_ngroups), dt = clamp(softplus(dt + dt_bias), min=time_step_min) (its `time_step_limit`
      (time_step_min, inf)), in_proj / out_proj biases where `add_bias_linear`;
    - a "hybrid" layer i (the s-th of `hybrid_layer_ids`) runs `shared_transformer` (block
      s % num_mem_blocks, its weights tied across the sites that share it) on concat(its input,
      the embeddings): input_layernorm (2 * hidden), attention with q/k/v from 2 * hidden features,
      head_dim = 2 * hidden / num_attention_heads, softmax scale (head_dim / 2) ** -0.5, RoPE over the
      whole head where `use_mem_rope`, o_proj back to hidden; pre_ff_layernorm; the gated MLP
      (gate_up_proj [gate; up], `hidden_act` "gelu": the exact erf GELU), its gate_up_proj output
      plus the site's LoRA adapter (always: transformers builds the MLP adapters whatever
      `use_shared_mlp_adapter` says) and q/k/v plus theirs where `use_shared_attention_adapter`;
      then the site's `linear`, added to the Mamba-2's input before its norm (not to the residual);
    - every RMS norm but the gated one has eps `rms_norm_eps`; no multipliers; the head is tied to
      the embedding unless `tie_word_embeddings` is false;
    - transformers (5.24) ties the sites' blocks only where it ties the embedding: with
      `tie_word_embeddings` false every site has a block of its own (its own weights, initialized
      and saved apart), so that model is read with one block per site (`shared_blocks` = the sites).

Where a site's weights are read from: block j from the first site that calls it (site j, under whose
name transformers saves a tied block); site s's adapters from the list of the block it calls, entry
s. A block's copy under another site's name (a checkpoint that saved every tie) must be equal to
it; an adapter entry in a block that site s does not call is a parameter transformers never reads
(its untied blocks each hold one for every site of their rotation) and is left out.

Derived fields transformers writes to config.json and recomputes on load from the fields above
(attention_head_dim, attention_hidden_size, mamba_headdim, hybrid_layer_ids, kv_channels,
num_query_groups) change nothing and are accepted as they are.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import torch

from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._hf._common import TOP, base_fields, check_understood, default_rope, positive_int, refuse

__all__ = ["zamba2_fields", "zamba2_tensors"]

Tensor = torch.Tensor
ARCH = "Zamba2"

#: fields that change no inference arithmetic: the scan's block length, the dt init's range,
#: the fused training path's switch, and the values transformers derives again on load
_INERT = {"chunk_size", "time_step_max", "time_step_floor", "use_mem_eff_path", "attention_head_dim",
          "attention_hidden_size", "mamba_headdim", "hybrid_layer_ids", "kv_channels", "num_query_groups",
          "use_conv_bias"}
_UNDERSTOOD = {
    "vocab_size", "tie_word_embeddings", "hidden_size", "intermediate_size", "num_hidden_layers",
    "layers_block_type", "layer_types", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_ngroups",
    "n_mamba_heads", "time_step_min", "add_bias_linear", "hidden_act", "num_attention_heads", "num_key_value_heads",
    "num_mem_blocks", "use_shared_attention_adapter", "use_shared_mlp_adapter", "adapter_rank", "use_mem_rope",
    "rope_parameters", "rope_theta", "rope_scaling", "rms_norm_eps", "max_position_embeddings", "use_long_context",
    "time_step_limit", "ffn_hidden_size"}
#: Zamba2Config's default layout (54 layers), where config.json names none
_DEFAULT_KINDS = (["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3
                  + ["hybrid"] + ["mamba"] * 2)
_MAMBA_NAMES = ("mamba", "linear_attention")  # the legacy name and transformers 5.x's

_refuse = partial(refuse, ARCH)


_positive_int = partial(positive_int, ARCH)


def _layer_kinds(cfg: dict[str, Any], n_layer: int) -> tuple[str, ...]:
    """`layers_block_type` (or its alias `layer_types`) -> each layer's kind: "hybrid" -> "shared",
    "mamba" / "linear_attention" -> "mamba2"; any other name refused."""
    field = "layers_block_type" if "layers_block_type" in cfg else "layer_types"
    kinds = cfg.get(field)
    if "layers_block_type" in cfg and "layer_types" in cfg and cfg["layer_types"] != kinds:
        raise _refuse("layer_types", "differs from layers_block_type (its alias)")
    if kinds is None:
        kinds = _DEFAULT_KINDS
    if not isinstance(kinds, list) or len(kinds) != n_layer:
        raise _refuse(field, f"expected a list of {n_layer} layer kinds (num_hidden_layers), got {kinds!r}")
    out = []
    for k in kinds:
        if k == "hybrid":
            out.append("shared")
        elif k in _MAMBA_NAMES:
            out.append("mamba2")
        else:
            raise _refuse(field, f"layer kind {k!r}: a Zamba2 layer is 'hybrid' or a Mamba-2 ('linear_attention')")
    return tuple(out)


def _rope_theta(cfg: dict[str, Any]) -> float:
    """The rope's theta: Zamba2's own default rope rotates the whole head (a scaled rope, or a
    partial factor transformers' Zamba2 rope would not read, is refused, named)."""
    return default_rope(cfg, ARCH, full_rotation="Zamba2's rope rotates the whole head")[1]


def zamba2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json -> `ModelConfig.create` fields; a field it cannot map is refused, named."""
    n_layer = _positive_int(cfg, "num_hidden_layers", 54)
    kinds = _layer_kinds(cfg, n_layer)
    d_model = _positive_int(cfg, "hidden_size", 2560)
    if cfg.get("hidden_act", "gelu") != "gelu":
        raise _refuse("hidden_act", f"activation {cfg['hidden_act']!r} is not supported (the shared MLP's: 'gelu')")
    if cfg.get("use_long_context", False) is not False:
        raise _refuse("use_long_context", "the long-context variant is not supported")
    if cfg.get("use_shared_mlp_adapter", True) is not True:
        raise _refuse("use_shared_mlp_adapter", "transformers applies the MLP adapters whatever this says: "
                      "a checkpoint meant without them is not its function")
    if cfg.get("time_step_limit") is not None:
        # transformers 5.x reads it nowhere: its dt is clamped below at time_step_min, never above
        raise _refuse("time_step_limit", f"{cfg['time_step_limit']!r}: transformers clamps dt at "
                      "(time_step_min, inf) whatever this says")
    intermediate = cfg.get("intermediate_size") or 4 * d_model
    if cfg.get("ffn_hidden_size") not in (None, intermediate):  # the hub's older name, read nowhere now
        raise _refuse("ffn_hidden_size", f"{cfg['ffn_hidden_size']!r} differs from intermediate_size {intermediate}")
    expand = cfg.get("mamba_expand", 2)
    d_inner = int(expand * d_model)
    mamba_heads = _positive_int(cfg, "n_mamba_heads", 8)
    if d_inner % mamba_heads:
        raise _refuse("n_mamba_heads", f"{mamba_heads} heads do not divide mamba_expand * hidden_size = {d_inner}")
    n_heads = _positive_int(cfg, "num_attention_heads", 32)
    if (2 * d_model) % n_heads:
        raise _refuse("num_attention_heads", f"{n_heads} heads do not divide the shared block's 2 * hidden_size")
    head_dim = 2 * d_model // n_heads
    n_kv = cfg.get("num_key_value_heads") or n_heads
    attention_adapter = bool(cfg.get("use_shared_attention_adapter", False))
    if attention_adapter and n_kv != n_heads:
        # the k/v adapters write 2 * hidden_size features: transformers' own model cannot add them
        raise _refuse("num_key_value_heads", f"{n_kv} key/value heads with the attention adapters (which need "
                      f"num_attention_heads={n_heads})")
    sites = kinds.count("shared")
    tied = bool(cfg.get("tie_word_embeddings", True))
    eps = cfg.get("rms_norm_eps", 1e-5)
    fields: dict[str, Any] = {
        **base_fields("mamba2", d_model, n_layer, cfg["vocab_size"]),
        "tie_embeddings": tied,
        "norm_eps": eps,
        "mixer_norm_eps": 1e-5,  # Zamba2RMSNormGated's, fixed
        "d_state": cfg.get("mamba_d_state", 64),
        "d_conv": cfg.get("mamba_d_conv", 4),
        "expand": expand,
        "headdim": d_inner // mamba_heads,
        "ngroups": cfg.get("mamba_ngroups", 1),
        "bias": bool(cfg.get("add_bias_linear", False)),
        "conv_bias": True,
        "norm_before_gate": False,
        "dt_min_clamp": float(cfg.get("time_step_min", 0.001)),
        "dt_max_clamp": None,
        "layer_types": kinds,
    }
    if sites:
        rope = bool(cfg.get("use_mem_rope", False))
        fields.update(
            ffn_types=("none",) * n_layer,  # the shared block's MLP is inside it: no layer has an ffn of its own
            n_q_heads=n_heads, n_kv_heads=n_kv, attn_head_dim=head_dim, attention_bias=False,
            attention_multiplier=(head_dim / 2) ** -0.5,  # Zamba2Attention.scaling
            position_embedding="rope" if rope else "nope", rope_theta=_rope_theta(cfg) if rope else None,
            max_positions=_positive_int(cfg, "max_position_embeddings", 4096),
            mlp_intermediate_size=intermediate, mlp_activation="gelu",
            mlp_bias=bool(cfg.get("add_bias_linear", False)),
            # more blocks than sites: the later ones are never built (transformers ties as it goes);
            # untied (see above): a block per site
            shared_blocks=min(_positive_int(cfg, "num_mem_blocks", 1), sites) if tied else sites,
            shared_adapter_rank=_positive_int(cfg, "adapter_rank", 128),
            shared_attention_adapter=attention_adapter,
        )
    check_understood(cfg, _UNDERSTOOD, _INERT, ARCH)
    return fields


#: within a shared_transformer: their names -> the shared block's (ours)
_BLOCK_NAMES = (("input_layernorm.", "norm."), ("pre_ff_layernorm.", "mlp_norm."), ("self_attn.", "attn."),
                ("feed_forward.gate_up_proj.", "mlp.input_linear."), ("feed_forward.down_proj.", "mlp.output_linear."))
#: a site's adapter within a shared_transformer: (list, site, 0 down / 1 up)
_ADAPTER = re.compile(r"(?:self_attn\.linear_([qkv])_adapter_list|feed_forward\.gate_up_proj_adapter_list)"
                      r"\.(\d+)\.([01])\.weight")


def _ours(name: str, layers: dict[int, str], site_of: dict[int, int], sites: list[int], blocks: int) -> str | None:
    """One checkpoint name -> ours (an unknown name as it is, for the shape check to refuse; None:
    a parameter transformers never reads)."""
    if name in TOP:
        return TOP[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.*)", name)
    if m is None:
        return name
    i, rest = int(m.group(1)), m.group(2)
    kind = layers.get(i)
    if kind == "mamba2":
        for theirs, ours in (("input_layernorm.", "norm."), ("mamba.", "mixer.")):
            if rest.startswith(theirs):
                return f"backbone.layers.{i}.{ours}{rest[len(theirs):]}"
    elif kind == "shared":
        for theirs, ours in (("mamba_decoder.input_layernorm.", "norm."), ("mamba_decoder.mamba.", "mixer.mamba."),
                             ("linear.", "mixer.linear.")):
            if rest.startswith(theirs):
                return f"backbone.layers.{i}.{ours}{rest[len(theirs):]}"
        if rest.startswith("shared_transformer."):
            inner = rest[len("shared_transformer."):]
            a = _ADAPTER.fullmatch(inner)
            if a is not None:  # site s's adapter, in the list of the block under site t's name
                s, t = int(a.group(2)), site_of[i]
                if s >= len(sites):
                    return name
                if t % blocks != s % blocks:  # not the block site s calls: never read
                    return None
                which = f"{a.group(1)}_adapter" if a.group(1) else "mlp_adapter"
                return f"backbone.layers.{sites[s]}.mixer.{which}.{'down' if a.group(3) == '0' else 'up'}.weight"
            for theirs, ours in _BLOCK_NAMES:
                if inner.startswith(theirs):
                    return f"backbone.shared.{site_of[i] % blocks}.{ours}{inner[len(theirs):]}"
    return name


def zamba2_tensors(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A checkpoint's tensors under our names. transformers saves each shared block once, under its
    first site's name (the others are tied to it); a checkpoint holding it under several sites'
    names is read once, where the copies are equal (a copy that differs is kept under its own name,
    for the shape check to refuse: the sites would not share their weights)."""
    layers = dict(enumerate(cfg.kinds))
    sites = [i for i, k in enumerate(cfg.kinds) if k == "shared"]
    site_of = {i: s for s, i in enumerate(sites)}
    blocks = cfg.shared_blocks or 1
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        new = _ours(name, layers, site_of, sites, blocks)
        if new is None:
            continue
        if new in out:
            if out[new].shape == t.shape and out[new].dtype == t.dtype and torch.equal(out[new], t):
                continue
            new = name
        out[new] = t
    return out

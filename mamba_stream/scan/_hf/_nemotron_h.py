"""NemotronH (NVIDIA's Nemotron-H and Nemotron Nano v2): every layer is one block, norm -> mixer ->
residual add, its mixer a Mamba-2 ("M"), attention ("*"), or an MLP ("-"); nothing follows a mixer.

What transformers 5.24's `NemotronHForCausalLM` computes, as mapped here:

- Mamba-2: d_ssm = mamba_num_heads * mamba_head_dim (`expand` is not read); the gated RMS norm
  multiplies by silu(z) first (`norm_before_gate` False) and normalizes over groups of
  d_ssm / n_groups with `layer_norm_epsilon`; D is per head; in/out projections biased by
  `use_bias`, the conv by `use_conv_bias`; dt = max(softplus(dt_raw + dt_bias), time_step_min),
  no upper clamp (transformers reads `time_step_min` as the clamp, not `time_step_limit`).
- attention: no position embedding (NoPE), softmax scale head_dim**-0.5, no biases whatever
  `attention_bias` says (the projections are built without one).
- MLP layers: not gated, out = down_proj(act(up_proj(x))), act `mlp_hidden_act` (relu2: relu,
  squared), biases by `mlp_bias`.
- MoE layers (`NemotronHMoE`: our "moe" layer kind, `scan._layers.Experts`): router logits
  W_gate x (float32), scores = sigmoid(logits); the choice reads scores + `e_score_correction_bias`:
  the `n_routed_experts` split into `n_group` groups, each scored by the sum of its top 2, the best
  `topk_group` groups kept, the top `num_experts_per_tok` experts among them; their weights the
  unbiased scores, divided by their sum + 1e-20 where `norm_topk_prob`, times
  `routed_scaling_factor`. Each expert is a bias-free, not gated MLP (up, `mlp_hidden_act`, down)
  over `moe_latent_size` features where set (x through `fc1_latent_proj` first, the experts'
  weighted sum through `fc2_latent_proj` after; biases by `mlp_bias`), else over x; then the
  shared expert (a not-gated MLP of `moe_shared_expert_intermediate_size`, biases by `mlp_bias`)
  on x is added. transformers builds that one shared expert whatever `n_shared_experts` says.
- the head is never tied to the embedding (the model declares no tied weights), whatever
  `tie_word_embeddings` says.

Multi-token-prediction layers (`mtp.*`) are not part of the next-token logits and are dropped, as
transformers drops them.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._errors import ConfigError
from mamba_stream.scan._hf._common import base_fields, check_understood, is_inf, positive_int, refuse

__all__ = ["nemotron_h_fields", "nemotron_h_tensors"]

Tensor = torch.Tensor
ARCH = "NemotronH"

#: a layer kind under each spelling: transformers 5.24 saves `layers_block_type` as
#: "linear_attention" / "full_attention" / "mlp" / "moe"; older lists say "mamba" / "attention";
#: the hub's configs give `hybrid_override_pattern`, one character a layer
KINDS = {"linear_attention": "mamba2", "mamba": "mamba2", "M": "mamba2",
         "full_attention": "attention", "attention": "attention", "*": "attention",
         "mlp": "mlp", "-": "mlp", "moe": "moe", "E": "moe"}
#: transformers' older names of config fields (NemotronHConfig renames them on load)
ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
           "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
           "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
           "mamba_chunk_size": "chunk_size", "num_local_experts": "n_routed_experts"}
#: fields that change no inference arithmetic of the layers we build: initialization, training,
#: kernels' block sizes, the cache's dtype, the multi-token-prediction fields (read only by the
#: mtp.* heads, which are dropped), `moe_shared_expert_overlap` (a scheduling hint) and
#: `n_shared_experts` (transformers 5.24 builds one shared expert whatever it says)
_INERT = {
    "chunk_size", "expand", "hidden_dropout", "rescale_prenorm_residual", "time_step_max", "time_step_floor",
    "mamba_ssm_cache_dtype", "mamba_proj_bias", "num_nextn_predict_layers", "mtp_layers_block_type",
    "mtp_hybrid_override_pattern", "moe_shared_expert_overlap", "n_shared_experts",
}
#: the MoE fields: read where some layer is an MoE layer, accepted as they are otherwise
_MOE_FIELDS = {
    "moe_intermediate_size", "moe_latent_size", "moe_shared_expert_intermediate_size", "n_group", "n_routed_experts",
    "norm_topk_prob", "num_experts_per_tok", "routed_scaling_factor", "topk_group",
}
_UNDERSTOOD = {
    "vocab_size", "hidden_size", "layers_block_type", "layer_types", "hybrid_override_pattern", "num_hidden_layers",
    "tie_word_embeddings", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "attention_bias", "sliding_window", "intermediate_size", "mlp_hidden_act", "mlp_bias", "ssm_state_size",
    "mamba_num_heads", "mamba_head_dim", "mamba_hidden_act", "n_groups", "conv_kernel", "time_step_min",
    "time_step_limit", "use_conv_bias", "use_bias", "layer_norm_epsilon", "residual_in_fp32", *_MOE_FIELDS,
}

_refuse = partial(refuse, ARCH)


def _layer_kinds(cfg: dict[str, Any]) -> tuple[str, ...]:
    """Each layer's kind from whichever field the config gives (the list first, as transformers
    does); an unknown kind refused naming that field."""
    for field in ("layers_block_type", "layer_types", "hybrid_override_pattern"):
        raw = cfg.get(field)
        if raw is None:
            continue
        if field == "hybrid_override_pattern" and isinstance(raw, str):
            raw = list(raw)
        if not isinstance(raw, list) or not raw:
            raise _refuse(field, f"{raw!r}: expected a non-empty list of layer kinds")
        unknown = sorted({str(k) for k in raw if k not in KINDS})
        if unknown:
            raise _refuse(field, f"unknown layer kinds {unknown}; expected {sorted(KINDS)}")
        return tuple(KINDS[k] for k in raw)
    raise ConfigError("no layer layout: layers_block_type, layer_types or hybrid_override_pattern",
                      field="layers_block_type")


def _activation(cfg: dict[str, Any], field: str, default: str, allowed: dict[str, str]) -> str:
    act = cfg.get(field, default)
    if act not in allowed:
        raise _refuse(field, f"activation {act!r} is not supported; expected one of {sorted(allowed)}")
    return allowed[act]


_positive = partial(positive_int, ARCH)


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE layers' fields (NemotronHConfig's defaults), each limit checked naming its field."""
    experts = _positive(cfg, "n_routed_experts", 8)
    groups = _positive(cfg, "n_group", 1)
    if experts % groups or experts // groups < 2:
        # transformers scores a group by the sum of its top 2 (a group of one fails there)
        raise _refuse("n_group", f"{experts} experts do not split into {groups} groups of at least 2")
    topk_group = _positive(cfg, "topk_group", 1)
    if topk_group > groups:
        raise _refuse("topk_group", f"{topk_group} groups kept of {groups}")
    top_k = _positive(cfg, "num_experts_per_tok", 2)
    if top_k > topk_group * (experts // groups):
        raise _refuse("num_experts_per_tok", f"{top_k} experts per token, but the {topk_group} kept groups hold "
                      f"{topk_group * (experts // groups)}")
    scaling = cfg.get("routed_scaling_factor", 1.0)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling) or not scaling:
        raise _refuse("routed_scaling_factor", f"{scaling!r}: expected a finite non-zero number")
    norm = cfg.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        raise _refuse("norm_topk_prob", f"{norm!r}: expected true or false")
    latent = cfg.get("moe_latent_size")
    return {
        "moe_experts": experts, "moe_top_k": top_k, "moe_router": "sigmoid_group_topk",
        "moe_intermediate_size": _positive(cfg, "moe_intermediate_size", 7688),
        "moe_groups": groups, "moe_topk_groups": topk_group, "moe_norm_topk": norm, "moe_scaling": float(scaling),
        "moe_shared_mlp": True,
        "moe_shared_intermediate_size": _positive(cfg, "moe_shared_expert_intermediate_size", 7688),
        "moe_latent_size": None if latent is None else _positive(cfg, "moe_latent_size", None),
    }


def nemotron_h_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json -> `ModelConfig.create` fields; a field it cannot map is refused, named.

    The defaults are NemotronHConfig's (transformers 5.24) for fields the file leaves out.
    """
    cfg = dict(cfg)
    for old, new in ALIASES.items():
        if old in cfg:  # NemotronHConfig lets the old name win
            cfg[new] = cfg.pop(old)
    kinds = _layer_kinds(cfg)
    n_layer = len(kinds)
    declared = cfg.get("num_hidden_layers")
    if declared is not None and declared != n_layer:
        raise _refuse("num_hidden_layers", f"{declared} layers, but the layer layout lists {n_layer}")
    d_model = cfg["hidden_size"]
    heads, head = cfg.get("mamba_num_heads", 128), cfg.get("mamba_head_dim", 64)
    d_ssm = heads * head
    # d_inner = expand * d_model must be exactly the Mamba heads' width (transformers sizes the
    # mixer by its heads and ignores `expand`)
    expand = d_ssm / d_model
    if not float(expand * d_model).is_integer() or int(expand * d_model) != d_ssm:
        raise _refuse("mamba_num_heads", f"mamba_num_heads * mamba_head_dim = {d_ssm} is not a width this "
                      f"loader can express over hidden_size {d_model}")
    groups = cfg.get("n_groups", 8)
    if not isinstance(groups, int) or groups < 1 or heads % groups:
        raise _refuse("n_groups", f"{groups!r}: the {heads} Mamba heads cannot share B and C in {groups!r} groups")
    limit = cfg.get("time_step_limit")
    if limit is not None and not (isinstance(limit, (list, tuple)) and len(limit) == 2 and limit[0] in (0, 0.0)
                                  and is_inf(limit[1])):
        # transformers 5.24 ignores it (its clamp is time_step_min); mamba-ssm's kernels, which
        # NVIDIA's own code calls, apply it: which one a checkpoint was made for is not known
        raise _refuse("time_step_limit", f"{limit!r}: only (0.0, inf) is supported (transformers does not apply it)")
    eps = float(cfg.get("layer_norm_epsilon", 1e-5))
    _activation(cfg, "mamba_hidden_act", "silu", {"silu": "silu", "swish": "silu"})
    fields: dict[str, Any] = {
        **base_fields("mamba2", d_model, n_layer, cfg.get("vocab_size", 131072)),
        # NemotronHForCausalLM declares no tied weights: its head is its own tensor even where
        # tie_word_embeddings is true
        "tie_embeddings": False,
        "norm_eps": eps,
        "mixer_norm_eps": eps,
        "residual_in_fp32": bool(cfg.get("residual_in_fp32", False)),
        "d_state": cfg.get("ssm_state_size", 128),
        "d_conv": cfg.get("conv_kernel", 4),
        "expand": expand,
        "headdim": head,
        "ngroups": groups,
        "bias": bool(cfg.get("use_bias", False)),
        "conv_bias": bool(cfg.get("use_conv_bias", True)),
        "norm_before_gate": False,
        "dt_min_clamp": float(cfg.get("time_step_min", 0.001)),
        "dt_max_clamp": None,
        "layer_types": kinds,
        "ffn_types": ("none",) * n_layer,
    }
    if "attention" in kinds:
        if cfg.get("attention_bias", False):
            raise _refuse("attention_bias", "transformers builds NemotronH's attention without biases")
        if cfg.get("sliding_window") is not None:
            raise _refuse("sliding_window", f"{cfg['sliding_window']!r}: sliding-window attention is not supported")
        n_heads = cfg.get("num_attention_heads", 32)
        head_dim = cfg.get("head_dim", 128) or d_model // n_heads
        fields.update(
            n_q_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads, attn_head_dim=head_dim,
            attention_bias=False, position_embedding="nope", attention_multiplier=float(head_dim) ** -0.5,
            max_positions=cfg.get("max_position_embeddings", 4096),
        )
    if "mlp" in kinds or "moe" in kinds:  # the MLP layers, the experts and the shared expert
        fields.update(
            mlp_gated=False, mlp_bias=bool(cfg.get("mlp_bias", False)),
            mlp_activation=_activation(cfg, "mlp_hidden_act", "relu2", {"relu2": "relu2", "silu": "silu",
                                                                         "swish": "silu"}),
        )
    if "mlp" in kinds:
        fields["mlp_intermediate_size"] = cfg.get("intermediate_size", 21504)
    if "moe" in kinds:
        fields.update(_moe_fields(cfg))
    check_understood(cfg, _UNDERSTOOD, _INERT, ARCH)
    return fields


def nemotron_h_tensors(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A checkpoint's tensors under our names (`scan._lm`): views, no copy.

    transformers saves them under `backbone.` (the hub's layout; in memory they are `model.`):
    `embeddings`, `layers.{i}.norm`, `layers.{i}.mixer.*`, `norm_f` are already ours but for the MLP
    layers' `up_proj` / `down_proj` (our `input_linear` / `output_linear`) and the MoE layers'
    names (`_MOE_NAMES`); their experts come one per expert (`experts.{e}.up_proj.weight`, as
    `save_pretrained` writes them) or stacked ((E, out, in) `experts.up_proj`, transformers' layout
    in memory), split here. `mtp.*` is dropped.
    """
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        if name.startswith("mtp."):
            continue
        new = name
        if new.startswith("model."):
            new = "backbone." + new[len("model."):]
        if new == "backbone.embeddings.weight":
            new = "backbone.embedding.weight"
        if new.startswith("backbone.layers."):
            index, _, rest = new[len("backbone.layers."):].partition(".")
            if index.isdigit() and int(index) < cfg.n_layer and cfg.kinds[int(index)] == "mlp":
                for theirs, ours in (("mixer.up_proj.", "mixer.input_linear."),
                                     ("mixer.down_proj.", "mixer.output_linear.")):
                    if rest.startswith(theirs):
                        rest = ours + rest[len(theirs):]
                new = f"backbone.layers.{index}.{rest}"
            elif index.isdigit() and int(index) < cfg.n_layer and cfg.kinds[int(index)] == "moe":
                stacked = _STACKED.get(rest)
                if stacked is not None and t.dim() == 3:
                    for e in range(t.shape[0]):
                        out[f"backbone.layers.{index}.mixer.experts.{e}.{stacked}.weight"] = t[e]
                    continue
                new = f"backbone.layers.{index}.{_moe_name(rest)}"
        out[new] = t
    return out


#: an MoE layer's names (after `mixer.`) -> ours (`scan._layers.Experts`)
_MOE_NAMES = (("gate.weight", "router.weight"), ("gate.e_score_correction_bias", "correction_bias"),
              ("shared_experts.up_proj.", "shared.input_linear."),
              ("shared_experts.down_proj.", "shared.output_linear."),
              ("fc1_latent_proj.", "latent_in."), ("fc2_latent_proj.", "latent_out."))
#: stacked experts (E, out, in) -> each expert's matrix
_STACKED = {"mixer.experts.up_proj": "input_linear", "mixer.experts.down_proj": "output_linear"}


def _moe_name(rest: str) -> str:
    """`mixer.<theirs>` within an MoE layer under our name (unknown names kept, for the shape check
    to refuse)."""
    if not rest.startswith("mixer."):
        return rest
    inner = rest[len("mixer."):]
    for theirs, ours in _MOE_NAMES:
        if inner == theirs or (theirs.endswith(".") and inner.startswith(theirs)):
            return "mixer." + ours + inner[len(theirs):]
    expert, _, tail = inner.removeprefix("experts.").partition(".")
    if inner.startswith("experts.") and expert.isdigit():
        for theirs, ours in (("up_proj.", "input_linear."), ("down_proj.", "output_linear.")):
            if tail.startswith(theirs):
                return f"mixer.experts.{expert}.{ours}{tail[len(theirs):]}"
    return rest

"""What every Hugging Face architecture's parser shares: the typed refusal naming the field, the
check that every field of config.json was understood, the default rope's fields, the Mamba-2 head
count and size, and the renaming (and joining) of a checkpoint's tensors."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from mamba_stream.scan._errors import ConfigError

__all__ = ["COMMON_INERT", "ROPE_KEYS", "STACKED_EXPERTS", "TOP", "base_fields", "check_default_rope",
           "check_full_rotation", "check_understood", "default_rope", "is_inf", "join_gate_up", "mamba2_headdim",
           "positive_int", "refuse", "rename_layers", "rope_theta", "silu_activation", "split_experts",
           "time_step_limit"]

Tensor = torch.Tensor

#: config.json fields of every transformers model that change no inference arithmetic (training,
#: generation, bookkeeping): accepted as they are
COMMON_INERT = frozenset({
    "architectures", "attention_dropout", "bos_token_id", "dtype", "torch_dtype", "eos_token_id", "pad_token_id",
    "initializer_range", "model_type", "output_router_logits", "router_aux_loss_coef", "transformers_version",
    "use_cache", "return_dict", "output_hidden_states", "output_attentions", "tie_encoder_decoder", "is_decoder",
    "_name_or_path", "problem_type", "chunk_size_feed_forward", "num_logits_to_keep", "use_mamba_kernels",
})


def refuse(arch: str, field: str, msg: str) -> ConfigError:
    """The typed refusal of config.json's `field`, naming the architecture (`functools.partial` it
    with the architecture's name for a parser's own `_refuse`)."""
    return ConfigError(f"{msg} ({arch})", field=field)


def is_inf(v: Any) -> bool:
    """Whether a config value means +infinity: a float, the strings "inf"/"Infinity", or
    transformers 5.x's `{"__float__": "Infinity"}`."""
    if isinstance(v, dict) and v.get("__float__") in ("Infinity", "inf"):
        return True
    if isinstance(v, str):
        return v.lower() in ("inf", "infinity")
    return isinstance(v, float) and math.isinf(v) and v > 0


def time_step_limit(value: Any) -> dict[str, float | None]:
    """`time_step_limit` (lo, hi) as the config's dt clamps (hi +infinity: no upper clamp)."""
    lo, hi = value or (0.0, float("inf"))
    return {"dt_min_clamp": float(lo), "dt_max_clamp": None if is_inf(hi) else float(hi)}


def check_understood(cfg: Mapping[str, Any], understood: Iterable[str], inert: Iterable[str], arch: str) -> None:
    """Refuse, naming it, the first field (in sorted order) that is neither mapped nor inert."""
    for key in sorted(set(cfg) - set(understood) - set(inert) - COMMON_INERT):
        raise refuse(arch, key, f"a field this loader cannot map (value {cfg[key]!r})")


def base_fields(architecture: str, d_model: int, n_layer: int, vocab_size: int) -> dict[str, Any]:
    """The first `ModelConfig.create` fields of every architecture here: the mixer family, the
    widths, and the vocabulary as the checkpoint holds it (transformers pads none)."""
    return {"architecture": architecture, "d_model": d_model, "n_layer": n_layer, "vocab_size": vocab_size,
            "pad_vocab_size_multiple": 1}


def positive_int(arch: str, cfg: Mapping[str, Any], field: str, default: Any) -> int:
    """An integer field of at least 1 (a bool is not one); `functools.partial` it with the
    architecture's name as `refuse`."""
    value = cfg.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise refuse(arch, field, f"{value!r}: expected a positive integer")
    return value


def silu_activation(cfg: Mapping[str, Any], arch: str) -> None:
    """`hidden_act` (default silu) must be SiLU ("silu" or its alias "swish")."""
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise refuse(arch, "hidden_act", f"activation {cfg['hidden_act']!r} is not supported")


#: the keys of `rope_parameters` a default rope reads
ROPE_KEYS = frozenset({"rope_type", "rope_theta", "partial_rotary_factor"})


def check_default_rope(rope: Mapping[str, Any], arch: str) -> None:
    """`rope_parameters.rope_type` must be "default" (its default)."""
    if rope.get("rope_type", "default") != "default":
        raise refuse(arch, "rope_parameters.rope_type", f"{rope.get('rope_type')!r}: only 'default' rope is supported")


def check_full_rotation(rope: Mapping[str, Any], arch: str, msg: str = "only a full rotation is supported") -> None:
    """`rope_parameters.partial_rotary_factor` must be 1.0 (its default): the whole head rotated."""
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse(arch, "rope_parameters.partial_rotary_factor", msg)


def rope_theta(cfg: Mapping[str, Any], rope: Mapping[str, Any]) -> float:
    """theta from `rope_parameters` (transformers 5.x), else the older top-level `rope_theta`, else 10000."""
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def default_rope(cfg: Mapping[str, Any], arch: str, full_rotation: str | None) -> tuple[Mapping[str, Any], float]:
    """`rope_parameters` of an unscaled ("default") rope, checked, and its theta (`rope_theta`): a
    `rope_scaling`, a `rope_parameters` that is not a mapping, another rope type or a key it does
    not read are refused, named. `full_rotation`: the refusal's message for a partial factor other
    than 1.0 (checked before the unknown keys); None where the architecture rotates part of a head:
    the factor is then left to the caller (checked after them)."""
    if cfg.get("rope_scaling") is not None:
        raise refuse(arch, "rope_scaling", f"{cfg['rope_scaling']!r}: only unscaled ('default') rope is supported")
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise refuse(arch, "rope_parameters", f"{rope!r}: expected a mapping")
    check_default_rope(rope, arch)
    if full_rotation is not None:
        check_full_rotation(rope, arch, full_rotation)
    for key in sorted(set(rope) - ROPE_KEYS):
        raise refuse(arch, f"rope_parameters.{key}", f"a rope parameter this loader cannot map ({rope[key]!r})")
    return rope, rope_theta(cfg, rope)


def mamba2_headdim(cfg: Mapping[str, Any], arch: str, width: int, width_name: str, typed: bool = False) -> int:
    """The Mamba-2's head size: `mamba_n_heads` heads of `mamba_d_head` ("auto": width / heads) must
    tile its `width` (named `width_name` in the refusal). `typed`: a head count that is not a
    positive integer, or a head size that is neither an integer nor "auto", is refused, named
    (otherwise it fails in the arithmetic)."""
    heads = cfg.get("mamba_n_heads", 128)
    head = cfg.get("mamba_d_head", "auto")
    if typed and (not isinstance(heads, int) or isinstance(heads, bool) or heads < 1):
        raise refuse(arch, "mamba_n_heads", f"{heads!r}: expected a positive count of heads")
    head = width // heads if head == "auto" else head
    if typed and (not isinstance(head, int) or isinstance(head, bool)):
        raise refuse(arch, "mamba_d_head", f"{head!r}: expected a head size or 'auto'")
    if heads * head != width:
        raise refuse(arch, "mamba_n_heads", f"mamba_n_heads={heads} * mamba_d_head={head} != {width_name}={width}")
    return head


#: the embedding's and the final norm's names (`model.final_layernorm`) -> ours
TOP = {"model.embed_tokens.weight": "backbone.embedding.weight",
       "model.final_layernorm.weight": "backbone.norm_f.weight"}


def rename_layers(sd: Mapping[str, Tensor], layer_names: Iterable[tuple[str, str]],
                  top: Mapping[str, str]) -> dict[str, Tensor]:
    """Their tensors under our names (`scan._lm`): `top` maps whole names (the embedding, the final
    norm; a q8 pair's `<name>_q8` / `<name>_scale` as its `<name>`), `layer_names` the prefixes
    within `model.layers.{i}.` (first match wins); any other name is kept as it is, for the shape
    check to refuse."""
    pairs = tuple(layer_names)
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        stem, suffix = name, ""
        for q8 in ("_q8", "_scale"):
            if name.endswith(q8) and name[: -len(q8)] in top:
                stem, suffix = name[: -len(q8)], q8
        new = top[stem] + suffix if stem in top else name
        if name.startswith("model.layers."):
            index, _, rest = name[len("model.layers."):].partition(".")
            for theirs, ours in pairs:
                if rest.startswith(theirs):
                    new = f"backbone.layers.{index}.{ours}{rest[len(theirs):]}"
                    break
        out[new] = t
    return out


#: transformers' names of stacked expert weights -> ours: its in-memory layout (5.x:
#: `experts.gate_up_proj` (E, 2I, D), `experts.down_proj` (E, D, I)), and the hub's, which
#: `save_pretrained` writes (GraniteMoe: `input_linear.weight` (E, 2I, D), `output_linear.weight`
#: (E, D, I))
STACKED_EXPERTS = (("experts.gate_up_proj", "input_linear"), ("experts.down_proj", "output_linear"),
                   ("input_linear.weight", "input_linear"), ("output_linear.weight", "output_linear"))


def split_experts(sd: Mapping[str, Tensor], is_moe: Callable[[str], bool],
                  stacked: Iterable[tuple[str, str]] = STACKED_EXPERTS) -> dict[str, Tensor]:
    """Stacked experts (a 3-d tensor `<p><theirs>`, one (out, in) matrix per expert) as one gated MLP
    per expert (`<p>experts.{e}.<ours>.weight`): views, no copy. `is_moe(name)` says which names are
    an expert block's (so a 2-d `input_linear.weight` of a plain MLP is left alone)."""
    pairs = tuple(stacked)
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        for theirs, ours in pairs:
            if is_moe(name) and name.endswith(theirs) and t.dim() == 3:
                stem = name[: -len(theirs)]
                for e in range(t.shape[0]):
                    out[f"{stem}experts.{e}.{ours}.weight"] = t[e]
                break
        else:
            out[name] = t
    return out


def join_gate_up(out: dict[str, Tensor], same_dtype: bool) -> dict[str, Tensor]:
    """Each MLP's gate_proj (I, D) and up_proj (I, D) (and their biases), under our names
    (`.mlp.gate_proj.` / `.mlp.up_proj.`), stacked in `out` as input_linear (2I, D), gate rows first
    (`scan._layers.MLP` chunks [gate; up]): a copy. A layer holding only one of the two (or, where
    `same_dtype`, two of different dtypes) keeps them under their own names, for the shape check to
    refuse. Returns `out`."""
    for name in [n for n in out if ".mlp.gate_proj." in n]:
        up_name = name.replace(".mlp.gate_proj.", ".mlp.up_proj.")
        if up_name in out and (not same_dtype or out[name].dtype == out[up_name].dtype):
            joined = torch.cat([out.pop(name), out.pop(up_name)], dim=0)
            out[name.replace(".mlp.gate_proj.", ".mlp.input_linear.")] = joined
    return out

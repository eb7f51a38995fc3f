"""Model configuration shared by the three architectures and the hybrids built of them.

One flat, frozen record; the model is built from it alone. Fields that only one architecture
reads are ignored by the others but still validated, so a config never means two things.

A hybrid (GraniteMoeHybrid) is a list of typed layers: `layer_types` names each layer's kind,
`architecture` or "attention"; its attention, MLP and multiplier fields are None on a plain Mamba
model and left out of its JSON (`model_dump`), so existing configs dump as they always did.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cached_property
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from mamba_stream.scan._errors import ConfigError

__all__ = ["HYBRID_FIELDS", "LAYER_KINDS", "ModelConfig"]

#: the kinds a layer of a model can be (`ModelConfig.layer_types`)
LAYER_KINDS = ("mamba1", "mamba2", "mamba3", "attention")
#: the optional fields of a hybrid model: None (unset) on a plain Mamba model, left out of its JSON
HYBRID_FIELDS = ("layer_types", "n_q_heads", "n_kv_heads", "attn_head_dim", "attention_bias", "position_embedding",
                 "rope_theta", "mlp_intermediate_size", "mlp_activation", "embedding_multiplier",
                 "residual_multiplier", "attention_multiplier", "logits_scaling", "max_positions")

_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "mamba1": {"d_state": 16, "d_conv": 4},
    "mamba2": {"d_state": 128, "d_conv": 4, "headdim": 64},
    "mamba3": {"d_state": 128, "d_conv": 0, "headdim": 64},
}


class ModelConfig(BaseModel):
    """Everything needed to build a Mamba language model with explicit state."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: Literal["mamba1", "mamba2", "mamba3"]
    d_model: int
    n_layer: int
    vocab_size: int  # before padding to pad_vocab_size_multiple
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
    rms_norm: bool = True  # False: LayerNorm (with bias), as mamba-ssm allows
    norm_eps: float = 1e-5
    # Kept so that checkpoints round-trip; the engine computes in float32 or float64, where the
    # residual stream is already at least float32, so it changes no arithmetic today.
    residual_in_fp32: bool = True

    d_state: int = 0  # filled with the architecture's default by `create`
    d_conv: int = 0  # filled with the architecture's default by `create`
    expand: float = 2
    bias: bool = False  # in_proj / out_proj bias
    conv_bias: bool = True
    # Mamba-1
    dt_rank: int | None = None  # None: ceil(d_model / 16)
    # FalconMamba: an RMS norm without a learned weight, with this eps, over each of dt (its
    # dt_rank inputs, before dt_proj), B and C (each over d_state) after x_proj splits them; the
    # scan then reads other inputs than a plain Mamba-1's, so the state schema records it.
    # None: no such norms (Mamba-1 as mamba-ssm has it).
    bcdt_rms_eps: float | None = None
    # Mamba-2 / Mamba-3
    headdim: int = 0  # filled with the architecture's default by `create`
    ngroups: int = 1
    chunk_size: int = 64  # block length of the chunked backend; no effect on results' meaning
    # Mamba-2
    d_ssm: int | None = None  # None: d_inner (no gated-MLP part)
    D_has_hdim: bool = False
    rmsnorm: bool = True  # gated RMSNorm before out_proj
    norm_before_gate: bool = False
    mixer_norm_eps: float = 1e-5
    dt_min_clamp: float = 0.0
    dt_max_clamp: float | None = None
    # Mamba-3
    rope_fraction: float = 0.5
    A_floor: float = 1e-4
    is_outproj_norm: bool = False
    mimo_rank: int = 1  # 1: SISO
    # --- hybrids (GraniteMoeHybrid); every field None on a plain Mamba model ------------------
    # each layer's kind: `architecture` (its Mamba layers) or "attention"; None: all `architecture`
    layer_types: tuple[Literal["mamba1", "mamba2", "mamba3", "attention"], ...] | None = None
    # grouped-query attention: n_q_heads query heads share n_kv_heads key/value heads of
    # attn_head_dim features (named apart from `headdim`, the Mamba-2/3 heads' size)
    n_q_heads: int | None = None
    n_kv_heads: int | None = None
    attn_head_dim: int | None = None
    attention_bias: bool | None = None  # q/k/v/o projections with a bias
    position_embedding: Literal["nope", "rope"] | None = None
    rope_theta: float | None = None
    # a gated MLP sublayer after every layer's mixer, with its own RMS norm:
    # out = W_out(act(gate) * up), [gate, up] = W_in x
    mlp_intermediate_size: int | None = None
    mlp_activation: Literal["silu"] | None = None
    # Granite's scalars: embeddings * embedding_multiplier; every sublayer's output *
    # residual_multiplier before it joins the residual stream; attention scores * attention_multiplier
    # (the softmax scale); logits / logits_scaling. None: no such operation at all
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    attention_multiplier: float | None = None
    logits_scaling: float | None = None
    # the per-stream bound on positions where a model has attention: its KV is preallocated at
    # this many rows, and a chunk that would pass it is refused (`scan.PositionLimit`)
    max_positions: int | None = None

    @classmethod
    def create(cls, **fields: Any) -> ModelConfig:
        """Build and validate a config; every problem becomes a `ConfigError` naming its field."""
        arch = fields.get("architecture")
        if arch not in _ARCH_DEFAULTS:
            raise ConfigError(
                f"unsupported architecture {arch!r}; expected one of {sorted(_ARCH_DEFAULTS)}",
                field="architecture",
            )
        for key, value in _ARCH_DEFAULTS[arch].items():
            if fields.get(key) is None:
                fields[key] = value
        try:
            cfg = cls(**fields)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "config"
            raise ConfigError(err["msg"], field=loc) from None
        cfg._check()
        return cfg

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        """The fields; a hybrid field that is unset (None) is left out, so a plain Mamba model's
        dump (and whatever is derived from it) is what it was before hybrids."""
        out = super().model_dump(**kwargs)
        for name in HYBRID_FIELDS:
            if out.get(name, 0) is None:
                out.pop(name)
        return out

    @cached_property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind: `layer_types`, or `architecture` for every layer."""
        return self.layer_types if self.layer_types is not None else (self.architecture,) * self.n_layer

    @cached_property
    def is_hybrid(self) -> bool:
        """Whether the model has anything besides Mamba blocks (attention, an MLP, a multiplier)."""
        return "attention" in self.kinds or self.mlp_intermediate_size is not None or any(
            getattr(self, m) is not None for m in ("embedding_multiplier", "residual_multiplier", "logits_scaling"))

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy; one with `update` derives its sizes afresh (pydantic copies the cached ones)."""
        out = super().model_copy(update=update, deep=deep)
        if update:
            for name, value in vars(ModelConfig).items():
                if isinstance(value, cached_property):
                    out.__dict__.pop(name, None)
        return out

    # --- derived sizes -------------------------------------------------------------------
    # cached: the config is frozen, and a step reads them many times (16 calls a 1-token chunk)

    @cached_property
    def d_inner(self) -> int:
        return int(self.expand * self.d_model)

    @cached_property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return self.vocab_size + (-self.vocab_size) % m if m > 1 else self.vocab_size

    @cached_property
    def resolved_dt_rank(self) -> int:
        return self.dt_rank if self.dt_rank is not None else math.ceil(self.d_model / 16)

    @cached_property
    def resolved_d_ssm(self) -> int:
        return self.d_inner if self.d_ssm is None else self.d_ssm

    @cached_property
    def nheads(self) -> int:
        if self.architecture == "mamba2":
            return self.resolved_d_ssm // self.headdim
        if self.architecture == "mamba3":
            return self.d_inner // self.headdim
        return 0

    @cached_property
    def conv_dim(self) -> int:
        if self.architecture == "mamba1":
            return self.d_inner
        if self.architecture == "mamba2":
            return self.resolved_d_ssm + 2 * self.ngroups * self.d_state
        return 0

    @cached_property
    def n_angles(self) -> int:
        if self.architecture != "mamba3":
            return 0
        split = int(self.d_state * self.rope_fraction)
        return (split - split % 2) // 2

    # --- validation ------------------------------------------------------------------------

    def _check(self) -> None:
        def need(cond: bool, field: str, msg: str) -> None:
            if not cond:
                raise ConfigError(msg, field=field)

        need(self.d_model > 0, "d_model", f"must be positive, got {self.d_model}")
        need(self.n_layer > 0, "n_layer", f"must be positive, got {self.n_layer}")
        need(self.vocab_size > 0, "vocab_size", f"must be positive, got {self.vocab_size}")
        need(self.pad_vocab_size_multiple >= 1, "pad_vocab_size_multiple", "must be >= 1")
        need(self.d_state > 0, "d_state", f"must be positive, got {self.d_state}")
        need(self.norm_eps > 0, "norm_eps", "must be positive")
        need(
            float(self.expand * self.d_model).is_integer() and self.d_inner > 0,
            "expand",
            f"expand * d_model must be a positive integer, got {self.expand} * {self.d_model}",
        )
        need(self.chunk_size >= 1, "chunk_size", "must be >= 1")
        arch = self.architecture
        if arch in ("mamba1", "mamba2"):
            need(self.d_conv >= 2, "d_conv", f"must be >= 2 for {arch}, got {self.d_conv}")
        if arch == "mamba1":
            need(self.resolved_dt_rank > 0, "dt_rank", "must be positive")
        if self.bcdt_rms_eps is not None:
            need(arch == "mamba1", "bcdt_rms_eps", f"the dt/B/C RMS norms are a Mamba-1 option, not {arch}'s")
            need(math.isfinite(self.bcdt_rms_eps) and self.bcdt_rms_eps > 0, "bcdt_rms_eps",
                 f"must be positive and finite, got {self.bcdt_rms_eps}")
        if arch == "mamba2":
            d_ssm = self.resolved_d_ssm
            need(0 < d_ssm <= self.d_inner, "d_ssm", f"must be in (0, d_inner={self.d_inner}]")
            need(self.headdim > 0 and d_ssm % self.headdim == 0, "headdim",
                 f"d_ssm={d_ssm} is not a multiple of headdim={self.headdim}")
            need(self.ngroups >= 1 and self.nheads % self.ngroups == 0, "ngroups",
                 f"nheads={self.nheads} is not a multiple of ngroups={self.ngroups}")
            need(d_ssm % self.ngroups == 0, "ngroups", "d_ssm must be a multiple of ngroups")
            need(self.dt_min_clamp >= 0, "dt_min_clamp", "must be >= 0")
            if self.dt_max_clamp is not None:
                need(self.dt_max_clamp > self.dt_min_clamp, "dt_max_clamp", "must exceed dt_min_clamp")
        self._check_hybrid(need)
        if arch == "mamba3":
            need(self.d_conv == 0, "d_conv", "Mamba-3 has no conv; d_conv must be 0")
            need(self.headdim > 0 and self.d_inner % self.headdim == 0, "headdim",
                 f"d_inner={self.d_inner} is not a multiple of headdim={self.headdim}")
            need(self.ngroups >= 1 and self.nheads % self.ngroups == 0, "ngroups",
                 f"nheads={self.nheads} is not a multiple of ngroups={self.ngroups}")
            need(self.rope_fraction in (0.5, 1.0), "rope_fraction",
                 f"must be 0.5 or 1.0, got {self.rope_fraction}")
            need(self.n_angles > 0, "rope_fraction", "d_state * rope_fraction gives no angle")
            need(self.A_floor > 0, "A_floor", "must be positive")
            need(self.mimo_rank >= 1, "mimo_rank", "must be >= 1")
            need(not self.bias, "bias", "Mamba-3 projections have no bias")
            if self.mimo_rank > 1:
                need(self.d_state % 2 == 0, "d_state", "MIMO rotary needs an even d_state")

    def _check_hybrid(self, need: Any) -> None:
        """The hybrid fields: consistent with each other and with the layers that read them."""
        arch = self.architecture
        if self.layer_types is not None:
            need(len(self.layer_types) == self.n_layer, "layer_types",
                 f"{len(self.layer_types)} layer kinds for n_layer={self.n_layer}")
            need(all(k in (arch, "attention") for k in self.layer_types), "layer_types",
                 f"a {arch} model's layers are {arch} or attention: got {sorted(set(self.layer_types))}")
        has_attention = "attention" in self.kinds
        attention_fields = ("n_q_heads", "n_kv_heads", "attn_head_dim", "attention_bias", "position_embedding",
                            "attention_multiplier", "max_positions")
        for name in attention_fields:
            if has_attention:
                need(getattr(self, name) is not None, name, "required by the attention layers")
            else:
                need(getattr(self, name) is None, name, "set, but no layer is an attention layer")
        if has_attention:
            assert self.n_q_heads is not None and self.n_kv_heads is not None and self.attn_head_dim is not None
            assert self.max_positions is not None
            need(self.n_kv_heads > 0, "n_kv_heads", f"must be positive, got {self.n_kv_heads}")
            need(self.n_q_heads > 0 and self.n_q_heads % self.n_kv_heads == 0, "n_q_heads",
                 f"{self.n_q_heads} query heads cannot share {self.n_kv_heads} key/value heads")
            need(self.attn_head_dim > 0, "attn_head_dim", f"must be positive, got {self.attn_head_dim}")
            need(self.max_positions >= 1, "max_positions", f"must be >= 1, got {self.max_positions}")
            rope = self.position_embedding == "rope"
            need((self.rope_theta is not None) == rope, "rope_theta",
                 "set exactly when position_embedding is 'rope'")
            if rope:
                assert self.rope_theta is not None
                need(self.rope_theta > 1.0 and math.isfinite(self.rope_theta), "rope_theta",
                     f"must be finite and above 1, got {self.rope_theta}")
                need(self.attn_head_dim % 2 == 0, "attn_head_dim", "rope rotates pairs: must be even")
        else:
            need(self.rope_theta is None, "rope_theta", "set, but no layer is an attention layer")
        need((self.mlp_intermediate_size is None) == (self.mlp_activation is None), "mlp_activation",
             "set exactly when mlp_intermediate_size is")
        if self.mlp_intermediate_size is not None:
            need(self.mlp_intermediate_size > 0, "mlp_intermediate_size",
                 f"must be positive, got {self.mlp_intermediate_size}")
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if value is not None:
                need(math.isfinite(value) and value != 0.0, name, f"must be finite and non-zero, got {value}")
        if self.layer_types is not None or self.mlp_intermediate_size is not None:
            need(self.rms_norm, "rms_norm", "a hybrid's norms are RMS norms")

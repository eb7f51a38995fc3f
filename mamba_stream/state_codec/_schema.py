"""The state schema: everything needed to interpret a stream's state bytes.

Only the standard library and pydantic are imported here, so the module is safe inside the
Temporal workflow sandbox. Shapes are per stream (no batch dimension).

Dimension letters used in tensor specs:
    C   channels of the causal conv (Mamba-1: d_inner; Mamba-2: d_ssm + 2 * ngroups * d_state)
    W   conv window, d_conv
    H   SSM heads, nheads
    P   head dimension, headdim
    N   SSM state size, d_state
    R   MIMO rank (1 for SISO)
    S   rotary angles, n_angles
    M   max_positions (a hybrid's attention layers: the KV rows a stream owns)
    Hkv key/value heads, Dh their head dimension
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from functools import cached_property
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

__all__ = [
    "SCHEMA_VERSION",
    "Discretization",
    "HybridLayers",
    "StateSchema",
    "TensorSpec",
]

#: Bumped whenever the meaning of any schema field changes.
SCHEMA_VERSION = 1

Architecture = Literal["mamba1", "mamba2", "mamba3"]
DType = Literal["float32", "float64", "bfloat16", "float16"]
WeightFormat = Literal["float32", "float64", "bfloat16", "float16", "q8"]


def without_unset_weights(out: dict) -> dict:
    """A dump without its `weights` field when that is None: models from before the field (a
    schema's fingerprint, a receipt an older worker reads) keep their JSON."""
    if out.get("weights") is None:
        out.pop("weights", None)
    return out


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy; one with `update` computes its cached values afresh (pydantic copies them as they
        were, which would give a changed schema its original's fingerprint)."""
        out = super().model_copy(update=update, deep=deep)
        if update:
            for cls in type(self).__mro__:
                for name, value in vars(cls).items():
                    if isinstance(value, cached_property):
                        out.__dict__.pop(name, None)
        return out


class TensorSpec(_Frozen):
    """One state tensor of one layer, per stream.

    A tensor whose `rows` is "position" (an attention layer's k and v) grows with the stream: at
    position p it holds p rows, `shape[1:]` each, row i the key (value) of the token at position i;
    `shape[0]` is the bound (max_positions) its rows never pass. Its bytes at rest and in a State
    are those p rows (`shape_at`), never the bound's."""

    name: str = Field(description="key in State.tensors, e.g. 'layers.0.ssm'")
    layer: int = Field(ge=0)
    role: Literal["conv", "ssm", "angle", "k", "v"]
    shape: tuple[int, ...]
    dtype: DType
    rows: Literal["position"] | None = Field(
        default=None, description="'position': the leading dimension is the stream's position, up to shape[0] "
        "(None, left out of the JSON: the tensor is `shape` whatever the position)")

    @model_serializer(mode="wrap")
    def _without_fixed_rows(self, handler: SerializerFunctionWrapHandler) -> dict:
        out = handler(self)
        if out.get("rows", 0) is None:
            out.pop("rows")
        return out

    def shape_at(self, position: int) -> tuple[int, ...]:
        """The tensor's shape in a state at `position`."""
        return (position, *self.shape[1:]) if self.rows == "position" else self.shape

    # cached: a spec is frozen, and every seal and open reads them
    @cached_property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @cached_property
    def nbytes(self) -> int:
        return self.numel * _DTYPE_BYTES[self.dtype]


_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


class Discretization(_Frozen):
    """How continuous parameters become the recurrence that updates the state.

    Two models whose states have the same shapes but differ here are different recurrences, and
    a state from one is meaningless under the other.
    """

    a_activation: Literal["neg_exp_log", "neg_softplus_clamped"] = Field(
        description="A = -exp(A_log) (Mamba-1/2) or A = min(-softplus(a_t), -a_floor) (Mamba-3)"
    )
    a_floor: float | None = None
    dt_activation: Literal["softplus_bias"] = "softplus_bias"
    dt_min: float = Field(default=0.0, description="lower clamp applied to dt after softplus")
    dt_max: float | None = Field(default=None, description="upper clamp, None for unbounded")
    rule: Literal["zoh_euler", "exp_trapezoidal"] = Field(
        description="zoh_euler: h = exp(dt*A) h + dt B x (Mamba-1/2); exp_trapezoidal: "
        "h = a h + (1-l) dt a k_prev v_prev + l dt k v with l = sigmoid(trap) (Mamba-3)"
    )
    rope: Literal["none", "pairwise", "halved"] = "none"
    angle_wrap: Literal["none", "mod_2pi"] = "none"
    bcdt_rms_eps: float | None = Field(
        default=None, description="FalconMamba: dt's inputs, B and C each divided by their root mean square "
        "(eps added to the mean square) before they enter the recurrence; None: no such norms (None is left "
        "out of the JSON, so schemas from before the field keep their fingerprints)")
    bcdt_norm_weights: bool | None = Field(
        default=None, description="Jamba: those norms each multiplied by a learned weight (the weights' values "
        "are in the revision); None: weightless or no norms (left out of the JSON, as bcdt_rms_eps is)")

    @model_serializer(mode="wrap")
    def _without_unset_norms(self, handler: SerializerFunctionWrapHandler) -> dict:
        out = handler(self)
        for name in ("bcdt_rms_eps", "bcdt_norm_weights"):
            if out.get(name) is None:
                out.pop(name, None)
        return out


class HybridLayers(_Frozen):
    """What a hybrid model (Mamba layers among attention and MLP layers, MLP or expert sublayers,
    Granite's multipliers) computes beyond its Mamba layers: none of it is in the weights' revision,
    and a state made under other values is another function's. The fields are the model config's
    hybrid fields under the same names (`kinds` its `layer_types`, `ffns` its `ffn_types`, both
    resolved for every layer). The KV tensors themselves are `tensors` with roles "k" and "v",
    (M, Hkv, Dh) each: row p the key (value) of position p, rows at or past the stream's position
    zero; an "mlp" or "moe" layer holds no state."""

    kinds: tuple[Literal["mamba1", "mamba2", "mamba3", "attention", "mlp", "parallel", "moe", "shared"], ...] = Field(
        description="each layer's kind, in layer order")
    ffns: tuple[Literal["none", "mlp", "moe"], ...] | None = Field(
        default=None, description="what follows each layer's mixer (None: nothing, on every layer)")
    n_q_heads: int | None = None
    n_kv_heads: int | None = None
    attn_head_dim: int | None = None
    attention_bias: bool | None = None
    position_embedding: Literal["nope", "rope"] | None = None
    rope_theta: float | None = None
    rotary_dim: int | None = None
    max_positions: int | None = Field(default=None, description="the KV rows a stream owns: the per-stream bound")
    kv_segment_rows: int | None = Field(
        default=None, gt=0, description="R: the KV rows of one segment at rest (rows jR..(j+1)R-1 of every "
        "growing tensor, sealed once and shared; `state_codec.codec` module docstring); set with max_positions")
    mlp_intermediate_size: int | None = None
    mlp_activation: Literal["silu", "relu2", "gelu"] | None = None
    mlp_gated: bool | None = None
    mlp_bias: bool | None = None
    moe_experts: int | None = None
    moe_top_k: int | None = None
    moe_intermediate_size: int | None = None
    moe_router: Literal["topk_softmax", "softmax_topk", "sigmoid_group_topk"] | None = None
    moe_shared_mlp: bool | None = None
    # Nemotron-H's routing (`scan.ModelConfig`): its correction bias is a tensor of the checkpoint
    moe_groups: int | None = None
    moe_topk_groups: int | None = None
    moe_norm_topk: bool | None = None
    moe_scaling: float | None = None
    moe_shared_intermediate_size: int | None = None
    moe_latent_size: int | None = None
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    attention_multiplier: float | None = None
    logits_scaling: float | None = None
    # Falcon-H1's (`scan.ModelConfig`): config values, not tensors of the checkpoint (transformers
    # derives its mup_vector from ssm_multipliers and saves none of them)
    ssm_in_multiplier: float | None = None
    ssm_multipliers: tuple[float, float, float, float, float] | None = None
    ssm_out_multiplier: float | None = None
    attention_in_multiplier: float | None = None
    attention_out_multiplier: float | None = None
    key_multiplier: float | None = None
    mlp_gate_multiplier: float | None = None
    mlp_down_multiplier: float | None = None
    logits_multiplier: float | None = None
    # Zamba2's (`scan.ModelConfig`): how many weight-shared transformer blocks the "shared" layers
    # call in rotation, their per-site adapters' rank, and whether q/k/v have adapters too
    shared_blocks: int | None = None
    shared_adapter_rank: int | None = None
    shared_attention_adapter: bool | None = None

    @model_serializer(mode="wrap")
    def _without_unset(self, handler: SerializerFunctionWrapHandler) -> dict:
        # an unset field is left out: a field added later leaves the fingerprints of the schemas
        # that do not use it as they were
        return {k: v for k, v in handler(self).items() if v is not None}


class StateSchema(_Frozen):
    """The layout and semantics of one model's per-stream recurrent state."""

    schema_version: int = SCHEMA_VERSION
    architecture: Architecture
    dtype: DType = Field(description="dtype of the model's computation (and of its weights unless `weights`)")
    weights: WeightFormat | None = Field(
        default=None, description="the format the model's matrices are read in, where it is not `dtype`: the "
        "same checkpoint read in another format is another function (None is left out of the JSON, so schemas "
        "from before the field keep their fingerprints)")
    d_model: int = Field(gt=0)
    n_layer: int = Field(gt=0)
    d_state: int = Field(gt=0)
    d_conv: int = Field(ge=0, description="0 when the architecture has no conv (Mamba-3)")
    expand: float = Field(gt=0)
    d_inner: int = Field(gt=0)
    headdim: int | None = None
    nheads: int | None = None
    ngroups: int = Field(default=1, ge=1)
    mimo_rank: int = Field(default=1, ge=1)
    rope_fraction: float | None = None
    n_angles: int = Field(default=0, ge=0)
    representation: Literal["real", "complex"] = "real"
    discretization: Discretization
    layer_order: tuple[int, ...]
    packed_layout: Literal["per-layer/v1"] = Field(
        default="per-layer/v1",
        description="one C-contiguous tensor per (layer, role), in `tensors` order; conv states "
        "hold the last d_conv conv inputs, newest in the last column",
    )
    tensors: tuple[TensorSpec, ...]
    layers: HybridLayers | None = Field(
        default=None, description="a hybrid model's layer kinds, attention, MLP and multipliers (None, left out "
        "of the JSON, for a plain Mamba model: its fingerprint is what it was)")

    @model_validator(mode="after")
    def _check_consistency(self) -> StateSchema:
        if sorted(self.layer_order) != list(range(self.n_layer)):
            raise ValueError(f"layer_order must be a permutation of range({self.n_layer})")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("tensor names must be unique")
        stateless = set() if self.layers is None else {
            i for i, k in enumerate(self.layers.kinds) if k in ("mlp", "moe")}
        if {t.layer for t in self.tensors} != set(range(self.n_layer)) - stateless:
            raise ValueError("every layer but an MLP or MoE layer must own at least one state tensor, those none")
        return self

    @model_serializer(mode="wrap")
    def _without_unset_weights(self, handler: SerializerFunctionWrapHandler) -> dict:
        out = without_unset_weights(handler(self))
        if out.get("layers", 0) is None:
            out.pop("layers")
        return out

    def canonical_json(self) -> str:
        """JSON with sorted keys and no whitespace: the input of `fingerprint`."""
        return self._canonical

    def fingerprint(self) -> str:
        """`sha256:<hex>` of the canonical JSON; equal schemas, equal fingerprints."""
        return self._fingerprint

    # computed once: a schema is frozen, and every chunk's seal writes its JSON and checks its fingerprint
    @cached_property
    def _canonical(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @cached_property
    def _fingerprint(self) -> str:
        return "sha256:" + hashlib.sha256(self._canonical.encode()).hexdigest()

    @cached_property
    def state_bytes(self) -> int:
        """Bytes of one stream's state at most: its KV (tensors with `rows` "position") at the
        bound; a plain Mamba model's, whatever its position."""
        return sum(t.nbytes for t in self.tensors)

    def bytes_at(self, position: int) -> int:
        """Bytes of one stream's state at `position`."""
        return sum(t.nbytes if t.rows is None else t.nbytes // t.shape[0] * position for t in self.tensors)

    def spec(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

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
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

__all__ = [
    "SCHEMA_VERSION",
    "Discretization",
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


class TensorSpec(_Frozen):
    """One state tensor of one layer, per stream."""

    name: str = Field(description="key in State.tensors, e.g. 'layers.0.ssm'")
    layer: int = Field(ge=0)
    role: Literal["conv", "ssm", "angle", "k", "v"]
    shape: tuple[int, ...]
    dtype: DType

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
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

    @model_validator(mode="after")
    def _check_consistency(self) -> StateSchema:
        if sorted(self.layer_order) != list(range(self.n_layer)):
            raise ValueError(f"layer_order must be a permutation of range({self.n_layer})")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("tensor names must be unique")
        if {t.layer for t in self.tensors} != set(range(self.n_layer)):
            raise ValueError("every layer must own at least one state tensor")
        return self

    @model_serializer(mode="wrap")
    def _without_unset_weights(self, handler: SerializerFunctionWrapHandler) -> dict:
        return without_unset_weights(handler(self))

    def canonical_json(self) -> str:
        """JSON with sorted keys and no whitespace: the input of `fingerprint`."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def fingerprint(self) -> str:
        """`sha256:<hex>` of the canonical JSON; equal schemas, equal fingerprints."""
        return "sha256:" + hashlib.sha256(self.canonical_json().encode()).hexdigest()

    @property
    def state_bytes(self) -> int:
        """Bytes of one stream's state, whatever its position."""
        return sum(t.nbytes for t in self.tensors)

    def spec(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

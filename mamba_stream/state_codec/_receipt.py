"""The receipt (a checkpoint pointer small enough for Temporal history) and resume validation.

Standard library and pydantic only: workflows build, carry and validate receipts in the sandbox.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from collections.abc import Sequence
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from mamba_stream.state_codec._errors import (
    ChunkSequenceMismatch,
    DTypeMismatch,
    EpochMismatch,
    InputTransformMismatch,
    ModelRevisionMismatch,
    PositionMismatch,
    PrincipalMismatch,
    SchemaMismatch,
    StreamMismatch,
    mismatch,
)
from mamba_stream.state_codec._schema import StateSchema, without_unset_weights

__all__ = ["RECEIPT_VERSION", "Arithmetic", "ModelIdentity", "Origin", "Receipt", "arithmetic_moved",
           "continue_arithmetic", "prefix_digest", "schema_diff", "validate_resume"]

RECEIPT_VERSION = 1

_SHA = re.compile(r"^sha256:[0-9a-f]{64}$")
#: a prefix's digest: keyed, or (receipts from before it was keyed) a plain sha256
_PREFIX_DIGEST = re.compile(r"^(hmac-sha256|sha256):[0-9a-f]{64}$")
_CHECKSUM = re.compile(r"^(blake3|sha256):[0-9a-f]{64}$")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


class ModelIdentity(_Frozen):
    """What a serving model is, as far as resuming a state is concerned (no tensors)."""

    model_id: str
    model_revision: str
    input_transform: str
    input_transform_revision: str
    state_schema: StateSchema

    @cached_property
    def fingerprint(self) -> str:
        return self.state_schema.fingerprint()

    @property
    def state_dtype(self) -> str:
        return self.state_schema.tensors[0].dtype


class Arithmetic(_Frozen):
    """What decided a state's bits, beside the model revision and the tokens.

    `id` is the part that decides them. The exact arithmetic (`scheme` "exact-<version>") is one
    fixed sequence of IEEE basic operations: its kernels and their twins give the same bits on
    any x86-64 CPU, thread count, BLAS and torch build, so its id is the scheme and the compute
    dtype only. Every other backend computes with torch's kernels (`scheme` "torch"), whose bits
    follow the torch build, the BLAS, the instruction set and the thread count: all in its id.
    The remaining fields say where a state was computed; they do not change its bits.
    """

    scheme: str = Field(min_length=1, max_length=40)
    backend: str = Field(max_length=40)
    path: str = Field(max_length=40, description="the kernels that ran (exact: kernels or their twins)")
    dtype: str = Field(max_length=20, description="compute dtype (the state's is the receipt's `dtype`)")
    torch: str = Field(max_length=40)
    blas: str = Field(max_length=80)
    cpu_capability: str = Field(max_length=40)
    threads: int = Field(ge=1)
    device: str = Field(max_length=40)
    weights: str | None = Field(
        default=None, max_length=20, description="the format the weights were read in, where it is not the compute "
        "dtype (left out of the JSON when None, as receipts before the field had it)")
    id: str = Field(default="", max_length=300, description="derived: what the bits depend on")

    @model_validator(mode="before")
    @classmethod
    def _derive_id(cls, data: Any) -> Any:
        if isinstance(data, dict):
            want = cls.id_of(data)
            if data.get("id", "") not in ("", want):
                raise ValueError(f"arithmetic id {data.get('id')!r} does not follow from its fields ({want!r})")
            data = {**data, "id": want}
        return data

    @model_serializer(mode="wrap")
    def _without_unset_weights(self, handler: SerializerFunctionWrapHandler) -> dict:
        return without_unset_weights(handler(self))

    @staticmethod
    def id_of(fields: dict[str, Any]) -> str:
        weights = f"/weights-{fields['weights']}" if fields.get("weights") else ""
        if fields.get("scheme", "").startswith("exact-"):
            return f"{fields['scheme']}/{fields.get('dtype')}{weights}"
        keys = ("backend", "torch", "blas", "cpu_capability", "threads", "device", "dtype")
        return "torch/" + "/".join(str(fields.get(k)) for k in keys) + weights

    @property
    def exact(self) -> bool:
        """Whether the bits are the same whatever the chunking, batching and machine."""
        return self.scheme.startswith("exact-")


def prefix_digest(tokens: Sequence[int], key: bytes) -> str:
    """`hmac-sha256:<hex>` of a prefix's token ids, each as a little-endian uint32, under `key`: what
    a receipt names a prefix by (`Origin.digest`). The workers key it per scope
    (`activities.PrefixStore.digest`): an unkeyed digest of a prompt would let anyone who sees a
    receipt, or a store, confirm a guess of it offline."""
    return "hmac-sha256:" + hmac.new(key, struct.pack(f"<{len(tokens)}I", *tokens), hashlib.sha256).hexdigest()


class Origin(_Frozen):
    """Where an epoch's first state came from, when it was not the model's initial state.

    `kind` "prefix": a prefix's state (`StreamClient.open(prefix=...)`): `digest` names the prefix's
    tokens (`prefix_digest`, keyed per scope; `sha256:` in receipts from before it was keyed),
    `tokens` how many, and `stored_tokens` how many of them came from a stored prefix state (the
    longest stored one; the rest were computed; 0: all computed), `scope`
    whose store entry that was ("principal", "shared"; "" when none). The state's bits are the
    same either way on an exact arithmetic: the receipt's checksum equals that of a stream fed the
    prefix from position 0.

    `kind` "checkpoint": another stream's checkpoint (a resume, or `StreamClient.fork`): `stream_id`,
    `chunk_seq`, `epoch` and `checksum` name it.
    """

    kind: Literal["prefix", "checkpoint"]
    digest: str | None = Field(default=None, pattern=_PREFIX_DIGEST.pattern)
    tokens: int = Field(default=0, ge=0)
    stored_tokens: int = Field(default=0, ge=0)
    scope: Literal["", "principal", "shared"] = ""
    stream_id: str | None = Field(default=None, max_length=200)
    chunk_seq: int | None = Field(default=None, ge=0)
    epoch: int | None = Field(default=None, ge=0)
    checksum: str | None = Field(default=None, pattern=_CHECKSUM.pattern)

    @model_validator(mode="after")
    def _consistent(self) -> Origin:
        if self.stored_tokens > self.tokens:
            raise ValueError(f"stored_tokens {self.stored_tokens} exceed the prefix's {self.tokens} tokens")
        if self.kind == "prefix" and self.digest is None:
            raise ValueError("a prefix origin names its prefix's digest")
        if self.kind == "checkpoint" and (self.stream_id is None or self.checksum is None):
            raise ValueError("a checkpoint origin names its stream and checksum")
        return self


class Receipt(_Frozen):
    """A pointer to one checkpoint of one stream, with everything a resume must check.

    The state bytes live in the store under `state_key`; only this record goes into history.
    """

    receipt_version: int = RECEIPT_VERSION
    stream_id: str = Field(min_length=1, max_length=200)
    principal: str = Field(min_length=1, max_length=200)
    model_id: str
    model_revision: str
    code_revision: str
    input_transform: str
    input_transform_revision: str
    schema_fingerprint: str = Field(pattern=_SHA.pattern)
    schema_version: int
    architecture: str
    dtype: str = Field(description="dtype of the state tensors")
    n_layer: int = Field(gt=0)
    d_state: int = Field(gt=0)
    state_bytes: int = Field(ge=0)
    position: int = Field(ge=0)
    chunk_seq: int = Field(ge=0, description="sequence number of the last chunk in this state")
    epoch: int = Field(ge=0, description="resets so far; a reset starts a new epoch at position 0")
    state_key: str = Field(min_length=1, max_length=300)
    checksum: str = Field(pattern=_CHECKSUM.pattern, description="digest of the plaintext state, tagged by its "
                          "algorithm: blake3:<hex> (sha256:<hex> before BLAKE3, still verified)")
    backend: str = Field(description="backend and path that produced the state")
    arithmetic: Arithmetic | None = Field(
        default=None, description="what decided the state's bits (None: recorded before receipts carried it)")
    arithmetic_since: int = Field(
        default=0, ge=0, description="the state's bits from this position on were computed under `arithmetic.id`")
    arithmetic_changes: int = Field(
        default=0, ge=0, description="times this epoch's state moved to another arithmetic")
    origin: Origin | None = Field(
        default=None, description="where this epoch's first state came from (a prefix, another stream's "
        "checkpoint); None: the initial state. Every receipt of the epoch names it. Left out of the JSON when "
        "None, so receipts of streams opened without one read as before")

    @model_validator(mode="after")
    def _since_within(self) -> Receipt:
        if self.arithmetic_since > self.position:
            raise ValueError(f"arithmetic_since {self.arithmetic_since} is past the position {self.position}")
        return self

    @model_serializer(mode="wrap")
    def _without_unset_origin(self, handler: SerializerFunctionWrapHandler) -> dict:
        out = handler(self)
        if out.get("origin") is None:
            out.pop("origin", None)
        return out

    def bound(self) -> dict[str, Any]:
        """The fields a checkpoint blob is cryptographically bound to."""
        return {
            "stream_id": self.stream_id,
            "principal": self.principal,
            "model_revision": self.model_revision,
            "schema_fingerprint": self.schema_fingerprint,
            "position": self.position,
            "chunk_seq": self.chunk_seq,
            "epoch": self.epoch,
        }


def continue_arithmetic(before: Receipt | None, arithmetic: Arithmetic) -> dict[str, Any]:
    """The arithmetic fields of a receipt whose state continues `before`'s under `arithmetic`.

    The initial state is the same under every arithmetic, so a change at position 0 is none. A
    `before` that recorded no arithmetic counts as another one: its bits cannot be vouched for.
    """
    if before is None or before.position == 0:
        return {"arithmetic": arithmetic, "arithmetic_since": 0, "arithmetic_changes": 0}
    if before.arithmetic is not None and before.arithmetic.id == arithmetic.id:
        return {"arithmetic": arithmetic, "arithmetic_since": before.arithmetic_since,
                "arithmetic_changes": before.arithmetic_changes}
    return {"arithmetic": arithmetic, "arithmetic_since": before.position,
            "arithmetic_changes": before.arithmetic_changes + 1}


def arithmetic_moved(before: Receipt | None, after: Receipt) -> bool:
    """Whether `after`, committed on top of `before`, moved the stream to another arithmetic."""
    return (before is not None and before.epoch == after.epoch
            and after.arithmetic_changes > before.arithmetic_changes)


def schema_diff(expected: StateSchema, actual: StateSchema) -> tuple[str, Any, Any] | None:
    """The first differing field (dotted path) with both values, or None if equal."""
    return _diff(expected.model_dump(mode="json"), actual.model_dump(mode="json"), "schema")


def _diff(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _diff(a.get(k), b.get(k), f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = _diff(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else (path, a, b)


def validate_resume(
    receipt: Receipt,
    model: ModelIdentity,
    principal: str,
    *,
    stream_id: str | None = None,
    position: int | None = None,
    chunk_seq: int | None = None,
    epoch: int | None = None,
) -> None:
    """Raise the first reason `receipt` may not be resumed by `principal` on `model`, or return.

    Every resume path calls this before touching state bytes. Checked in order: stream (when
    the caller names one), principal, model revision, input transform, state dtype, schema,
    then position, chunk sequence and epoch when the caller expects specific values.
    """
    if stream_id is not None and receipt.stream_id != stream_id:
        raise mismatch(StreamMismatch, "stream_id", stream_id, receipt.stream_id)
    if receipt.principal != principal:
        raise mismatch(PrincipalMismatch, "principal", principal, receipt.principal)
    if receipt.model_revision != model.model_revision:
        raise mismatch(ModelRevisionMismatch, "model_revision", model.model_revision, receipt.model_revision)
    if receipt.input_transform != model.input_transform:
        raise mismatch(InputTransformMismatch, "input_transform", model.input_transform, receipt.input_transform)
    if receipt.input_transform_revision != model.input_transform_revision:
        raise mismatch(InputTransformMismatch, "input_transform_revision", model.input_transform_revision,
                       receipt.input_transform_revision)
    if receipt.dtype != model.state_dtype:
        raise mismatch(DTypeMismatch, "dtype", model.state_dtype, receipt.dtype)
    schema = model.state_schema
    for field, ours in (("schema_version", schema.schema_version), ("architecture", schema.architecture),
                        ("n_layer", schema.n_layer), ("d_state", schema.d_state),
                        ("state_bytes", schema.state_bytes)):
        theirs = getattr(receipt, field)
        if theirs != ours:
            raise mismatch(SchemaMismatch, f"schema.{field}", ours, theirs)
    if receipt.schema_fingerprint != model.fingerprint:
        raise mismatch(SchemaMismatch, "schema.fingerprint", model.fingerprint, receipt.schema_fingerprint)
    if position is not None and receipt.position != position:
        raise mismatch(PositionMismatch, "position", position, receipt.position)
    if chunk_seq is not None and receipt.chunk_seq != chunk_seq:
        raise mismatch(ChunkSequenceMismatch, "chunk_seq", chunk_seq, receipt.chunk_seq)
    if epoch is not None and receipt.epoch != epoch:
        raise mismatch(EpochMismatch, "epoch", epoch, receipt.epoch)

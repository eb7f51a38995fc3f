"""An epoch's first state, committed: a stream's open (epoch 0: the model's initial state, a
prefix's state, or another stream's checkpoint resumed) and a reset (a later epoch, at position
0). Each is sealed, stored put-if-absent under a key derived from what it is, recorded with its
receipt (what a rewind to it goes back to), and held in the stream's slot.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

import torch

from mamba_stream.activities._engine import owner_of
from mamba_stream.activities._guards import beat, cancel_point
from mamba_stream.activities._prefix import PREFIX_STREAM_PREFIX, Compute, is_prefix_stream
from mamba_stream.activities._segments import is_segment_stream
from mamba_stream.activities._store import check_name
from mamba_stream.scan import Model, State
from mamba_stream.state_codec import (
    EpochMismatch,
    InputTransformMismatch,
    Origin,
    PrincipalMismatch,
    Receipt,
    stream_tag,
    validate_resume,
)
from mamba_stream.workflows import (
    ChunkTooLarge,
    InvalidRequest,
    ModelInfo,
    OpenStreamRequest,
    OpenStreamResult,
    QuotaExceeded,
    ResetStreamRequest,
    StateResult,
)

if TYPE_CHECKING:
    from mamba_stream.activities._activities import StreamActivities

__all__ = ["model_info", "open_stream", "reset_stream"]

log = logging.getLogger(__name__)


def open_stream(acts: StreamActivities, req: OpenStreamRequest) -> OpenStreamResult:
    """Bind a new stream to a model: its initial state, a prefix's, or a validated checkpoint to resume."""
    check_name("stream id", req.stream_id)
    if is_prefix_stream(req.stream_id) or is_segment_stream(req.stream_id):
        raise InvalidRequest(f"stream id {req.stream_id!r} is in the workers' own namespace (the prefix store's or "
                             "the KV segments')", field="stream_id")
    acts._verify("open", req.stream_id, req.principal, req)
    tag = stream_tag(req.stream_id)
    if tag is not None and tag != acts.keyring.principal_tag(req.principal):
        # the id names another principal than the stream is opened for: its payloads
        # would be under that principal's key
        raise PrincipalMismatch(f"stream {req.stream_id} is tagged for another principal than "
                                f"{req.principal!r}", field="principal", expected=tag, actual=req.principal)
    if tag is not None:
        _check_streams(acts, tag, req.stream_id)
    model = acts._model(req.model_id)
    info = model_info(model)
    if req.input_transform not in (None, info.input_transform):
        raise InputTransformMismatch(
            f"model {req.model_id} reads {info.input_transform!r}, not {req.input_transform!r}",
            field="input_transform", expected=info.input_transform, actual=req.input_transform)
    prefix = _prefix_tokens(model, req)
    if prefix and req.resume is not None:
        raise InvalidRequest("a stream opens from a prefix or from a checkpoint, not both", field="prefix")
    last, origin, what = None, None, "initial"
    if prefix:
        compute = _prefill(acts, model, owner_of(req.stream_id))
        opened = acts.prefixes.state_for(model, req.principal, prefix, compute, on_wait=beat)
        state, last, origin = opened.state, opened.logits, opened.origin
        what = f"prefix|{origin.digest}"
    elif req.resume is not None:
        # another stream's checkpoint: everything but the stream id must match
        validate_resume(req.resume, model.identity(), req.principal)
        state, last = acts._fetch(model, req.resume, req.principal, current=False)
        origin = Origin(kind="checkpoint", stream_id=req.resume.stream_id, chunk_seq=req.resume.chunk_seq,
                        epoch=req.resume.epoch, checksum=req.resume.checksum)
        what = req.resume.checksum
    else:
        state = model.initial_state()
    key = acts.commits.state_key(req.stream_id, 0, 0, f"open|{what}")
    receipt = start_epoch(acts, model, req.stream_id, req.principal, state, kind="open", chunk_seq=0, epoch=0,
                          key=key, before=req.resume, last=last, origin=origin)
    # its receipt recorded beside it, as a chunk's is: what a rewind to it goes back to
    acts.commits.write_record(receipt, {"kind": "open", "receipt": receipt.model_dump(mode="json")}, last)
    acts._gauge()
    acts.opened(req.stream_id)
    return OpenStreamResult(receipt=receipt, info=info, worker_queue=acts.worker_queue)


def reset_stream(acts: StreamActivities, req: ResetStreamRequest) -> StateResult:
    """A new epoch at position 0: the model's initial state, sealed for the stream."""
    acts._verify("reset", req.stream_id, req.principal, req.request)
    if req.request is not None and req.request.epoch not in (None, req.epoch):
        raise EpochMismatch(f"the reset was signed for epoch {req.request.epoch}, not {req.epoch}",
                            field="epoch", expected=req.epoch, actual=req.request.epoch)
    model = acts._model(req.receipt.model_id)
    acts._check(model, req.receipt, req.principal, req.stream_id)
    if req.epoch <= req.receipt.epoch:
        raise EpochMismatch(f"epoch {req.epoch} does not follow {req.receipt.epoch}",
                            field="epoch", expected=req.receipt.epoch + 1, actual=req.epoch)
    key = acts.commits.state_key(req.stream_id, req.epoch, req.receipt.chunk_seq, "reset|initial")
    receipt = start_epoch(acts, model, req.stream_id, req.principal, model.initial_state(), kind="reset",
                          chunk_seq=req.receipt.chunk_seq, epoch=req.epoch, key=key, before=None)
    acts.commits.write_record(receipt, {"kind": "reset", "receipt": receipt.model_dump(mode="json")}, None)
    if req.request is not None and req.request.revoke:
        n = acts.commits.revoke_before(req.stream_id, req.principal, req.epoch, model)
        log.info("reset of %s revoked %d checkpoints of the epochs before %d", req.stream_id, n, req.epoch)
    acts.metrics.resets.add(1, {"model": model.model_id})
    acts._gauge()
    return StateResult(receipt=receipt, worker_queue=acts.worker_queue)


def start_epoch(acts: StreamActivities, model: Model, stream_id: str, principal: str, state: State, *, kind: str,
                chunk_seq: int, epoch: int, key: str, before: Receipt | None, last: torch.Tensor | None = None,
                origin: Origin | None = None) -> Receipt:
    """An epoch's first state, its own (`kind` "open": initial, a prefix's or resumed; "reset":
    initial), committed and held in the stream's slot; `origin` where it came from."""
    cancel_point()
    done = acts.commits.commit(model, state, stream_id=stream_id, principal=principal, chunk_seq=chunk_seq,
                               epoch=epoch, key=key, backend=model.ran(kind), before=before, origin=origin)
    acts.engine(model).put(stream_id, done.state, epoch=epoch, state_key=key, logits=last)
    return done.receipt


def model_info(model: Model) -> ModelInfo:
    """What an open tells its stream of the model that serves it."""
    ident = model.identity()
    return ModelInfo(
        model_id=model.model_id, model_revision=model.revision, architecture=model.schema.architecture,
        vocab_size=model.vocab_size, input_transform=ident.input_transform,
        input_transform_revision=ident.input_transform_revision, schema_fingerprint=ident.fingerprint,
        state_bytes=model.schema.state_bytes,
    )


def _prefix_tokens(model: Model, req: OpenStreamRequest) -> list[int]:
    """An open's prefix as checked token ids ([]: none, or an empty one): refused typed before
    anything is computed or stored (a token outside the vocabulary, too many tokens)."""
    if req.prefix is None:
        return []
    if isinstance(req.prefix, str):
        if model.transform is None:
            raise InvalidRequest("this model has no input transform; send the prefix as tokens", field="prefix")
        tokens = model.transform.encode(req.prefix)
    else:
        tokens = list(req.prefix)
    if len(tokens) > req.max_prefix_tokens:
        raise ChunkTooLarge(f"the prefix's {len(tokens)} tokens exceed max_prefix_tokens {req.max_prefix_tokens}",
                            limit=req.max_prefix_tokens, actual=len(tokens))
    model.check_tokens(tokens)
    return tokens


def _check_streams(acts: StreamActivities, tag: str, stream_id: str) -> None:
    """The principal's `streams` quota (`Quotas`): the streams of its tag holding state in the
    store, this one aside (an open tried again finds its own objects), below the limit."""
    limit = acts.quotas.streams
    used = len([sid for sid in acts.store.streams_of(tag) if sid != stream_id])
    if used >= limit:
        raise QuotaExceeded(f"the principal holds {used} streams in the store, its quota streams is {limit} "
                            "(MAMBA_STREAM_QUOTA_STREAMS); cancel one to open another",
                            quota="streams", limit=limit, used=used)


def _prefill(acts: StreamActivities, model: Model, owner: str) -> Compute:
    """A prefix's computation, by the model's engine like any chunk (in `prefill_piece` pieces
    between the other streams' decode rounds, this thread heartbeating while it waits: a long
    prefix on a loaded worker never outlasts the heartbeat timeout), in a slot of its own that
    is freed after; only the last row of logits is kept. Served from `owner`'s share (the
    opening stream's principal)."""
    def compute(state: State, tokens: list[int]) -> tuple[State, torch.Tensor | None, str]:
        engine = acts.engine(model)
        slot = f"{PREFIX_STREAM_PREFIX}compute.{uuid.uuid4().hex}"
        cancel_point()
        try:
            out = engine.advance(slot, tokens, expected_key=f"{slot}/start", epoch=0,
                                 load=lambda: (state, None), on_wait=beat, keep_rows=False, owner=owner)
        finally:
            engine.release(slot)
        return out.state, out.last_logits, out.path
    return compute

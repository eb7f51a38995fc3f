"""What a stream committed earlier, read back from its records: a checkpoint proved to be in the
store and authentic (`checkpoint_stream`), a rewind to an earlier checkpoint's recorded receipt
(`rewind_stream`), a committed chunk's recorded result (`recall_result`). Only ever the stream's
own keys (`own_key`): a forged carry or a recorded result could name any.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mamba_stream.scan import Model
from mamba_stream.state_codec import Receipt, StreamMismatch, parse_state_key
from mamba_stream.workflows import (
    AdvanceResult,
    CheckpointStreamRequest,
    GenerateResult,
    RecallResultRequest,
    RecallResultResult,
    ResultExpired,
    RewindStreamRequest,
    RewindUnavailable,
    StateResult,
)

if TYPE_CHECKING:
    from mamba_stream.activities._activities import StreamActivities

__all__ = ["checkpoint_stream", "own_key", "recall_result", "rewind_stream"]

log = logging.getLogger(__name__)


def checkpoint_stream(acts: StreamActivities, req: CheckpointStreamRequest) -> StateResult:
    """Prove the stream's current checkpoint (or an earlier one, `state_key`: its recorded
    receipt) is in the store and authentic; return its receipt."""
    acts._verify("checkpoint", req.stream_id, req.principal, req.request)
    model = acts._model(req.receipt.model_id)
    acts._check(model, req.receipt, req.principal, req.stream_id)
    if req.state_key is None:
        acts.commits.fetch_current(model, req.receipt, req.principal)
        return StateResult(receipt=req.receipt, worker_queue=acts.worker_queue)
    target = _recorded(acts, model, req.stream_id, req.principal, req.state_key)
    acts.commits.fetch(model, target, req.principal)  # there, authentic, this stream's
    return StateResult(receipt=target, worker_queue=acts.worker_queue)


def rewind_stream(acts: StreamActivities, req: RewindStreamRequest) -> StateResult:
    """The receipt of one of the stream's earlier checkpoints (its recorded receipt), checked
    to be stored and authentic: what the stream goes back to. The undone chunks' checkpoints
    (`drop_keys`) are deleted."""
    acts._verify("rewind", req.stream_id, req.principal, req.request)
    model = acts._model(req.receipt.model_id)
    acts._check(model, req.receipt, req.principal, req.stream_id)
    target = _recorded(acts, model, req.stream_id, req.principal, req.state_key)
    acts.commits.fetch_current(model, target, req.principal)  # there, authentic, this stream's
    acts.commits.drop(req.drop_keys, stream_id=req.stream_id, principal=req.principal, model=model)
    log.info("stream %s rewound to chunk %d (position %d)", req.stream_id, target.chunk_seq, target.position)
    return StateResult(receipt=target, worker_queue=acts.worker_queue)


def recall_result(acts: StreamActivities, req: RecallResultRequest) -> RecallResultResult:
    """A committed chunk's recorded result (a repeated update id whose full result was not
    carried across continue-as-new)."""
    own_key(req.stream_id, req.state_key)  # never another stream's record
    prior = acts.commits.prior(req.state_key, req.principal)
    if prior is None:
        raise ResultExpired(f"chunk result {req.state_key} is no longer kept (its checkpoint left the window)",
                            state_key=req.state_key)
    model = AdvanceResult if req.kind == "advance" else GenerateResult
    return RecallResultResult(**{req.kind: model.model_validate(prior.result)})


def own_key(stream_id: str, state_key: str) -> None:
    """A checkpoint key a request names is one of its stream's own (a forged carry or a recorded
    result could name any), else StreamMismatch."""
    owner = parse_state_key(state_key)
    if owner is None or owner.stream_id != stream_id:
        raise StreamMismatch(f"{state_key!r} is not a checkpoint of stream {stream_id}", field="state_key",
                             expected=stream_id, actual=owner.stream_id if owner else None)


def _recorded(acts: StreamActivities, model: Model, stream_id: str, principal: str, state_key: str) -> Receipt:
    """The recorded receipt of one of the stream's own checkpoints, checked against the model."""
    own_key(stream_id, state_key)
    prior = acts.commits.prior(state_key, principal)
    if prior is None or "receipt" not in prior.result:
        raise RewindUnavailable(f"checkpoint {state_key} has no recorded receipt (gone, or written "
                                f"before rewinds recorded one)", state_key=state_key)
    target = Receipt.model_validate(prior.result["receipt"])
    acts._check(model, target, principal, stream_id)
    return target

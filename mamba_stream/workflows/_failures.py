"""The catalogue of a stream's failure reasons: classes, never strings.

Every refusal or failure a stream can report to its caller is an exception class with a stable
`reason` (its class name, and the Temporal `ApplicationError.type` the caller sees) and a
`retryable` flag: a permanent failure becomes a non-retryable `ApplicationError`, one that trying
again can cure stays retryable. Every family is under one root, `mamba_stream.failures.Failure`:

    StreamFailure subclasses    here: refusals of the workflow and the activities' own checks
    state_codec.StateRejected   a receipt, checkpoint or signature that does not belong
    store and scan errors       activities' `StoreError` subclasses, `scan.ScanError` subclasses,
                                `UnknownModel`, `StreamBusy`

`application_error` (from `mamba_stream.failures`, re-exported here) turns any of them into the
`ApplicationError` that crosses Temporal, and
`NOT_THE_CHUNKS_FAULT` names the reasons a caller cannot cure by changing the chunk: after one of
these, the same chunk may be sent again as a next attempt (`workflows.update_id(..., attempt=)`).

Sandbox-safe: the standard library, temporalio and state_codec's record.
"""

from __future__ import annotations

from mamba_stream.failures import (
    Failure,
    InvalidRequest,
    TokenOutOfRange,
    application_error,
    catalogue,
    invalid_request,
)
from mamba_stream.state_codec import CheckpointNotFound, CorruptBlob, SegmentMissing, TruncatedBlob

__all__ = [
    "NOT_THE_CHUNKS_FAULT",
    "ActivityFailed",
    "ChunkTooLarge",
    "ConflictingChunk",
    "EmptyContext",
    "InternalError",
    "InvalidRequest",
    "LocalTooSlow",
    "OpenFailed",
    "PriorityMismatch",
    "ReservedStreamId",
    "ResultExpired",
    "RewindPastWindow",
    "RewindUnavailable",
    "StreamCancelled",
    "StreamFailure",
    "StreamMoving",
    "StreamOpening",
    "TokenOutOfRange",
    "UnknownRequest",
    "UpdateIdMismatch",
    "WorkerUnhealthy",
    "application_error",
    "catalogue",
    "invalid_request",
]


class StreamFailure(Failure):
    """A stream's refusal or failure. `details`: JSON-friendly values that travel with it."""


class StreamCancelled(StreamFailure):
    """The stream is cancelled: it takes no more chunks."""


class StreamOpening(StreamFailure):
    """The stream has no first receipt yet. Refused, not failed: the same update id can come again."""

    retryable = True


class StreamMoving(StreamFailure):
    """The stream is continuing as new before its time: its history neared the server's limits (a
    flood of signals or updates while a chunk ran). The chunk or checkpoint in flight, or waiting,
    was stopped before it committed anything; send it again, under the same update id: the next
    run takes it."""

    retryable = True


class LocalTooSlow(StreamFailure):
    """A local attempt declined: at the engine's pace now, the chunk would not finish well inside
    the local timeout. The workflow sends it the regular way at once (no attempt was made)."""

    retryable = True


class ChunkTooLarge(StreamFailure):
    """More tokens, text bytes or generated tokens than the stream's options allow."""


class EmptyContext(StreamFailure):
    """Nothing to continue from: a generate before any input."""


class ReservedStreamId(StreamFailure):
    """A stream started under an id of the workers' own namespace: `pfx.` names the prefix store's
    entries (`activities.PREFIX_STREAM_PREFIX`), `seg.` an owner's KV segments
    (`activities.SEGMENT_STREAM_PREFIX`), and no workflow's stream runs there, whoever
    sealed its start. The run fails at its first workflow task, before any activity."""


class PriorityMismatch(StreamFailure):
    """A stream started with a Temporal priority other than its principal's
    (`workflows.stream_priority`): another principal's fairness key, a weight of the client's own
    (weights are the operator's, set on the queues) or a level above the default. A client holding
    one principal's keys would have its workflow tasks take another's turns, or everyone's. The run
    fails at its first workflow task, before any activity. A start with no priority at all is taken
    (it shares the default key), and so is a level below the default. Details: `expected`, `actual`
    as [level, fairness key, weight]."""


class UnknownRequest(StreamFailure):
    """An update, signal or query of a name the stream does not have. An update or query is
    refused with it (an update leaves nothing in history); a signal, which has no caller to
    answer, is counted (`StreamStats.unknown_signals`) and changes nothing."""


class ConflictingChunk(StreamFailure):
    """A chunk sequence already committed or in flight with other content: the second writer's."""


class UpdateIdMismatch(StreamFailure):
    """An update id made by `update_id` that names another chunk, epoch or content than its request."""


class RewindPastWindow(StreamFailure):
    """A rewind to a chunk outside the stream's rewind window: refused by `StreamClient.rewind`
    before anything is reset; or, after a raw Temporal reset there (or a chain of rewinds deeper
    than the store holds), the next chunk's refusal: its checkpoint is no longer stored.

    The stream stays usable: a `reset` signal starts a fresh epoch at position 0."""


class RewindUnavailable(StreamFailure):
    """No point in the stream's current run where the chunk asked for is the last one committed:
    it was never committed, or it lies in an earlier run (before a continue-as-new)."""


class ResultExpired(StreamFailure):
    """A repeated update id whose chunk was committed, but whose full result is no longer kept (it
    left the carry's byte budget and its record left the store with its checkpoint)."""


class InternalError(StreamFailure):
    """An unforeseen exception in an activity, retried a bounded number of times, then typed."""


class WorkerUnhealthy(StreamFailure):
    """The worker stopped taking work: it failed chunk after chunk of several streams, with no
    success between, for reasons that were not the chunks' own (`activities.WorkerHealth`).
    Retryable: another worker (or this one, restarted) takes the chunk. Also what a tripped
    worker's `Worker.run` raises, so that `python worker.py` exits non-zero."""

    retryable = True


class QuotaExceeded(StreamFailure):
    """The principal is at one of the workers' quotas (`activities.Quotas`), refused before
    anything ran: nothing advanced, stored or lost. Details: `quota` (`streams`: streams holding
    state in the store; `chunks_in_flight`: the principal's chunks running on this worker;
    `state_bytes`: hot states (and KV) the principal's running chunks hold in this worker's engine),
    its `limit` and the current `used`. Not retried: the same request goes through once the
    principal holds less (a stream disposed, a chunk finished)."""


class ActivityFailed(StreamFailure):
    """An activity failed without a reason of its own (a timeout, a worker lost for good)."""


class OpenFailed(StreamFailure):
    """Opening the stream failed (the run's failure names the cause)."""


#: reasons a caller cannot cure by changing the chunk: the same chunk may be sent again as a next
#: attempt once the cause is gone (a store back, a blob restored, a reset signal after a rewind)
NOT_THE_CHUNKS_FAULT = frozenset({c.reason for c in (
    CheckpointNotFound, SegmentMissing, CorruptBlob, TruncatedBlob, InternalError, ActivityFailed, RewindPastWindow,
    WorkerUnhealthy)}
) | {"StoreError", "StoreUnavailable", "StoreCorrupt"}  # the stores' are named: they live above workflows

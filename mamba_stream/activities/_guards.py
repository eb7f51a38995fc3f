"""What every stream activity runs under (`guarded`): its failures typed, its outcome told to the
worker's health, its cancellation cooperative.

Failures cross Temporal typed by reason (`workflows.application_error`): permanent ones
non-retryable, transient ones (a store outage) retried by the activity's retry policy. An
exception nobody foresaw is retried `UNTYPED_ATTEMPTS` times, then fails the chunk as
`InternalError`: a bug never retries forever behind the stream's lock. Unless it is judged the
worker's own (`WorkerHealth`: this worker fails other streams' chunks too, with no success
between): then it is retried, up to `WORKER_FAULT_ATTEMPTS`, and the worker stops taking work
once it trips.

Cancellation is cooperative. The SDK would cancel a thread-run activity by raising
CancelledError asynchronously inside its thread, wherever it is: in the middle of an import (a
model's first load imports torch._dynamo and sympy), which then stays half-done for the whole
process. So every activity is declared `no_thread_cancel_exception=True`, and checks
`activity.is_cancelled()` at safe points (`cancel_point`): once its model is there, before it
hands the chunk to the engine, five times a second while it waits on the engine (`beat`, which
heartbeats once a second), and before a commit starts. A local attempt that times out is
cancelled the same way (SDK 1.35.0 cancels it with `timed_out` set): it ends at its next safe
point, its pool thread free again within 0.2 s of waiting, and the engine drops its work, while
the regular attempt takes over. Models load at worker start (`StreamActivities.warm`), or on
first use under the registry's lock, which nothing interrupts now.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError, CancelledError

from mamba_stream.activities._health import WorkerHealth
from mamba_stream.activities._live import LiveTokens
from mamba_stream.activities._metrics import StreamMetrics
from mamba_stream.failures import Failure
from mamba_stream.state_codec import RequestRejected, StateRejected, StreamMismatch
from mamba_stream.workflows import InternalError, QuotaExceeded, WorkerUnhealthy, application_error

__all__ = ["BEAT_S", "UNTYPED_ATTEMPTS", "WORKER_FAULT_ATTEMPTS", "beat", "cancel_point", "guarded", "live_wait",
           "typed_errors"]

log = logging.getLogger(__name__)

#: seconds between heartbeats of an attempt that waits (heartbeat_timeout_s is at least twice it)
BEAT_S = 1.0
#: attempts of an activity that fails with an exception nobody foresaw, before it fails typed
UNTYPED_ATTEMPTS = 3
#: attempts of one whose failures are judged the worker's (`WorkerHealth.failed`), before it fails
#: typed all the same: a chunk that breaks every worker it reaches does not go round forever
WORKER_FAULT_ATTEMPTS = 10


@contextmanager
def guarded(health: WorkerHealth, metrics: StreamMetrics, stream_id: str, model_id: str = "") -> Iterator[None]:
    """An activity's body: refused at once on a tripped worker (retryable: another worker takes
    it) or when another workflow than the stream's own scheduled it, its exceptions typed
    (`typed_errors`), and its outcome told to `health`."""
    why = health.tripped
    if why is not None:
        raise application_error(WorkerUnhealthy(f"this worker stopped taking work: {why}"))
    if activity.in_activity():
        # Only the stream's own workflow schedules its activities: the server says which
        # workflow did (a standalone activity, started by any caller of the frontend, names none)
        caller = activity.info().workflow_id
        if caller != stream_id:
            raise application_error(StreamMismatch(
                f"an activity of stream {stream_id} scheduled by {caller or 'no workflow'}",
                field="workflow_id", expected=stream_id, actual=caller))

    def worker_fault(exc: BaseException) -> bool:
        metrics.untyped_failures.add(1, {"exception": type(exc).__name__})
        theirs = health.failed(stream_id, exc)
        metrics.consecutive_failures.set(health.consecutive)
        return theirs

    with typed_errors(metrics, model_id, worker_fault):
        yield
    health.succeeded()
    metrics.consecutive_failures.set(0)


@contextmanager
def typed_errors(metrics: StreamMetrics | None = None, model_id: str = "",
                 worker_fault: Callable[[BaseException], bool] | None = None) -> Iterator[None]:
    """Our exceptions become ApplicationErrors typed by reason; permanent ones non-retryable.

    Refusals are counted on the way out: a signature's as a refused request, a receipt's or a
    checkpoint's as a refused resume. Any other exception is retried (re-raised) until the
    activity's `UNTYPED_ATTEMPTS`-th attempt, which fails it as a non-retryable `InternalError`
    naming the original; `worker_fault(exc)` is told of each, and where it answers True (the
    failure is the worker's, not the chunk's) retries go on up to `WORKER_FAULT_ATTEMPTS`.
    """
    try:
        yield
    except ApplicationError:
        raise
    except CancelledError:
        raise
    except Exception as exc:  # every exception leaves typed, or is retried a bounded number of times
        if isinstance(exc, Failure):  # a reason of its own: application_error types it
            if metrics is not None and isinstance(exc, QuotaExceeded):
                metrics.quota_refusals.add(1, {"quota": str(exc.extra.get("quota"))})
            if metrics is not None and isinstance(exc, StateRejected):
                if isinstance(exc, RequestRejected):
                    metrics.requests_rejected.add(1, {"reason": exc.reason})
                else:
                    metrics.refused(exc.reason, model_id)
            raise application_error(exc) from exc
        attempt = activity.info().attempt if activity.in_activity() else UNTYPED_ATTEMPTS
        theirs = worker_fault(exc) if worker_fault is not None else False
        if attempt < UNTYPED_ATTEMPTS or (theirs and attempt < WORKER_FAULT_ATTEMPTS):
            log.warning("untyped failure on attempt %d of %d%s: %r", attempt,
                        WORKER_FAULT_ATTEMPTS if theirs else UNTYPED_ATTEMPTS,
                        " (this worker fails other streams too)" if theirs else "", exc)
            raise
        log.error("untyped failure on attempt %d, failing the chunk: %r", attempt, exc, exc_info=exc)
        raise application_error(InternalError(
            f"{type(exc).__name__}: {exc} (after {attempt} attempts)", exception=type(exc).__name__,
            attempts=attempt)) from exc


def cancel_point() -> None:
    """A safe point: raise CancelledError here if the attempt was cancelled (by the workflow, a
    timeout, the worker's shutdown). Nothing else raises it in our threads (module docstring)."""
    if activity.in_activity() and activity.is_cancelled():
        details = activity.cancellation_details()
        why = "timed out" if details is not None and details.timed_out else "cancelled"
        raise CancelledError(f"the attempt was {why}")


_beats = threading.local()  # (task token, when) of the last heartbeat sent from this thread


def beat(*details: Any) -> None:
    """While waiting (several times a second): a safe point, then a heartbeat at most once a
    second (a local activity has none: its timeout still cancels it, and this is where it notices)."""
    cancel_point()
    if activity.in_activity() and not activity.info().is_local:
        token, now = activity.info().task_token, time.monotonic()
        last = getattr(_beats, "last", None)
        if last is None or last[0] != token or now - last[1] >= BEAT_S:
            _beats.last = (token, now)
            activity.heartbeat(*details)


def live_wait(live: LiveTokens) -> Callable[[], float | None]:
    """A streaming generate's wait: a safe point, then its progress heartbeated at its own pace."""
    def wait() -> float | None:
        cancel_point()
        return live.on_wait()
    return wait

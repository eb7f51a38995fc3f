"""WorkerHealth: whether this worker's failures are its own, and when it stops taking work.

A worker can break in a way no chunk can cure: a module left half-imported, memory that is gone,
an engine thread that died. Then it fails every chunk and every open that reaches it, while it
stays up and keeps taking work, and each stream it touches fails (an exception nobody foresaw
becomes `InternalError` after `UNTYPED_ATTEMPTS`). A supervisor would restart it, if it knew.

So the stream activities tell this tracker how each of their attempts ends: a success, or an
exception without a reason of its own (untyped: what becomes `InternalError`). Typed failures (a
refusal, a store that is down, a cancellation) are the chunk's or the deployment's, not this
worker's, and count neither way. It trips when `failures` untyped failures come in a row, with
no success between, across at least `streams` streams: one bad chunk (retried `UNTYPED_ATTEMPTS`
times) or one bad stream cannot trip it, and a worker that succeeds at anything is not tripped.

Once tripped, the worker refuses every attempt (`WorkerUnhealthy`, retryable: another worker
takes the chunk), the plugin shuts it down, and its `Worker.run` raises `WorkerUnhealthy`, so that
`python worker.py` exits non-zero (`EXIT_UNHEALTHY`) for its supervisor to restart it. Before it
trips, a failure while the current run of failures already spans several streams is judged the
worker's (`failed` returns True): the activity retries it rather than failing the chunk for good.

Stdlib only: the plugin imports it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

__all__ = ["FAILURES_TO_TRIP", "STREAMS_TO_TRIP", "WorkerHealth"]

log = logging.getLogger(__name__)

#: untyped failures in a row, with no success between, that trip a worker
FAILURES_TO_TRIP = 8
#: the distinct streams those failures must span (one stream's failures never trip it)
STREAMS_TO_TRIP = 2


class WorkerHealth:
    """Thread-safe; activities call `succeeded` and `failed` from their threads.

    Args:
        failures: untyped failures in a row that trip the worker.
        streams: the distinct streams they must span.
    """

    def __init__(self, *, failures: int = FAILURES_TO_TRIP, streams: int = STREAMS_TO_TRIP) -> None:
        if failures < 1 or streams < 2:
            raise ValueError("a worker trips on at least 1 failure across at least 2 streams")
        self.failures, self.streams = failures, streams
        self._lock = threading.Lock()
        self._run: list[tuple[str, str]] = []  # (stream id, "Type: message") of the current run
        self._tripped: str | None = None
        self._listeners: list[Callable[[str], None]] = []

    @property
    def tripped(self) -> str | None:
        """Why this worker stopped taking work; None while it takes work."""
        return self._tripped

    @property
    def consecutive(self) -> int:
        """Untyped failures since the last success."""
        with self._lock:
            return len(self._run)

    def on_trip(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call `listener(reason)` once, when the worker trips (at once if it has); returns a
        function that removes it."""
        with self._lock:
            why = self._tripped
            if why is None:
                self._listeners.append(listener)
        if why is not None:
            listener(why)

        def remove() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return remove

    def succeeded(self) -> None:
        """An attempt ended well: whatever failed before was not the worker's every chunk."""
        with self._lock:
            self._run.clear()

    def failed(self, stream_id: str, exc: BaseException) -> bool:
        """An attempt for `stream_id` failed with `exc`, an exception without a reason of its own.

        Returns whether the failure is judged the worker's rather than the chunk's: the current
        run of failures spans at least two streams (or the worker has tripped).
        """
        with self._lock:
            if self._tripped is not None:
                return True
            self._run.append((stream_id, f"{type(exc).__name__}: {exc}"))
            spanned = len({s for s, _ in self._run})
            if len(self._run) < self.failures or spanned < self.streams:
                return spanned >= 2
            why = self._reason_locked(spanned)
            self._tripped = why
            listeners, self._listeners = self._listeners, []
        log.error("this worker stops taking work: %s", why)
        for listener in listeners:
            try:
                listener(why)
            except Exception:  # one listener's fault must not keep the others from hearing
                log.exception("a listener of the worker's trip failed")
        return True

    def _reason_locked(self, spanned: int) -> str:
        causes = Counter(cause for _, cause in self._run).most_common(3)
        named = "; ".join(f"{n} x {cause}" for cause, n in causes)
        return (f"{len(self._run)} attempts in a row across {spanned} streams failed with exceptions that are "
                f"not the chunks' own, and none succeeded between ({named})")

"""How principals share a worker: `Fairness` (whose work goes next) and `Quotas` (what one may hold).

Three places decide who goes next, and each is told the same thing:

- Temporal's task queues, by fairness key: every stream's workflow and activities carry their
  principal's tag as the key (`workflows.stream_priority`); the operator's weights are set on the
  worker's queues as the server's per-key overrides (`apply_weights`, at the worker's start), by
  tag, so the server never sees a principal's name.
- The engine: its rounds are shared between owners (principal tags) by the same weights
  (`StreamEngine(fair=..., weights=...)`).
- The quotas (`Quotas`) bound what one principal holds at once: streams, chunks running, hot
  state bytes; past one, a typed refusal before anything runs.

    MAMBA_STREAM_FAIRNESS           on (default) or off: the worker's own fair sharing (off: first
                                    come, first served; Temporal's dispatch is the server's setting,
                                    `matching.enableFairness`)
    MAMBA_STREAM_FAIRNESS_WEIGHTS   principal=weight,... (default 1 each): a principal of weight 2
                                    gets twice the share of one of weight 1 while both wait
    MAMBA_STREAM_FAIRNESS_BURST     streams one principal may open on one worker within
                                    BURST_WINDOW_S before the next are moved to the bulk priority
                                    level (default 16; 0: never)

A worker's own (sticky) task queue, where a stream's workflow tasks go once a worker holds it,
is dispatched by Temporal by priority level and then in arrival order, not by fairness key: there
a flood of one principal's streams would come before another's chunk. So a principal's burst of
new streams is moved to a lower level (`workflows.BULK_PRIORITY_LEVEL`, `demote`): their tasks
yield to everyone's at the default level, and take the worker whole when nobody else waits.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from mamba_stream.failures import Failure
from mamba_stream.workflows import BULK_PRIORITY_LEVEL, QuotaExceeded

__all__ = ["BURST_WINDOW_S", "Bursts", "Fairness", "InFlight", "Quotas", "TenancyConfigError", "apply_weights",
           "demote"]

#: the window over which a principal's new streams count as one burst (`Fairness.burst`)
BURST_WINDOW_S = 10.0

log = logging.getLogger(__name__)


class TenancyConfigError(Failure, ValueError):
    """A fairness or quota setting that does not parse; the message names the variable."""


def _quota(var: str, default: int) -> int:
    raw = os.environ.get(var, "").strip().replace("_", "")
    if not raw:
        return default
    if not raw.isdigit():
        raise TenancyConfigError(f"{var}: expected a whole number (0 or more), got {os.environ.get(var)!r}")
    return int(raw)


@dataclass(frozen=True)
class Quotas:
    """What one principal may hold at once; past a quota, a request is refused `QuotaExceeded`
    (typed, not retried, naming the quota, its limit and the current use) before anything runs.

    streams: streams holding state in the store (checked when a stream opens; opens racing on
        several workers may pass it by their number). MAMBA_STREAM_QUOTA_STREAMS, default 1024.
    chunks_in_flight: the principal's chunks (advance, generate) running on one worker at once.
        MAMBA_STREAM_QUOTA_CHUNKS, default 256.
    state_bytes: the hot states (and a hybrid's KV) of the principal's streams in one worker's
        engine, per model. Past it, a chunk first evicts the principal's own least recently used
        idle stream (nothing is lost: its checkpoint is in the store); only when every one of them
        is running is the chunk refused. MAMBA_STREAM_QUOTA_STATE_BYTES, default 4 GiB.
    The prefix store's bound per principal is MAMBA_STREAM_PREFIX_BYTES (`PrefixStore`): past it
    the principal's least recently used prefix states are evicted, and one larger than the bound
    is not stored (counted as a `prefix_bytes` refusal; the open itself goes on).
    """

    streams: int = 1024
    chunks_in_flight: int = 256
    state_bytes: int = 4 << 30

    @classmethod
    def from_env(cls) -> Quotas:
        """From MAMBA_STREAM_QUOTA_STREAMS, _CHUNKS and _STATE_BYTES (unset: the defaults).

        Raises:
            TenancyConfigError: one is not a whole number (one line, naming it).
        """
        d = cls()
        return cls(streams=_quota("MAMBA_STREAM_QUOTA_STREAMS", d.streams),
                   chunks_in_flight=_quota("MAMBA_STREAM_QUOTA_CHUNKS", d.chunks_in_flight),
                   state_bytes=_quota("MAMBA_STREAM_QUOTA_STATE_BYTES", d.state_bytes))


class InFlight:
    """The chunks each principal (by tag) has running on this worker, bounded by `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}

    def used(self, owner: str) -> int:
        with self._lock:
            return self._running.get(owner, 0)

    @contextmanager
    def chunk(self, owner: str) -> Iterator[None]:
        """Hold one of `owner`'s chunk places while the block runs; `QuotaExceeded` at the limit."""
        with self._lock:
            used = self._running.get(owner, 0)
            if used >= self.limit:
                raise QuotaExceeded(f"the principal has {used} chunks running on this worker, its quota "
                                    f"chunks_in_flight is {self.limit} (MAMBA_STREAM_QUOTA_CHUNKS)",
                                    quota="chunks_in_flight", limit=self.limit, used=used)
            self._running[owner] = used + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._running[owner] - 1
                if left:
                    self._running[owner] = left
                else:
                    del self._running[owner]


def _parse_weight(var: str, item: str) -> tuple[str, float]:
    name, sep, raw = item.partition("=")
    name = name.strip()
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not sep or not name or not math.isfinite(value) or value <= 0:
        raise TenancyConfigError(f"{var}: expected principal=weight with a positive weight, got {item.strip()!r}")
    return name, value


@dataclass(frozen=True)
class Fairness:
    """enabled: the worker's engine shares its rounds between principals, and moves a principal's
    burst of new streams to the bulk level (False: first come, first served, no level moved).
    weights: principal name -> weight (default 1.0). burst: streams one principal may open on one
    worker within `BURST_WINDOW_S` at the default level; the next ones go to the bulk level
    (0: never)."""

    enabled: bool = True
    weights: Mapping[str, float] = field(default_factory=dict)
    burst: int = 16

    @classmethod
    def from_spec(cls, enabled: str = "on", weights: str = "", burst: str = "") -> Fairness:
        """Parse MAMBA_STREAM_FAIRNESS (on/off), MAMBA_STREAM_FAIRNESS_WEIGHTS (alice=2,bob=1) and
        MAMBA_STREAM_FAIRNESS_BURST (a whole number; empty: the default).

        Raises:
            TenancyConfigError: either does not parse (one line, naming the variable).
        """
        flag = enabled.strip().lower()
        if flag not in ("on", "off", "1", "0", "true", "false", "yes", "no", ""):
            raise TenancyConfigError(f"MAMBA_STREAM_FAIRNESS: expected on or off, got {enabled!r}")
        parsed = dict(_parse_weight("MAMBA_STREAM_FAIRNESS_WEIGHTS", item)
                      for item in weights.split(",") if item.strip())
        raw = burst.strip().replace("_", "")
        if raw and not raw.isdigit():
            raise TenancyConfigError(f"MAMBA_STREAM_FAIRNESS_BURST: expected a whole number (0 or more), got {burst!r}")
        return cls(enabled=flag in ("on", "1", "true", "yes", ""), weights=parsed,
                   burst=int(raw) if raw else cls.burst)

    def tag_weights(self, keyring) -> dict[str, float]:
        """The weights by principal tag (`Keyring.principal_tag`): what the engine and the server
        are given, never the names."""
        return {keyring.principal_tag(p): w for p, w in self.weights.items()}


async def apply_weights(client, task_queue: str, weights: Mapping[str, float]) -> bool:
    """Set `weights` (principal tag -> weight) as the server's fairness-weight overrides of
    `task_queue`, for its workflow and activity tasks. False (logged) where the server refuses:
    one without task-queue config, or a caller not allowed to set it; the worker serves on."""
    if not weights:
        return True
    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.workflowservice.v1 import UpdateTaskQueueConfigRequest
    from temporalio.service import RPCError

    for kind in (TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW, TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY):
        try:
            await client.workflow_service.update_task_queue_config(UpdateTaskQueueConfigRequest(
                namespace=client.namespace, identity=client.identity, task_queue=task_queue,
                task_queue_type=kind, set_fairness_weight_overrides=dict(weights)))
        except RPCError as exc:
            log.warning("the fairness weights of task queue %s were not set (%s): the server shares it "
                        "evenly between principals", task_queue, exc.message)
            return False
    log.info("fairness weights of %d principals set on task queue %s", len(weights), task_queue)
    return True


class Bursts:
    """The streams each principal (by tag) opened on this worker within the last `window` seconds:
    past `limit` of them, the next ones are a burst's (`opened` says so)."""

    def __init__(self, limit: int, window: float = BURST_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window, self.clock = limit, window, clock
        self._lock = threading.Lock()
        self._opened: dict[str, deque[float]] = {}
        self._swept = clock()

    def opened(self, owner: str) -> bool:
        """Count a stream `owner` opened now; True when it is past the limit (bulk)."""
        if self.limit <= 0:
            return False
        now = self.clock()
        with self._lock:
            times = self._opened.setdefault(owner, deque())
            while times and now - times[0] > self.window:
                times.popleft()
            times.append(now)
            if now - self._swept > self.window:  # idle principals are forgotten, once a window
                self._swept = now
                for other in [o for o, t in self._opened.items() if now - t[-1] > self.window]:
                    del self._opened[other]
            return len(times) > self.limit


async def demote(client, stream_id: str, fairness_key: str) -> bool:
    """Move the running stream `stream_id` to `workflows.BULK_PRIORITY_LEVEL`, keeping its
    fairness key (Temporal's UpdateWorkflowExecutionOptions: its next workflow tasks, and its
    continue-as-new runs, carry it). False (logged) where the server refuses."""
    from google.protobuf.field_mask_pb2 import FieldMask
    from temporalio.api.common.v1 import Priority, WorkflowExecution
    from temporalio.api.workflow.v1 import WorkflowExecutionOptions
    from temporalio.api.workflowservice.v1 import UpdateWorkflowExecutionOptionsRequest
    from temporalio.service import RPCError

    try:
        await client.workflow_service.update_workflow_execution_options(UpdateWorkflowExecutionOptionsRequest(
            namespace=client.namespace, identity=client.identity,
            workflow_execution=WorkflowExecution(workflow_id=stream_id),
            workflow_execution_options=WorkflowExecutionOptions(
                priority=Priority(priority_key=BULK_PRIORITY_LEVEL, fairness_key=fairness_key)),
            update_mask=FieldMask(paths=["priority"])))
    except RPCError as exc:
        global _refused_once
        level = logging.DEBUG if _refused_once else logging.WARNING  # a server that refuses one refuses all
        _refused_once = True
        log.log(level, "stream %s was not moved to the bulk priority level (%s): it stays at the default",
                stream_id, exc.message)
        return False
    return True


_refused_once = False

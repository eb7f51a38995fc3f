"""The orphan sweep: states that outlived their stream's workflow are found, counted and deleted.

A stream's states are destroyed by its workflow when it is cancelled (`dispose_stream`). A
workflow that ends any other way (terminated by an operator, failed, timed out) leaves them in
the store, and its hot state in a worker's slots; so does one whose history the server has already
forgotten. The sweep lists the store's streams and the ones this worker holds hot, asks Temporal
about each (the workflow id is the stream id), and deletes the states of those whose workflow is
not running and closed more than `grace_s` ago (a grace that leaves an operator time to look at a
failed stream's checkpoints): the blobs in the store, and the hot states zeroed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities._metrics import StreamMetrics
from activities._store import StateStore

__all__ = ["SweepReport", "sweep_orphans"]

log = logging.getLogger(__name__)


@dataclass
class SweepReport:
    checked: int = 0
    orphans: dict[str, str] = field(default_factory=dict)  # stream id -> why (workflow status)
    blobs_deleted: int = 0
    hot_released: int = 0


async def sweep_orphans(client: Client, store: StateStore, metrics: StreamMetrics | None = None, *,
                        grace_s: float = 3600.0, dry_run: bool = False, activities: Any = None) -> SweepReport:
    """Find (and unless `dry_run`, delete) the states of streams whose workflow is gone.

    Args:
        activities: this worker's `StreamActivities`, whose hot states are swept too.
    """
    report = SweepReport()
    now = time.time()
    hot = activities.hot_stream_ids() if activities is not None else set()
    for sid in sorted(set(store.stream_ids()) | hot):
        report.checked += 1
        try:
            desc = await client.get_workflow_handle(sid).describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            why = "workflow not found"
        else:
            if desc.status in (None, WorkflowExecutionStatus.RUNNING):
                continue
            closed = desc.close_time.timestamp() if desc.close_time else now
            if now - closed < grace_s:
                continue
            why = f"workflow {desc.status.name.lower()}"
        report.orphans[sid] = why
        if dry_run:
            continue
        n = store.delete_stream(stream_id=sid)
        released = activities.release_stream(sid) if sid in hot else 0
        report.blobs_deleted += n
        report.hot_released += released
        if metrics is not None and (n or released):  # another worker's sweep may have been first
            metrics.orphans.add(1, {"why": why})
            metrics.orphan_blobs.add(n)
        log.warning("orphaned stream %s (%s): %d blobs deleted, %d hot states zeroed", sid, why, n, released)
    return report

"""The orphan sweep: states that outlived their stream's workflow are found, counted and deleted.

A stream's states are destroyed by its workflow when it is cancelled (`dispose_stream`). A
workflow that ends any other way (terminated by an operator, failed, timed out) leaves them in
the store, and its hot state in a worker's slots; so does one whose history the server has already
forgotten. The sweep lists the store's streams and the ones this worker holds hot, asks Temporal
about each (the workflow id is the stream id), and deletes the states of those whose workflow is
not running and closed more than `grace_s` ago (a grace that leaves an operator time to look at a
failed stream's checkpoints): the blobs in the store, and the hot states zeroed.

"Not found" is the dangerous answer: asked of the wrong server, every live stream is not found.
So a store records its owner, the Temporal cluster and namespace whose workflows write it
(`claim_store`, at worker start-up), and the sweep refuses a store owned elsewhere, or owned by
no one yet. And a stream whose workflow is not found ages through the grace like any other: the
sweep records when it first saw it missing (a `missing` metadata record, first writer wins, so
every worker's sweep counts from the same moment), deletes it only once that is `grace_s` old,
and forgets the sighting if the workflow turns up again.

Given a worker's activities (and so the keyring), the sweep also rewrites keyed whatever an earlier
version left in clear (`activities.rekey_store`).

Each owner's KV segments (`activities.KVSegments`) are kept under a stream id of their own
(`seg.<owner tag>`) too, never taken for an orphan: given a worker's activities, the sweep deletes
the segments no checkpoint names any more, by their own rule (two sightings, `grace_s` apart).

The prefix store's entries (`activities.PrefixStore`) are kept under stream ids of their own
(`pfx.<scope>`), which no workflow has: the sweep never takes them for orphans. Given a worker's
activities it sweeps them by their own rule instead (`PrefixStore.sweep`: each scope within its
bytes bound, least recently used out first; a fill that never finished removed after the grace).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from temporalio.api.workflowservice.v1 import GetClusterInfoRequest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from mamba_stream.activities._metrics import StreamMetrics
from mamba_stream.activities._prefix import PrefixSweep, is_prefix_stream
from mamba_stream.activities._rekey import RekeyReport, rekey_store
from mamba_stream.activities._segments import SegmentSweep, is_segment_stream
from mamba_stream.activities._store import (
    StateStore,
    StoreError,
    StoreOwnedElsewhere,
    StoreOwner,
    since_of,
    since_record,
)

__all__ = ["SweepReport", "claim_store", "store_owner", "sweep_orphans"]

log = logging.getLogger(__name__)

OWNER_KIND, OWNER_NAME = "owner", "temporal"
MISSING_KIND = "missing"  # name: the stream id; data: {"since": unix time first seen missing}


@dataclass
class SweepReport:
    checked: int = 0
    orphans: dict[str, str] = field(default_factory=dict)  # stream id -> why (workflow status)
    blobs_deleted: int = 0
    hot_released: int = 0
    missing: dict[str, float] = field(default_factory=dict)  # workflow not found, within grace: first seen
    prefixes: PrefixSweep | None = None  # the prefix store's sweep (None: not swept, no worker's activities)
    segments: SegmentSweep | None = None  # the KV segments' sweep (None: not swept, no worker's activities)
    rekeyed: RekeyReport | None = None  # what was left in clear, rewritten keyed (None: no worker's activities)
    owner: StoreOwner | None = None  # the store's owner, as checked
    refused: str | None = None  # why nothing was swept (the store has no owner record)
    tmp_removed: int = 0  # what writers killed before they committed left in the store, removed


async def client_owner(client: Client) -> StoreOwner:
    """The cluster and namespace `client` talks to, as a store would record them."""
    info = await client.workflow_service.get_cluster_info(GetClusterInfoRequest())
    if not info.cluster_id:
        address = client.service_client.config.target_host
        raise StoreError(f"the Temporal server at {address} reports no cluster id")
    return StoreOwner(cluster_id=info.cluster_id, namespace=client.namespace, cluster_name=info.cluster_name)


def store_owner(store: StateStore) -> StoreOwner | None:
    """The owner recorded in `store`, or None when it has none (or cannot keep one)."""
    try:
        data = store.get_meta(kind=OWNER_KIND, name=OWNER_NAME)
    except NotImplementedError:
        return None
    return None if data is None else StoreOwner.from_bytes(data)


def _refuse(store: StateStore, recorded: StoreOwner, ours: StoreOwner) -> StoreOwnedElsewhere:
    return StoreOwnedElsewhere(
        f"store {store.url} belongs to {recorded}, not to {ours}: its streams are that cluster's "
        f"workflows; point MAMBA_STREAM_STORE at this cluster's store (or TEMPORAL_ADDRESS at the "
        f"store's cluster), or remove the store's owner record to hand the store over")


async def claim_store(client: Client, store: StateStore, *, write: bool = True) -> StoreOwner | None:
    """Record `client`'s cluster and namespace as the store's owner, or check that they are.

    The record is written put-if-absent, so of several workers starting at once one writes it
    and the others compare against it.

    Args:
        write: record the owner when the store has none (False: only check; None if none).

    Returns:
        The store's owner (ours), or None when `write` is False and none is recorded.

    Raises:
        StoreOwnedElsewhere: the store belongs to another cluster or namespace.
    """
    ours = await client_owner(client)
    recorded = store_owner(store)
    if recorded is None and write:
        try:
            if store.put_meta_if_absent(kind=OWNER_KIND, name=OWNER_NAME, data=ours.to_bytes()):
                log.info("store %s claimed for %s", store.url, ours)
        except NotImplementedError:
            raise StoreError(f"{type(store).__name__} cannot record an owner; it cannot be claimed") from None
        recorded = store_owner(store)
    if recorded is None:
        return None
    if not recorded.same(ours):
        raise _refuse(store, recorded, ours)
    return recorded


def _first_missing(store: StateStore, sid: str, now: float, *, record: bool) -> float:
    """When the sweep first saw `sid`'s workflow missing (recording `now` if this is the first time)."""
    seen = since_of(store.get_meta(kind=MISSING_KIND, name=sid))
    if seen is None and record:
        store.put_meta_if_absent(kind=MISSING_KIND, name=sid, data=since_record(now))
        seen = since_of(store.get_meta(kind=MISSING_KIND, name=sid))  # another sweep's, if it was first
    return now if seen is None else seen


async def sweep_orphans(client: Client, store: StateStore, metrics: StreamMetrics | None = None, *,
                        grace_s: float = 3600.0, dry_run: bool = False, activities: Any = None,
                        claim: bool = False) -> SweepReport:
    """Find (and unless `dry_run`, delete) the states of streams whose workflow is gone.

    The store's owner is checked first: a store owned by another cluster or namespace raises,
    and one with no owner record is reported (`refused`) and left alone, since there is nothing
    to tell this server's "not found" from the wrong server's.

    Args:
        activities: this worker's `StreamActivities`, whose hot states are swept too.
        claim: record `client`'s cluster as the owner of a store that has none, then sweep.

    Raises:
        StoreOwnedElsewhere: the store belongs to another cluster or namespace.
    """
    report = SweepReport()
    report.owner = await claim_store(client, store, write=claim and not dry_run)
    if report.owner is None:
        report.refused = (f"store {store.url} has no owner record: nothing tells this server's streams from "
                          f"another's; a worker claims it at start-up (or sweep with claim)")
        log.warning("orphan sweep skipped: %s", report.refused)
        return report
    now = time.time()
    hot = activities.hot_stream_ids() if activities is not None else set()
    streams = sorted(sid for sid in set(store.stream_ids()) | hot
                     if not is_prefix_stream(sid) and not is_segment_stream(sid))
    marked = set(store.list_meta(kind=MISSING_KIND))
    for sid in streams:
        report.checked += 1
        try:
            desc = await client.get_workflow_handle(sid).describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            since = _first_missing(store, sid, now, record=not dry_run)
            if now - since < grace_s:
                report.missing[sid] = since
                continue
            why = "workflow not found"
        else:
            if sid in marked and not dry_run:  # it turned up again: a later absence starts afresh
                store.delete_meta(kind=MISSING_KIND, name=sid)
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
        store.delete_meta(kind=MISSING_KIND, name=sid)
        report.blobs_deleted += n
        report.hot_released += released
        if metrics is not None and (n or released):  # another worker's sweep may have been first
            metrics.orphans.add(1, {"why": why})
            metrics.orphan_blobs.add(n)
        log.warning("orphaned stream %s (%s): %d blobs deleted, %d hot states zeroed", sid, why, n, released)
    if not dry_run:  # sightings of streams deleted since (by their workflow or another sweep)
        for sid in marked - set(streams):
            store.delete_meta(kind=MISSING_KIND, name=sid)
        report.tmp_removed = store.sweep_tmp(older_than_s=grace_s)
        if report.tmp_removed:
            log.warning("orphan sweep: %d files of writers killed before they committed removed", report.tmp_removed)
        prefixes = getattr(activities, "prefixes", None)
        if prefixes is not None:
            report.prefixes = prefixes.sweep(grace_s=grace_s)
        if activities is not None:  # after the streams and prefixes it deleted: their segments are due
            report.segments = activities.commits.segments.sweep(grace_s=grace_s)
        if activities is not None:  # a store written before owners were tagged says nothing once swept
            report.rekeyed = rekey_store(store, activities.keyring, prefixes)
    return report

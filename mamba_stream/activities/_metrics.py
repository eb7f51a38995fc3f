"""The worker's own meters, exported beside Temporal's runtime telemetry.

`StreamMetrics` creates every meter on a Temporal `MetricMeter`: a worker whose `Runtime` has a
Prometheus endpoint (worker.py, `MAMBA_STREAM_METRICS`) serves them there, next to the SDK's
`temporal_*` series; with no telemetry configured they go to the no-op meter. Names, units and
labels are the contract of docs/metrics.md (tests read them back from the endpoint).

Lifecycle faults are counted where they are detected, so that they show as counters before they
show as odd generations: resumes refused by reason, stale ones among them, chunks delivered twice,
signed requests refused, states left behind by streams that ended without disposing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from temporalio.common import MetricMeter

from mamba_stream.state_codec import (
    CheckpointNotFound,
    ChunkSequenceMismatch,
    EpochMismatch,
    InputTransformMismatch,
    ModelRevisionMismatch,
    PositionMismatch,
    SchemaMismatch,
)

__all__ = ["HISTOGRAM_BUCKETS", "STALE_REASONS", "StreamMetrics"]

log = logging.getLogger(__name__)

#: refusals of a receipt that names a state which is no longer the one to continue from: dropped
#: by retention or disposal, left behind by a reset or a later chunk, or made by another model
#: revision or state schema (a rollout). Other reasons (principal, stream, corruption) are not stale.
STALE_REASONS = frozenset(c.reason for c in (
    CheckpointNotFound, ChunkSequenceMismatch, EpochMismatch, PositionMismatch, ModelRevisionMismatch,
    SchemaMismatch, InputTransformMismatch))

_LATENCY = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
#: bucket bounds for the Prometheus exporter (its defaults are for milliseconds)
HISTOGRAM_BUCKETS: dict[str, list[float]] = {
    "mamba_stream_time_to_first_output_seconds": _LATENCY,
    "mamba_stream_decode_step_seconds": _LATENCY,
    "mamba_stream_state_age_seconds": [1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 6 * 3600.0, 86400.0, 7 * 86400.0],
    "mamba_stream_drift_logits_abs": [1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0],
}

#: committed-at times remembered for the state-age histogram (oldest forgotten first)
_AGES_KEPT = 100_000


class StreamMetrics:
    """Every meter of the stream activities. Thread-safe (Temporal's meters are)."""

    def __init__(self, meter: MetricMeter | None = None) -> None:
        m = meter or MetricMeter.noop
        self.active_states = m.create_gauge(
            "mamba_stream_active_states", "streams whose state is held hot in this worker's slots")
        self.checkpoints_written = m.create_counter(
            "mamba_stream_checkpoints_written", "checkpoints sealed and stored by this worker")
        self.checkpoint_bytes = m.create_counter(
            "mamba_stream_checkpoint_bytes_written", "bytes of sealed checkpoints stored", "By")
        self.resume_failures = m.create_counter(
            "mamba_stream_resume_failures", "receipts or checkpoints refused, by reason")
        self.stale_resumes = m.create_counter(
            "mamba_stream_stale_resumes_rejected", "refused receipts naming a state that is no longer current")
        self.requests_rejected = m.create_counter(
            "mamba_stream_requests_rejected", "signed requests refused before touching state, by reason")
        self.resets = m.create_counter("mamba_stream_resets", "resets committed (a new epoch at position 0)")
        self.duplicate_chunks = m.create_counter(
            "mamba_stream_duplicate_chunks", "chunks delivered again after they committed; answered from the record")
        self.orphans = m.create_counter(
            "mamba_stream_orphaned_states_found", "streams whose states outlived their workflow (then deleted)")
        self.orphan_blobs = m.create_counter(
            "mamba_stream_orphaned_blobs_deleted", "blobs deleted with orphaned streams")
        self.state_age = m.create_histogram_float(
            "mamba_stream_state_age_seconds", "age of a committed state when it is next used", "s")
        self.migrations = m.create_counter(
            "mamba_stream_migrations", "states loaded from the store because this worker did not hold them")
        self.migration_bytes = m.create_counter(
            "mamba_stream_migration_bytes", "sealed bytes loaded by migrations", "By")
        self.time_to_first_output = m.create_histogram_float(
            "mamba_stream_time_to_first_output_seconds",
            "from the activity's start to the chunk's logits (advance) or first sampled token (generate)", "s")
        self.decode_step = m.create_histogram_float(
            "mamba_stream_decode_step_seconds", "between consecutive sampled tokens of a generate", "s")
        self.tokens = m.create_counter("mamba_stream_tokens", "tokens advanced, by kind (prefill, decode)")
        self.drift = m.create_histogram_float(
            "mamba_stream_drift_logits_abs", "max |logits - float64 reference| of a sampled chunk (reference check)")
        self.models_loaded = m.create_counter(
            "mamba_stream_models_loaded", "models this worker serves, by backend, path and arithmetic (path "
            "exact-twin: the exact kernels were not verified here and their twins run: the same bits, slower)")
        self.arithmetic_changes = m.create_counter(
            "mamba_stream_arithmetic_changes",
            "chunks that continued a state computed under another arithmetic (other bits), by model and backend")
        self.exact_mismatches = m.create_counter(
            "mamba_stream_exact_mismatches",
            "sampled chunks on an exact backend whose re-run in another partition gave other bits (should stay 0)")
        self.untyped_failures = m.create_counter(
            "mamba_stream_untyped_failures",
            "activity attempts that failed with an exception without a reason of its own, by exception class")
        self.consecutive_failures = m.create_gauge(
            "mamba_stream_consecutive_failures",
            "such failures in a row since this worker's last successful attempt (activities.WorkerHealth)")
        self.worker_unhealthy = m.create_counter(
            "mamba_stream_worker_unhealthy",
            "1 once this worker tripped: it stops taking work and exits (python worker.py: status 3)")
        self.prefix_hits = m.create_counter(
            "mamba_stream_prefix_hits", "opens with a prefix that started from a stored prefix state, by scope "
            "(principal, shared) and whether it was the whole prefix (full) or a shorter one (partial)")
        self.prefix_misses = m.create_counter(
            "mamba_stream_prefix_misses", "opens with a prefix no stored prefix state began (computed from position "
            "0); a worker whose arithmetic is not exact looks nothing up and counts neither")
        self.prefix_tokens = m.create_counter(
            "mamba_stream_prefix_tokens", "prefix tokens opened, by how (stored: loaded with a stored state; "
            "computed: prefilled, once for concurrent opens of the same prefix, counted when the computation ends)")
        self.prefix_bytes = m.create_counter(
            "mamba_stream_prefix_bytes_written", "bytes of sealed prefix states (and their logits) stored", "By")
        self.prefix_evictions = m.create_counter(
            "mamba_stream_prefix_evictions", "prefix states removed, by why (lru: the scope's bytes bound; "
            "incomplete: a fill that never finished; unreadable)")
        self.prefix_store_bytes = m.create_gauge(
            "mamba_stream_prefix_store_bytes", "bytes of prefix states in the store, as of the last sweep", "By")
        self.prefix_leases_lost = m.create_counter(
            "mamba_stream_prefix_leases_lost", "prefix fills whose lease was taken over while they computed (the "
            "worker stalled past the stale time): their writes refused by the lease's fence, nothing stored by them")
        self.quota_refusals = m.create_counter(
            "mamba_stream_quota_refusals", "requests refused at a principal's quota (QuotaExceeded), by quota "
            "(streams, chunks_in_flight, state_bytes, prefix_bytes: a prefix state larger than the bound, not stored)")
        self.bulk_streams = m.create_counter(
            "mamba_stream_bulk_streams", "streams moved to the bulk priority level: a principal's burst of new "
            "streams on this worker (MAMBA_STREAM_FAIRNESS_BURST), whose workflow tasks yield to everyone's")
        self._committed_at: OrderedDict[str, float] = OrderedDict()
        self._migration_count = 0
        self._count_lock = threading.Lock()

    # --- helpers the activities call ------------------------------------------------------------

    def refused(self, reason: str, model_id: str) -> None:
        """A resume refused for `reason`; stale reasons are counted twice (by reason, and as stale)."""
        self.resume_failures.add(1, {"reason": reason, "model": model_id})
        if reason in STALE_REASONS:
            self.stale_resumes.add(1, {"model": model_id})

    def committed(self, state_key: str, size: int, model_id: str, *, at: float | None = None) -> None:
        self.checkpoints_written.add(1, {"model": model_id})
        self.checkpoint_bytes.add(size, {"model": model_id})
        self.note_commit(state_key, at)

    def note_commit(self, state_key: str, at: float | None = None) -> None:
        self._committed_at[state_key] = time.time() if at is None else at
        self._committed_at.move_to_end(state_key)
        while len(self._committed_at) > _AGES_KEPT:
            self._committed_at.popitem(last=False)

    def used(self, state_key: str, model_id: str) -> None:
        """A committed state is used again: its age goes into the histogram (when it is known)."""
        at = self._committed_at.get(state_key)
        if at is not None:
            self.state_age.record(max(0.0, time.time() - at), {"model": model_id})

    def committed_at(self, state_key: str) -> float | None:
        return self._committed_at.get(state_key)

    def migrated(self, size: int, model_id: str) -> None:
        """A state loaded from the store because this worker did not hold it (another worker's
        stream, an eviction, a resume), `size` sealed bytes: a migration."""
        self.migrations.add(1, {"model": model_id})
        self.migration_bytes.add(size, {"model": model_id})
        with self._count_lock:
            self._migration_count += 1

    # --- read back in-process (a meter is write-only: its values are the exporter's) ----------

    @property
    def migration_count(self) -> int:
        """Migrations counted by this instance, every model's (`mamba_stream_migrations`)."""
        return self._migration_count

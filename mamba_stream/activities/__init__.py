"""Worker-side pieces: the stream activities, the models they serve, their engines (slot tables and
batching), state stores.

    from mamba_stream.activities import open_store
    store = open_store("file:///var/lib/mamba-stream")     # or postgresql://user@host/db
    store.put_if_absent(key=receipt.state_key, data=blob, stream_id=..., owner=keyring.principal_tag(...))
"""

from mamba_stream.activities._alloc import RELEASE_BYTES, release_freed, tune_allocator
from mamba_stream.activities._fairness import (
    BURST_WINDOW_S,
    Bursts,
    Fairness,
    Quotas,
    TenancyConfigError,
    apply_weights,
    demote,
)
from mamba_stream.activities._file_store import FileStateStore
from mamba_stream.activities._health import WorkerHealth
from mamba_stream.activities._memory_store import MemoryStateStore
from mamba_stream.activities._store import (
    Fence,
    InvalidStoreKey,
    LeaseLost,
    LegacyObject,
    StateStore,
    StoreCorrupt,
    StoreError,
    StoreOwnedElsewhere,
    StoreOwner,
    StoreUnavailable,
    StoreUsage,
    open_store,
)

__all__ = [
    "BURST_WINDOW_S",
    "HISTOGRAM_BUCKETS",
    "RELEASE_BYTES",
    "Bursts",
    "Fairness",
    "Fence",
    "FileStateStore",
    "InvalidStoreKey",
    "KVSegments",
    "LeaseLost",
    "LegacyObject",
    "MemoryStateStore",
    "ModelRegistry",
    "PostgresStateStore",
    "PrefixStore",
    "PrefixSweep",
    "Quotas",
    "RekeyReport",
    "SegmentSweep",
    "SlotTable",
    "StateStore",
    "StoreCorrupt",
    "StoreError",
    "StoreOwnedElsewhere",
    "StoreOwner",
    "StoreUnavailable",
    "StoreUsage",
    "StreamActivities",
    "StreamEngine",
    "StreamMetrics",
    "SweepReport",
    "TenancyConfigError",
    "WorkerHealth",
    "apply_weights",
    "claim_store",
    "demote",
    "open_store",
    "rekey_store",
    "release_freed",
    "sweep_orphans",
    "tune_allocator",
]


def __getattr__(name: str):
    # Imported on first use: psycopg is optional, and the stream activities pull in torch.
    if name == "PostgresStateStore":
        from mamba_stream.activities._pg_store import PostgresStateStore

        return PostgresStateStore
    homes = {"StreamActivities": "_activities", "ModelRegistry": "_registry", "StreamEngine": "_engine",
             "SlotTable": "_slots", "StreamMetrics": "_metrics", "HISTOGRAM_BUCKETS": "_metrics",
             "SweepReport": "_sweep", "sweep_orphans": "_sweep",
             "claim_store": "_sweep", "PrefixStore": "_prefix", "PrefixSweep": "_prefix",
             "RekeyReport": "_rekey", "rekey_store": "_rekey", "KVSegments": "_segments",
             "SegmentSweep": "_segments"}
    if name in homes:
        import importlib

        return getattr(importlib.import_module(f"mamba_stream.activities.{homes[name]}"), name)
    raise AttributeError(name)

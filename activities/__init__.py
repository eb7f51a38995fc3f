"""Worker-side pieces: the stream activities, the models they serve, their hot cache, state stores.

    from activities import open_store
    store = open_store("file:///var/lib/mamba-stream")     # or postgresql://user@host/db
    store.put_if_absent(key=receipt.state_key, data=blob, stream_id=..., principal=...)
"""

from activities._file_store import FileStateStore
from activities._store import (
    InvalidStoreKey,
    StateStore,
    StoreCorrupt,
    StoreError,
    StoreUnavailable,
    StoreUsage,
    open_store,
)

__all__ = [
    "FileStateStore",
    "HotCache",
    "InvalidStoreKey",
    "ModelRegistry",
    "PostgresStateStore",
    "StateStore",
    "StoreCorrupt",
    "StoreError",
    "StoreUnavailable",
    "StoreUsage",
    "StreamActivities",
    "open_store",
]


def __getattr__(name: str):
    # Imported on first use: psycopg is optional, and the stream activities pull in torch.
    if name == "PostgresStateStore":
        from activities._pg_store import PostgresStateStore

        return PostgresStateStore
    if name in ("StreamActivities", "ModelRegistry", "HotCache"):
        from activities import _hot, _stream

        return getattr(_stream if name == "StreamActivities" else _hot, name)
    raise AttributeError(name)

"""Worker-side pieces: state stores now; the stream activities land with the Temporal plugin.

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
    "InvalidStoreKey",
    "PostgresStateStore",
    "StateStore",
    "StoreCorrupt",
    "StoreError",
    "StoreUnavailable",
    "StoreUsage",
    "open_store",
]


def __getattr__(name: str):  # psycopg is optional: import the PostgreSQL store on first use
    if name == "PostgresStateStore":
        from activities._pg_store import PostgresStateStore

        return PostgresStateStore
    raise AttributeError(name)

"""State stores: where encrypted checkpoint blobs live, keyed by content-derived state keys.

One interface, two backends chosen by URL: `file:///var/lib/mamba-stream` (one machine) and
`postgresql://user@host/db` (shared by every worker). Writes are put-if-absent: a retried
activity that recomputes the same state key finds the first write and keeps it. Reads are
filtered by principal: a blob is never handed to another tenant, not even as ciphertext.

Beside the blobs a store keeps a little metadata (`get_meta`, `put_meta_if_absent`, ...): which
Temporal cluster and namespace own it, and when the orphan sweep first saw a stream's workflow
missing. Metadata is never a stream, a checkpoint or part of `usage()`.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Union

__all__ = [
    "InvalidStoreKey",
    "StateStore",
    "StoreCorrupt",
    "StoreError",
    "StoreOwnedElsewhere",
    "StoreOwner",
    "StoreUnavailable",
    "StoreUsage",
    "open_store",
]

Blob = Union[bytes, bytearray, memoryview]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")


class StoreError(Exception):
    """A store operation failed. `retryable` says whether trying again may help."""

    retryable: bool = False
    reason: str = "StoreError"


class StoreUnavailable(StoreError):
    """The backend is unreachable or busy (connection refused, timeout, disk full)."""

    retryable = True
    reason = "StoreUnavailable"


class StoreCorrupt(StoreError):
    """A stored object no longer matches its digest."""

    reason = "StoreCorrupt"


class StoreOwnedElsewhere(StoreError):
    """The store belongs to another Temporal cluster or namespace.

    That cluster's workflows own the streams in it: swept from here every one of them looks
    forgotten, and a worker serving here would write streams that cluster's sweep cannot see.
    Retrying cannot help; the store or the address is misconfigured.
    """

    reason = "StoreOwnedElsewhere"


class InvalidStoreKey(StoreError, ValueError):
    """A key or stream id outside [A-Za-z0-9._-], or empty, or too long."""

    reason = "InvalidStoreKey"


def since_record(when: float, **more: str) -> bytes:
    """A metadata record of when something was first seen or taken (`{"since": when, ...}`): the
    sweep's sightings, the prefix store's leases."""
    return json.dumps({"since": when, **more}).encode()


def since_of(data: bytes | None) -> float | None:
    """The time in a `since_record` (None: no record). StoreCorrupt if it is not one."""
    if data is None:
        return None
    try:
        return float(json.loads(data)["since"])
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreCorrupt(f"unreadable metadata record ({exc})") from None


def check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value) or value in (".", ".."):
        raise InvalidStoreKey(f"{kind} {value!r} must match {_NAME.pattern}")
    return value


@dataclass(frozen=True)
class StoreOwner:
    """The Temporal cluster and namespace whose workflows own a store's streams.

    Two owners are the same when cluster id and namespace match; `cluster_name` is for people.
    """

    cluster_id: str
    namespace: str
    cluster_name: str = ""

    def same(self, other: StoreOwner) -> bool:
        return (self.cluster_id, self.namespace) == (other.cluster_id, other.namespace)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> StoreOwner:
        try:
            obj = json.loads(data)
            return cls(cluster_id=str(obj["cluster_id"]), namespace=str(obj["namespace"]),
                       cluster_name=str(obj.get("cluster_name", "")))
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreCorrupt(f"unreadable owner record ({exc})") from None

    def __str__(self) -> str:
        name = f" ({self.cluster_name})" if self.cluster_name else ""
        return f"cluster {self.cluster_id}{name}, namespace {self.namespace}"


@dataclass(frozen=True)
class StoreUsage:
    objects: int
    bytes: int
    streams: int


class StateStore(ABC):
    """Put-if-absent blob storage, partitioned by stream, readable only by the owning principal."""

    url: str

    @abstractmethod
    def put_if_absent(self, *, key: str, data: Blob, stream_id: str, principal: str) -> bool:
        """Store `data` under `key` unless the key exists. True if this call wrote it."""

    @abstractmethod
    def get(self, *, key: str, principal: str) -> bytes | None:
        """The blob under `key` if it exists and belongs to `principal`; None otherwise."""

    @abstractmethod
    def delete(self, *, key: str, stream_id: str, principal: str) -> bool:
        """Remove one object of `stream_id` and `principal`. True if it existed and was theirs: an
        object of another stream or principal is left alone (False), whatever the key says."""

    @abstractmethod
    def delete_stream(self, *, stream_id: str) -> int:
        """Remove every object of a stream; returns how many."""

    @abstractmethod
    def list_stream(self, *, stream_id: str) -> list[str]:
        """Keys of a stream's objects, sorted."""

    def stream_ids(self) -> list[str]:
        """Ids of the streams that hold objects, sorted (for the orphan sweep)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its streams")

    @abstractmethod
    def usage(self) -> StoreUsage:
        """Objects, bytes and streams held."""

    # Metadata: small records in namespaces (`kind`), apart from the blobs. Not abstract, so a
    # store written before them still loads; the sweep refuses to delete from such a store.

    def get_meta(self, *, kind: str, name: str) -> bytes | None:
        """The metadata record `kind`/`name`, or None."""
        raise NotImplementedError(f"{type(self).__name__} keeps no metadata")

    def put_meta_if_absent(self, *, kind: str, name: str, data: bytes) -> bool:
        """Write a metadata record unless it exists (first writer wins). True if this call wrote it."""
        raise NotImplementedError(f"{type(self).__name__} keeps no metadata")

    def put_meta(self, *, kind: str, name: str, data: bytes) -> None:
        """Write a metadata record, replacing one that exists (last writer wins)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no metadata")

    def delete_meta(self, *, kind: str, name: str) -> bool:
        """Remove a metadata record. True if it existed."""
        raise NotImplementedError(f"{type(self).__name__} keeps no metadata")

    def read_meta(self, *, kind: str) -> dict[str, bytes]:
        """Every metadata record of `kind`, by name, in one read."""
        raise NotImplementedError(f"{type(self).__name__} keeps no metadata")

    def list_meta(self, *, kind: str) -> list[str]:
        """Names of the metadata records of `kind`, sorted."""
        raise NotImplementedError(f"{type(self).__name__} keeps no metadata")

    def close(self) -> None:
        """Release connections or handles."""

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(url: str) -> StateStore:
    """A store from its URL: `file:///abs/path`, `file:relative/path`, or `postgresql://...`.

    PostgreSQL URLs take an optional `table=` query parameter (default `mamba_state_blobs`).
    """
    if url.startswith("file:"):
        from activities._file_store import FileStateStore

        path = url[len("file://") :] if url.startswith("file://") else url[len("file:") :]
        return FileStateStore(path)
    if url.startswith(("postgresql://", "postgres://")):
        from activities._pg_store import PostgresStateStore

        return PostgresStateStore(url)
    raise StoreError(f"unsupported store URL {url!r}; use file:// or postgresql://")

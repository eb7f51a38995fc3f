"""State stores: where encrypted checkpoint blobs live, keyed by content-derived state keys.

One interface, two backends chosen by URL: `file:///var/lib/mamba-stream` (one machine) and
`postgresql://user@host/db` (shared by every worker). Writes are put-if-absent: a retried
activity that recomputes the same state key finds the first write and keeps it. Reads are
filtered by owner: a blob is never handed to another tenant, not even as ciphertext.

A store holds nothing in clear that names a principal or what a state is: an object's owner is
the principal's keyed tag (`Keyring.principal_tag`: the tag stream ids already carry, an HMAC under the
workers' keyring, never the name), its key and stream id are keyed values too, and the blob is
sealed. A store's own integrity check is the blob's authentication tag (read by whoever decodes
it); a store keeps no digest of its own. What a reader of the store's files still sees is listed
in docs/release/threat-model.md: sizes, counts, times, and which objects share an owner.

Stores written before owners were tagged hold the principal's name, and a digest, per object
("legacy" objects). They are still read: `get` and `delete` take the name as `legacy`, matched
against legacy objects only. `legacy_objects` lists them and `rewrite` turns one into a tagged one
(`activities.rekey_store`, run by every worker's sweep and by `mamba-stream rekey-store`).

Beside the blobs a store keeps a little metadata (`get_meta`, `put_meta_if_absent`, ...): which
Temporal cluster and namespace own it, when the orphan sweep first saw a stream's workflow
missing, and the prefix store's index, scopes and fill leases. Metadata is never a stream, a
checkpoint or part of `usage()`. `swap_meta` is a compare-and-set of one record; a write may be
fenced (`Fence`): it happens only while a metadata record (a lease) still starts with a token
(its generation), atomically with the check, else it raises `LeaseLost` and writes nothing.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

from mamba_stream.failures import Failure
from mamba_stream.state_codec import stream_id_head

__all__ = [
    "Fence",
    "InvalidStoreKey",
    "LeaseLost",
    "LegacyObject",
    "StateStore",
    "StoreCorrupt",
    "StoreError",
    "StoreOwnedElsewhere",
    "StoreOwner",
    "StoreUnavailable",
    "StoreUsage",
    "open_store",
]

Blob = bytes | bytearray | memoryview

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")


class StoreError(Failure):
    """A store operation failed. `retryable` says whether trying again may help."""


class StoreUnavailable(StoreError):
    """The backend is unreachable or busy (connection refused, timeout, disk full)."""

    retryable = True


class StoreCorrupt(StoreError):
    """A stored object no longer matches its digest."""


class StoreOwnedElsewhere(StoreError):
    """The store belongs to another Temporal cluster or namespace.

    That cluster's workflows own the streams in it: swept from here every one of them looks
    forgotten, and a worker serving here would write streams that cluster's sweep cannot see.
    Retrying cannot help; the store or the address is misconfigured.
    """


class LeaseLost(StoreError):
    """A fenced write was refused: the lease it was conditional on is no longer the writer's (it
    went stale and another worker took it over). Nothing was written; retrying cannot help."""


class InvalidStoreKey(StoreError, ValueError):
    """A key or stream id outside [A-Za-z0-9._-], or empty, or too long."""


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
class Fence:
    """A condition on a write: the metadata record `kind`/`name` exists and its data starts with
    `token` (a lease's generation), checked atomically with the write."""

    kind: str
    name: str
    token: bytes

    def holds(self, data: bytes | None) -> bool:
        return data is not None and data.startswith(self.token)


@dataclass(frozen=True)
class LegacyObject:
    """An object written before owners were tagged: its key, stream and principal's name."""

    key: str
    stream_id: str
    principal: str


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
    """Put-if-absent blob storage, partitioned by stream, readable only by the owning principal.

    `owner` is always the principal's keyed tag (`Keyring.principal_tag`), never its name; `legacy`, where a
    method takes it, is the name, matched against legacy objects only (see the module docstring).
    """

    url: str

    @abstractmethod
    def put_if_absent(self, *, key: str, data: Blob, stream_id: str, owner: str, fence: Fence | None = None) -> bool:
        """Store `data` under `key` unless the key exists. True if this call wrote it.
        With `fence`: LeaseLost (nothing written) unless the fence holds."""

    @abstractmethod
    def get(self, *, key: str, owner: str, legacy: str | None = None) -> bytes | None:
        """The blob under `key` if it exists and belongs to `owner` (or is a legacy object of the
        principal named `legacy`); None otherwise."""

    @abstractmethod
    def delete(self, *, key: str, stream_id: str, owner: str, legacy: str | None = None,
               fence: Fence | None = None) -> bool:
        """Remove one object of `stream_id` and `owner` (or a legacy object of `legacy`). True if it
        existed and was theirs: an object of another stream or owner is left alone (False),
        whatever the key says. With `fence`: nothing is deleted (False) unless the fence holds,
        checked atomically with the delete (the KV segments' sweep deletes under its sighting)."""

    @abstractmethod
    def delete_stream(self, *, stream_id: str) -> int:
        """Remove every object of a stream; returns how many."""

    @abstractmethod
    def list_stream(self, *, stream_id: str) -> list[str]:
        """Keys of a stream's objects, sorted."""

    def stream_ids(self) -> list[str]:
        """Ids of the streams that hold objects, sorted (for the orphan sweep)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its streams")

    def streams_of(self, tag: str) -> list[str]:
        """The streams holding objects whose ids name principal tag `tag` (`ms.<tag>.<hex>`):
        what the `streams` quota counts."""
        head = stream_id_head(tag)
        return [sid for sid in self.stream_ids() if sid.startswith(head)]

    @abstractmethod
    def usage(self) -> StoreUsage:
        """Objects, bytes and streams held."""

    def sweep_tmp(self, older_than_s: float = 3600.0) -> int:
        """Remove what writers that died before committing left behind, older than `older_than_s`
        (the orphan sweep's grace); how many. A store whose writes are atomic leaves nothing."""
        return 0

    def legacy_objects(self) -> list[LegacyObject]:
        """The objects written before owners were tagged (their principal's name in clear)."""
        return []

    def rewrite(self, *, key: str, data: Blob, owner: str, legacy: str) -> bool:
        """Replace the legacy object `key` of the principal named `legacy` by `data`, owned by
        `owner` (its tag), atomically: readers see the old object or the new one. False if it is
        no longer a legacy object of `legacy` (rewritten or deleted meanwhile)."""
        raise NotImplementedError(f"{type(self).__name__} holds no legacy objects")

    # Metadata: small records in namespaces (`kind`), apart from the blobs. Not abstract, so a
    # store written before them still loads; the sweep refuses to delete from such a store.

    def get_meta(self, *, kind: str, name: str) -> bytes | None:
        """The metadata record `kind`/`name`, or None."""
        raise NotImplementedError(f"{type(self).__name__} keeps no metadata")

    def put_meta_if_absent(self, *, kind: str, name: str, data: bytes) -> bool:
        """Write a metadata record unless it exists (first writer wins). True if this call wrote it."""
        raise NotImplementedError(f"{type(self).__name__} keeps no metadata")

    def put_meta(self, *, kind: str, name: str, data: bytes, fence: Fence | None = None) -> None:
        """Write a metadata record, replacing one that exists (last writer wins). With `fence`:
        LeaseLost (nothing written) unless the fence holds."""
        raise NotImplementedError(f"{type(self).__name__} keeps no metadata")

    def swap_meta(self, *, kind: str, name: str, expect: bytes | None, data: bytes | None) -> bool:
        """Compare-and-set: if the record `kind`/`name` holds exactly `expect` (None: there is no
        such record), make it `data` (None: remove it) and return True; else change nothing, False."""
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

    def close(self) -> None:  # noqa: B027 - a default, not abstract: a store without connections has none to release
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
        from mamba_stream.activities._file_store import FileStateStore

        path = url[len("file://") :] if url.startswith("file://") else url[len("file:") :]
        return FileStateStore(path)
    if url.startswith(("postgresql://", "postgres://")):
        from mamba_stream.activities._pg_store import PostgresStateStore

        return PostgresStateStore(url)
    raise StoreError(f"unsupported store URL {url!r}; use file:// or postgresql://")

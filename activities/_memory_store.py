"""An in-memory state store: the store interface without a disk or a database.

For unit tests of the layers above the store (the commit protocol, the activities through
`ActivityEnvironment`) and for single-process experiments: nothing survives the process, and
nothing is shared with another worker. Same semantics as the real stores: put-if-absent, reads
filtered by principal, names checked.
"""

from __future__ import annotations

import threading

from activities._store import Blob, StateStore, StoreUsage, check_name

__all__ = ["MemoryStateStore"]


class MemoryStateStore(StateStore):
    """Blobs in a dict, guarded by a lock (activities run on threads)."""

    def __init__(self) -> None:
        self.url = "memory:"
        self._lock = threading.Lock()
        self._blobs: dict[str, tuple[bytes, str, str]] = {}  # key -> (data, stream id, principal)
        self._meta: dict[tuple[str, str], bytes] = {}

    def put_if_absent(self, *, key: str, data: Blob, stream_id: str, principal: str) -> bool:
        check_name("key", key)
        check_name("stream id", stream_id)
        with self._lock:
            if key in self._blobs:
                return False
            self._blobs[key] = (bytes(data), stream_id, principal)
            return True

    def get(self, *, key: str, principal: str) -> bytes | None:
        check_name("key", key)
        with self._lock:
            hit = self._blobs.get(key)
        return hit[0] if hit is not None and hit[2] == principal else None

    def delete(self, *, key: str, stream_id: str, principal: str) -> bool:
        check_name("key", key)
        with self._lock:
            hit = self._blobs.get(key)
            if hit is None or (hit[1], hit[2]) != (stream_id, principal):
                return False
            del self._blobs[key]
            return True

    def delete_stream(self, *, stream_id: str) -> int:
        check_name("stream id", stream_id)
        with self._lock:
            keys = [k for k, v in self._blobs.items() if v[1] == stream_id]
            for k in keys:
                del self._blobs[k]
            return len(keys)

    def list_stream(self, *, stream_id: str) -> list[str]:
        check_name("stream id", stream_id)
        with self._lock:
            return sorted(k for k, v in self._blobs.items() if v[1] == stream_id)

    def stream_ids(self) -> list[str]:
        with self._lock:
            return sorted({v[1] for v in self._blobs.values()})

    def usage(self) -> StoreUsage:
        with self._lock:
            return StoreUsage(objects=len(self._blobs), bytes=sum(len(v[0]) for v in self._blobs.values()),
                              streams=len({v[1] for v in self._blobs.values()}))

    def get_meta(self, *, kind: str, name: str) -> bytes | None:
        with self._lock:
            return self._meta.get((kind, name))

    def put_meta_if_absent(self, *, kind: str, name: str, data: bytes) -> bool:
        with self._lock:
            if (kind, name) in self._meta:
                return False
            self._meta[(kind, name)] = bytes(data)
            return True

    def delete_meta(self, *, kind: str, name: str) -> bool:
        with self._lock:
            return self._meta.pop((kind, name), None) is not None

    def list_meta(self, *, kind: str) -> list[str]:
        with self._lock:
            return sorted(n for k, n in self._meta if k == kind)

    def put_meta(self, *, kind: str, name: str, data: bytes) -> None:
        check_name("metadata kind", kind)
        check_name("metadata name", name)
        with self._lock:
            self._meta[(kind, name)] = bytes(data)

    def read_meta(self, *, kind: str) -> dict[str, bytes]:
        with self._lock:
            return {n: d for (k, n), d in sorted(self._meta.items()) if k == kind}

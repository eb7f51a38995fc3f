"""An in-memory state store: the store interface without a disk or a database.

For unit tests of the layers above the store (the commit protocol, the activities through
`ActivityEnvironment`) and for single-process experiments: nothing survives the process, and
nothing is shared with another worker. Same semantics as the real stores: put-if-absent, reads
filtered by owner, names checked, fences and compare-and-set atomic.
"""

from __future__ import annotations

import threading

from mamba_stream.activities._store import Blob, Fence, LeaseLost, LegacyObject, StateStore, StoreUsage, check_name

__all__ = ["MemoryStateStore"]


class MemoryStateStore(StateStore):
    """Blobs in a dict, guarded by a lock (activities run on threads). `legacy` holds objects as a
    store written before owners were tagged would (tests of the migration)."""

    def __init__(self) -> None:
        self.url = "memory:"
        self._lock = threading.Lock()
        self._blobs: dict[str, tuple[bytes, str, str]] = {}  # key -> (data, stream id, owner)
        self._legacy: set[str] = set()  # keys whose owner is a principal's name
        self._meta: dict[tuple[str, str], bytes] = {}

    def _fenced(self, fence: Fence | None) -> None:
        """LeaseLost unless `fence` holds (the lock held)."""
        if fence is not None and not fence.holds(self._meta.get((fence.kind, fence.name))):
            raise LeaseLost(f"the lease {fence.kind}/{fence.name} is no longer the writer's")

    def _mine(self, key: str, owner: str, legacy: str | None) -> bool:
        hit = self._blobs.get(key)
        if hit is None:
            return False
        return hit[2] == legacy if key in self._legacy else hit[2] == owner

    def put_if_absent(self, *, key: str, data: Blob, stream_id: str, owner: str, fence: Fence | None = None) -> bool:
        check_name("key", key)
        check_name("stream id", stream_id)
        with self._lock:
            self._fenced(fence)
            if key in self._blobs:
                return False
            self._blobs[key] = (bytes(data), stream_id, owner)
            return True

    def put_legacy(self, *, key: str, data: Blob, stream_id: str, principal: str) -> None:
        """An object as a store written before owners were tagged holds it (tests)."""
        with self._lock:
            self._blobs[key] = (bytes(data), stream_id, principal)
            self._legacy.add(key)

    def get(self, *, key: str, owner: str, legacy: str | None = None) -> bytes | None:
        check_name("key", key)
        with self._lock:
            return self._blobs[key][0] if self._mine(key, owner, legacy) else None

    def delete(self, *, key: str, stream_id: str, owner: str, legacy: str | None = None,
               fence: Fence | None = None) -> bool:
        check_name("key", key)
        with self._lock:
            if not self._mine(key, owner, legacy) or self._blobs[key][1] != stream_id:
                return False
            if fence is not None and not fence.holds(self._meta.get((fence.kind, fence.name))):
                return False
            del self._blobs[key]
            self._legacy.discard(key)
            return True

    def delete_stream(self, *, stream_id: str) -> int:
        check_name("stream id", stream_id)
        with self._lock:
            keys = [k for k, v in self._blobs.items() if v[1] == stream_id]
            for k in keys:
                del self._blobs[k]
                self._legacy.discard(k)
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

    def legacy_objects(self) -> list[LegacyObject]:
        with self._lock:
            return [LegacyObject(k, self._blobs[k][1], self._blobs[k][2]) for k in sorted(self._legacy)]

    def rewrite(self, *, key: str, data: Blob, owner: str, legacy: str) -> bool:
        with self._lock:
            if key not in self._legacy or self._blobs[key][2] != legacy:
                return False
            self._blobs[key] = (bytes(data), self._blobs[key][1], owner)
            self._legacy.discard(key)
            return True

    def get_meta(self, *, kind: str, name: str) -> bytes | None:
        with self._lock:
            return self._meta.get((kind, name))

    def put_meta_if_absent(self, *, kind: str, name: str, data: bytes) -> bool:
        with self._lock:
            if (kind, name) in self._meta:
                return False
            self._meta[(kind, name)] = bytes(data)
            return True

    def swap_meta(self, *, kind: str, name: str, expect: bytes | None, data: bytes | None) -> bool:
        check_name("metadata kind", kind)
        check_name("metadata name", name)
        with self._lock:
            if self._meta.get((kind, name)) != (None if expect is None else bytes(expect)):
                return False
            if data is None:
                self._meta.pop((kind, name), None)
            else:
                self._meta[(kind, name)] = bytes(data)
            return True

    def delete_meta(self, *, kind: str, name: str) -> bool:
        with self._lock:
            return self._meta.pop((kind, name), None) is not None

    def list_meta(self, *, kind: str) -> list[str]:
        with self._lock:
            return sorted(n for k, n in self._meta if k == kind)

    def put_meta(self, *, kind: str, name: str, data: bytes, fence: Fence | None = None) -> None:
        check_name("metadata kind", kind)
        check_name("metadata name", name)
        with self._lock:
            self._fenced(fence)
            self._meta[(kind, name)] = bytes(data)

    def read_meta(self, *, kind: str) -> dict[str, bytes]:
        with self._lock:
            return {n: d for (k, n), d in sorted(self._meta.items()) if k == kind}

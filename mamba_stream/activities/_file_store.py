"""The file state store: one file per blob, committed atomically, readable by its owner only.

Layout under the root:

    objects/<xx>/<key>      the blob, behind a small header (`MSSB\x02`, then JSON: stream id,
                            owner tag, size); xx = first two hex digits of sha256(key), to keep
                            directories small
    streams/<stream>/<key>  empty markers, written before the object, for list/delete by stream
    tmp/                    objects being written
    meta/<kind>/<name>      metadata records (the owner, the sweep's first sightings, the prefix
                            store's index and leases), not blobs
    locks/meta.lock         taken (flock) by compare-and-set, fenced writes, deletes and rewrites

A write goes to tmp/ with mode 0600, is fsynced, then hard-linked to its final name: `link`
fails if the name exists, which makes put-if-absent atomic across threads and processes, and a
writer killed at any point leaves at most a file in tmp/, never a partial object. A fenced write
is fsynced first, then checked and linked under the lock: the check and the commit are one step
for every other process that takes the lock, and a lease changes only under it (`swap_meta`).

An object written before owners were tagged (`MSSB\x01`: key, stream id, the principal's name
and a sha256 in clear) is still read, by the name, and `rewrite` replaces it by a tagged one under
the lock (so that a delete of the same object cannot run between its check and its replace).

Cleanup after a failure (the tmp file, a descriptor) never raises over the failure itself: on a
read-only or broken file system the cleanup fails too, and its error would hide the real one.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from mamba_stream.activities._store import (
    Blob,
    Fence,
    LeaseLost,
    LegacyObject,
    StateStore,
    StoreCorrupt,
    StoreError,
    StoreUnavailable,
    StoreUsage,
    check_name,
)
from mamba_stream.state_codec import stream_id_head

__all__ = ["FileStateStore"]

log = logging.getLogger(__name__)

_MAGIC = b"MSSB\x02"
#: an object written before owners were tagged: its header names the principal and a sha256
_LEGACY_MAGIC = b"MSSB\x01"
_CHUNK = 8 << 20


def _os_error(exc: OSError, what: str) -> StoreError:
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StoreError(f"{what}: {exc}")
    return StoreUnavailable(f"{what}: {exc}")  # ENOSPC, EIO, EMFILE...: may pass


def _quiet_unlink(path: Path) -> None:
    """Best-effort removal during cleanup: a failure is logged, never raised over the real error."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.debug("cleanup: cannot remove %s: %s", path, exc)


def _quiet_close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError as exc:
        log.debug("cleanup: cannot close descriptor %d: %s", fd, exc)


def _link_making_parent(src: Path, dst: Path) -> None:
    """`os.link(src, dst)`, making `dst`'s directory when it is missing (a shard's first object)
    rather than asking for it before every link. FileExistsError when `dst` exists."""
    try:
        os.link(src, dst)
    except FileNotFoundError:
        dst.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.link(src, dst)


def _fsync_dir(path: Path) -> None:
    dfd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dfd)
    except BaseException:
        _quiet_close(dfd)
        raise
    os.close(dfd)


class FileStateStore(StateStore):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.url = f"file://{self.root}"
        try:
            for sub in ("objects", "streams", "tmp", "meta", "locks"):
                (self.root / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.root, 0o700)
        except OSError as exc:
            raise _os_error(exc, f"cannot create store at {self.root}") from exc
        # flock excludes other processes; the threads of this one share the descriptor, so a
        # mutex excludes them
        self._mutex = threading.Lock()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The store's lock, across threads and processes."""
        with self._mutex:
            fd = os.open(self.root / "locks" / "meta.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the flock

    def _check_fence(self, fence: Fence | None) -> None:
        """LeaseLost unless `fence` holds (the lock held)."""
        if fence is not None and not fence.holds(self.get_meta(kind=fence.kind, name=fence.name)):
            raise LeaseLost(f"the lease {fence.kind}/{fence.name} is no longer the writer's")

    # --- paths ------------------------------------------------------------------------------

    def _object(self, key: str) -> Path:
        shard = hashlib.sha256(key.encode()).hexdigest()[:2]
        return self.root / "objects" / shard / key

    def _marker(self, stream_id: str, key: str) -> Path:
        return self.root / "streams" / stream_id / key

    def _meta(self, kind: str, name: str) -> Path:
        return self.root / "meta" / check_name("metadata kind", kind) / check_name("metadata name", name)

    # --- writing ----------------------------------------------------------------------------

    def _write_chunk(self, fd: int, chunk: memoryview) -> None:
        """Write one chunk completely (a seam for tests that kill a writer midway)."""
        while len(chunk):
            n = os.write(fd, chunk)
            chunk = chunk[n:]

    def _write_synced(self, tmp: Path, chunks: list[memoryview]) -> None:
        """Write `chunks` to a new file `tmp` (0600) and fsync it. A descriptor is closed quietly
        only when the write already failed; after a good write, a failed close is the error."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            for chunk in chunks:
                for i in range(0, len(chunk), _CHUNK):
                    self._write_chunk(fd, chunk[i : i + _CHUNK])
            os.fsync(fd)
        except BaseException:
            _quiet_close(fd)
            raise
        os.close(fd)

    def _write_then_rename(self, tmp: Path, final: Path, chunks: list[memoryview], fence: Fence | None = None) -> bool:
        """Write `chunks` to `tmp`, fsync it, link it to `final`; False if `final` exists. With
        `fence`, the check and the link happen under the lock (LeaseLost if it does not hold).

        The caller removes `tmp` afterwards, whatever happened.
        """
        self._write_synced(tmp, chunks)
        try:
            if fence is None:
                _link_making_parent(tmp, final)  # the commit point
            else:
                with self._locked():
                    self._check_fence(fence)
                    _link_making_parent(tmp, final)
        except FileExistsError:
            return False
        _fsync_dir(final.parent)
        return True

    @staticmethod
    def _touch_marker(marker: Path) -> None:
        """The stream's marker of an object, made if missing (its directory too): one system call
        when both exist, as they do for every chunk of a stream after its first."""
        for attempt in (0, 1):
            try:
                os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
                return
            except FileNotFoundError:
                if attempt:
                    raise
                marker.parent.mkdir(parents=True, exist_ok=True, mode=0o700)

    @staticmethod
    def _head(stream_id: str, owner: str, size: int) -> memoryview:
        header = json.dumps({"stream_id": stream_id, "owner": owner, "size": size}).encode()
        return memoryview(_MAGIC + struct.pack("<I", len(header)) + header)

    def put_if_absent(self, *, key: str, data: Blob, stream_id: str, owner: str, fence: Fence | None = None) -> bool:
        check_name("key", key)
        check_name("stream id", stream_id)
        final = self._object(key)
        if final.exists():
            if fence is not None:
                with self._locked():
                    self._check_fence(fence)
            return False
        view = memoryview(data).cast("B")
        tmp = self.root / "tmp" / f"{key}.{uuid.uuid4().hex}.part"
        try:
            self._touch_marker(self._marker(stream_id, key))
            return self._write_then_rename(tmp, final, [self._head(stream_id, owner, len(view)), view], fence)
        except OSError as exc:
            raise _os_error(exc, f"cannot write {key}") from exc
        finally:
            _quiet_unlink(tmp)

    # --- reading ----------------------------------------------------------------------------

    def _read(self, key: str) -> tuple[dict, bytes] | None:
        """An object's header (a legacy one's marked `legacy`) and blob; None if there is none."""
        try:
            fh = open(self._object(key), "rb")  # noqa: SIM115 - closed by the `with fh:` below
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _os_error(exc, f"cannot read {key}") from exc
        with fh:
            try:
                header = self._parse_head(fh)
                data = fh.read()  # the blob, read once
            except (ValueError, struct.error) as exc:
                raise StoreCorrupt(f"{key}: unreadable object ({exc})") from None
            except OSError as exc:
                raise _os_error(exc, f"cannot read {key}") from exc
        if len(data) != header.get("size"):
            raise StoreCorrupt(f"{key}: {len(data)} bytes, its header says {header.get('size')}")
        if header["legacy"] and hashlib.sha256(data).hexdigest() != header.get("sha256"):
            raise StoreCorrupt(f"{key}: content does not match its digest")
        return header, data

    @staticmethod
    def _parse_head(fh: BinaryIO) -> dict:
        head = fh.read(9)
        if head[:5] not in (_MAGIC, _LEGACY_MAGIC):
            raise ValueError("bad magic")
        (hlen,) = struct.unpack_from("<I", head, 5)
        header = json.loads(fh.read(hlen))
        if not isinstance(header, dict):
            raise ValueError("header is not an object")  # caught: a corrupt object
        header["legacy"] = head[:5] == _LEGACY_MAGIC
        return header

    @staticmethod
    def _owned(header: dict, owner: str, legacy: str | None) -> bool:
        if header["legacy"]:
            return legacy is not None and header.get("principal") == legacy
        return header.get("owner") == owner

    def get(self, *, key: str, owner: str, legacy: str | None = None) -> bytes | None:
        check_name("key", key)
        found = self._read(key)
        if found is None or not self._owned(found[0], owner, legacy):
            return None
        return found[1]

    def delete(self, *, key: str, stream_id: str, owner: str, legacy: str | None = None,
               fence: Fence | None = None) -> bool:
        check_name("key", key)
        with self._locked():
            found = self._read_header(key)
            if found is None or found.get("stream_id") != stream_id or not self._owned(found, owner, legacy):
                return False  # absent, or another stream's (an unreadable header: the stream's dispose takes it)
            if fence is not None and not fence.holds(self.get_meta(kind=fence.kind, name=fence.name)):
                return False
            try:
                self._object(key).unlink()
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise _os_error(exc, f"cannot delete {key}") from exc
        try:
            self._marker(stream_id, key).unlink(missing_ok=True)
        except OSError as exc:  # the object is gone, which is what was asked; the index lags
            log.warning("deleted %s but not its stream marker: %s", key, exc)
        return True

    def _read_header(self, key: str) -> dict | None:
        try:
            with open(self._object(key), "rb") as fh:
                return self._parse_head(fh)
        except (OSError, ValueError, struct.error):
            return None

    def list_stream(self, *, stream_id: str) -> list[str]:
        check_name("stream id", stream_id)
        d = self.root / "streams" / stream_id
        if not d.is_dir():
            return []
        return sorted(k for k in os.listdir(d) if self._object(k).exists())

    def stream_ids(self) -> list[str]:
        return self._streams("")

    def streams_of(self, tag: str) -> list[str]:
        return self._streams(stream_id_head(tag))  # names first: only this principal's directories are opened

    def _streams(self, head: str) -> list[str]:
        d = self.root / "streams"
        return sorted(e.name for e in os.scandir(d)
                      if e.name.startswith(head) and e.is_dir() and any(os.scandir(e.path)))

    def delete_stream(self, *, stream_id: str) -> int:
        check_name("stream id", stream_id)
        d = self.root / "streams" / stream_id
        if not d.is_dir():
            return 0
        n = 0
        try:
            with self._locked():
                for key in os.listdir(d):
                    try:
                        self._object(key).unlink()
                        n += 1
                    except FileNotFoundError:
                        pass
                    (d / key).unlink(missing_ok=True)
            d.rmdir()
        except OSError as exc:
            raise _os_error(exc, f"cannot delete stream {stream_id}") from exc
        return n

    def _objects(self) -> Iterator[Path]:
        for shard in (self.root / "objects").iterdir():
            yield from shard.iterdir()

    def usage(self) -> StoreUsage:
        """Blob bytes (headers excluded), as the PostgreSQL store counts them."""
        objects = size = 0
        for f in self._objects():
            header = self._read_header(f.name)
            objects += 1
            size += int(header["size"]) if header else 0
        streams = sum(1 for d in (self.root / "streams").iterdir() if any(d.iterdir()))
        return StoreUsage(objects=objects, bytes=size, streams=streams)

    def legacy_objects(self) -> list[LegacyObject]:
        """See base class."""
        out = []
        for f in self._objects():
            header = self._read_header(f.name)
            if header is not None and header["legacy"]:
                out.append(LegacyObject(f.name, str(header.get("stream_id")), str(header.get("principal"))))
        return sorted(out, key=lambda o: o.key)

    def rewrite(self, *, key: str, data: Blob, owner: str, legacy: str) -> bool:
        """See base class. Written and fsynced, then checked and renamed over the object under the
        lock, which deletes take too: a deleted object is never brought back."""
        check_name("key", key)
        view = memoryview(data).cast("B")
        final = self._object(key)
        tmp = self.root / "tmp" / f"{key}.{uuid.uuid4().hex}.part"
        try:
            header = self._read_header(key)
            if header is None or not header["legacy"] or header.get("principal") != legacy:
                return False
            self._write_synced(tmp, [self._head(str(header["stream_id"]), owner, len(view)), view])
            with self._locked():
                again = self._read_header(key)
                if again is None or not again["legacy"] or again.get("principal") != legacy:
                    return False
                os.replace(tmp, final)
            _fsync_dir(final.parent)
            return True
        except OSError as exc:
            raise _os_error(exc, f"cannot rewrite {key}") from exc
        finally:
            _quiet_unlink(tmp)

    def sweep_tmp(self, older_than_s: float = 3600.0) -> int:
        """See base class: the tmp/ files of writers killed before their link."""
        cutoff, n = time.time() - older_than_s, 0
        for f in (self.root / "tmp").iterdir():
            try:  # a live writer may remove its own file between the listing and here
                if f.stat().st_mtime < cutoff:
                    f.unlink()
                    n += 1
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise _os_error(exc, f"cannot sweep {f}") from exc
        return n

    # --- metadata ---------------------------------------------------------------------------

    def get_meta(self, *, kind: str, name: str) -> bytes | None:
        """See base class."""
        path = self._meta(kind, name)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _os_error(exc, f"cannot read metadata {kind}/{name}") from exc

    def put_meta_if_absent(self, *, kind: str, name: str, data: bytes) -> bool:
        """See base class. Committed like a blob: tmp file, fsync, link (atomic first-writer-wins)."""
        final = self._meta(kind, name)
        if final.exists():
            return False
        tmp = self.root / "tmp" / f"meta.{kind}.{uuid.uuid4().hex}.part"
        try:
            return self._write_then_rename(tmp, final, [memoryview(bytes(data))])
        except OSError as exc:
            raise _os_error(exc, f"cannot write metadata {kind}/{name}") from exc
        finally:
            _quiet_unlink(tmp)

    def put_meta(self, *, kind: str, name: str, data: bytes, fence: Fence | None = None) -> None:
        """See base class. Written to a tmp file, fsynced, renamed over the record (atomic); a
        fenced one is checked and renamed under the lock."""
        final = self._meta(kind, name)
        tmp = self.root / "tmp" / f"meta.{kind}.{uuid.uuid4().hex}.part"
        try:
            self._write_synced(tmp, [memoryview(bytes(data))])
            final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            if fence is None:
                os.replace(tmp, final)
            else:
                with self._locked():
                    self._check_fence(fence)
                    os.replace(tmp, final)
            _fsync_dir(final.parent)
        except OSError as exc:
            raise _os_error(exc, f"cannot write metadata {kind}/{name}") from exc
        finally:
            _quiet_unlink(tmp)

    def swap_meta(self, *, kind: str, name: str, expect: bytes | None, data: bytes | None) -> bool:
        """See base class. Under the lock: read, compare, then replace (or remove) the record."""
        final = self._meta(kind, name)
        tmp = self.root / "tmp" / f"meta.{kind}.{uuid.uuid4().hex}.part"
        try:
            if data is not None:
                self._write_synced(tmp, [memoryview(bytes(data))])
            final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with self._locked():
                if self.get_meta(kind=kind, name=name) != (None if expect is None else bytes(expect)):
                    return False
                if data is None:
                    final.unlink(missing_ok=True)  # expected absent and absent: nothing to do
                else:
                    os.replace(tmp, final)
            _fsync_dir(final.parent)
            return True
        except OSError as exc:
            raise _os_error(exc, f"cannot write metadata {kind}/{name}") from exc
        finally:
            _quiet_unlink(tmp)

    def read_meta(self, *, kind: str) -> dict[str, bytes]:
        """See base class."""
        out: dict[str, bytes] = {}
        for name in self.list_meta(kind=kind):
            data = self.get_meta(kind=kind, name=name)
            if data is not None:  # deleted since the listing
                out[name] = data
        return out

    def delete_meta(self, *, kind: str, name: str) -> bool:
        """See base class."""
        path = self._meta(kind, name)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise _os_error(exc, f"cannot delete metadata {kind}/{name}") from exc
        return True

    def list_meta(self, *, kind: str) -> list[str]:
        """See base class."""
        d = self.root / "meta" / check_name("metadata kind", kind)
        try:
            return sorted(os.listdir(d))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise _os_error(exc, f"cannot list metadata {kind}") from exc

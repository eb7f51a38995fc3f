"""The file state store: one file per blob, committed atomically, readable by its owner only.

Layout under the root:

    objects/<xx>/<key>      the blob, behind a small header (stream, principal, size, sha256);
                            xx = first two hex digits of sha256(key), to keep directories small
    streams/<stream>/<key>  empty markers, written before the object, for list/delete by stream
    tmp/                    objects being written

A write goes to tmp/ with mode 0600, is fsynced, then hard-linked to its final name: `link`
fails if the name exists, which makes put-if-absent atomic across threads and processes, and a
writer killed at any point leaves at most a file in tmp/, never a partial object.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import time
import uuid
from pathlib import Path

from activities._store import (
    Blob,
    StateStore,
    StoreCorrupt,
    StoreError,
    StoreUnavailable,
    StoreUsage,
    check_name,
)

__all__ = ["FileStateStore"]

_MAGIC = b"MSSB\x01"
_CHUNK = 8 << 20


def _os_error(exc: OSError, what: str) -> StoreError:
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StoreError(f"{what}: {exc}")
    return StoreUnavailable(f"{what}: {exc}")  # ENOSPC, EIO, EMFILE...: may pass


class FileStateStore(StateStore):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.url = f"file://{self.root}"
        try:
            for sub in ("objects", "streams", "tmp"):
                (self.root / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.root, 0o700)
        except OSError as exc:
            raise _os_error(exc, f"cannot create store at {self.root}") from exc

    # --- paths ------------------------------------------------------------------------------

    def _object(self, key: str) -> Path:
        shard = hashlib.sha256(key.encode()).hexdigest()[:2]
        return self.root / "objects" / shard / key

    def _marker(self, stream_id: str, key: str) -> Path:
        return self.root / "streams" / stream_id / key

    # --- writing ----------------------------------------------------------------------------

    def _write_chunk(self, fd: int, chunk: memoryview) -> None:
        """Write one chunk completely (a seam for tests that kill a writer midway)."""
        while len(chunk):
            n = os.write(fd, chunk)
            chunk = chunk[n:]

    def put_if_absent(self, *, key: str, data: Blob, stream_id: str, principal: str) -> bool:
        check_name("key", key)
        check_name("stream id", stream_id)
        final = self._object(key)
        if final.exists():
            return False
        view = memoryview(data).cast("B")
        header = json.dumps({"key": key, "stream_id": stream_id, "principal": principal, "size": len(view),
                             "sha256": hashlib.sha256(view).hexdigest()}).encode()
        tmp = self.root / "tmp" / f"{key}.{uuid.uuid4().hex}.part"
        try:
            marker = self._marker(stream_id, key)
            marker.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            marker.touch(mode=0o600, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                self._write_chunk(fd, memoryview(_MAGIC + struct.pack("<I", len(header)) + header))
                for i in range(0, len(view), _CHUNK):
                    self._write_chunk(fd, view[i : i + _CHUNK])
                os.fsync(fd)
            finally:
                os.close(fd)
            final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                os.link(tmp, final)  # the commit point
            except FileExistsError:
                return False
            dfd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            return True
        except OSError as exc:
            raise _os_error(exc, f"cannot write {key}") from exc
        finally:
            tmp.unlink(missing_ok=True)

    # --- reading ----------------------------------------------------------------------------

    def _read(self, key: str) -> tuple[dict, bytes] | None:
        try:
            fh = open(self._object(key), "rb")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _os_error(exc, f"cannot read {key}") from exc
        with fh:
            try:
                head = fh.read(9)
                if head[:5] != _MAGIC:
                    raise ValueError("bad magic")
                (hlen,) = struct.unpack_from("<I", head, 5)
                header = json.loads(fh.read(hlen))
                data = fh.read()  # the blob, read once
            except (ValueError, struct.error) as exc:
                raise StoreCorrupt(f"{key}: unreadable object ({exc})") from None
            except OSError as exc:
                raise _os_error(exc, f"cannot read {key}") from exc
        if len(data) != header.get("size") or hashlib.sha256(data).hexdigest() != header.get("sha256"):
            raise StoreCorrupt(f"{key}: content does not match its digest")
        return header, data

    def get(self, *, key: str, principal: str) -> bytes | None:
        check_name("key", key)
        found = self._read(key)
        if found is None or found[0].get("principal") != principal:
            return None
        return found[1]

    def delete(self, *, key: str) -> bool:
        check_name("key", key)
        found = self._read_header(key)
        try:
            self._object(key).unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise _os_error(exc, f"cannot delete {key}") from exc
        if found is not None:
            self._marker(found["stream_id"], key).unlink(missing_ok=True)
        return True

    def _read_header(self, key: str) -> dict | None:
        try:
            with open(self._object(key), "rb") as fh:
                head = fh.read(9)
                if head[:5] != _MAGIC:
                    return None
                (hlen,) = struct.unpack_from("<I", head, 5)
                return json.loads(fh.read(hlen))
        except (OSError, ValueError, struct.error):
            return None

    def list_stream(self, *, stream_id: str) -> list[str]:
        check_name("stream id", stream_id)
        d = self.root / "streams" / stream_id
        if not d.is_dir():
            return []
        return sorted(k for k in os.listdir(d) if self._object(k).exists())

    def stream_ids(self) -> list[str]:
        d = self.root / "streams"
        return sorted(e.name for e in os.scandir(d) if e.is_dir() and any(os.scandir(e.path)))

    def delete_stream(self, *, stream_id: str) -> int:
        check_name("stream id", stream_id)
        d = self.root / "streams" / stream_id
        if not d.is_dir():
            return 0
        n = 0
        try:
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

    def usage(self) -> StoreUsage:
        """Blob bytes (headers excluded), as the PostgreSQL store counts them."""
        objects = size = 0
        for shard in (self.root / "objects").iterdir():
            for f in shard.iterdir():
                header = self._read_header(f.name)
                objects += 1
                size += int(header["size"]) if header else 0
        streams = sum(1 for d in (self.root / "streams").iterdir() if any(d.iterdir()))
        return StoreUsage(objects=objects, bytes=size, streams=streams)

    def sweep_tmp(self, older_than_s: float = 3600.0) -> int:
        """Remove leftovers of writers that died before committing; returns how many."""
        cutoff, n = time.time() - older_than_s, 0
        for f in (self.root / "tmp").iterdir():
            if f.stat().st_mtime < cutoff:
                f.unlink(missing_ok=True)
                n += 1
        return n

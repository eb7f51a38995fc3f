"""The PostgreSQL state store: blobs as bytea, stream and principal in their own columns.

Every worker of a deployment shares it. Put-if-absent is `INSERT ... ON CONFLICT DO NOTHING`;
reads filter on the principal in SQL, so another tenant's row is never even fetched.
"""

from __future__ import annotations

import hashlib
import queue
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from activities._store import (
    Blob,
    StateStore,
    StoreCorrupt,
    StoreError,
    StoreUnavailable,
    StoreUsage,
    check_name,
)

__all__ = ["PostgresStateStore"]

_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class PostgresStateStore(StateStore):
    def __init__(self, url: str, *, pool_size: int = 4, connect_timeout: float = 5.0) -> None:
        try:
            import psycopg
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise StoreError("the PostgreSQL store needs psycopg: pip install 'mamba-stream-state[postgres]'") from exc
        self._psycopg = psycopg
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        self.table = query.pop("table", "mamba_state_blobs")
        if not _IDENT.match(self.table):
            raise StoreError(f"table name {self.table!r} must match {_IDENT.pattern}")
        query.setdefault("connect_timeout", str(int(connect_timeout)))
        self._conninfo = urlunsplit(parts._replace(query=urlencode(query)))
        netloc = (f"{parts.username}@" if parts.username else "") + (parts.hostname or "") + (
            f":{parts.port}" if parts.port else "")
        self.url = urlunsplit(parts._replace(netloc=netloc, query=f"table={self.table}"))  # no password
        self._idle: queue.LifoQueue[Any] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(pool_size)
        self._closed = False
        with self._conn() as conn:
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {self.table} ("
                " key text PRIMARY KEY, stream_id text NOT NULL, principal text NOT NULL,"
                " data bytea NOT NULL, sha256 bytea NOT NULL, size bigint NOT NULL,"
                " created_at timestamptz NOT NULL DEFAULT now())"
            )
            conn.execute(f"CREATE INDEX IF NOT EXISTS {self.table}_stream ON {self.table} (stream_id)")

    @contextmanager
    def _conn(self) -> Iterator[Any]:
        """A pooled autocommit connection; psycopg errors become store errors."""
        psycopg = self._psycopg
        if self._closed:
            raise StoreError("store is closed")
        self._slots.acquire()
        conn = None
        try:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                conn = psycopg.connect(self._conninfo, autocommit=True)
            yield conn
        except psycopg.OperationalError as exc:
            if conn is not None:
                conn.close()
                conn = None
            raise StoreUnavailable(f"PostgreSQL unavailable: {exc}") from exc
        except psycopg.Error as exc:
            if conn is not None and conn.closed:
                conn = None
            raise StoreError(f"PostgreSQL error: {exc}") from exc
        finally:
            if conn is not None and not conn.closed:
                self._idle.put(conn)
            self._slots.release()

    def put_if_absent(self, *, key: str, data: Blob, stream_id: str, principal: str) -> bool:
        check_name("key", key)
        check_name("stream id", stream_id)
        view = memoryview(data).cast("B")
        digest = hashlib.sha256(view).digest()
        with self._conn() as conn:
            cur = conn.execute(
                f"INSERT INTO {self.table} (key, stream_id, principal, data, sha256, size)"
                " VALUES (%s, %s, %s, %b, %b, %s) ON CONFLICT (key) DO NOTHING",
                (key, stream_id, principal, view, digest, len(view)),
            )
            return cur.rowcount == 1

    def get(self, *, key: str, principal: str) -> bytes | None:
        check_name("key", key)
        with self._conn() as conn:
            row = conn.execute(
                f"SELECT data, sha256 FROM {self.table} WHERE key = %s AND principal = %s",
                (key, principal), binary=True,
            ).fetchone()
        if row is None:
            return None
        data = bytes(row[0])
        if hashlib.sha256(data).digest() != bytes(row[1]):
            raise StoreCorrupt(f"{key}: content does not match its digest")
        return data

    def delete(self, *, key: str) -> bool:
        check_name("key", key)
        with self._conn() as conn:
            return conn.execute(f"DELETE FROM {self.table} WHERE key = %s", (key,)).rowcount == 1

    def delete_stream(self, *, stream_id: str) -> int:
        check_name("stream id", stream_id)
        with self._conn() as conn:
            return conn.execute(f"DELETE FROM {self.table} WHERE stream_id = %s", (stream_id,)).rowcount

    def list_stream(self, *, stream_id: str) -> list[str]:
        check_name("stream id", stream_id)
        with self._conn() as conn:
            rows = conn.execute(f"SELECT key FROM {self.table} WHERE stream_id = %s ORDER BY key",
                                (stream_id,)).fetchall()
        return [r[0] for r in rows]

    def stream_ids(self) -> list[str]:
        with self._conn() as conn:
            rows = conn.execute(f"SELECT DISTINCT stream_id FROM {self.table} ORDER BY stream_id").fetchall()
        return [r[0] for r in rows]

    def usage(self) -> StoreUsage:
        with self._conn() as conn:
            objects, size, streams = conn.execute(
                f"SELECT count(*), coalesce(sum(size), 0), count(DISTINCT stream_id) FROM {self.table}"
            ).fetchone()
        return StoreUsage(objects=int(objects), bytes=int(size), streams=int(streams))

    def drop(self) -> None:
        """Drop the table (tests and teardown)."""
        with self._conn() as conn:
            conn.execute(f"DROP TABLE IF EXISTS {self.table}")

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                break

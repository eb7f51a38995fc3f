"""The PostgreSQL state store: blobs as bytea, stream and principal in their own columns.

Every worker of a deployment shares it. Put-if-absent is `INSERT ... ON CONFLICT DO NOTHING`;
reads filter on the principal in SQL, so another tenant's row is never even fetched. Metadata
(the owner record, the sweep's first sightings) lives in a second table, `<table>_meta`.

Errors are mapped by SQLSTATE, not by psycopg's exception class: PostgreSQL briefly read-only
(25006, a failover in progress), a serialization failure or deadlock, a cancelled statement or
a shutting-down server may pass, and an activity retry should see `StoreUnavailable`; a syntax
error, a missing privilege or bad data will not, and becomes a non-retryable `StoreError`. A
connection that saw a transient error is closed, never pooled: it may be broken, or attached to
a server that has just become a read-only standby.
"""

from __future__ import annotations

import hashlib
import logging
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

log = logging.getLogger(__name__)

_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_MAX_IDENT = 63  # PostgreSQL truncates longer names silently

# SQLSTATEs after which the same statement may succeed: whole classes, then single codes.
_TRANSIENT_CLASSES = frozenset({
    "08",  # connection exception
    "53",  # insufficient resources: disk full, out of memory, too many connections
})
_TRANSIENT_STATES = frozenset({
    "25006",  # read-only SQL transaction: a primary demoted, a standby promoted, a read-only pause
    "40001",  # serialization failure
    "40P01",  # deadlock detected
    "55P03",  # lock not available
    "57014",  # query canceled (statement timeout)
    "57P01", "57P02", "57P03",  # admin shutdown, crash shutdown, cannot connect now
    "57P05",  # idle session timeout: the connection was closed, a new one will do
    "58030",  # I/O error on the server, as EIO is transient in the file store
})


def _aux_table(table: str, suffix: str) -> str:
    """`<table><suffix>`, shortened with a digest when it would pass PostgreSQL's name limit."""
    name = table + suffix
    if len(name) <= _MAX_IDENT:
        return name
    digest = hashlib.sha256(table.encode()).hexdigest()[:8]
    return f"{table[: _MAX_IDENT - len(suffix) - 9]}_{digest}{suffix}"


def is_transient(exc: BaseException, conn: Any = None) -> bool:
    """Whether a psycopg error may pass if the operation is tried again (on a new connection).

    Args:
        exc: the psycopg error.
        conn: the connection it was raised on (None: raised while connecting).
    """
    import psycopg

    state = getattr(exc, "sqlstate", None)
    if state:
        return state[:2] in _TRANSIENT_CLASSES or state in _TRANSIENT_STATES
    # no SQLSTATE: the client raised it, not the server: a refused, timed-out or lost connection
    if conn is None or conn.closed or conn.broken:
        return True
    return isinstance(exc, psycopg.OperationalError)


def store_error(exc: BaseException, conn: Any = None) -> StoreError:
    """The store error for a psycopg error: `StoreUnavailable` if transient, else a `StoreError`
    naming the SQLSTATE."""
    state = getattr(exc, "sqlstate", None) or "no SQLSTATE"
    if is_transient(exc, conn):
        return StoreUnavailable(f"PostgreSQL unavailable ({state}, {type(exc).__name__}): {exc}")
    return StoreError(f"PostgreSQL error {state} ({type(exc).__name__}): {exc}")


def _discard(conn: Any) -> None:
    """Close a connection that will not be pooled again; a failure to close is only logged."""
    try:
        conn.close()
    except Exception as exc:  # noqa: BLE001 - cleanup never hides the error being raised
        log.debug("cleanup: closing a PostgreSQL connection failed: %s", exc)


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
        self.meta_table = _aux_table(self.table, "_meta")
        self._create_tables()

    def _create_tables(self) -> None:
        """Create the tables unless they exist.

        Existing tables are only looked up, never re-created: a `CREATE ... IF NOT EXISTS` is
        refused outright by a read-only server (and needs CREATE on the schema), so a store on
        one could not even be opened to read checkpoints. Two workers creating the tables at
        once may collide (23505 / 42P07); the loser finds them made.
        """
        psycopg = self._psycopg
        with self._conn() as conn:
            have = conn.execute("SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
                                (self.table, self.meta_table)).fetchone()
            if all(have):
                return
            for ddl in (
                f"CREATE TABLE IF NOT EXISTS {self.table} ("
                " key text PRIMARY KEY, stream_id text NOT NULL, principal text NOT NULL,"
                " data bytea NOT NULL, sha256 bytea NOT NULL, size bigint NOT NULL,"
                " created_at timestamptz NOT NULL DEFAULT now())",
                f"CREATE INDEX IF NOT EXISTS {self.table}_stream ON {self.table} (stream_id)",
                f"CREATE TABLE IF NOT EXISTS {self.meta_table} ("
                " kind text NOT NULL, name text NOT NULL, data bytea NOT NULL,"
                " created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (kind, name))",
            ):
                try:
                    conn.execute(ddl)
                except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable):
                    log.debug("created concurrently by another process: %s", ddl.split("(")[0])

    @contextmanager
    def _conn(self) -> Iterator[Any]:
        """A pooled autocommit connection; psycopg errors become store errors (by SQLSTATE).

        Only a healthy, idle connection goes back to the pool: one that saw a transient error,
        broke, or was left inside a transaction is closed.
        """
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
        except psycopg.Error as exc:
            err = store_error(exc, conn)
            if conn is not None and err.retryable:
                _discard(conn)
                conn = None
            raise err from exc
        finally:
            if conn is not None:
                idle = psycopg.pq.TransactionStatus.IDLE
                if conn.closed or conn.broken or conn.info.transaction_status != idle:
                    _discard(conn)
                else:
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

    def delete(self, *, key: str, stream_id: str, principal: str) -> bool:
        check_name("key", key)
        with self._conn() as conn:
            return conn.execute(f"DELETE FROM {self.table} WHERE key = %s AND stream_id = %s AND principal = %s",
                                (key, stream_id, principal)).rowcount == 1

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

    # --- metadata ---------------------------------------------------------------------------

    def get_meta(self, *, kind: str, name: str) -> bytes | None:
        """See base class."""
        check_name("metadata kind", kind)
        check_name("metadata name", name)
        with self._conn() as conn:
            row = conn.execute(f"SELECT data FROM {self.meta_table} WHERE kind = %s AND name = %s",
                               (kind, name), binary=True).fetchone()
        return None if row is None else bytes(row[0])

    def put_meta_if_absent(self, *, kind: str, name: str, data: bytes) -> bool:
        """See base class."""
        check_name("metadata kind", kind)
        check_name("metadata name", name)
        with self._conn() as conn:
            return conn.execute(
                f"INSERT INTO {self.meta_table} (kind, name, data) VALUES (%s, %s, %b)"
                " ON CONFLICT (kind, name) DO NOTHING", (kind, name, bytes(data))).rowcount == 1

    def put_meta(self, *, kind: str, name: str, data: bytes) -> None:
        """See base class."""
        check_name("metadata kind", kind)
        check_name("metadata name", name)
        with self._conn() as conn:
            conn.execute(f"INSERT INTO {self.meta_table} (kind, name, data) VALUES (%s, %s, %b)"
                         " ON CONFLICT (kind, name) DO UPDATE SET data = EXCLUDED.data", (kind, name, bytes(data)))

    def read_meta(self, *, kind: str) -> dict[str, bytes]:
        """See base class."""
        check_name("metadata kind", kind)
        with self._conn() as conn:
            rows = conn.execute(f"SELECT name, data FROM {self.meta_table} WHERE kind = %s ORDER BY name",
                                (kind,), binary=True).fetchall()
        return {r[0]: bytes(r[1]) for r in rows}

    def delete_meta(self, *, kind: str, name: str) -> bool:
        """See base class."""
        check_name("metadata kind", kind)
        check_name("metadata name", name)
        with self._conn() as conn:
            return conn.execute(f"DELETE FROM {self.meta_table} WHERE kind = %s AND name = %s",
                                (kind, name)).rowcount == 1

    def list_meta(self, *, kind: str) -> list[str]:
        """See base class."""
        check_name("metadata kind", kind)
        with self._conn() as conn:
            rows = conn.execute(f"SELECT name FROM {self.meta_table} WHERE kind = %s ORDER BY name",
                                (kind,)).fetchall()
        return [r[0] for r in rows]

    def drop(self) -> None:
        """Drop the tables (tests and teardown)."""
        with self._conn() as conn:
            conn.execute(f"DROP TABLE IF EXISTS {self.table}")
            conn.execute(f"DROP TABLE IF EXISTS {self.meta_table}")

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                _discard(self._idle.get_nowait())
            except queue.Empty:
                break

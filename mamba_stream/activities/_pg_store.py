"""The PostgreSQL state store: blobs as bytea, stream and owner (a keyed tag) in their own columns.

Every worker of a deployment shares it. Put-if-absent is `INSERT ... ON CONFLICT DO NOTHING`;
reads filter on the owner in SQL, so another tenant's row is never even fetched. Metadata
(the owner record, the sweep's first sightings, the prefix store's index and leases) lives in a
second table, `<table>_meta`. A fenced write is one statement, `INSERT ... SELECT ... WHERE EXISTS
(the lease row whose data starts with the writer's generation ... FOR SHARE)`: the lease row is
locked while the write commits, so a takeover (`swap_meta`, an `UPDATE ... WHERE data = ...`)
either comes after it or makes it write nothing.

Tables made before owners were tagged ("legacy layout": columns `principal` and `sha256`) are
used as they are: new rows hold the owner's tag in `principal` and an empty `sha256`; a row with a
32-byte `sha256` is a legacy row, whose `principal` is a name, read only by that name and
rewritten by `rewrite` (tag in, digest out). A table made now has `owner` and no digest column.

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
from mamba_stream.state_codec import stream_id_head, stream_tag

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
        """Create the tables unless they exist, and learn the blob table's layout.

        Existing tables are only looked up, never re-created: a `CREATE ... IF NOT EXISTS` is
        refused outright by a read-only server (and needs CREATE on the schema), so a store on
        one could not even be opened to read checkpoints. Two workers creating the tables at
        once may collide (23505 / 42P07); the loser finds them made.
        """
        psycopg = self._psycopg
        with self._conn() as conn:
            have = conn.execute("SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
                                (self.table, self.meta_table)).fetchone()
            if not all(have):
                for ddl in (
                    f"CREATE TABLE IF NOT EXISTS {self.table} ("
                    " key text PRIMARY KEY, stream_id text NOT NULL, owner text NOT NULL,"
                    " data bytea NOT NULL, size bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
                    f"CREATE INDEX IF NOT EXISTS {self.table}_stream ON {self.table} (stream_id)",
                    f"CREATE TABLE IF NOT EXISTS {self.meta_table} ("
                    " kind text NOT NULL, name text NOT NULL, data bytea NOT NULL,"
                    " created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (kind, name))",
                ):
                    try:
                        conn.execute(ddl)
                    except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable):
                        log.debug("created concurrently by another process: %s", ddl.split("(")[0])
            columns = {r[0] for r in conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0"
                " AND NOT attisdropped", (self.table,)).fetchall()}
        self.legacy_layout = "principal" in columns
        own = "principal" if self.legacy_layout else "owner"
        self._own = own
        # a row of this store's owner (a tag), and (legacy layout) a legacy row of a principal's name
        self._tagged = f"{own} = %s" + (" AND octet_length(sha256) = 0" if self.legacy_layout else "")
        self._named = (f"{own} = %s AND octet_length(sha256) = 32" if self.legacy_layout
                       else "false AND %s::text IS NULL")
        self._mine = f"(({self._tagged}) OR ({self._named}))"
        self._insert_cols = (f"key, stream_id, {own}, data, size" + (", sha256" if self.legacy_layout else ""))
        self._insert_vals = "%s, %s, %s, %b, %s" + (", ''::bytea" if self.legacy_layout else "")

    _FENCE = ("EXISTS (SELECT 1 FROM {meta} WHERE kind = %s AND name = %s AND substring(data from 1 for %s) = %b "
              "FOR SHARE)")

    def _fence_sql(self, fence: Fence | None) -> tuple[str, tuple]:
        if fence is None:
            return "true", ()
        return self._FENCE.format(meta=self.meta_table), (fence.kind, fence.name, len(fence.token), fence.token)

    def _fence_holds(self, conn: Any, fence: Fence) -> bool:
        sql, params = self._fence_sql(fence)
        return bool(conn.execute(f"SELECT {sql.replace(' FOR SHARE', '')}", params).fetchone()[0])

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

    def put_if_absent(self, *, key: str, data: Blob, stream_id: str, owner: str, fence: Fence | None = None) -> bool:
        check_name("key", key)
        check_name("stream id", stream_id)
        view = memoryview(data).cast("B")
        cond, params = self._fence_sql(fence)
        with self._conn() as conn:
            cur = conn.execute(
                f"INSERT INTO {self.table} ({self._insert_cols}) SELECT {self._insert_vals} WHERE {cond}"
                " ON CONFLICT (key) DO NOTHING",
                (key, stream_id, owner, view, len(view), *params),
            )
            if cur.rowcount == 1:
                return True
            if fence is not None and not self._fence_holds(conn, fence):
                raise LeaseLost(f"the lease {fence.kind}/{fence.name} is no longer the writer's")
            return False

    def get(self, *, key: str, owner: str, legacy: str | None = None) -> bytes | None:
        check_name("key", key)
        digest = ", sha256" if self.legacy_layout else ", NULL"
        with self._conn() as conn:
            row = conn.execute(
                f"SELECT data{digest} FROM {self.table} WHERE key = %s AND {self._mine}",
                (key, owner, legacy), binary=True,
            ).fetchone()
        if row is None:
            return None
        data = bytes(row[0])
        if row[1] and hashlib.sha256(data).digest() != bytes(row[1]):  # a legacy row's digest
            raise StoreCorrupt(f"{key}: content does not match its digest")
        return data

    def delete(self, *, key: str, stream_id: str, owner: str, legacy: str | None = None,
               fence: Fence | None = None) -> bool:
        check_name("key", key)
        cond, params = self._fence_sql(fence)
        with self._conn() as conn:
            return conn.execute(
                f"DELETE FROM {self.table} WHERE key = %s AND stream_id = %s AND {self._mine} AND {cond}",
                (key, stream_id, owner, legacy, *params)).rowcount == 1

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

    def streams_of(self, tag: str) -> list[str]:
        # Asked at every open (the streams quota): a range on the indexed column, which a LIKE
        # pattern is not under a database's default (non-C) collation: it read the whole table.
        # The ids go on from the head with 32 hex digits, which every collation puts between "0"
        # and "g"; `stream_tag` keeps exactly this principal's of what the range gives.
        head = stream_id_head(tag)
        with self._conn() as conn:
            rows = conn.execute(f"SELECT DISTINCT stream_id FROM {self.table} WHERE stream_id >= %s "
                                "AND stream_id < %s ORDER BY stream_id", (head + "0", head + "g")).fetchall()
        return [r[0] for r in rows if stream_tag(r[0]) == tag]

    def usage(self) -> StoreUsage:
        with self._conn() as conn:
            objects, size, streams = conn.execute(
                f"SELECT count(*), coalesce(sum(size), 0), count(DISTINCT stream_id) FROM {self.table}"
            ).fetchone()
        return StoreUsage(objects=int(objects), bytes=int(size), streams=int(streams))

    def legacy_objects(self) -> list[LegacyObject]:
        """See base class."""
        if not self.legacy_layout:
            return []
        with self._conn() as conn:
            rows = conn.execute(f"SELECT key, stream_id, principal FROM {self.table}"
                                " WHERE octet_length(sha256) = 32 ORDER BY key").fetchall()
        return [LegacyObject(*r) for r in rows]

    def rewrite(self, *, key: str, data: Blob, owner: str, legacy: str) -> bool:
        """See base class. One UPDATE, conditional on the row still being `legacy`'s legacy row."""
        check_name("key", key)
        if not self.legacy_layout:
            return False
        view = memoryview(data).cast("B")
        with self._conn() as conn:
            return conn.execute(
                f"UPDATE {self.table} SET principal = %s, data = %b, size = %s, sha256 = ''::bytea"
                f" WHERE key = %s AND {self._named}", (owner, view, len(view), key, legacy)).rowcount == 1

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

    def put_meta(self, *, kind: str, name: str, data: bytes, fence: Fence | None = None) -> None:
        """See base class."""
        check_name("metadata kind", kind)
        check_name("metadata name", name)
        cond, params = self._fence_sql(fence)
        with self._conn() as conn:
            cur = conn.execute(f"INSERT INTO {self.meta_table} (kind, name, data) SELECT %s, %s, %b WHERE {cond}"
                               " ON CONFLICT (kind, name) DO UPDATE SET data = EXCLUDED.data",
                               (kind, name, bytes(data), *params))
            if cur.rowcount != 1:
                raise LeaseLost(f"the lease {fence.kind}/{fence.name} is no longer the writer's")  # type: ignore[union-attr]

    def swap_meta(self, *, kind: str, name: str, expect: bytes | None, data: bytes | None) -> bool:
        """See base class. One statement: an INSERT, UPDATE or DELETE conditional on the record."""
        check_name("metadata kind", kind)
        check_name("metadata name", name)
        t = self.meta_table
        with self._conn() as conn:
            if expect is None and data is None:
                return conn.execute(f"SELECT 1 FROM {t} WHERE kind = %s AND name = %s", (kind, name)).fetchone() is None
            if expect is None:
                cur = conn.execute(f"INSERT INTO {t} (kind, name, data) VALUES (%s, %s, %b)"
                                   " ON CONFLICT (kind, name) DO NOTHING", (kind, name, bytes(data or b"")))
            elif data is None:
                cur = conn.execute(f"DELETE FROM {t} WHERE kind = %s AND name = %s AND data = %b",
                                   (kind, name, bytes(expect)))
            else:
                cur = conn.execute(f"UPDATE {t} SET data = %b WHERE kind = %s AND name = %s AND data = %b",
                                   (bytes(data), kind, name, bytes(expect)))
            return cur.rowcount == 1

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

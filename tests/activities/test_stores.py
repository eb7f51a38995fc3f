"""State stores against the real file system and the real PostgreSQL on 127.0.0.1:5432."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from activities import (
    FileStateStore,
    InvalidStoreKey,
    StateStore,
    StoreCorrupt,
    StoreError,
    StoreUnavailable,
    open_store,
)

PG_URL = os.environ.get("MAMBA_STREAM_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REQUIRED = os.environ.get("MAMBA_STREAM_REQUIRE_CROSSCHECK") == "1"
ROOT = Path(__file__).resolve().parents[2]
PG_HOSTPART = PG_URL.split("@", 1)[1]  # host:port/db, for connecting as another role


def _pg_store(table: str) -> StateStore:
    try:
        return open_store(f"{PG_URL}?table={table}")
    except StoreUnavailable as exc:
        if REQUIRED:
            raise
        pytest.skip(f"PostgreSQL is not reachable at {PG_URL}: {exc}")


@pytest.fixture(params=["file", "postgresql"])
def store(request, tmp_path):
    if request.param == "file":
        s = open_store(f"file://{tmp_path / 'store'}")
        yield s
        s.close()
    else:
        s = _pg_store(f"t_{uuid.uuid4().hex[:12]}")
        yield s
        s.drop()
        s.close()


def _url(store: StateStore) -> str:
    return store.url if store.url.startswith("file") else f"{PG_URL}?table={store.table}"


def test_put_get_list_delete_usage(store):
    assert store.put_if_absent(key="s1.k1", data=b"one", stream_id="s1", principal="alice")
    assert not store.put_if_absent(key="s1.k1", data=b"other", stream_id="s1", principal="alice")
    assert store.put_if_absent(key="s1.k2", data=bytearray(b"two!"), stream_id="s1", principal="alice")
    assert store.put_if_absent(key="s2.k1", data=memoryview(b"three"), stream_id="s2", principal="bob")
    assert store.get(key="s1.k1", principal="alice") == b"one"
    assert store.get(key="nope", principal="alice") is None
    assert store.list_stream(stream_id="s1") == ["s1.k1", "s1.k2"]
    assert store.list_stream(stream_id="s3") == []
    assert store.stream_ids() == ["s1", "s2"]
    u = store.usage()
    assert (u.objects, u.bytes, u.streams) == (3, 3 + 4 + 5, 2)
    # a delete names the object's stream and principal: another's is left alone, whatever the key
    assert not store.delete(key="s2.k1", stream_id="s1", principal="alice")
    assert not store.delete(key="s2.k1", stream_id="s2", principal="alice")
    assert not store.delete(key="s1.k2", stream_id="s1", principal="bob")
    assert store.get(key="s2.k1", principal="bob") == b"three" and store.get(key="s1.k2", principal="alice")
    assert store.delete(key="s1.k2", stream_id="s1", principal="alice")
    assert not store.delete(key="s1.k2", stream_id="s1", principal="alice")
    assert store.delete_stream(stream_id="s2") == 1
    assert store.get(key="s2.k1", principal="bob") is None
    assert store.list_stream(stream_id="s1") == ["s1.k1"]
    assert store.stream_ids() == ["s1"]
    store.delete(key="s1.k1", stream_id="s1", principal="alice")
    assert store.stream_ids() == []


def test_a_read_with_the_wrong_principal_returns_nothing(store):
    store.put_if_absent(key="k", data=b"secret", stream_id="s", principal="alice")
    assert store.get(key="k", principal="mallory") is None
    assert store.get(key="k", principal="alice") == b"secret"


def test_invalid_keys_are_typed_errors(store):
    for bad in ("", "../etc/passwd", "a/b", ".", "x" * 300, "spaces are bad"):
        with pytest.raises(InvalidStoreKey):
            store.put_if_absent(key=bad, data=b"x", stream_id="s", principal="p")
    with pytest.raises(InvalidStoreKey):
        store.list_stream(stream_id="../up")
    assert not InvalidStoreKey.retryable


def test_concurrent_threads_leave_one_complete_object(store):
    payloads = [bytes([i]) * (256 * 1024 + i) for i in range(8)]
    results: list[bool] = []
    barrier = threading.Barrier(len(payloads))

    def write(p: bytes) -> None:
        barrier.wait()
        results.append(store.put_if_absent(key="race", data=p, stream_id="s", principal="alice"))

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]
    got = store.get(key="race", principal="alice")
    assert got in payloads
    assert store.list_stream(stream_id="s") == ["race"] and store.usage().objects == 1


_WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from activities import open_store
    store = open_store(sys.argv[1])
    payload = bytes([int(sys.argv[2])]) * (2 << 20)
    while time.time() < float(sys.argv[3]):
        pass
    print(store.put_if_absent(key="race", data=payload, stream_id="s", principal="alice"))
""")


def test_concurrent_processes_leave_one_complete_object(store):
    start = time.time() + 2.0
    code = _WRITER.format(root=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", code, _url(store), str(i), str(start)],
                              stdout=subprocess.PIPE, text=True) for i in range(4)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(outs) == ["False", "False", "False", "True"]
    got = store.get(key="race", principal="alice")
    assert got is not None and len(got) == 2 << 20 and got == bytes([got[0]]) * len(got)
    assert store.usage().objects == 1


_SLOW_WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from activities import FileStateStore

    class Slow(FileStateStore):
        def _write_chunk(self, fd, chunk):
            super()._write_chunk(fd, chunk)
            time.sleep(0.2)

    Slow(sys.argv[1]).put_if_absent(key="big", data=bytes(64 << 20), stream_id="s", principal="alice")
""")


def test_a_writer_killed_midway_leaves_nothing_readable(tmp_path):
    root = tmp_path / "store"
    store = FileStateStore(root)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER.format(root=str(ROOT)), str(root)])
    deadline = time.time() + 30
    while time.time() < deadline:  # wait until the object is partly written
        parts = list((root / "tmp").glob("*.part"))
        if parts and parts[0].stat().st_size > (8 << 20):
            break
        time.sleep(0.02)
    else:
        proc.kill()
        pytest.fail("the writer never started writing")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert store.get(key="big", principal="alice") is None
    assert store.list_stream(stream_id="s") == []
    assert store.usage().objects == 0
    # the next writer of that key succeeds and the leftover can be swept
    assert store.put_if_absent(key="big", data=b"whole", stream_id="s", principal="alice")
    assert store.get(key="big", principal="alice") == b"whole"
    assert store.sweep_tmp(older_than_s=0) == 1


def test_file_store_permissions_and_corruption(tmp_path):
    store = FileStateStore(tmp_path / "store")
    store.put_if_absent(key="k", data=b"payload", stream_id="s", principal="p")
    obj = next((tmp_path / "store" / "objects").rglob("k"))
    assert (obj.stat().st_mode & 0o777) == 0o600
    assert ((tmp_path / "store").stat().st_mode & 0o777) == 0o700
    raw = bytearray(obj.read_bytes())
    raw[-1] ^= 1
    obj.write_bytes(bytes(raw))
    with pytest.raises(StoreCorrupt):
        store.get(key="k", principal="p")


def test_unreachable_postgres_is_a_retryable_error():
    with pytest.raises(StoreUnavailable) as exc:
        open_store("postgresql://postgres@127.0.0.1:1/test")
    assert exc.value.retryable
    with pytest.raises(StoreError):
        open_store("s3://bucket/x")


# --- metadata: beside the blobs, never a stream, a checkpoint or usage --------------------------


def test_metadata_is_put_if_absent_and_apart_from_the_blobs(store):
    store.put_if_absent(key="s1.k1", data=b"one", stream_id="s1", principal="alice")
    assert store.get_meta(kind="owner", name="temporal") is None
    assert store.put_meta_if_absent(kind="owner", name="temporal", data=b'{"a": 1}')
    assert not store.put_meta_if_absent(kind="owner", name="temporal", data=b"other")
    assert store.get_meta(kind="owner", name="temporal") == b'{"a": 1}'
    assert store.put_meta_if_absent(kind="missing", name="s1", data=b"x")
    assert store.put_meta_if_absent(kind="missing", name="s0", data=b"y")
    assert store.list_meta(kind="missing") == ["s0", "s1"] and store.list_meta(kind="nothing") == []
    # none of it is a stream, an object of a stream, or counted
    assert store.stream_ids() == ["s1"] and store.list_stream(stream_id="s1") == ["s1.k1"]
    assert store.list_stream(stream_id="s0") == []
    u = store.usage()
    assert (u.objects, u.bytes, u.streams) == (1, 3, 1)
    assert store.delete_meta(kind="missing", name="s0") and not store.delete_meta(kind="missing", name="s0")
    assert store.list_meta(kind="missing") == ["s1"]
    with pytest.raises(InvalidStoreKey):
        store.get_meta(kind="../x", name="y")


# --- PostgreSQL errors mapped by SQLSTATE: transient vs permanent -------------------------------


@pytest.mark.parametrize(("sqlstate", "transient"), [
    ("25006", True), ("08006", True), ("08001", True), ("40001", True), ("40P01", True), ("53100", True),
    ("53300", True), ("55P03", True), ("57014", True), ("57P01", True), ("57P02", True), ("57P03", True),
    ("42501", False), ("42601", False), ("42P01", False), ("22P02", False), ("23505", False),
    ("54000", False), ("57P04", False), ("XX000", False),
])
def test_postgres_errors_are_classified_by_sqlstate(pg_admin, sqlstate, transient):
    """Each SQLSTATE's psycopg exception, as raised on a healthy connection: its code decides."""
    from activities._pg_store import store_error

    exc = psycopg.errors.lookup(sqlstate)("from the server")
    err = store_error(exc, conn=pg_admin)
    assert isinstance(err, StoreUnavailable) is transient and err.retryable is transient
    assert sqlstate in str(err)


@pytest.fixture
def pg_admin():
    try:
        conn = psycopg.connect(PG_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        if REQUIRED:
            raise
        pytest.skip(f"PostgreSQL is not reachable at {PG_URL}: {exc}")
    yield conn
    conn.close()


@pytest.fixture
def pg_role(pg_admin):
    """A login role of its own (no superuser), dropped with everything it owns afterwards."""
    role = f"mss_{uuid.uuid4().hex[:10]}"
    pg_admin.execute(f"CREATE ROLE {role} LOGIN")
    yield role
    pg_admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
    pg_admin.execute(f"DROP OWNED BY {role}")
    pg_admin.execute(f"DROP ROLE {role}")


def test_read_only_postgres_is_retryable_and_the_put_passes_once_lifted(pg_admin, pg_role):
    """The hostile test's finding: PostgreSQL read-only for a moment (25006) failed a chunk for good."""
    pg_admin.execute(f"GRANT CREATE ON SCHEMA public TO {pg_role}")
    url = f"postgresql://{pg_role}@{PG_HOSTPART}?table=t_{uuid.uuid4().hex[:12]}"
    open_store(url).close()  # the role creates (and owns) its tables
    pg_admin.execute(f"ALTER ROLE {pg_role} SET default_transaction_read_only = on")
    store = open_store(url)  # new connections, read-only: a store on them still opens, to read
    try:
        assert store.get(key="k", principal="alice") is None  # reads work
        with pytest.raises(StoreUnavailable) as exc:
            store.put_if_absent(key="k", data=b"state", stream_id="s", principal="alice")
        assert exc.value.retryable and exc.value.reason == "StoreUnavailable"
        assert isinstance(exc.value.__cause__, psycopg.errors.ReadOnlySqlTransaction)
        assert exc.value.__cause__.sqlstate == "25006" and "25006" in str(exc.value)
        pg_admin.execute(f"ALTER ROLE {pg_role} RESET default_transaction_read_only")
        # the same put passes: the connection that saw the error was not pooled again
        assert store.put_if_absent(key="k", data=b"state", stream_id="s", principal="alice")
        assert store.get(key="k", principal="alice") == b"state"
    finally:
        store.close()


def test_a_missing_privilege_is_a_permanent_error_naming_its_sqlstate(pg_admin, pg_role):
    table = f"t_{uuid.uuid4().hex[:12]}"
    owner = _pg_store(table)  # made by the superuser; the role may only read it
    try:
        owner.put_if_absent(key="k0", data=b"zero", stream_id="s", principal="alice")
        pg_admin.execute(f"GRANT SELECT ON {owner.table}, {owner.meta_table} TO {pg_role}")
        reader = open_store(f"postgresql://{pg_role}@{PG_HOSTPART}?table={table}")
        try:
            with pytest.raises(StoreError) as exc:
                reader.put_if_absent(key="k", data=b"x", stream_id="s", principal="alice")
            assert not isinstance(exc.value, StoreUnavailable) and not exc.value.retryable
            assert "42501" in str(exc.value)
            assert isinstance(exc.value.__cause__, psycopg.errors.InsufficientPrivilege)
            assert reader.get(key="k0", principal="alice") == b"zero"  # its connection is fine, and reused
        finally:
            reader.close()
    finally:
        owner.drop()
        owner.close()


def test_a_killed_connection_is_retryable_and_not_pooled_again(pg_admin):
    app = f"mss_{uuid.uuid4().hex[:10]}"
    store = _pg_store(f"t_{uuid.uuid4().hex[:12]}")
    store.close()
    store = open_store(f"{PG_URL}?table={store.table}&application_name={app}")
    try:
        store.put_if_absent(key="k", data=b"state", stream_id="s", principal="alice")
        killed = pg_admin.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                                  " WHERE application_name = %s", (app,)).fetchone()[0]
        assert killed == 1
        with pytest.raises(StoreUnavailable) as exc:
            store.get(key="k", principal="alice")
        assert exc.value.retryable and isinstance(exc.value.__cause__, psycopg.Error)
        assert store.get(key="k", principal="alice") == b"state"  # on a new connection
    finally:
        store.drop()
        store.close()


# --- the file store: cleanup never hides the error ----------------------------------------------


def test_a_failed_write_is_raised_not_its_cleanup_error(tmp_path):
    """tmp/ is not a directory: the write fails (ENOTDIR), and so does removing the tmp file.

    The removal's error used to replace the write's StoreError. This fails for root too, which
    chmod cannot stop.
    """
    store = FileStateStore(tmp_path / "store")
    shutil.rmtree(tmp_path / "store" / "tmp")
    (tmp_path / "store" / "tmp").write_bytes(b"not a directory")
    for put in (lambda: store.put_if_absent(key="k", data=b"state", stream_id="s", principal="alice"),
                lambda: store.put_meta_if_absent(kind="owner", name="temporal", data=b"{}")):
        with pytest.raises(StoreError) as exc:
            put()
        assert isinstance(exc.value, StoreUnavailable)  # ENOTDIR: as `_os_error` decides, may pass
        assert isinstance(exc.value.__cause__, OSError) and exc.value.__cause__.errno == errno.ENOTDIR
    assert store.get(key="k", principal="alice") is None


@pytest.fixture
def read_only_store(tmp_path):
    """A file store holding one blob, whose directory then refuses writes, for real.

    Not root: the objects and tmp directories are made 0500. Root ignores modes, so there a
    tmpfs is mounted and remounted read-only (EROFS, the case that was found); skipped where
    root may not mount.
    """
    root = tmp_path / "store"
    if os.geteuid() != 0:
        store = FileStateStore(root)
        store.put_if_absent(key="k0", data=b"zero", stream_id="s", principal="alice")
        for sub in ("objects", "tmp"):
            os.chmod(root / sub, 0o500)
        yield store, (errno.EACCES,)
        for sub in ("objects", "tmp"):
            os.chmod(root / sub, 0o700)
        return
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(root)],
                      capture_output=True).returncode != 0:
        pytest.skip("running as root, where chmod cannot make a directory read-only, "
                    "and mount is not permitted")
    try:
        store = FileStateStore(root)
        store.put_if_absent(key="k0", data=b"zero", stream_id="s", principal="alice")
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True, capture_output=True)
        yield store, (errno.EROFS,)
    finally:
        subprocess.run(["umount", str(root)], check=False, capture_output=True)


def test_a_read_only_file_store_raises_the_write_error_typed(read_only_store):
    store, errnos = read_only_store
    with pytest.raises(StoreError) as exc:
        store.put_if_absent(key="k", data=b"state", stream_id="s2", principal="alice")
    assert type(exc.value) is StoreError and not exc.value.retryable  # EROFS/EACCES: as `_os_error` decides
    assert isinstance(exc.value.__cause__, OSError) and exc.value.__cause__.errno in errnos
    assert "cannot write k" in str(exc.value)
    assert store.get(key="k0", principal="alice") == b"zero"  # reads still work

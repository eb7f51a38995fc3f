"""State stores against the real file system and the real PostgreSQL on 127.0.0.1:5432."""

from __future__ import annotations

import errno
import itertools
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

from mamba_stream.activities import (
    Fence,
    FileStateStore,
    InvalidStoreKey,
    LeaseLost,
    LegacyObject,
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
    assert store.put_if_absent(key="s1.k1", data=b"one", stream_id="s1", owner="alice")
    assert not store.put_if_absent(key="s1.k1", data=b"other", stream_id="s1", owner="alice")
    assert store.put_if_absent(key="s1.k2", data=bytearray(b"two!"), stream_id="s1", owner="alice")
    assert store.put_if_absent(key="s2.k1", data=memoryview(b"three"), stream_id="s2", owner="bob")
    assert store.get(key="s1.k1", owner="alice") == b"one"
    assert store.get(key="nope", owner="alice") is None
    assert store.list_stream(stream_id="s1") == ["s1.k1", "s1.k2"]
    assert store.list_stream(stream_id="s3") == []
    assert store.stream_ids() == ["s1", "s2"]
    u = store.usage()
    assert (u.objects, u.bytes, u.streams) == (3, 3 + 4 + 5, 2)
    # a delete names the object's stream and principal: another's is left alone, whatever the key
    assert not store.delete(key="s2.k1", stream_id="s1", owner="alice")
    assert not store.delete(key="s2.k1", stream_id="s2", owner="alice")
    assert not store.delete(key="s1.k2", stream_id="s1", owner="bob")
    assert store.get(key="s2.k1", owner="bob") == b"three" and store.get(key="s1.k2", owner="alice")
    assert store.delete(key="s1.k2", stream_id="s1", owner="alice")
    assert not store.delete(key="s1.k2", stream_id="s1", owner="alice")
    assert store.delete_stream(stream_id="s2") == 1
    assert store.get(key="s2.k1", owner="bob") is None
    assert store.list_stream(stream_id="s1") == ["s1.k1"]
    assert store.stream_ids() == ["s1"]
    store.delete(key="s1.k1", stream_id="s1", owner="alice")
    assert store.stream_ids() == []


def test_a_read_with_the_wrong_principal_returns_nothing(store):
    store.put_if_absent(key="k", data=b"secret", stream_id="s", owner="alice")
    assert store.get(key="k", owner="mallory") is None
    assert store.get(key="k", owner="alice") == b"secret"


def test_invalid_keys_are_typed_errors(store):
    for bad in ("", "../etc/passwd", "a/b", ".", "x" * 300, "spaces are bad"):
        with pytest.raises(InvalidStoreKey):
            store.put_if_absent(key=bad, data=b"x", stream_id="s", owner="p")
    with pytest.raises(InvalidStoreKey):
        store.list_stream(stream_id="../up")
    assert not InvalidStoreKey.retryable


def test_concurrent_threads_leave_one_complete_object(store):
    payloads = [bytes([i]) * (256 * 1024 + i) for i in range(8)]
    results: list[bool] = []
    barrier = threading.Barrier(len(payloads))

    def write(p: bytes) -> None:
        barrier.wait()
        results.append(store.put_if_absent(key="race", data=p, stream_id="s", owner="alice"))

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]
    got = store.get(key="race", owner="alice")
    assert got in payloads
    assert store.list_stream(stream_id="s") == ["race"] and store.usage().objects == 1


_WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from mamba_stream.activities import open_store
    store = open_store(sys.argv[1])
    payload = bytes([int(sys.argv[2])]) * (2 << 20)
    while time.time() < float(sys.argv[3]):
        pass
    print(store.put_if_absent(key="race", data=payload, stream_id="s", owner="alice"))
""")


def test_concurrent_processes_leave_one_complete_object(store):
    start = time.time() + 2.0
    code = _WRITER.format(root=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", code, _url(store), str(i), str(start)],
                              stdout=subprocess.PIPE, text=True) for i in range(4)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(outs) == ["False", "False", "False", "True"]
    got = store.get(key="race", owner="alice")
    assert got is not None and len(got) == 2 << 20 and got == bytes([got[0]]) * len(got)
    assert store.usage().objects == 1


_SLOW_WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from mamba_stream.activities import FileStateStore

    class Slow(FileStateStore):
        def _write_chunk(self, fd, chunk):
            super()._write_chunk(fd, chunk)
            time.sleep(0.2)

    Slow(sys.argv[1]).put_if_absent(key="big", data=bytes(64 << 20), stream_id="s", owner="alice")
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
    assert store.get(key="big", owner="alice") is None
    assert store.list_stream(stream_id="s") == []
    assert store.usage().objects == 0
    # the next writer of that key succeeds and the leftover can be swept
    assert store.put_if_absent(key="big", data=b"whole", stream_id="s", owner="alice")
    assert store.get(key="big", owner="alice") == b"whole"
    assert store.sweep_tmp(older_than_s=0) == 1


def test_file_store_permissions_and_corruption(tmp_path):
    store = FileStateStore(tmp_path / "store")
    store.put_if_absent(key="k", data=b"payload", stream_id="s", owner="p")
    obj = next((tmp_path / "store" / "objects").rglob("k"))
    assert (obj.stat().st_mode & 0o777) == 0o600
    assert ((tmp_path / "store").stat().st_mode & 0o777) == 0o700
    raw = obj.read_bytes()
    # the store keeps no digest of its own (it would be a checksum in clear): a flipped bit is the
    # blob's authentication tag's to find, where it is decoded (tests/workflows/test_store_faults.py);
    # what the store itself sees is an object that does not frame: cut short, or not its magic
    obj.write_bytes(raw[:-1])
    with pytest.raises(StoreCorrupt, match="its header says"):
        store.get(key="k", owner="p")
    obj.write_bytes(b"XXXX" + raw[4:])
    with pytest.raises(StoreCorrupt, match="bad magic"):
        store.get(key="k", owner="p")


def test_unreachable_postgres_is_a_retryable_error():
    with pytest.raises(StoreUnavailable) as exc:
        open_store("postgresql://postgres@127.0.0.1:1/test")
    assert exc.value.retryable
    with pytest.raises(StoreError):
        open_store("s3://bucket/x")


# --- metadata: beside the blobs, never a stream, a checkpoint or usage --------------------------


def test_metadata_is_put_if_absent_and_apart_from_the_blobs(store):
    store.put_if_absent(key="s1.k1", data=b"one", stream_id="s1", owner="alice")
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
    from mamba_stream.activities._pg_store import store_error

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
        assert store.get(key="k", owner="alice") is None  # reads work
        with pytest.raises(StoreUnavailable) as exc:
            store.put_if_absent(key="k", data=b"state", stream_id="s", owner="alice")
        assert exc.value.retryable and exc.value.reason == "StoreUnavailable"
        assert isinstance(exc.value.__cause__, psycopg.errors.ReadOnlySqlTransaction)
        assert exc.value.__cause__.sqlstate == "25006" and "25006" in str(exc.value)
        pg_admin.execute(f"ALTER ROLE {pg_role} RESET default_transaction_read_only")
        # the same put passes: the connection that saw the error was not pooled again
        assert store.put_if_absent(key="k", data=b"state", stream_id="s", owner="alice")
        assert store.get(key="k", owner="alice") == b"state"
    finally:
        store.close()


def test_a_missing_privilege_is_a_permanent_error_naming_its_sqlstate(pg_admin, pg_role):
    table = f"t_{uuid.uuid4().hex[:12]}"
    owner = _pg_store(table)  # made by the superuser; the role may only read it
    try:
        owner.put_if_absent(key="k0", data=b"zero", stream_id="s", owner="alice")
        pg_admin.execute(f"GRANT SELECT ON {owner.table}, {owner.meta_table} TO {pg_role}")
        reader = open_store(f"postgresql://{pg_role}@{PG_HOSTPART}?table={table}")
        try:
            with pytest.raises(StoreError) as exc:
                reader.put_if_absent(key="k", data=b"x", stream_id="s", owner="alice")
            assert not isinstance(exc.value, StoreUnavailable) and not exc.value.retryable
            assert "42501" in str(exc.value)
            assert isinstance(exc.value.__cause__, psycopg.errors.InsufficientPrivilege)
            assert reader.get(key="k0", owner="alice") == b"zero"  # its connection is fine, and reused
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
        store.put_if_absent(key="k", data=b"state", stream_id="s", owner="alice")
        killed = pg_admin.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                                  " WHERE application_name = %s", (app,)).fetchone()[0]
        assert killed == 1
        with pytest.raises(StoreUnavailable) as exc:
            store.get(key="k", owner="alice")
        assert exc.value.retryable and isinstance(exc.value.__cause__, psycopg.Error)
        assert store.get(key="k", owner="alice") == b"state"  # on a new connection
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
    for put in (lambda: store.put_if_absent(key="k", data=b"state", stream_id="s", owner="alice"),
                lambda: store.put_meta_if_absent(kind="owner", name="temporal", data=b"{}")):
        with pytest.raises(StoreError) as exc:
            put()
        assert isinstance(exc.value, StoreUnavailable)  # ENOTDIR: as `_os_error` decides, may pass
        assert isinstance(exc.value.__cause__, OSError) and exc.value.__cause__.errno == errno.ENOTDIR
    assert store.get(key="k", owner="alice") is None


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
        store.put_if_absent(key="k0", data=b"zero", stream_id="s", owner="alice")
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
        store.put_if_absent(key="k0", data=b"zero", stream_id="s", owner="alice")
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True, capture_output=True)
        yield store, (errno.EROFS,)
    finally:
        subprocess.run(["umount", str(root)], check=False, capture_output=True)


def test_a_read_only_file_store_raises_the_write_error_typed(read_only_store):
    store, errnos = read_only_store
    with pytest.raises(StoreError) as exc:
        store.put_if_absent(key="k", data=b"state", stream_id="s2", owner="alice")
    assert type(exc.value) is StoreError and not exc.value.retryable  # EROFS/EACCES: as `_os_error` decides
    assert isinstance(exc.value.__cause__, OSError) and exc.value.__cause__.errno in errnos
    assert "cannot write k" in str(exc.value)
    assert store.get(key="k0", owner="alice") == b"zero"  # reads still work


# --- compare-and-set, fences, legacy objects (issue 43) -----------------------------------------


def test_swap_meta_is_a_compare_and_set(any_store):
    s = any_store
    assert s.swap_meta(kind="lease", name="e", expect=None, data=b"g1 a")  # absent -> written
    assert not s.swap_meta(kind="lease", name="e", expect=None, data=b"g2 a")  # present: refused
    assert not s.swap_meta(kind="lease", name="e", expect=b"g1 b", data=b"g2 a")  # another value: refused
    assert s.get_meta(kind="lease", name="e") == b"g1 a"
    assert s.swap_meta(kind="lease", name="e", expect=b"g1 a", data=b"g1 b")  # renewed
    assert not s.swap_meta(kind="lease", name="e", expect=b"g1 a", data=None)  # a stale delete: refused
    assert s.swap_meta(kind="lease", name="e", expect=b"g1 b", data=None)
    assert s.get_meta(kind="lease", name="e") is None
    assert s.swap_meta(kind="lease", name="e", expect=None, data=None)  # absent, as expected


def test_a_fenced_write_happens_only_while_its_lease_starts_with_the_token(any_store):
    s = any_store
    fence = Fence("lease", "e", b"g1 ")
    for fenced in (lambda: s.put_if_absent(key="k1", data=b"x", stream_id="s", owner="o", fence=fence),
                   lambda: s.put_meta(kind="index", name="e", data=b"rec", fence=fence)):
        with pytest.raises(LeaseLost):  # no lease at all
            fenced()
    assert s.get(key="k1", owner="o") is None and s.get_meta(kind="index", name="e") is None
    assert s.swap_meta(kind="lease", name="e", expect=None, data=b"g1 {since 1}")
    assert s.put_if_absent(key="k1", data=b"x", stream_id="s", owner="o", fence=fence)
    assert not s.put_if_absent(key="k1", data=b"y", stream_id="s", owner="o", fence=fence)  # exists: False
    s.put_meta(kind="index", name="e", data=b"rec", fence=fence)
    assert s.swap_meta(kind="lease", name="e", expect=b"g1 {since 1}", data=b"g1 {since 2}")  # a renewal keeps it
    s.put_meta(kind="index", name="e", data=b"rec2", fence=fence)
    # taken over: the old holder's writes are refused and change nothing
    assert s.swap_meta(kind="lease", name="e", expect=b"g1 {since 2}", data=b"g2 {since 3}")
    with pytest.raises(LeaseLost) as err:
        s.put_meta(kind="index", name="e", data=b"stale", fence=fence)
    assert not err.value.retryable
    with pytest.raises(LeaseLost):
        s.put_if_absent(key="k2", data=b"stale", stream_id="s", owner="o", fence=fence)
    with pytest.raises(LeaseLost):  # an existing key under a lost lease: still refused, not False
        s.put_if_absent(key="k1", data=b"stale", stream_id="s", owner="o", fence=fence)
    assert s.get_meta(kind="index", name="e") == b"rec2" and s.get(key="k2", owner="o") is None
    s.put_meta(kind="index", name="e", data=b"new", fence=Fence("lease", "e", b"g2 "))


def test_a_fenced_delete_happens_only_while_its_sighting_starts_with_the_token(any_store):
    """The KV segments' sweep deletes under a fence on its sighting: a sighting cleared (a commit
    took the segment) or replaced (another sweep's, another token) since keeps the object."""
    s = any_store
    fence = Fence("kv-seen", "k1", b"t1 ")
    assert s.put_if_absent(key="k1", data=b"x", stream_id="seg.o", owner="o")
    assert not s.delete(key="k1", stream_id="seg.o", owner="o", fence=fence)  # no sighting at all
    assert s.put_meta_if_absent(kind="kv-seen", name="k1", data=b"t2 5.0")
    assert not s.delete(key="k1", stream_id="seg.o", owner="o", fence=fence)  # another sweep's sighting
    assert s.get(key="k1", owner="o") == b"x"
    assert s.swap_meta(kind="kv-seen", name="k1", expect=b"t2 5.0", data=b"t1 6.0")
    assert not s.delete(key="k1", stream_id="seg.o", owner="other", fence=fence)  # not the owner's: kept
    assert s.delete(key="k1", stream_id="seg.o", owner="o", fence=fence)
    assert s.get(key="k1", owner="o") is None
    assert not s.delete(key="k1", stream_id="seg.o", owner="o", fence=fence)  # gone: False


def test_fenced_writes_and_a_takeover_race_on_threads_one_way_only(any_store):
    """Writers fenced by one generation race a takeover: each writes until refused; every write
    that succeeded is in the store, none came after its writer's first refusal, and every writer
    was refused once the lease was another's."""
    s = any_store
    assert s.swap_meta(kind="lease", name="e", expect=None, data=b"g1 x")
    fence, lock = Fence("lease", "e", b"g1 "), threading.Lock()
    written: list[tuple[int, int]] = []
    refused: list[tuple[int, int]] = []
    some = threading.Event()

    def write(i: int) -> None:
        deadline = time.monotonic() + 60  # a writer that is never refused fails the test, not hangs it
        for j in itertools.count():
            if time.monotonic() > deadline:
                return
            try:
                s.put_if_absent(key=f"k{i}-{j}", data=b"x", stream_id="s", owner="o", fence=fence)
            except LeaseLost:
                with lock:
                    refused.append((i, j))
                return
            with lock:
                written.append((i, j))
                if len(written) >= 8:
                    some.set()

    # three writers: the PostgreSQL store's pool has four connections, one left for the takeover
    threads = [threading.Thread(target=write, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert some.wait(30)
    assert s.swap_meta(kind="lease", name="e", expect=b"g1 x", data=b"g2 x")  # the takeover, mid-flight
    for t in threads:
        t.join()
    assert sorted(i for i, _ in refused) == [0, 1, 2]  # every writer refused once, then it stopped
    for i, j in refused:
        assert all(jj < j for ii, jj in written if ii == i)
    assert sorted(s.list_stream(stream_id="s")) == sorted(f"k{i}-{j}" for i, j in written)


def test_a_legacy_object_is_read_by_its_principals_name_only_and_rewritten_owned_by_a_tag(tmp_path):
    from tests._legacy import legacy_file_object, legacy_pg_row, legacy_pg_table

    file_store = open_store(f"file://{tmp_path / 'store'}")
    legacy_file_object(file_store.root, key="s1.k1", data=b"old blob", stream_id="s1", principal="alice")
    table = f"t_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            legacy_pg_table(conn, table)
            legacy_pg_row(conn, table, key="s1.k1", data=b"old blob", stream_id="s1", principal="alice")
    except psycopg.OperationalError as exc:
        if REQUIRED:
            raise
        pytest.skip(f"PostgreSQL is not reachable at {PG_URL}: {exc}")
    pg = _pg_store(table)
    try:
        assert pg.legacy_layout
        for s in (file_store, pg):
            assert s.get(key="s1.k1", owner="tag-a") is None  # not by a tag
            assert s.get(key="s1.k1", owner="alice") is None  # a name is no owner: only a legacy one
            assert s.get(key="s1.k1", owner="tag-a", legacy="bob") is None
            assert s.get(key="s1.k1", owner="tag-a", legacy="alice") == b"old blob"
            assert s.legacy_objects() == [LegacyObject("s1.k1", "s1", "alice")]
            # new objects beside it, in the same (legacy-layout) table: owned by their tag
            assert s.put_if_absent(key="s1.k2", data=b"new", stream_id="s1", owner="tag-a")
            assert s.get(key="s1.k2", owner="tag-a") == b"new" and s.get(key="s1.k2", owner="x", legacy="tag-a") is None
            assert not s.rewrite(key="s1.k1", data=b"resealed", owner="tag-a", legacy="bob")
            assert s.rewrite(key="s1.k1", data=b"resealed", owner="tag-a", legacy="alice")
            assert not s.rewrite(key="s1.k1", data=b"again", owner="tag-a", legacy="alice")  # no longer legacy
            assert s.legacy_objects() == []
            assert s.get(key="s1.k1", owner="tag-a") == b"resealed"
            assert s.get(key="s1.k1", owner="tag-b", legacy="alice") is None
            assert s.list_stream(stream_id="s1") == ["s1.k1", "s1.k2"] and s.usage().bytes == len(b"resealed") + 3
        raw = b"".join(p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file())
        assert b"alice" not in raw and b"sha256" not in raw
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            rows = conn.execute(f"SELECT principal, octet_length(sha256) FROM {table} ORDER BY key").fetchall()
        assert rows == [("tag-a", 0), ("tag-a", 0)]
        # a legacy object deleted by its name, while legacy
        legacy_file_object(file_store.root, key="s2.k1", data=b"old", stream_id="s2", principal="bob")
        assert not file_store.delete(key="s2.k1", stream_id="s2", owner="tag-b")
        assert file_store.delete(key="s2.k1", stream_id="s2", owner="tag-b", legacy="bob")
    finally:
        pg.drop()
        pg.close()


def test_a_new_postgres_table_has_an_owner_column_and_no_digest():
    store = _pg_store(f"t_{uuid.uuid4().hex[:12]}")
    try:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            cols = [r[0] for r in conn.execute("SELECT column_name FROM information_schema.columns"
                                               " WHERE table_name = %s ORDER BY ordinal_position",
                                               (store.table,)).fetchall()]
        assert cols == ["key", "stream_id", "owner", "data", "size", "created_at"] and not store.legacy_layout
    finally:
        store.drop()
        store.close()


def test_streams_of_counts_a_principals_streams_holding_objects(store):
    """What the `streams` quota counts: the streams whose ids name the tag and hold objects."""
    a, b = "a" * 32, "b" * 32
    ids = [f"ms.{a}.{'1' * 32}", f"ms.{a}.{'2' * 32}", f"ms.{b}.{'3' * 32}", f"pfx.{a}"]
    for sid in ids:
        assert store.put_if_absent(key=f"{sid}.k1", data=b"x", stream_id=sid, owner=a)
    assert store.streams_of(a) == ids[:2] and store.streams_of(b) == ids[2:3]
    assert store.streams_of("c" * 32) == []
    store.delete_stream(stream_id=ids[0])
    assert store.streams_of(a) == ids[1:2]  # a disposed stream no longer counts

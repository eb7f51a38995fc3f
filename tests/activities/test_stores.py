"""State stores against the real file system and the real PostgreSQL on 127.0.0.1:5432."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

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
    assert store.delete(key="s1.k2") and not store.delete(key="s1.k2")
    assert store.delete_stream(stream_id="s2") == 1
    assert store.get(key="s2.k1", principal="bob") is None
    assert store.list_stream(stream_id="s1") == ["s1.k1"]
    assert store.stream_ids() == ["s1"]
    store.delete(key="s1.k1")
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

"""A store written before its owners were tagged (issue 43): read as before, then rewritten keyed.

The old-format store is made the way that version made it: streams and prefix entries written by
the activities, then every object, blob and record turned into the older layout (`tests._legacy`:
principals' names and sha256 digests in clear, checkpoint envelopes with their bound fields in
clear, prefix records as clear JSON), on the file store and on a PostgreSQL table of the older
layout. Then a new worker goes on with those streams and prefixes, bit for bit, and the rekey
leaves nothing of them in clear."""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg
import pytest

from mamba_stream.activities import PrefixStore, StateStore, open_store, rekey_store
from mamba_stream.state_codec.codec import Keyring, is_clear_header
from tests._legacy import downgrade_file_store, downgrade_meta, downgrade_pg_rows, legacy_pg_table
from tests.activities.test_prefix import acts_for, feed, open_, tokens, truth
from tests.activities.test_stores import PG_URL, REQUIRED

NAMES = ["principal-alice-q7", "principal-bob-z3"]


@pytest.fixture(params=["file", "postgresql"])
def old_store(request, tmp_path):
    """(store, a function that turns what is in it into the older layout, one that reads every byte
    of it at rest)."""
    if request.param == "file":
        root = tmp_path / "states"
        store = open_store(f"file://{root}")

        def downgrade(ring: Keyring) -> int:
            downgrade_meta(store, ring)
            return downgrade_file_store(root, ring, NAMES)

        yield store, downgrade, lambda: b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())
        return
    table = f"t_{uuid.uuid4().hex[:12]}"
    try:
        conn = psycopg.connect(PG_URL, autocommit=True)
    except psycopg.OperationalError as exc:
        if REQUIRED:
            raise
        pytest.skip(f"PostgreSQL is not reachable at {PG_URL}: {exc}")
    legacy_pg_table(conn, table)
    store = open_store(f"{PG_URL}?table={table}")
    assert store.legacy_layout

    def downgrade(ring: Keyring) -> int:
        downgrade_meta(store, ring)
        return downgrade_pg_rows(conn, table, ring, NAMES)

    def at_rest() -> bytes:
        out = b""
        for t in (table, f"{table}_meta"):
            for row in conn.execute(f"SELECT * FROM {t}").fetchall():
                out += b"|".join(bytes(v) if isinstance(v, (bytes, memoryview)) else str(v).encode() for v in row)
        return out

    try:
        yield store, downgrade, at_rest
    finally:
        store.drop()
        store.close()
        conn.close()


def test_an_old_format_store_is_read_as_before_then_rekeyed_and_nothing_is_lost(old_store):
    store, downgrade, at_rest = old_store
    ring = Keyring.generate()
    alice, bob = NAMES
    p, more, rest = tokens(200, seed=21), tokens(30, seed=22), tokens(20, seed=23)
    old = acts_for(store, ring)
    a = open_(old, "s-a", p, alice).receipt
    a1 = feed(old, "s-a", a, more, alice).receipt
    b = open_(old, "s-b", None, bob).receipt
    b1 = feed(old, "s-b", b, more, bob).receipt
    assert downgrade(ring) >= 6
    raw = at_rest()
    assert alice.encode() in raw and bob.encode() in raw  # what the old layout said to anyone
    assert len(store.legacy_objects()) >= 6

    # a new worker (nothing in memory) goes on from the old store as before
    new = acts_for(store, ring, prefix_ram_bytes=0)
    a2 = feed(new, "s-a", a1, rest, alice).receipt
    assert a2.checksum == truth(p + more + rest)
    again = open_(new, "s-a2", p, alice).receipt  # alice's prefix entry, as the old worker stored it
    assert again.origin.stored_tokens == 200 and again.checksum == truth(p)
    assert open_(new, "s-b2", p, bob).receipt.origin.stored_tokens == 0  # alice's, never bob's

    rep = rekey_store(store, ring, new.prefixes)
    assert rep.objects >= 6 and rep.resealed >= 4 and rep.records >= 2 and rep.unreadable == 0
    assert store.legacy_objects() == []
    raw = at_rest()
    for name in NAMES:
        assert name.encode() not in raw
    assert b'"receipt"' not in raw and b"checksum" not in raw
    if isinstance(store.url, str) and store.url.startswith("file"):
        assert b"sha256" not in raw and b"MSSB\x01" not in raw
    # and nothing lost: every stream and the prefix go on, bit for bit
    fresh = acts_for(store, ring, prefix_ram_bytes=0)
    b2 = feed(fresh, "s-b", b1, rest, bob).receipt
    assert b2.checksum == truth(more + rest)
    a3 = feed(fresh, "s-a", a2, rest, alice).receipt
    assert a3.checksum == truth(p + more + rest + rest)
    assert open_(fresh, "s-a3", p, alice).receipt.origin.stored_tokens == 200
    assert not any(is_clear_header(store.get(key=k, owner=ring.principal_tag(alice)) or b"")
                   for k in store.list_stream(stream_id="s-a"))
    # run again, it finds nothing
    assert rekey_store(store, ring, PrefixStore(store, ring)).objects == 0


def test_a_legacy_checkpoint_under_another_keyring_is_left_as_it_is(tmp_path: Path):
    from tests._legacy import legacy_file_object

    store: StateStore = open_store(f"file://{tmp_path / 's'}")
    legacy_file_object(store.root, key="s.e0.c0." + "0" * 32, data=_v1_blob(Keyring.generate()),
                       stream_id="s", principal="carol")
    rep = rekey_store(store, Keyring.generate())
    assert (rep.objects, rep.unreadable) == (0, 1) and len(store.legacy_objects()) == 1


def _v1_blob(ring: Keyring) -> bytes:
    from mamba_stream.scan import load_model
    from mamba_stream.state_codec.codec import seal
    from tests._legacy import legacy_blob

    m = load_model("tiny-mamba2")
    st = m.advance(m.initial_state(), [1, 2]).state
    receipt, _ = seal(m, st, stream_id="s", principal="carol", chunk_seq=0, epoch=0, keyring=ring)
    return legacy_blob(st.tensors, receipt, ring, m.schema.canonical_json())

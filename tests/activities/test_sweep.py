"""The orphan sweep against real Temporal dev servers and real stores (a file store, PostgreSQL).

The finding behind these: `MAMBA_STREAM_STORE=<live store> mamba-stream sweep --address <another
server>` deleted every live stream's blobs, since to the wrong server each workflow is "not found".
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from mamba_stream.activities import (
    StateStore,
    StoreOwnedElsewhere,
    claim_store,
    open_store,
    sweep_orphans,
)
from mamba_stream.activities._sweep import MISSING_KIND, store_owner
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.worker import WorkerConfig, run_worker, start_dev_server
from tests.activities.test_stores import store  # noqa: F401 - the file and PostgreSQL stores, as a fixture

pytestmark = pytest.mark.asyncio(loop_scope="session")

ROOT = Path(__file__).resolve().parents[2]


async def _server() -> WorkflowEnvironment:
    return await start_dev_server()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server_a() -> AsyncIterator[WorkflowEnvironment]:
    env = await _server()
    yield env
    await env.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server_b() -> AsyncIterator[WorkflowEnvironment]:
    """Another cluster: a second dev server, with its own cluster id."""
    env = await _server()
    yield env
    await env.shutdown()


def _address(env: WorkflowEnvironment) -> str:
    return env.client.service_client.config.target_host


def _fill(store: StateStore, sid: str, n: int = 3) -> list[str]:
    keys = [f"{sid}.k{i}" for i in range(n)]
    for k in keys:
        store.put_if_absent(key=k, data=b"sealed state " + k.encode(), stream_id=sid, owner="tag-of-alice")
    return keys


async def _live(client: Client, sid: str) -> None:
    """A running workflow with the stream's id (no worker needed for it to be running)."""
    await client.start_workflow("MambaStreamWorkflow", id=sid, task_queue=f"nobody-{uuid.uuid4().hex[:8]}")


def _sid() -> str:
    return "ms-" + uuid.uuid4().hex


async def test_claim_store_records_the_owner_once_and_refuses_another(store, server_a, server_b):
    a = await claim_store(server_a.client, store)
    assert a is not None and a.namespace == "default" and a.cluster_id
    assert store_owner(store) == a
    assert await claim_store(server_a.client, store) == a  # the same cluster and namespace: fine
    with pytest.raises(StoreOwnedElsewhere) as exc:
        await claim_store(server_b.client, store)  # another cluster
    assert exc.value.reason == "StoreOwnedElsewhere" == type(exc.value).__name__
    assert not exc.value.retryable and a.cluster_id in str(exc.value)
    other_ns = await Client.connect(_address(server_a), namespace="elsewhere")
    with pytest.raises(StoreOwnedElsewhere):
        await claim_store(other_ns, store)  # the same cluster, another namespace
    assert store_owner(store) == a  # a refused claim changes nothing


async def test_a_sweep_through_another_cluster_is_refused_and_deletes_nothing(store, server_a, server_b):
    """The finding, reproduced: live streams of A, swept through B with --grace 3600."""
    await claim_store(server_a.client, store)
    live = sorted(_sid() for _ in range(3))
    blobs = {}
    for sid in live:
        await _live(server_a.client, sid)
        blobs[sid] = _fill(store, sid)
    for grace in (3600.0, 0.0):
        with pytest.raises(StoreOwnedElsewhere):
            await sweep_orphans(server_b.client, store, grace_s=grace)
    assert store.stream_ids() == live and all(store.list_stream(stream_id=s) == blobs[s] for s in live)
    assert store.list_meta(kind=MISSING_KIND) == []  # not even a sighting recorded
    # through its own cluster the streams are live: nothing to delete
    rep = await sweep_orphans(server_a.client, store, grace_s=0)
    assert rep.checked == 3 and rep.orphans == {} and rep.missing == {} and store.stream_ids() == live


async def test_a_stream_whose_workflow_is_not_found_ages_through_the_grace(store, server_a):
    await claim_store(server_a.client, store)
    gone, live = _sid(), _sid()
    gone_keys = _fill(store, gone)
    _fill(store, live, 2)
    await _live(server_a.client, live)

    first = await sweep_orphans(server_a.client, store, grace_s=3600)
    assert first.orphans == {} and first.blobs_deleted == 0 and set(first.missing) == {gone}
    assert store.list_stream(stream_id=gone) == gone_keys
    assert store.list_meta(kind=MISSING_KIND) == [gone]  # the sighting is recorded...
    assert store.stream_ids() == sorted([gone, live]) and store.usage().objects == 5  # ...and is no blob
    since = first.missing[gone]
    again = await sweep_orphans(server_a.client, store, grace_s=3600)
    assert again.missing == {gone: since}  # aged from the first sighting, not from this one

    await asyncio.sleep(max(0.0, since + 0.6 - time.time()))
    rep = await sweep_orphans(server_a.client, store, grace_s=0.5)  # missing longer than the grace now
    assert rep.orphans == {gone: "workflow not found"} and rep.blobs_deleted == 3 and rep.missing == {}
    assert store.list_stream(stream_id=gone) == [] and store.stream_ids() == [live]
    assert store.list_meta(kind=MISSING_KIND) == []


async def test_prefix_entries_are_never_orphans_and_a_workers_sweep_bounds_them(store, server_a):
    """The prefix store keeps its entries under stream ids no workflow has (`pfx.<scope>`): the
    sweep must not take them for forgotten streams, whatever the grace; given the worker's
    activities it sweeps them by their own rule (the scope's bytes bound)."""
    from mamba_stream.activities import ModelRegistry, StreamActivities
    from mamba_stream.workflows import OpenStreamRequest
    from tests.activities._env import stream_env

    await claim_store(server_a.client, store)
    acts = StreamActivities(models=ModelRegistry(["tiny-mamba2"], backend="exact"), store=store,
                            keyring=Keyring.generate(), prefix_ram_bytes=0)
    try:
        for i in range(3):
            stream_env(f"ms-p{i}").run(acts.open_stream, OpenStreamRequest(
                stream_id=f"ms-p{i}", principal="alice", model_id="tiny-mamba2", prefix=[i + 1] * 20))
        entries = {s: store.list_stream(stream_id=s) for s in store.stream_ids() if s.startswith("pfx.")}
        assert len(entries) == 1 and len(next(iter(entries.values()))) == 6  # 3 states and their logits
        rep = await sweep_orphans(server_a.client, store, grace_s=0)  # no worker's activities
        assert set(rep.orphans) == {"ms-p0", "ms-p1", "ms-p2"} and rep.prefixes is None
        assert {s: store.list_stream(stream_id=s) for s in entries} == entries
        one = acts.prefixes.usage().bytes // 3
        acts.prefixes.max_bytes = 2 * one  # an operator lowers the bound: the worker's sweep applies it
        rep = await sweep_orphans(server_a.client, store, grace_s=0, activities=acts)
        # (the opened streams' hot states go now: the first sweep had no worker to zero them in)
        assert set(rep.orphans) == {"ms-p0", "ms-p1", "ms-p2"}
        assert rep.prefixes.evicted == 1 and rep.prefixes.entries == 2
        assert rep.prefixes.bytes == 2 * one and len(store.list_stream(stream_id=next(iter(entries)))) == 4
    finally:
        acts.close()


async def test_a_missing_workflow_that_turns_up_again_starts_afresh(store, server_a):
    await claim_store(server_a.client, store)
    sid = _sid()
    keys = _fill(store, sid)
    assert set((await sweep_orphans(server_a.client, store, grace_s=3600)).missing) == {sid}
    await _live(server_a.client, sid)  # it is there after all
    rep = await sweep_orphans(server_a.client, store, grace_s=0)
    assert rep.orphans == {} and rep.missing == {} and store.list_meta(kind=MISSING_KIND) == []
    await server_a.client.get_workflow_handle(sid).terminate("operator")
    assert (await sweep_orphans(server_a.client, store, grace_s=3600)).orphans == {}  # closed within grace
    assert store.list_stream(stream_id=sid) == keys
    rep = await sweep_orphans(server_a.client, store, grace_s=0)
    assert rep.orphans == {sid: "workflow terminated"} and rep.blobs_deleted == 3


async def test_a_store_with_no_owner_is_not_swept(store, server_a):
    sid = _sid()
    keys = _fill(store, sid)
    for dry_run in (False, True):
        rep = await sweep_orphans(server_a.client, store, grace_s=0, dry_run=dry_run)
        assert rep.refused and "no owner" in rep.refused and rep.owner is None
        assert rep.checked == 0 and rep.orphans == {} and rep.blobs_deleted == 0
    assert store.list_stream(stream_id=sid) == keys
    assert store_owner(store) is None and store.list_meta(kind=MISSING_KIND) == []
    # an explicit claim records the owner, and the sweep goes ahead
    rep = await sweep_orphans(server_a.client, store, grace_s=0, claim=True)
    assert rep.refused is None and store_owner(store) == rep.owner and rep.owner.namespace == "default"
    assert rep.orphans == {sid: "workflow not found"} and store.list_stream(stream_id=sid) == []


def _cli_env(store_url: str, address: str) -> dict[str, str]:
    return dict(os.environ, MAMBA_STREAM_STORE=store_url, MAMBA_STREAM_KEYRING=Keyring.generate().to_json(),
                TEMPORAL_ADDRESS=address)


async def _sweep_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "mamba_stream.cli", "sweep", *args], env=env,
                                   capture_output=True, text=True, timeout=120, cwd=ROOT)


async def test_the_sweep_command_prints_the_refusal_and_exits_non_zero(tmp_path, server_a, server_b):
    store = open_store(f"file://{tmp_path / 'store'}")
    sid = _sid()
    keys = _fill(store, sid)
    unowned = await _sweep_cli(_cli_env(store.url, _address(server_a)), "--grace", "0")
    assert unowned.returncode == 3 and "no owner record" in unowned.stderr and "--claim" in unowned.stderr
    await claim_store(server_a.client, store)
    await _live(server_a.client, sid)
    out = await _sweep_cli(_cli_env(store.url, _address(server_a)), "--address", _address(server_b),
                           "--grace", "3600")
    assert out.returncode == 3, out.stdout + out.stderr
    assert "refused: StoreOwnedElsewhere" in out.stderr and "nothing was deleted" in out.stderr
    assert store.list_stream(stream_id=sid) == keys
    ok = await _sweep_cli(_cli_env(store.url, _address(server_a)), "--grace", "0")
    assert ok.returncode == 0 and "0 of 1 streams" in ok.stdout and store.list_stream(stream_id=sid) == keys


async def test_a_worker_claims_its_store_and_will_not_start_on_another_clusters(tmp_path, server_a, server_b):
    url = f"file://{tmp_path / 'store'}"

    def config(env: WorkflowEnvironment) -> WorkerConfig:
        return WorkerConfig(home=tmp_path / "home", address=_address(env), store_url=url,
                            keyring=Keyring.generate().to_json(), task_queue=f"sweep-{uuid.uuid4().hex[:10]}",
                            models="tiny-mamba1", metrics="off", sweep_s=0)

    stop, ready = asyncio.Event(), asyncio.Event()
    serving = asyncio.create_task(run_worker(config(server_a), stop, ready=ready))
    await asyncio.wait_for(ready.wait(), 60)
    stop.set()
    await asyncio.wait_for(serving, 60)
    with open_store(url) as store:
        owner = store_owner(store)
    assert owner is not None and owner == await claim_store(server_a.client, open_store(url), write=False)

    ready_b = asyncio.Event()
    with pytest.raises(StoreOwnedElsewhere) as exc:
        await asyncio.wait_for(run_worker(config(server_b), asyncio.Event(), ready=ready_b), 60)
    assert not ready_b.is_set() and owner.cluster_id in str(exc.value)
    recorded = json.loads((tmp_path / "store" / "meta" / "owner" / "temporal").read_bytes())
    assert recorded["cluster_id"] == owner.cluster_id  # unchanged by the refused worker


async def test_the_sweep_removes_what_a_writer_killed_before_its_commit_left_past_the_grace(tmp_path, server_a):
    files = open_store(f"file://{tmp_path / 'states'}")
    await claim_store(server_a.client, files)
    left = tmp_path / "states" / "tmp" / "ms-x.k1.dead.part"  # as `put_if_absent` names its file
    left.write_bytes(b"half a sealed state")
    writing = tmp_path / "states" / "tmp" / "ms-x.k2.live.part"
    writing.write_bytes(b"a write in progress")
    past = time.time() - 120
    os.utime(left, (past, past))
    report = await sweep_orphans(server_a.client, files, grace_s=60, dry_run=True)
    assert report.tmp_removed == 0 and left.exists()  # a dry run removes nothing
    report = await sweep_orphans(server_a.client, files, grace_s=60)
    assert report.tmp_removed == 1
    assert not left.exists() and writing.exists()  # the one within the grace may still be committed

"""A worker is never poisoned (issue 25): a timed-out attempt leaves it healthy, timeouts have
floors, and a worker that fails every chunk for a reason not theirs stops taking work."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType, TimeoutType
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.worker import Worker

from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.workflows import MambaStreamWorkflow, OpenStreamInput, StreamOptions, new_stream_id
from mamba_stream.workflows._models import TIMEOUT_FLOORS
from tests.workflows.conftest import FAST, Stack, eventually, make_stack
from tests.workflows.test_stream_workflow import digest, local

pytestmark = pytest.mark.asyncio(loop_scope="session")

ROOT = Path(__file__).resolve().parents[2]


async def _events(stack: Stack, sid: str) -> list:
    return [e async for e in stack.client.get_workflow_handle(sid).fetch_history_events()]


def _local_outcomes(events: list) -> list[str]:
    """Each local activity's outcome, from its marker: "ok", or its failure's kind."""
    out = []
    for e in events:
        attrs = e.marker_recorded_event_attributes
        if e.event_type != EventType.EVENT_TYPE_MARKER_RECORDED or attrs.marker_name != "core_local_activity":
            continue
        if not attrs.HasField("failure"):
            out.append("ok")
            continue
        f = attrs.failure
        while not f.HasField("timeout_failure_info") and f.HasField("cause"):
            f = f.cause
        out.append(TimeoutType.Name(f.timeout_failure_info.timeout_type) if f.HasField("timeout_failure_info")
                   else "failed")
    return out


async def _open_elsewhere(stack: Stack, options: StreamOptions) -> str:
    """Open a stream on a worker of this process that then stops: the stream's next work goes
    to the next worker that comes (no affinity to a queue nobody serves)."""
    stack.acts.worker_queue = None
    client = await Client.connect(stack.address, plugins=[MambaStreamPlugin(keyring=stack.keyring,
                                                                            activities=stack.acts)])
    async with Worker(client, task_queue=stack.queue, activity_executor=concurrent.futures.ThreadPoolExecutor(4)):
        return await stack.streams.open("alice", "tiny-mamba2", options=options)


async def test_a_cold_worker_whose_first_local_chunk_times_out_at_the_floor_is_not_poisoned(temporal_env, tmp_path):
    """A fresh worker process whose first work is a local chunk: the model's first load (a slow
    import, as torch._dynamo and sympy once were on a loaded disk) outlasts `local_timeout_s` at its
    floor, the attempt times out, and the worker stays healthy: the load runs once, to its end; the
    chunk goes the regular way on the same worker and commits what one scan gives, and later chunks
    and opens on it succeed. It used to raise CancelledError into the import, which Python then ran
    again over what the first one left (depending on where it landed: `module 'sympy' has no
    attribute 'core'` from then on)."""
    floor = TIMEOUT_FLOORS["local_timeout_s"]
    opts = StreamOptions(**{**FAST.model_dump(), "local_timeout_s": floor})
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        sid = await _open_elsewhere(stack, opts)
        keyfile, ready, logfile, imports = (tmp_path / n for n in ("keyring.json", "ready", "cold.log", "imports"))
        stack.keyring.save(keyfile)
        with open(logfile, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "tests.workflows._cold_worker", stack.address, stack.queue,
                                     stack.store_url, str(keyfile), str(ready), str(imports)], cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT)
        try:
            await eventually(lambda: _exists(ready), timeout=90)
            cold = json.loads(ready.read_text())
            assert cold["imported"] == [] and cold["loaded"] == []  # nothing of the first load happened yet
            model = local("tiny-mamba2")
            tokens = list(range(60, 90))
            r1 = await asyncio.wait_for(stack.streams.advance(sid, "alice", tokens=tokens[:5]), 120)
            stats = await stack.streams.stats(sid)
            assert (stats.local_chunks, stats.local_fallbacks) == (0, 1), stats
            # the local attempt's deadline (schedule- and start-to-close alike) ran out
            assert _local_outcomes(await _events(stack, sid)) in (["TIMEOUT_TYPE_SCHEDULE_TO_CLOSE"],
                                                                   ["TIMEOUT_TYPE_START_TO_CLOSE"])
            # the same worker, from now on: chunks, a generate (this stream's next ones the regular
            # way: its local attempt timed out, `StreamStats.regular_until`), and a stream it opens
            # itself, whose chunks run locally
            r2 = await stack.streams.advance(sid, "alice", tokens=tokens[5:20])
            g = await stack.streams.generate(sid, "alice", 4, seed=11)
            truth = model.advance(model.initial_state(), tokens[:20] + g.tokens)
            assert r1.output_digest == digest(truth.logits[:5]) and r2.output_digest == digest(truth.logits[5:20])
            assert g.position == 24 and g.receipt.checksum == plaintext_checksum(truth.state.tensors)
            stats = await stack.streams.stats(sid)
            assert (stats.local_chunks, stats.local_fallbacks, stats.chunks) == (0, 1, 3), stats
            assert stats.regular_until > 3
            assert len(_local_outcomes(await _events(stack, sid))) == 1
            other = await asyncio.wait_for(stack.streams.open("bob", "tiny-mamba2", options=opts), 60)
            r3 = await stack.streams.advance(other, "bob", tokens=tokens[20:])
            alone = model.advance(model.initial_state(), tokens[20:])
            assert r3.receipt.checksum == plaintext_checksum(alone.state.tensors)
            assert (await stack.streams.stats(other)).local_chunks == 1
            assert proc.poll() is None, logfile.read_text()
            # the first load ran once, to its end: nothing was imported twice (half, then again)
            assert imports.read_text().split() == ["tests.workflows._slow_first_load"], logfile.read_text()
            assert "has no attribute" not in logfile.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def _exists(path: Path) -> bool:
    return path.exists()


async def test_a_worker_failing_every_chunk_stops_taking_work_and_a_healthy_one_finishes_the_streams(
        temporal_env, tmp_path):
    """worker.py's worker, poisoned after its warm-up (every open and chunk fails untyped): it
    trips (8 failures in a row across several streams, none succeeding), stops taking work and
    exits with status 3 saying why; the streams it failed are not failed for good: a healthy
    worker started next to it opens them and runs their chunks."""
    from tests.workflows._poisoned_worker import POISON

    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        keyfile, logfile = tmp_path / "keyring.json", tmp_path / "poisoned.log"
        stack.keyring.save(keyfile)
        with open(logfile, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "tests.workflows._poisoned_worker", stack.address,
                                     stack.queue, stack.store_url, str(keyfile), str(tmp_path / "home")],
                                    cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            await eventually(lambda: _logged(logfile, " ready on "), timeout=90)
            principals = ["alice", "bob", "carol", "dave"]
            opening = [asyncio.create_task(stack.streams.open(p, "tiny-mamba2", options=FAST)) for p in principals]
            status = await asyncio.wait_for(asyncio.to_thread(proc.wait), 60)
            log = logfile.read_text()
            assert status == 3, log
            [trip] = [line for line in log.splitlines() if "this worker stops taking work" in line]
            assert " ERROR " in trip and f"8 x AttributeError: {POISON}" in trip and "across " in trip, trip
            assert "exiting with status 3" in log
            assert not any(t.done() for t in opening)  # no stream was failed for it
            await stack.worker()
            sids = await asyncio.wait_for(asyncio.gather(*opening), 90)
            model = local("tiny-mamba2")
            for i, (p, sid) in enumerate(zip(principals, sids, strict=True)):
                tokens = list(range(10 * i, 10 * i + 7))
                r = await stack.streams.advance(sid, p, tokens=tokens)
                truth = model.advance(model.initial_state(), tokens)
                assert r.receipt.checksum == plaintext_checksum(truth.state.tensors)
                assert (await stack.streams.handle(sid).describe()).status == WorkflowExecutionStatus.RUNNING
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def _logged(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text()


BELOW = {name: floor / 2 for name, floor in TIMEOUT_FLOORS.items()}


@pytest.mark.parametrize("field", [*sorted(BELOW), "task_timeout"])
async def test_a_timeout_under_its_floor_is_refused_typed_and_starts_nothing(stack: Stack, field):
    """A raw client (no validation of its own) asks for a timeout under its floor, in the options
    or as the start request's workflow task timeout: the workers refuse it, typed, before the
    stream opens; nothing runs and nothing is stored."""
    sid = new_stream_id(stack.keyring.principal_tag("alice"))
    if field == "task_timeout":
        opts, task_timeout = FAST, timedelta(seconds=TIMEOUT_FLOORS["task_timeout_s"] / 2)
    else:
        with pytest.raises(ValueError):  # a client refuses to build it ...
            StreamOptions(**{**FAST.model_dump(), field: BELOW[field]})
        # ... a raw one sends it all the same
        opts, task_timeout = FAST.model_copy(update={field: BELOW[field]}), timedelta(seconds=FAST.task_timeout_s)
    handle = await stack.client.start_workflow(
        MambaStreamWorkflow.run, OpenStreamInput.model_construct(principal="alice", model_id="tiny-mamba2",
                                                                 options=opts),
        id=sid, task_queue=stack.queue, task_timeout=task_timeout)
    with pytest.raises(WorkflowFailureError) as err:
        await asyncio.wait_for(handle.result(), 30)
    cause = err.value.cause
    assert cause.type == "InvalidRequest" and cause.non_retryable, cause
    named = "task_timeout" if field == "task_timeout" else field
    assert named in cause.message and (field == "task_timeout" or "greater than or equal" in cause.message)
    assert (await handle.describe()).status == WorkflowExecutionStatus.FAILED
    events = await _events(stack, sid)
    assert [e for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED] == []
    assert stack.acts.store.list_stream(stream_id=sid) == []
    # the floors themselves are taken
    ok = await stack.streams.open("alice", "tiny-mamba2",
                                  options=StreamOptions(**{**FAST.model_dump(), **TIMEOUT_FLOORS}))
    assert (await stack.streams.advance(ok, "alice", tokens=[1, 2])).position == 2

"""Fair tenants on a real dev server (issue 50): Temporal dispatches a quiet principal's chunk
before a flooding principal's backlog drains (fairness keys from the principals' tags), and the
workers' quotas refuse typed, with nothing advanced. Every run here is replayed at the stack's
exit (`make_stack`), fairness keys included."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from mamba_stream.activities import HISTOGRAM_BUCKETS, Quotas, StreamActivities, StreamMetrics
from mamba_stream.plugin import data_converter
from mamba_stream.state_codec import stream_tag
from mamba_stream.workflows import BULK_PRIORITY_LEVEL, stream_priority
from tests.workflows.conftest import FAST, Stack, eventually, make_stack
from tests.workflows.test_metrics import free_port, scrape, total

pytestmark = pytest.mark.asyncio(loop_scope="session")

#: every chunk a regular activity on the shared queue: Temporal's task queue is where they wait
REGULAR = FAST.model_copy(update={"local_chunks": False, "affinity": False})


class Gated(StreamActivities):
    """Records the order in which chunks are admitted; the first one waits at admission until
    `release` is set (its activity holds the worker's only slot meanwhile)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.admitted: list[str] = []
        self.holding, self.release = threading.Event(), threading.Event()

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        if name != "admitted":
            return
        self.admitted.append(stream_id)
        if len(self.admitted) == 1:
            self.holding.set()
            self.release.wait(60)


async def _scheduled(stack: Stack, sid: str, n: int) -> bool:
    """Whether `sid`'s workflow has scheduled its `n`-th activity (open first, then chunks)."""
    events = [e async for e in stack.streams.handle(sid).fetch_history_events()]
    return sum(e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED for e in events) >= n


async def _one_slot_worker(stack: Stack, acts: StreamActivities) -> None:
    """Workflows on one worker; the activities on another that runs one at a time."""
    await stack.worker(activities=False)
    client = await Client.connect(stack.address, data_converter=data_converter(stack.keyring))
    pool = concurrent.futures.ThreadPoolExecutor(2)
    stack.exits.callback(pool.shutdown, wait=False)
    await stack.exits.enter_async_context(Worker(client, task_queue=stack.queue, activities=acts.activities(),
                                                 activity_executor=pool, max_concurrent_activities=1))


async def _order(stack: Stack) -> tuple[list[str], str, list[str]]:
    """Alice's five chunks wait in the task queue behind her first (which holds the only slot),
    then bob's arrives; all are let through. Returns the order admitted, bob's stream, alice's."""
    acts = stack.new_activities(Gated)
    await _one_slot_worker(stack, acts)
    alice = [await stack.streams.open("alice", "tiny-mamba2", options=REGULAR) for _ in range(6)]
    bob = await stack.streams.open("bob", "tiny-mamba2", options=REGULAR)
    # what carries the key: the stream's workflow (its tasks) and every activity it schedules
    info = await stack.streams.handle(bob).describe()
    assert info.raw_description.workflow_execution_info.priority.fairness_key == stream_tag(bob)
    first = asyncio.create_task(stack.streams.advance(alice[0], "alice", tokens=[1, 2, 3]))
    await eventually(lambda: asyncio.to_thread(acts.holding.wait, 0.05))
    rest = [asyncio.create_task(stack.streams.advance(s, "alice", tokens=[4, 5, 6])) for s in alice[1:]]
    for s in alice[1:]:
        await eventually(lambda s=s: _scheduled(stack, s, 2))
    quiet = asyncio.create_task(stack.streams.advance(bob, "bob", tokens=[7, 8, 9]))
    await eventually(lambda: _scheduled(stack, bob, 2))
    acts.release.set()
    results = await asyncio.gather(first, *rest, quiet)
    assert [r.position for r in results] == [3] * 7
    return acts.admitted, bob, alice


async def test_a_quiet_principals_chunk_is_dispatched_before_the_floods_backlog_drains(temporal_env, tmp_path):
    """The dev server runs with `matching.enableFairness`: of alice's five waiting chunks and
    bob's one, bob's is dispatched first or second of them (third of all 7), not last."""
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        admitted, bob, alice = await _order(stack)
        assert admitted[0] == alice[0] and sorted(admitted) == sorted([*alice, bob])
        assert admitted.index(bob) <= 2, admitted
        # the activities carried bob's key (their scheduled events say so)
        events = [e async for e in stack.streams.handle(bob).fetch_history_events()]
        keys = {e.activity_task_scheduled_event_attributes.priority.fairness_key for e in events
                if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED}
        assert keys == {stream_priority(bob).fairness_key} == {stream_tag(bob)}


async def test_without_the_servers_fairness_the_quiet_chunk_waits_for_the_whole_backlog(tmp_path):
    """The control: the same run on a server without fairness gives bob's chunk the last place
    (what the test above would see if the keys were not set or not used)."""
    from mamba_stream.devserver import DEV_SERVER_DYNAMIC_CONFIG, start_dev_server

    env = await start_dev_server({**DEV_SERVER_DYNAMIC_CONFIG, "matching.enableFairness": False})
    try:
        stack = await make_stack(env, tmp_path, start_worker=False)
        async with stack.exits:
            admitted, bob, _ = await _order(stack)
            assert admitted.index(bob) == 6, admitted
    finally:
        await env.shutdown()


def _reason(err: BaseException) -> tuple[str, dict]:
    cause = err.cause if isinstance(err, (WorkflowUpdateFailedError, WorkflowFailureError)) else err
    while not isinstance(cause, ApplicationError) and cause is not None:
        cause = cause.cause
    assert isinstance(cause, ApplicationError), err
    details = cause.details[0] if cause.details else {}
    return cause.type, details


_RUNTIMES: list = []  # a runtime's endpoint lives as long as the runtime


def _metered() -> tuple[int, StreamMetrics]:
    """Metrics on a Prometheus endpoint of their own: its port, and the activities' meter on it."""
    from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

    port = free_port()
    runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(
        bind_address=f"127.0.0.1:{port}", histogram_bucket_overrides=HISTOGRAM_BUCKETS)))
    _RUNTIMES.append(runtime)
    return port, StreamMetrics(runtime.metric_meter)


async def test_a_principal_past_its_streams_quota_is_refused_typed_and_others_are_not(temporal_env, tmp_path: Path):
    port, metrics = _metered()
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        acts = stack.new_activities(quotas=Quotas(streams=2), metrics=metrics)
        await stack.worker(acts)
        first = [await stack.streams.open("alice", "tiny-mamba2", options=FAST) for _ in range(2)]
        await stack.streams.advance(first[0], "alice", tokens=[1, 2])
        stored = set(acts.store.stream_ids())
        refused = stack.streams.new_id("alice")
        with pytest.raises(WorkflowFailureError) as err:
            await stack.streams.open("alice", "tiny-mamba2", options=FAST, stream_id=refused)
        reason, details = _reason(err.value)
        assert reason == "QuotaExceeded", (reason, details)
        assert details["quota"] == "streams" and details["limit"] == 2 and details["used"] == 2
        assert set(acts.store.stream_ids()) == stored and refused not in stored  # nothing stored
        assert total(scrape(port), "mamba_stream_quota_refusals", quota="streams") == 1
        # another principal is not bound by alice's streams; alice's own go on
        await stack.streams.open("bob", "tiny-mamba2", options=FAST)
        assert (await stack.streams.advance(first[0], "alice", tokens=[3])).position == 3
        # one cancelled (its state destroyed): alice opens again
        await stack.streams.cancel(first[1], "alice")
        await eventually(lambda: _gone(acts, first[1]))
        again = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
        assert (await stack.streams.advance(again, "alice", tokens=[1])).position == 1


async def _gone(acts: StreamActivities, sid: str) -> bool:
    return sid not in acts.store.stream_ids()


class HeldChunk(StreamActivities):
    """Holds the first chunk at admission (after its quota place was taken) until `release`."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.holding, self.release = threading.Event(), threading.Event()
        self._held = False

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        if name == "admitted" and not self._held:
            self._held = True
            self.holding.set()
            self.release.wait(60)


async def test_a_chunk_past_the_chunks_in_flight_quota_is_refused_with_nothing_advanced(temporal_env, tmp_path):
    """One chunk running per principal: alice's second stream's chunk, sent while her first runs,
    is refused QuotaExceeded (chunks_in_flight, limit 1, used 1) before it runs; her stream is
    where it was, and the same chunk sent again as the next attempt, once the first finished,
    advances it exactly once. Bob's chunk meanwhile is not refused."""
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        acts = stack.new_activities(HeldChunk, quotas=Quotas(chunks_in_flight=1))
        await stack.worker(acts)
        a1, a2 = [await stack.streams.open("alice", "tiny-mamba2", options=FAST) for _ in range(2)]
        b1 = await stack.streams.open("bob", "tiny-mamba2", options=FAST)
        held = asyncio.create_task(stack.streams.advance(a1, "alice", tokens=[1, 2, 3]))
        await eventually(lambda: asyncio.to_thread(acts.holding.wait, 0.05))
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await stack.streams.advance(a2, "alice", tokens=[4, 5], chunk_seq=1)
        reason, details = _reason(err.value)
        assert (reason, details) == ("QuotaExceeded", {"quota": "chunks_in_flight", "limit": 1, "used": 1})
        assert (await stack.streams.stats(a2)).position == 0  # nothing advanced
        assert (await stack.streams.advance(b1, "bob", tokens=[6])).position == 1
        acts.release.set()
        assert (await held).position == 3
        again = await stack.streams.advance(a2, "alice", tokens=[4, 5], chunk_seq=1, attempt=1)
        assert again.position == 2 and (await stack.streams.stats(a2)).position == 2


async def test_the_operators_weights_reach_the_servers_queues_by_tag_never_by_name(temporal_env, tmp_path):
    """MAMBA_STREAM_FAIRNESS_WEIGHTS (here `Fairness(weights=...)`): the worker sets them on each
    queue it serves, workflow and activity tasks alike, as the server's fairness-weight overrides
    keyed by the principals' tags; the names appear nowhere in the queue's config."""
    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

    from mamba_stream.activities import Fairness

    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        acts = stack.new_activities(fairness=Fairness(weights={"alice": 3.0, "bob": 0.5}))
        await stack.worker(acts)
        sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)  # the worker is up
        assert (await stack.streams.advance(sid, "alice", tokens=[1])).position == 1
        want = {stack.keyring.principal_tag("alice"): 3.0, stack.keyring.principal_tag("bob"): 0.5}

        async def config(queue: str, kind: int):
            got = await stack.client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
                namespace=stack.client.namespace, task_queue=TaskQueue(name=queue), task_queue_type=kind,
                report_config=True))
            return got.config

        # the own queue's worker starts beside the first one: its weights are set as it starts
        for queue in (stack.queue, acts.worker_queue):
            for kind in (TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW, TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY):
                cfg = await eventually(lambda q=queue, k=kind: _with_overrides(config(q, k)))
                assert dict(cfg.fairness_weight_overrides) == pytest.approx(want), (queue, kind)
                assert "alice" not in str(cfg) and "bob" not in str(cfg)


async def _with_overrides(pending):
    """The queue's config once it has fairness-weight overrides (None before)."""
    cfg = await pending
    return cfg if cfg.fairness_weight_overrides else None


async def _priority(stack: Stack, sid: str):
    return (await stack.streams.handle(sid).describe()).raw_description.workflow_execution_info.priority


async def _at_bulk(stack: Stack, sid: str):
    p = await _priority(stack, sid)
    return p if p.priority_key == BULK_PRIORITY_LEVEL else None


async def test_a_principals_burst_of_new_streams_goes_to_the_bulk_level_and_serves_on(temporal_env, tmp_path):
    """MAMBA_STREAM_FAIRNESS_BURST (here `Fairness(burst=2)`): of alice's four streams opened at
    once, the two past her burst are moved to the bulk priority level, their fairness key kept; her
    first two and bob's stay at the default level. Why: Temporal dispatches a worker's own (sticky)
    queue by level and arrival, not by key, so only a lower level lets a quiet principal's workflow
    task pass a flood's there. A moved stream serves on, exactly as before (the options' change is
    an event of its history, which is replayed at exit), and each move is counted."""
    from mamba_stream.activities import Fairness

    port, metrics = _metered()
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        acts = stack.new_activities(fairness=Fairness(burst=2), metrics=metrics)
        await stack.worker(acts)
        alice = [await stack.streams.open("alice", "tiny-mamba2", options=FAST) for _ in range(4)]
        bob = await stack.streams.open("bob", "tiny-mamba2", options=FAST)
        for sid in alice[2:]:
            moved = await eventually(lambda sid=sid: _at_bulk(stack, sid))
            assert moved.fairness_key == stream_tag(sid) and not moved.fairness_weight
        for sid in [*alice[:2], bob]:
            kept = await _priority(stack, sid)
            assert (kept.priority_key, kept.fairness_key) == (0, stream_tag(sid)), sid

        async def counted() -> bool:
            return total(scrape(port), "mamba_stream_bulk_streams") == 2

        await eventually(counted)
        # the moved streams serve on, bit for bit what the others give
        outs = [await stack.streams.advance(sid, "alice", tokens=[1, 2, 3]) for sid in alice]
        assert [o.position for o in outs] == [3] * 4
        assert len({o.receipt.checksum for o in outs}) == 1
        events = [e async for e in stack.streams.handle(alice[3]).fetch_history_events()]
        assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_OPTIONS_UPDATED in [e.event_type for e in events]


async def test_with_the_workers_fairness_off_no_stream_is_moved(temporal_env, tmp_path):
    """The control: MAMBA_STREAM_FAIRNESS=off (here `Fairness(enabled=False, burst=2)`) moves none
    of the same four streams."""
    from mamba_stream.activities import Fairness

    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        acts = stack.new_activities(fairness=Fairness(enabled=False, burst=2))
        await stack.worker(acts)
        alice = [await stack.streams.open("alice", "tiny-mamba2", options=FAST) for _ in range(4)]
        assert (await stack.streams.advance(alice[3], "alice", tokens=[1])).position == 1
        assert [(await _priority(stack, sid)).priority_key for sid in alice] == [0] * 4

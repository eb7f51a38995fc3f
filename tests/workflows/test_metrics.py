"""The worker's Prometheus endpoint through a real Temporal server: a scenario (open, advance, a
chunk delivered twice, generate, reset, stale and foreign resumes, a migration, an orphan, cancel)
moves each of our meters by exactly the expected amount, beside Temporal's own series."""

from __future__ import annotations

import concurrent.futures
import re
import socket
import urllib.request

import pytest
from temporalio.client import Client, WorkflowFailureError
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.worker import Worker

from mamba_stream.activities import HISTOGRAM_BUCKETS, StreamMetrics, sweep_orphans
from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.workflows import StreamClient, StreamOptions
from tests.workflows.conftest import FAST, eventually, make_stack
from tests.workflows.test_stream_workflow import FailOnce

pytestmark = pytest.mark.asyncio(loop_scope="session")

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or line.startswith("#"):
            continue
        labels = frozenset((k, v) for k, v in re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")
                           if k != "service_name")
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def total(series: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in series.items() if n == name and want <= ls)


class Meter:
    """Deltas of the endpoint's series since the last `mark`."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.before = scrape(port)

    def delta(self, name: str, **labels: str) -> float:
        return total(scrape(self.port), name, **labels) - total(self.before, name, **labels)

    def mark(self) -> None:
        self.before = scrape(self.port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_lifecycle_scenario_moves_each_meter_by_exactly_its_amount(temporal_env, tmp_path):
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    port = free_port()
    runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(
        bind_address=f"127.0.0.1:{port}", histogram_bucket_overrides=HISTOGRAM_BUCKETS)))
    acts = stack.new_activities(FailOnce, backend="chunked", metrics=StreamMetrics(runtime.metric_meter),
                                drift_check_every=2)
    async with stack.exits:
        client = await Client.connect(stack.address, runtime=runtime,
                                      plugins=[MambaStreamPlugin(keyring=stack.keyring, activities=acts)])
        pool = concurrent.futures.ThreadPoolExecutor(4)
        await stack.exits.enter_async_context(Worker(client, task_queue=stack.queue, activity_executor=pool))
        streams: StreamClient = stack.streams
        opts = StreamOptions(**{**FAST.model_dump(), "checkpoints_kept": 1})
        m = Meter(port)
        assert any(n.startswith("temporal_") for n, _ in m.before), "Temporal's runtime metrics share the endpoint"

        sid = await streams.open("alice", "tiny-mamba2", options=opts)
        assert m.delta("mamba_stream_checkpoints_written") == 1
        assert total(scrape(port), "mamba_stream_active_states") == 1
        first = await streams.advance(sid, "alice", tokens=[1, 2, 3, 4, 5])
        blob_bytes = len(acts.store.get(key=first.receipt.state_key, owner=acts.commits.owner("alice")))
        # chunk 2: committed, then the response is lost; the retry answers from the record
        await streams.advance(sid, "alice", tokens=[6, 7, 8])
        assert acts.failed == {2} and acts.runs[2] == 1
        # the same update id again: the server answers it; no worker sees it
        await streams.advance(sid, "alice", tokens=[6, 7, 8], chunk_seq=2)
        assert m.delta("mamba_stream_checkpoints_written") == 3
        assert m.delta("mamba_stream_checkpoint_bytes_written") == 3 * blob_bytes  # fixed-size sealed states
        assert m.delta("mamba_stream_duplicate_chunks") == 1
        assert m.delta("mamba_stream_tokens", kind="prefill") == 8
        assert m.delta("mamba_stream_time_to_first_output_seconds_count", kind="advance") == 2
        assert m.delta("mamba_stream_drift_logits_abs_count") == 1  # every 2nd advanced chunk
        drift = m.delta("mamba_stream_drift_logits_abs_sum")
        assert 0 <= drift < 1e-4  # chunked against the reference backend, same weights
        m.mark()

        gen = await streams.generate(sid, "alice", 4, seed=3)
        assert len(gen.tokens) == 4
        assert m.delta("mamba_stream_tokens", kind="decode") == 4
        assert m.delta("mamba_stream_decode_step_seconds_count") == 3
        assert m.delta("mamba_stream_time_to_first_output_seconds_count", kind="generate") == 1
        assert m.delta("mamba_stream_state_age_seconds_count") == 1

        await streams.reset(sid, "alice")
        await eventually(lambda: _epoch(streams, sid, 1))
        assert m.delta("mamba_stream_resets") == 1
        assert m.delta("mamba_stream_checkpoints_written") == 2  # the generate's and the reset's
        m.mark()

        # a refused reset (naming another principal) has no caller to tell: the stream's stats
        # say why, and the workers count it
        await streams.reset(sid, "bob")
        await eventually(lambda: _refused(streams, sid))
        await eventually(lambda: _counted(m, "mamba_stream_refused_requests", kind="reset", reason="PrincipalMismatch"))
        assert m.delta("mamba_stream_refused_requests") == 1 and m.delta("mamba_stream_resets") == 0
        m.mark()

        # a stale resume: chunk 1's receipt, whose checkpoint retention dropped when chunk 2 committed
        with pytest.raises(WorkflowFailureError):
            await streams.open("alice", "tiny-mamba2", resume=first.receipt, options=opts)
        # a foreign one: alice's current checkpoint presented by bob (refused, not stale)
        current = (await streams.checkpoint(sid, "alice")).receipt
        with pytest.raises(WorkflowFailureError):
            await streams.open("bob", "tiny-mamba2", resume=current, options=opts)
        assert m.delta("mamba_stream_resume_failures", reason="CheckpointNotFound") == 1
        assert m.delta("mamba_stream_resume_failures", reason="PrincipalMismatch") == 1
        assert m.delta("mamba_stream_resume_failures") == 2
        assert m.delta("mamba_stream_stale_resumes_rejected") == 1
        assert m.delta("mamba_stream_migrations") == 0
        m.mark()

        # a migration: the hot state is evicted, so the next chunk loads it from the store
        acts.engines["tiny-mamba2"].release(sid)
        assert total(scrape(port), "mamba_stream_active_states") in (0, 1)  # the gauge updates per activity
        await streams.advance(sid, "alice", tokens=[9, 10])
        assert m.delta("mamba_stream_migrations") == 1
        assert m.delta("mamba_stream_migration_bytes") == blob_bytes
        assert m.delta("mamba_stream_drift_logits_abs_count") == 0  # the 3rd advanced chunk: not sampled
        m.mark()

        # an orphan: a stream terminated by an operator leaves its states; the sweep finds them
        live = await streams.open("alice", "tiny-mamba1", options=opts)
        gone = await streams.open("alice", "tiny-mamba1", options=opts)
        await streams.advance(gone, "alice", tokens=[1])
        n_blobs = len(acts.store.list_stream(stream_id=gone))
        await streams.handle(gone).terminate("operator")
        assert gone in acts.hot_stream_ids()
        # the sweep only deletes from a store its cluster owns (a worker claims it at start-up)
        within_grace = await sweep_orphans(stack.client, acts.store, acts.metrics, grace_s=3600,
                                           activities=acts, claim=True)
        assert within_grace.orphans == {} and acts.store.list_stream(stream_id=gone)
        report = await sweep_orphans(stack.client, acts.store, acts.metrics, grace_s=0, activities=acts)
        assert set(report.orphans) == {gone} and report.blobs_deleted == n_blobs > 0
        assert report.hot_released == 1 and gone not in acts.hot_stream_ids()
        assert acts.store.list_stream(stream_id=gone) == [] and acts.store.list_stream(stream_id=live)
        assert m.delta("mamba_stream_orphaned_states_found") == 1
        assert m.delta("mamba_stream_orphaned_blobs_deleted") == n_blobs
        again = await sweep_orphans(stack.client, acts.store, acts.metrics, grace_s=0, activities=acts)
        assert again.orphans == {} and m.delta("mamba_stream_orphaned_states_found") == 1

        for s in (sid, live):
            await streams.cancel(s)
        assert total(scrape(port), "mamba_stream_active_states") == 0
        assert m.delta("mamba_stream_resets") == 0 and m.delta("mamba_stream_duplicate_chunks") == 0


async def _refused(streams: StreamClient, sid: str) -> bool:
    return (await streams.stats(sid)).rejected_resets == 1


async def _counted(m: Meter, name: str, **labels: str) -> bool:
    return m.delta(name, **labels) == 1


async def _epoch(streams: StreamClient, sid: str, n: int) -> bool:
    return (await streams.stats(sid)).epoch == n

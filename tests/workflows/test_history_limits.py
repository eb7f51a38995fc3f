"""No sequence of requests pushes a stream's history to the server's limits.

Every signal is written to history before the workflow sees it, up to 2 MiB each, from anyone who
reaches the frontend; continue-as-new normally waits for the chunk that holds the stream's lock. A
flood while a long chunk runs would end the stream (the server terminates a workflow at 50 MiB).
Past `HISTORY_CRITICAL_BYTES` the stream moves to a new run at once: the chunk in flight is stopped
uncommitted, and its caller sends it again to the next run (`StreamMoving`, retried by the client).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.client import Client
from temporalio.exceptions import CancelledError

from mamba_stream.activities import StreamActivities
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.workflows._stream import HISTORY_CRITICAL_BYTES
from tests.workflows.conftest import FAST, histories, make_stack
from tests.workflows.test_stream_workflow import local

pytestmark = pytest.mark.asyncio(loop_scope="session")

#: a signal's payload just under the server's 2 MiB blob limit
BIG = 1_900_000


class SlowSecondChunk(StreamActivities):
    """Chunk 2's first attempt runs long (8 s, heartbeating, stopping if told it was cancelled:
    it may not be, the run that asked having closed)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.started = threading.Event()
        self.attempts = 0

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        if name != "admitted" or chunk_seq != 2:
            return
        self.attempts += 1
        if self.attempts > 1:
            return
        self.started.set()
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            activity.heartbeat()
            if activity.is_cancelled():
                raise CancelledError("the long chunk was cancelled")
            time.sleep(0.05)


async def test_a_signal_flood_while_a_chunk_runs_moves_the_stream_and_the_chunk_commits_once(temporal_env, tmp_path):
    stack = await make_stack(temporal_env, tmp_path, acts_cls=SlowSecondChunk)
    async with stack.exits:
        opts = FAST.model_copy(update={"local_chunks": False})
        sid = await stack.streams.open("alice", "tiny-mamba2", options=opts)
        await stack.streams.advance(sid, "alice", tokens=[1, 2, 3])
        second = asyncio.ensure_future(stack.streams.advance(sid, "alice", tokens=[4, 5, 6, 7]))
        assert await asyncio.to_thread(stack.acts.started.wait, 60)
        first_run = (await stack.streams.handle(sid).describe()).run_id
        # anyone who reaches the frontend, with no keys: plaintext signals the stream never reads
        raw = await Client.connect(stack.address)
        # one more than the threshold takes: a workflow task sees the history's size before the
        # newest events that woke it
        flood = HISTORY_CRITICAL_BYTES // BIG + 2
        for _ in range(flood):
            await raw.get_workflow_handle(sid).signal("no-such-signal", "x" * BIG)
        result = await asyncio.wait_for(second, 120)
        stats = await stack.streams.stats(sid)
        assert stats.forced_moves == 1 and stats.continued_as_new == 1, stats
        assert stats.chunk_seq == 2 and stats.chunks == 2  # the stopped chunk committed once, in the new run
        model = local("tiny-mamba2")
        truth = model.advance(model.initial_state(), [1, 2, 3, 4, 5, 6, 7])
        assert result.receipt.checksum == plaintext_checksum(truth.state.tensors)
        assert result.position == 7 and stack.acts.attempts in (1, 2)
        # committed once: by the stopped attempt, when its cancel did not reach it before the run
        # closed (the next run's attempt then waits for it, StreamBusy, and finds its record), or
        # by the next run's
        keys = stack.acts.store.list_stream(stream_id=sid)
        assert sum(1 for k in keys if ".c2." in k and not k.endswith(".out")) == 1, keys
        # the first run closed well under the server's limits, by continuing as new
        old = await stack.client.get_workflow_handle(sid, run_id=first_run).fetch_history()
        assert old.events[-1].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
        assert old.events[-1].event_id < 1000 and sum(e.ByteSize() for e in old.events) < 20 * 1024 * 1024
        # the only failed workflow tasks are the server's own: it force-closes a task to flush the
        # signals buffered while the task ran, past its limit of buffered bytes (FORCE_CLOSE_COMMAND),
        # and it refuses a continue-as-new while signals it has not shown the workflow are waiting
        # (UNHANDLED_COMMAND: the next task sees them; seen on a saturated machine, where the flood
        # lands while the move's task runs). Neither is the workflow's code failing.
        causes = [e.workflow_task_failed_event_attributes.cause for h in await histories(stack.client, stack.queue)
                  for e in h.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]
        assert set(causes) <= {WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_FORCE_CLOSE_COMMAND,
                               WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND}, causes
        # and the stream goes on
        nxt = await stack.streams.advance(sid, "alice", tokens=[8])
        truth = model.advance(model.initial_state(), [1, 2, 3, 4, 5, 6, 7, 8])
        assert nxt.receipt.checksum == plaintext_checksum(truth.state.tensors)

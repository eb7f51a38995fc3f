"""Store faults through a stream (Issue 15, finding 2): a short-lived fault never becomes the
chunk's permanent outcome; a permanent one is typed, and the same chunk passes as a next attempt
once the cause is gone."""

from __future__ import annotations

import asyncio
import errno
import uuid

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import CancelledError

from mamba_stream.activities._file_store import _os_error
from mamba_stream.scan import load_model
from mamba_stream.state_codec.codec import plaintext_checksum
from tests.activities.test_stores import PG_HOSTPART, pg_admin, pg_role  # noqa: F401 - fixtures
from tests.workflows.conftest import FAST, eventually, make_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _truth(tokens: list[int]):
    m = load_model("tiny-mamba2", backend="reference")
    return m.advance(m.initial_state(), tokens)


async def _attempts(stack, sid: str, n: int) -> bool:
    desc = await stack.streams.handle(sid).describe()
    return any(a.attempt >= n for a in desc.raw_description.pending_activities)


async def test_postgres_read_only_for_a_moment_delays_the_chunk_and_never_fails_it(temporal_env, tmp_path, pg_admin,
                                                                                   pg_role):
    admin, role = pg_admin, pg_role
    admin.execute(f"GRANT CREATE ON SCHEMA public TO {role}")
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        stack.store_url = f"postgresql://{role}@{PG_HOSTPART}?table=t_{uuid.uuid4().hex[:12]}"
        stack.acts = stack.new_activities()
        await stack.worker(stack.acts)
        sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
        await stack.streams.advance(sid, "alice", tokens=[1, 2, 3])
        # read-only from now: new sessions start read-only, the pooled ones are ended
        admin.execute(f"ALTER ROLE {role} SET default_transaction_read_only = on")
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        chunk = asyncio.create_task(stack.streams.advance(sid, "alice", tokens=[4, 5]))
        await eventually(lambda: _attempts(stack, sid, 2), timeout=30)
        assert not chunk.done()  # retried, not failed
        admin.execute(f"ALTER ROLE {role} RESET default_transaction_read_only")
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        res = await asyncio.wait_for(chunk, 60)
        assert res.chunk_seq == 2 and res.receipt.checksum == plaintext_checksum(_truth([1, 2, 3, 4, 5]).state.tensors)
        assert (await stack.streams.advance(sid, "alice", tokens=[6])).chunk_seq == 3


async def test_a_corrupted_checkpoint_fails_typed_and_the_next_attempt_passes_once_restored(temporal_env, tmp_path):
    stack = await make_stack(temporal_env, tmp_path)
    async with stack.exits:
        sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
        first = await stack.streams.advance(sid, "alice", tokens=[1, 2, 3])
        stack.acts.release_stream(sid)  # not hot: the next chunk must read the checkpoint
        blob = stack.acts.store._object(first.receipt.state_key)  # the file itself, to corrupt
        good = blob.read_bytes()
        blob.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await stack.streams.advance(sid, "alice", tokens=[4, 5])
        assert err.value.cause.type in ("StoreCorrupt", "CorruptBlob") and err.value.cause.non_retryable
        blob.write_bytes(good)  # restored
        with pytest.raises(WorkflowUpdateFailedError):  # the failed id keeps its outcome...
            await stack.streams.advance(sid, "alice", tokens=[4, 5])
        res = await stack.streams.advance(sid, "alice", tokens=[4, 5], attempt=1)  # ...a next attempt passes
        assert res.chunk_seq == 2 and res.receipt.checksum == plaintext_checksum(_truth([1, 2, 3, 4, 5]).state.tensors)



async def _dispose_attempts(stack, sid: str, n: int) -> bool:
    desc = await stack.streams.handle(sid).describe()
    return any(a.activity_type.name == "dispose_stream" and a.attempt >= n
               for a in desc.raw_description.pending_activities)


async def _cancelled_with_nothing_left(stack, sid: str) -> None:
    handle = stack.streams.handle(sid)
    with pytest.raises(WorkflowFailureError) as err:
        await asyncio.wait_for(handle.result(), 60)
    assert isinstance(err.value.cause, CancelledError)
    assert (await handle.describe()).status == WorkflowExecutionStatus.CANCELED
    assert stack.acts.store.list_stream(stream_id=sid) == []
    assert sid not in stack.acts.hot_stream_ids()


async def test_a_cancel_while_postgres_is_read_only_completes_once_it_is_back_with_nothing_left(
        temporal_env, tmp_path, pg_admin, pg_role):
    """Issue 25: a cancel while the store was read-only ended the run FAILED, its blobs left."""
    admin, role = pg_admin, pg_role
    admin.execute(f"GRANT CREATE ON SCHEMA public TO {role}")
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        stack.store_url = f"postgresql://{role}@{PG_HOSTPART}?table=t_{uuid.uuid4().hex[:12]}"
        stack.acts = stack.new_activities()
        await stack.worker(stack.acts)
        # the client bounds its chunks' attempts: that bound is not the dispose's
        sid = await stack.streams.open("alice", "tiny-mamba2",
                                       options=FAST.model_copy(update={"retry_max_attempts": 2}))
        for chunk in ([1, 2, 3], [4, 5]):
            await stack.streams.advance(sid, "alice", tokens=chunk)
        held = stack.acts.store.list_stream(stream_id=sid)
        assert len(held) == 6 and sid in stack.acts.hot_stream_ids()  # the opened state, 2 chunks, and their records
        admin.execute(f"ALTER ROLE {role} SET default_transaction_read_only = on")
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        chunk = asyncio.create_task(stack.streams.advance(sid, "alice", tokens=[6]))  # in flight at the cancel
        handle = stack.streams.handle(sid)
        await stack.streams.cancel(sid, "alice", wait=False)
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await asyncio.wait_for(chunk, 60)
        assert refused.value.cause.type in ("StreamCancelled", "StoreUnavailable")
        await eventually(lambda: _dispose_attempts(stack, sid, 4), timeout=60)
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING  # not FAILED: still disposing
        assert stack.acts.store.list_stream(stream_id=sid) == held  # reads work, deletes do not...
        assert sid not in stack.acts.hot_stream_ids()  # ...and the hot state went first
        admin.execute(f"ALTER ROLE {role} RESET default_transaction_read_only")
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        await _cancelled_with_nothing_left(stack, sid)


async def test_a_cancel_waits_out_a_store_fault_that_is_permanent_for_a_chunk(temporal_env, tmp_path):
    """A read-only file system (EROFS) is a non-retryable StoreError for a chunk, whose caller sends
    it again once fixed; a cancel has no caller, so its dispose waits until the operator fixes it."""
    stack = await make_stack(temporal_env, tmp_path)
    async with stack.exits:
        sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
        await stack.streams.advance(sid, "alice", tokens=[1, 2, 3])
        store, real = stack.acts.store, stack.acts.store.delete_stream
        read_only = True

        def delete_stream(*, stream_id: str) -> int:
            if read_only:  # what the file store raises on a read-only mount
                raise _os_error(OSError(errno.EROFS, "Read-only file system"), f"cannot delete stream {stream_id}")
            return real(stream_id=stream_id)

        store.delete_stream = delete_stream
        assert not _os_error(OSError(errno.EROFS, ""), "").retryable
        handle = stack.streams.handle(sid)
        await stack.streams.cancel(sid, "alice", wait=False)
        await eventually(lambda: _dispose_attempts(stack, sid, 3), timeout=60)
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
        assert len(store.list_stream(stream_id=sid)) == 4  # the opened state, the chunk, and their records
        read_only = False
        await _cancelled_with_nothing_left(stack, sid)

"""Every refusal is typed (Issue 25): an update, query or signal of no known name, and a missing,
extra or null argument to any handler or to the start, through a raw Temporal client. Refused
updates and queries write nothing to history; refused signals are counted and change nothing;
the stream goes on; a refused start input fails the run typed."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError, WorkflowQueryFailedError, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.workflow import _Definition

from mamba_stream.scan import load_model
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.state_codec.payload import ENCODED_FAILURE
from mamba_stream.workflows import MambaStreamWorkflow, ResetRequest, catalogue
from tests.workflows.conftest import FAST, Stack, eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")

DEFN = _Definition.must_from_class(MambaStreamWorkflow)


def _wrong_arguments(arg_types: list | None) -> list[tuple]:
    """Argument lists a handler of one argument does not take: none, JSON null, one too many, one
    of another shape. (The SDK drops the arguments of a handler that takes none.)"""
    if not arg_types:
        return []
    return [(), (None,), ({"x": 1}, {"x": 2}), ("not a request",)]


async def _events(stack: Stack, sid: str) -> list:
    return [e async for e in stack.streams.handle(sid).fetch_history_events()]


def _query_reason(err: WorkflowQueryFailedError) -> str:
    """The type a refused query names: the server hands its caller the failure's message alone,
    whose clear stand-in (the message itself is encrypted) is `Encoded failure: <type>`."""
    prefix = f"{ENCODED_FAILURE}: "
    assert err.message.startswith(prefix), err.message
    return err.message[len(prefix):]


async def test_every_update_refusal_is_typed_and_writes_nothing(stack: Stack):
    sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
    first = await stack.streams.advance(sid, "alice", tokens=[1, 2, 3])
    handle = stack.client.get_workflow_handle(sid)  # raw: untyped names, any arguments
    before = await _events(stack, sid)

    cases = [("no_such", ({"principal": "alice"},), "UnknownRequest"), ("no_such", (), "UnknownRequest")]
    for name, defn in sorted((k, d) for k, d in DEFN.updates.items() if k):
        cases += [(name, args, "InvalidRequest") for args in _wrong_arguments(defn.arg_types)]
    assert {c[0] for c in cases} >= {"advance", "generate", "checkpoint", "no_such"}
    for name, args, reason in cases:
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await handle.execute_update(name, args=list(args), id=f"{name}-{uuid.uuid4().hex}")
        cause = err.value.cause
        assert isinstance(cause, ApplicationError), (name, args, cause)
        assert (cause.type, cause.non_retryable) == (reason, True), (name, args, cause)
        assert reason in catalogue()

    after = await _events(stack, sid)
    assert len(after) == len(before), [EventType.Name(e.event_type) for e in after[len(before):]]
    # the stream goes on, as if nothing had been sent
    nxt = await stack.streams.advance(sid, "alice", tokens=[4, 5])
    m = load_model("tiny-mamba2", backend="reference")
    assert nxt.chunk_seq == first.chunk_seq + 1
    assert nxt.receipt.checksum == plaintext_checksum(m.advance(m.initial_state(), [1, 2, 3, 4, 5]).state.tensors)


async def test_every_query_refusal_is_typed(stack: Stack):
    sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
    handle = stack.client.get_workflow_handle(sid)
    cases = [("no_such", (), "UnknownRequest"), ("no_such", ({"x": 1},), "UnknownRequest")]
    for name, defn in sorted((k, d) for k, d in DEFN.queries.items() if k and not k.startswith("__")):
        cases += [(name, args, "InvalidRequest") for args in _wrong_arguments(defn.arg_types)]
    assert {c[0] for c in cases} >= {"no_such"}
    for name, args, reason in cases:
        with pytest.raises(WorkflowQueryFailedError) as err:
            await handle.query(name, args=list(args))
        assert _query_reason(err.value) == reason, (name, args, err.value.message)
        assert reason in catalogue()
    assert (await stack.streams.stats(sid)).chunk_seq == 0  # still answering


async def test_every_signal_refusal_is_counted_and_changes_nothing(stack: Stack):
    sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
    await stack.streams.advance(sid, "alice", tokens=[1, 2, 3])
    handle = stack.client.get_workflow_handle(sid)
    before = await stack.streams.stats(sid)
    for args in ((), (None,), ({"principal": "alice"}, {"principal": "alice"})):
        await handle.signal("reset", args=list(args))  # each would have failed the workflow task
    await handle.signal("reset", ResetRequest(principal="mallory"))
    for args in ((), ({"principal": "alice"},)):
        await handle.signal("no_such", args=list(args))

    stats = await eventually(lambda: _counted(stack, sid, resets=4, unknown=2))
    assert (stats.epoch, stats.resets, stats.position, stats.chunk_seq) == (
        before.epoch, before.resets, before.position, before.chunk_seq)
    nxt = await stack.streams.advance(sid, "alice", tokens=[4, 5])
    m = load_model("tiny-mamba2", backend="reference")
    assert nxt.receipt.checksum == plaintext_checksum(m.advance(m.initial_state(), [1, 2, 3, 4, 5]).state.tensors)
    # a valid reset still resets
    await stack.streams.reset(sid, "alice")
    assert (await eventually(lambda: _counted(stack, sid, resets=4, unknown=2, epoch=1))).position == 0
    failed = [e for e in await _events(stack, sid) if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]
    assert failed == []


async def _counted(stack: Stack, sid: str, *, resets: int, unknown: int, epoch: int = 0):
    s = await stack.streams.stats(sid)
    return s if (s.rejected_resets, s.unknown_signals, s.epoch) == (resets, unknown, epoch) else None


@pytest.mark.parametrize("args", [(), (None,), ({"principal": "alice", "model_id": "tiny-mamba2"}, {"x": 1})],
                         ids=["none", "null", "two"])
async def test_a_start_input_that_is_not_one_open_request_fails_the_run_typed(stack: Stack, args: tuple):
    """Before: the SDK's TypeError (AttributeError for null) failed the first workflow task and
    every retry of it, a stream that neither ran nor ended."""
    handle = await stack.client.start_workflow("MambaStream", args=list(args), id=f"ms-{uuid.uuid4().hex}",
                                               task_queue=stack.queue)
    with pytest.raises(WorkflowFailureError) as err:
        await asyncio.wait_for(handle.result(), 20)
    cause = err.value.cause
    assert isinstance(cause, ApplicationError) and (cause.type, cause.non_retryable) == ("InvalidRequest", True)
    events = [e async for e in handle.fetch_history_events()]
    assert not [e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]
    assert not [e for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]


async def test_the_worker_logs_a_typed_refusal_in_one_line_and_a_fault_with_its_traceback(stack: Stack, caplog):
    """An open of a model the workers do not serve is refused by its activity, typed: the
    worker's log says so in one line (it was a 40-line traceback), its reason and message."""
    import logging

    caplog.set_level(logging.WARNING, logger="temporalio.activity")
    with pytest.raises(WorkflowFailureError):
        await stack.streams.open("alice", "no-such-model")

    def said() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "temporalio.activity" and "open_stream" in r.getMessage()]

    await eventually(lambda: asyncio.sleep(0, said()))
    [record] = said()
    line = caplog.text.splitlines()
    assert "refused, UnknownModel: model 'no-such-model' is not served here" in record.getMessage()
    assert record.exc_info is None and not any("Traceback" in x for x in line)

    from mamba_stream.plugin import RefusalsInOneLine

    fault = logging.LogRecord("temporalio.activity", logging.WARNING, __file__, 1, "Completing activity as failed",
                              (), (ApplicationError, ApplicationError("boom", type="InternalError"), None))
    assert RefusalsInOneLine().filter(fault) and fault.exc_info is not None  # a fault keeps its traceback
    untyped = logging.LogRecord("temporalio.activity", logging.WARNING, __file__, 1, "Completing activity as failed",
                                (), (RuntimeError, RuntimeError("boom"), None))
    assert RefusalsInOneLine().filter(untyped) and untyped.exc_info is not None

"""Which client call failures `StreamClient` sends again (`workflows.transient`), without a server."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import WorkflowQueryFailedError
from temporalio.service import RPCError, RPCStatusCode

from mamba_stream.workflows._client import StreamClient, transient


@pytest.mark.parametrize(("err", "again"), [
    # the worker's deadlock detector cut the query's activation short (a GC pause, a loaded machine):
    # as the encrypting codec shows it, and as the SDK words it
    (WorkflowQueryFailedError("Encoded failure: _DeadlockError"), True),
    (WorkflowQueryFailedError("[TMPRL1101] Potential deadlock detected: workflow didn't yield within 2 second(s)."),
     True),
    # a query's own failure is the answer
    (WorkflowQueryFailedError("Encoded failure: InvalidRequest"), False),
    (WorkflowQueryFailedError("unknown query type"), False),
    (RPCError("query task not found", RPCStatusCode.NOT_FOUND, b""), True),
    (RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b""), False),
])
def test_a_query_cut_short_by_the_deadlock_detector_is_asked_again_and_nothing_else(err, again):
    assert transient(err) is again


def test_the_client_asks_a_query_again_after_a_deadlock_and_answers_it():
    calls = []

    async def query() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise WorkflowQueryFailedError("Encoded failure: _DeadlockError")
        return "stats"

    client = StreamClient.__new__(StreamClient)  # no server: only the retry loop is exercised
    client.retry_s = 30.0
    assert asyncio.run(client._retrying(query)) == "stats" and len(calls) == 3

    async def refused() -> str:
        calls.append(1)
        raise WorkflowQueryFailedError("Encoded failure: InvalidRequest")

    calls.clear()
    with pytest.raises(WorkflowQueryFailedError):
        asyncio.run(client._retrying(refused))
    assert len(calls) == 1

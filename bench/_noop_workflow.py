"""A workflow whose update does nothing: the floor of an update round trip (bench only)."""

from datetime import timedelta

from temporalio import activity, workflow


@workflow.defn(name="BenchNoop")
class NoopWorkflow:
    def __init__(self) -> None:
        self._done = False

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: self._done)

    @workflow.update
    async def ping(self, n: int) -> int:
        return n

    @workflow.signal
    def finish(self) -> None:
        self._done = True


@activity.defn(name="bench_noop_local")
def noop_local(n: int) -> int:
    """An activity that does nothing (bench only)."""
    return n


@workflow.defn(name="BenchNoopLocal")
class NoopLocalWorkflow:
    """A workflow whose update runs one local activity that does nothing: the floor of a chunk's
    trip on the local path (an update, a local activity, the activation its result brings)."""

    def __init__(self) -> None:
        self._done = False

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: self._done)

    @workflow.update
    async def ping(self, n: int) -> int:
        return await workflow.execute_local_activity(noop_local, n, start_to_close_timeout=timedelta(seconds=10))

    @workflow.signal
    def finish(self) -> None:
        self._done = True

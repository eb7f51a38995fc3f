"""A workflow whose update does nothing: the floor of an update round trip (bench only)."""

from temporalio import workflow


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

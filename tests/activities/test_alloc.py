"""The worker's allocator settings: applied once per process, and switchable off."""

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

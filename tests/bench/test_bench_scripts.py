"""The benchmark and measurement scripts: argument parsing, and a small run on CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_kernel_matrix_arguments_and_a_cpu_smoke_run(tmp_path):
    mod = _load("bench_kernels")
    args = mod.parse_args(["--quick", "--device", "cpu", "--archs", "mamba2", "--out", str(tmp_path / "k.md")])
    assert args.lengths == [1, 4, 16, 64] and args.batches == [1, 4]
    for bad in (["--lengths", "0,2"], ["--batches", "x"], ["--dtypes", "float8"], ["--archs", "rwkv"]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)
    text = mod.run(args)
    assert "## Prefill" in text and "## Decode" in text and "## Crossover" in text
    assert "| mamba2 | float32 | 16 | 64 |" in text and "error" not in text


def test_drift_measurement_arguments_and_a_cpu_run(tmp_path):
    mod = _load("measure_drift")
    with pytest.raises(SystemExit):
        mod.parse_args(["--dtypes", "float8"])
    with pytest.raises(SystemExit):
        mod.parse_args(["--tokens", "1"])
    args = mod.parse_args(["--tokens", "40", "--presets", "tiny-mamba2", "--backends", "reference,chunked",
                           "--dtypes", "float32", "--device", "cpu"])
    text = mod.run(args)
    rows = [line for line in text.splitlines() if line.startswith("| tiny-mamba2 |")]
    assert len(rows) == 2 and all("| ok |" in r for r in rows)
    assert "## tiny-mamba2, chunked, float32" in text

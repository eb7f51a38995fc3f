"""`mamba-stream verify` prints the chunk-equivalence report and exits 0 when it holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mamba_stream.cli import main
from mamba_stream.scan import load_model
from mamba_stream.scan._verify import standard_partitions, verify_chunking


def test_verify_reports_every_partition(capsys):
    assert main(["verify", "--model", "tiny-mamba2", "--tokens", "41"]) == 0
    out = capsys.readouterr().out
    for word in ("one-token chunks", "empty chunks around", "prime-sized", "shorter than d_conv-1",
                 "final short chunk", "reset control", "PASS", "backend reference", "backend chunked"):
        assert word in out
    assert " exact " in out and "FAIL" not in out


def test_verify_fails_on_a_broken_model(monkeypatch):
    """A model that forgets its conv carry between calls must fail the report."""
    model = load_model("tiny-mamba1", backend="reference")
    real = model._stack

    def forgetful(states):
        layers = real(states)
        return [(conv * 0, ssm) for conv, ssm in layers]

    monkeypatch.setattr(model, "_stack", forgetful)
    report = verify_chunking(model, n_tokens=23)
    assert not report.passed
    assert any(not r.exact and not r.passed for r in report.rows)


def test_partitions_cover_the_sequence():
    for name, chunks in standard_partitions(97, 4):
        assert sum(chunks) == 97, name


def test_console_script():
    script = Path(sys.executable).parent / "mamba-stream"  # installed by `pip install -e .`
    out = subprocess.run([str(script), "verify", "--backend", "reference", "--tokens", "19"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "PASS" in out.stdout

"""worker.py: what the servers it starts, and the deployment's, are configured with."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_deployment_raises_the_transfer_queue_rate_as_the_embedded_server_does():
    import yaml

    from mamba_stream.worker import DEV_SERVER_DYNAMIC_CONFIG, dev_server_args

    config = yaml.safe_load((ROOT / "deploy" / "temporal-dynamic-config.yaml").read_text())
    assert {k: [c["value"] for c in v] for k, v in config.items()} == {
        k: [v] for k, v in DEV_SERVER_DYNAMIC_CONFIG.items()}
    assert DEV_SERVER_DYNAMIC_CONFIG["history.transferProcessorMaxPollRPS"] >= 500
    assert DEV_SERVER_DYNAMIC_CONFIG["matching.enableFairness"] is True
    assert dev_server_args() == ["--dynamic-config-value", "history.transferProcessorMaxPollRPS=1000",
                                 "--dynamic-config-value", "matching.enableFairness=true",
                                 "--dynamic-config-value", "matching.numTaskqueueReadPartitions=1",
                                 "--dynamic-config-value", "matching.numTaskqueueWritePartitions=1"]



def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("temporal", ["embedded", "address"])
def test_a_worker_refuses_to_start_on_a_model_it_cannot_load_before_starting_anything(tmp_path, temporal):
    """Issue 28: a bad checkpoint path was found only at a stream's first open. Now worker.py
    exits at once, status 2, with one line naming the model and what is wrong, having started
    no server and made no home, keyring or store."""
    import os
    import subprocess
    import sys
    import time

    from mamba_stream.worker import EXIT_CONFIG

    missing = tmp_path / "no-such-checkpoint"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAMBA_STREAM_", "TEMPORAL_"))}
    env.update(MAMBA_STREAM_HOME=str(tmp_path / "home"), MAMBA_STREAM_MODELS=f"tiny-mamba1,mine={missing}",
               MAMBA_STREAM_METRICS="off", MAMBA_STREAM_TEMPORAL_PORT=str(_free_port()),
               MAMBA_STREAM_UI_PORT=str(_free_port()), MAMBA_STREAM_CODEC_PORT=str(_free_port()))
    if temporal == "address":  # nothing listens there: the refusal comes before any connection
        env["TEMPORAL_ADDRESS"] = f"127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(ROOT / "worker.py")], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, check=False)
    took = time.monotonic() - t0
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert out.returncode == EXIT_CONFIG == 2, out.stderr
    assert len(errors) == 1, out.stderr
    assert f"refusing to start: model 'mine' ({missing}): no such preset (" in errors[0], errors
    assert "or directory (MAMBA_STREAM_MODELS)" in errors[0]
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert not (tmp_path / "home").exists()  # no keyring, store or server database made
    assert took < 60, took  # the time to import torch, not to start a server or load weights

"""worker.py: what the servers it starts, and the deployment's, are configured with."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_deployment_raises_the_transfer_queue_rate_as_the_embedded_server_does():
    import yaml

    from worker import DEV_SERVER_DYNAMIC_CONFIG, dev_server_args

    config = yaml.safe_load((ROOT / "deploy" / "temporal-dynamic-config.yaml").read_text())
    assert {k: [c["value"] for c in v] for k, v in config.items()} == {
        k: [v] for k, v in DEV_SERVER_DYNAMIC_CONFIG.items()}
    assert DEV_SERVER_DYNAMIC_CONFIG["history.transferProcessorMaxPollRPS"] >= 500
    assert dev_server_args() == ["--dynamic-config-value", "history.transferProcessorMaxPollRPS=1000"]


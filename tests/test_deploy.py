"""docker-compose.yml is valid Compose, configured only by environment variables (it is checked,
not run: there is no container engine here)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _compose() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


COMPOSE = _compose()
pytestmark = pytest.mark.skipif(COMPOSE is None, reason="neither `docker compose` nor docker-compose is installed "
                                "(.ci/run installs Debian's docker-compose)")


def config(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("MAMBA_STREAM_", "POSTGRES_", "TEMPORAL_"))}
    return subprocess.run([*COMPOSE, "-f", str(ROOT / "docker-compose.yml"), "config", *args],
                          capture_output=True, text=True, env={**full, **env}, cwd=ROOT)


def test_the_compose_file_validates_with_the_services_of_a_deployment():
    ring = '{"active": "k1", "keys": {"k1": "x"}}'
    out = config("--services", MAMBA_STREAM_KEYRING=ring)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == {"postgresql", "temporal", "temporal-ui", "codec-server", "worker-1", "worker-2"}
    full = config(MAMBA_STREAM_KEYRING=ring, MAMBA_STREAM_BACKEND="chunked")
    assert full.returncode == 0, full.stderr
    text = full.stdout
    # both replicas share the PostgreSQL state store and the keyring; the UI decrypts through the codec server
    assert text.count("MAMBA_STREAM_STORE: postgresql://mamba:mamba@postgresql:5432/mamba_stream") == 2
    assert text.count("MAMBA_STREAM_BACKEND: chunked") == 2
    assert "TEMPORAL_CODEC_ENDPOINT: http://localhost:8081" in text and "DB: postgres12" in text
    # the server reads the transfer queue as often as the embedded dev server does (worker.py)
    assert "DYNAMIC_CONFIG_FILE_PATH: config/dynamicconfig/mamba-stream.yaml" in text
    assert "/etc/temporal/config/dynamicconfig/mamba-stream.yaml" in text


def test_the_shared_keyring_is_required():
    out = config("-q")
    assert out.returncode != 0 and "MAMBA_STREAM_KEYRING" in out.stderr

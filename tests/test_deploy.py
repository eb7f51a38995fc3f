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
pytestmark = pytest.mark.skipif(COMPOSE is None, reason="neither `docker compose` nor docker-compose is installed: "
                                "`apt-get install docker-compose` (what .ci/run does)")


def config(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("MAMBA_STREAM_", "POSTGRES_", "TEMPORAL_"))}
    return subprocess.run([*COMPOSE, "-f", str(ROOT / "docker-compose.yml"), "config", *args],
                          capture_output=True, text=True, env={**full, **env}, cwd=ROOT)


#: what the deployer must give: the keyring, and who may call the frontend (an identity provider's keys)
REQUIRED = {"MAMBA_STREAM_KEYRING": '{"active": "k1", "keys": {"k1": "x"}}',
            "TEMPORAL_JWKS_URL": "https://idp.example/jwks.json", "MAMBA_STREAM_WORKER_TOKEN": "a.jwt.token",
            "TEMPORAL_UI_OIDC_URL": "https://idp.example", "TEMPORAL_UI_OIDC_CLIENT_ID": "ui",
            "TEMPORAL_UI_OIDC_CLIENT_SECRET": "s"}


def test_the_compose_file_validates_with_the_services_of_a_deployment():
    out = config("--services", **REQUIRED)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == {"postgresql", "temporal", "temporal-ui", "codec-server", "worker-1", "worker-2"}
    full = config(**REQUIRED, MAMBA_STREAM_BACKEND="chunked")
    assert full.returncode == 0, full.stderr
    text = full.stdout
    # both replicas share the PostgreSQL state store and the keyring; the UI decrypts through the codec server
    assert text.count("MAMBA_STREAM_STORE: postgresql://mamba:mamba@postgresql:5432/mamba_stream") == 2
    assert text.count("MAMBA_STREAM_BACKEND: chunked") == 2
    assert "TEMPORAL_CODEC_ENDPOINT: http://localhost:8081" in text and "DB: postgres12" in text
    # the server reads the transfer queue as often as the embedded dev server does (worker.py)
    assert "DYNAMIC_CONFIG_FILE_PATH: config/dynamicconfig/mamba-stream.yaml" in text
    assert "/etc/temporal/config/dynamicconfig/mamba-stream.yaml" in text


    # Temporal's own authorization: every call to the frontend carries a token it checks
    assert "TEMPORAL_AUTH_AUTHORIZER: default" in text and "TEMPORAL_AUTH_CLAIM_MAPPER: default" in text
    assert "TEMPORAL_JWT_KEY_SOURCE1: https://idp.example/jwks.json" in text
    assert text.count("TEMPORAL_API_KEY: a.jwt.token") == 2 and "TEMPORAL_AUTH_ENABLED: \"true\"" in text
    # the operator's codec token is in nothing the UI serves: its codec endpoint is the address alone
    import yaml

    ui = yaml.safe_load(text)["services"]["temporal-ui"]["environment"]
    assert ui["TEMPORAL_CODEC_ENDPOINT"] == "http://localhost:8081" and not any("/t/" in str(v) for v in ui.values())


@pytest.mark.parametrize("missing", sorted(REQUIRED))
def test_the_keyring_and_the_frontends_authorization_are_required(missing: str):
    out = config("-q", **{k: v for k, v in REQUIRED.items() if k != missing})
    assert out.returncode != 0 and missing in out.stderr

"""The workflow sandbox never sees torch, mamba_ssm, triton, msgpack or cryptography; a client never
loads the engine, the checkpoint codec or the worker; the record never reaches up to the engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "mamba_ssm", "triton", "msgpack", "cryptography", "numpy", "safetensors")
#: what a client process must not pay for: the payload codec's cryptography is all it needs
WORKER_ONLY = ("torch", "mamba_ssm", "triton", "msgpack", "numpy", "safetensors", "mamba_stream.scan",
               "mamba_stream.state_codec.codec", "mamba_stream.activities._activities",
               "mamba_stream.activities._engine", "mamba_stream.worker", "psycopg")


def _loaded(statement: str, watch: tuple[str, ...]) -> list[str]:
    code = (
        f"import sys\n{statement}\n"
        f"bad = [m for m in {watch!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


@pytest.mark.parametrize("package", ["mamba_stream", "mamba_stream.workflows", "mamba_stream.state_codec"])
def test_importing_sandbox_packages_loads_no_heavy_module(package):
    assert _loaded(f"import {package}", HEAVY) == [], package


@pytest.mark.parametrize("statement", [
    "import mamba_stream.plugin",
    "from mamba_stream import MambaStreamPlugin, StreamClient, ModelStream",
    "from mamba_stream.workflows import StreamClient",
    "from mamba_stream.workflows import ClientConfig",
    "from mamba_stream.state_codec.keyring import Keyring, find_keyring",
    "from mamba_stream import MambaStreamPlugin, StreamClient; import mamba_stream.cli._streams",
    # an agent's model is built in its workflow's module: the engine loads where a request runs
    "from mamba_stream.pydantic_ai import MambaModel; MambaModel('tiny-mamba2')",
])
def test_a_client_loads_nothing_of_the_worker(statement):
    assert _loaded(statement, WORKER_ONLY) == [], statement


def test_the_keyring_needs_no_cryptography_and_the_record_never_imports_the_engine():
    assert _loaded("import mamba_stream.state_codec.keyring", ("cryptography", "msgpack", "torch")) == []
    # the checkpoint codec is worker-side (torch, msgpack) but sits below the engine
    assert _loaded("import mamba_stream.state_codec.codec", ("mamba_stream.scan", "mamba_stream.activities",
                                                            "mamba_stream.workflows", "mamba_stream.worker")) == []


def test_loading_a_model_and_advancing_it_does_not_import_torch_dynamo():
    # torch._dynamo takes about a second to import: a worker that loads a model must not pay it
    # (building the module on the meta device once did, through the embedding's init)
    statement = ("from mamba_stream.scan import ModelConfig, init_model\n"
                 "cfg = ModelConfig.create(architecture='mamba2', d_model=64, n_layer=2, vocab_size=300,"
                 " d_state=16, headdim=16)\n"
                 "m = init_model(cfg, seed=0, backend='exact')\n"
                 "m.advance(m.initial_state(), [1, 2, 3])\n"
                 "init_model(cfg, seed=0, backend='reference').advance(m.initial_state(), [4])")
    assert _loaded(statement, ("torch._dynamo",)) == []

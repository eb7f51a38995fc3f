"""The workflow sandbox never sees torch, mamba_ssm, triton, msgpack or cryptography."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "mamba_ssm", "triton", "msgpack", "cryptography", "numpy", "safetensors")


@pytest.mark.parametrize("package", ["workflows", "state_codec"])
def test_importing_sandbox_packages_loads_no_heavy_module(package):
    code = (
        f"import sys, {package}\n"
        f"bad = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{package} pulled in: {out.stdout.strip()}"

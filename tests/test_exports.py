"""Each package's public surface is its sorted __all__, and every name in it exists."""

from __future__ import annotations

import importlib

import pytest

EXPECTED = {
    "scan": [
        "BACKENDS", "PRESETS", "TOLERANCES", "ByteTransform", "CheckpointError", "ConfigError",
        "HFTokenizerTransform", "InputTransform", "InvalidInput", "InvalidState", "Model", "ModelConfig",
        "NonFiniteInput", "NonFiniteOutput", "NonIntegerInput", "ScanError", "State", "StepResult",
        "TokenOutOfRange", "Tolerance", "UnsupportedBackend", "init_model", "load_model", "save_checkpoint", "tolerance",
        "weights_revision",
    ],
    "state_codec": ["SCHEMA_VERSION", "Discretization", "StateSchema", "TensorSpec"],
    "activities": [],
    "workflows": [],
    "cli": ["main"],
}


@pytest.mark.parametrize("package", sorted(EXPECTED))
def test_public_names(package):
    mod = importlib.import_module(package)
    assert list(mod.__all__) == EXPECTED[package]
    for name in mod.__all__:
        assert hasattr(mod, name), name

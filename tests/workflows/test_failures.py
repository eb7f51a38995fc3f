"""The failure catalogue: every reason a stream reports is a class, and crosses Temporal typed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mamba_stream import workflows
from mamba_stream.activities import StoreCorrupt, StoreError, StoreOwnedElsewhere, StoreUnavailable
from mamba_stream.activities._registry import UnknownModel
from mamba_stream.scan import NonFiniteOutput, TokenOutOfRange
from mamba_stream.state_codec import CheckpointNotFound, PrincipalMismatch
from mamba_stream.workflows import NOT_THE_CHUNKS_FAULT, StreamFailure, application_error, catalogue

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [f"mamba_stream/{s}"
           for s in ("activities", "workflows", "cli", "state_codec", "scan", "plugin.py", "worker.py")]


def _calls_with_literal_type(path: Path) -> list[str]:
    """ApplicationError(..., type="SomeString") calls: a reason spelled as a string."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) \
                and getattr(node.func, "id", getattr(node.func, "attr", "")) == "ApplicationError":
            for kw in node.keywords:
                if kw.arg == "type" and isinstance(kw.value, ast.Constant):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} type={kw.value.value!r}")
    return found


def test_no_reason_is_spelled_as_a_string():
    files = [p for s in SOURCES for p in ((ROOT / s).rglob("*.py") if (ROOT / s).is_dir() else [ROOT / s])]
    assert len(files) > 20
    assert [hit for f in files for hit in _calls_with_literal_type(f)] == []


def test_every_failure_class_is_named_by_its_reason_and_in_the_catalogue():
    cat = catalogue()
    for name in workflows.__all__:
        obj = getattr(workflows, name)
        if isinstance(obj, type) and issubclass(obj, StreamFailure):
            assert obj.reason == obj.__name__ and cat[obj.reason] is obj
    assert cat["CheckpointNotFound"] is CheckpointNotFound and cat["ConflictingChunk"] is workflows.ConflictingChunk
    assert set(NOT_THE_CHUNKS_FAULT) <= set(cat) | {"StoreError", "StoreUnavailable", "StoreCorrupt"}


@pytest.mark.parametrize("exc,reason,retryable", [
    (workflows.ConflictingChunk("x", chunk_seq=2), "ConflictingChunk", False),
    (workflows.StreamOpening("x"), "StreamOpening", True),
    (PrincipalMismatch("x", field="principal", expected="a", actual="b"), "PrincipalMismatch", False),
    (StoreUnavailable("down"), "StoreUnavailable", True),
    (StoreCorrupt("bad"), "StoreCorrupt", False),
    (StoreOwnedElsewhere("other"), "StoreOwnedElsewhere", False),
    (StoreError("x"), "StoreError", False),
    (TokenOutOfRange("x", position=3, value=9), "TokenOutOfRange", False),
    (NonFiniteOutput("nan"), "NonFiniteOutput", False),
    (UnknownModel("no such model"), "UnknownModel", False),
])
def test_application_error_keeps_the_reason_and_whether_a_retry_can_help(exc, reason, retryable):
    err = application_error(exc)
    assert err.type == reason and err.non_retryable is (not retryable) and err.message == str(exc)


def test_an_untyped_exception_is_not_silently_typed():
    with pytest.raises(TypeError):
        application_error(ValueError("a bug"))
    details = application_error(workflows.ConflictingChunk("x", chunk_seq=2)).details
    assert details[0] == {"chunk_seq": 2}

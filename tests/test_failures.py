"""One failure root (issue 44, item 4): every exception the package raises on purpose is a
`mamba_stream.failures.Failure`, its reason derived from its class (never written out), one class
per reason; the packages import one another in one direction only."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import mamba_stream
from mamba_stream.failures import Failure, InvalidRequest, TokenOutOfRange, application_error, catalogue

PACKAGE = Path(mamba_stream.__file__).resolve().parent

#: exceptions that are not failures, on purpose: the engine's death is the worker's fault, left
#: untyped so that it counts towards the worker's health; the rest is control flow, never reported
NOT_FAILURES = {"EngineDead", "NeedsLoad", "StaleSlot", "_Unconverted"}

#: which package may import which (below: imported by above); a package not named imports none
LAYERS = {
    "failures": set(),
    "state_codec": {"failures"},
    "scan": {"failures", "state_codec"},
    "workflows": {"failures", "state_codec"},
    "quality": {"failures", "scan"},
    "activities": {"failures", "state_codec", "scan", "workflows"},
    "devserver": {"failures"},
    "serving": {"failures", "state_codec", "scan", "workflows", "activities"},
    "plugin": {"failures", "state_codec", "workflows", "serving"},
}


def _modules() -> list:
    out = []
    for info in pkgutil.walk_packages(mamba_stream.__path__, "mamba_stream."):
        if info.name.endswith("__main__") or "triton" in info.name:
            continue
        out.append(importlib.import_module(info.name))
    return out


def test_every_exception_of_the_package_is_a_failure_named_by_its_class():
    found = {}
    for mod in _modules():
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == mod.__name__:
                found[name] = obj
    assert len(found) > 50
    assert {n for n, c in found.items() if not issubclass(c, Failure)} == NOT_FAILURES
    cat = catalogue()
    for name, cls in found.items():
        if issubclass(cls, Failure):
            assert cls.reason == name and cat[name] is cls, name  # one class per reason


def test_no_failure_class_writes_its_reason_out():
    _modules()  # every failure class defined, so that the catalogue names them all
    failures = set(catalogue()) - {"Failure"}
    said = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                        [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
                    if any(getattr(t, "id", None) == "reason" for t in targets) and node.name in failures:
                        said.append(f"{path.name}:{node.name}")
    assert said == []


def test_packages_import_downwards_only():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).parts
        here = rel[0].removesuffix(".py")
        if here not in LAYERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                parts = name.split(".")
                if parts[0] == "mamba_stream" and len(parts) > 1 and parts[1] != here and \
                        parts[1] not in LAYERS[here]:
                    wrong.append(f"{'/'.join(rel)} imports {name}")
    assert wrong == []


@pytest.mark.parametrize("exc", [
    InvalidRequest("bad", errors=[{"loc": "x", "msg": "y"}]),
    TokenOutOfRange("token 9 is outside [0, 8)", position=3, value=9),
])
def test_a_failure_crosses_temporal_typed_by_its_class(exc):
    err = application_error(exc)
    assert err.type == type(exc).__name__ and err.non_retryable and err.message == str(exc)
    assert err.details[0] == exc.details()
    with pytest.raises(TypeError):
        application_error(ValueError("a bug is not silently typed"))

"""Fixtures shared by the activities' tests."""

from __future__ import annotations

import uuid

import pytest

from mamba_stream.activities import MemoryStateStore, open_store


@pytest.fixture(params=["memory", "file", "postgresql"])
def any_store(request, tmp_path):
    """Each store kind, empty: in memory, files under tmp_path, a fresh PostgreSQL table (dropped after)."""
    if request.param == "memory":
        yield MemoryStateStore()
    elif request.param == "file":
        yield open_store(f"file://{tmp_path / 'store'}")
    else:
        from tests.activities.test_stores import _pg_store

        s = _pg_store(f"t_{uuid.uuid4().hex[:12]}")
        yield s
        s.drop()
        s.close()

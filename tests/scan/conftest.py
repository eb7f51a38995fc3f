"""Fixtures shared by the scan tests."""

from __future__ import annotations

import pytest

from tests.scan._helpers import ARCH_PRESETS


@pytest.fixture(params=ARCH_PRESETS)
def preset(request: pytest.FixtureRequest) -> str:
    return request.param

"""Shared test configuration."""

from __future__ import annotations

import os

from hypothesis import settings

# CI runs the full profile; `HYPOTHESIS_PROFILE=dev` gives quicker local runs.
settings.register_profile("ci", deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=25)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

#: test files that take minutes: collected first, so that under `pytest -n 2` (make test) one
#: worker starts on them while the other takes everything else, instead of one finishing them alone
LONG_FIRST = ("tests/workflows/test_many_streams.py",)


def pytest_collection_modifyitems(session, config, items) -> None:  # pytest's hook
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONG_FIRST)  # stable: order kept otherwise

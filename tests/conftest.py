"""Shared test configuration."""

from __future__ import annotations

import os

from hypothesis import settings

# CI runs the full profile; `HYPOTHESIS_PROFILE=dev` gives quicker local runs.
settings.register_profile("ci", deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=25)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

"""Typed errors of the scan engine.

Every failure the engine can foresee raises one of these; none of them leaves a state advanced,
because `advance` never writes to its input state.
"""

from __future__ import annotations

from typing import Any

from mamba_stream.failures import InvalidInput, ScanError, TokenOutOfRange

__all__ = [
    "CheckpointError",
    "ConfigError",
    "InvalidInput",
    "InvalidState",
    "NonFiniteInput",
    "NonFiniteOutput",
    "NonIntegerInput",
    "PositionLimit",
    "ScanError",
    "TokenOutOfRange",
    "UnsupportedBackend",
]


# ScanError, InvalidInput and TokenOutOfRange live in `mamba_stream.failures`: the stream's
# admission (workflows, which cannot import the scan) refuses an out-of-range token as the scan
# does, with the same class.


class NonIntegerInput(InvalidInput):
    """A token is not an integer (a float, a bool, a string, a nested list...)."""


class NonFiniteInput(InvalidInput):
    """A float input holds NaN or infinity."""


class InvalidState(ScanError, ValueError):
    """A state does not fit the model's schema (names, shapes, dtypes, position, values)."""

    def __init__(self, message: str, *, field: str, expected: Any = None, actual: Any = None) -> None:
        super().__init__(message)
        self.field = field
        self.expected = expected
        self.actual = actual


class NonFiniteOutput(ScanError, ArithmeticError):
    """The scan produced NaN or infinity; the new state is discarded."""


class ConfigError(ScanError, ValueError):
    """A model configuration is unsupported or inconsistent; `field` names the culprit."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class CheckpointError(ScanError, ValueError):
    """A checkpoint directory cannot be loaded (missing files, wrong or missing tensors)."""


class UnsupportedBackend(ScanError, ValueError):
    """The requested backend does not exist or cannot run here."""


class PositionLimit(ScanError, ValueError):
    """A chunk would take a stream past its model's `max_positions` (the rows its attention
    layers' KV is preallocated with); refused before anything advances.

    `field`: "max_positions"; `limit`: the bound; `actual`: the position the chunk would reach.
    """

    def __init__(self, message: str, *, field: str = "max_positions", limit: int, actual: int) -> None:
        super().__init__(message, field=field, limit=limit, actual=actual)
        self.field = field
        self.limit = limit
        self.actual = actual

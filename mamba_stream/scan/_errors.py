"""Typed errors of the scan engine.

Every failure the engine can foresee raises one of these; none of them leaves a state advanced,
because `advance` never writes to its input state.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "CheckpointError",
    "ConfigError",
    "InvalidInput",
    "InvalidState",
    "NonFiniteInput",
    "NonFiniteOutput",
    "NonIntegerInput",
    "ScanError",
    "TokenOutOfRange",
    "UnsupportedBackend",
]


class ScanError(Exception):
    """Base class of every error raised by `scan`. `reason` (the class name) is the failure's
    type across Temporal (workflows' catalogue); none is worth a retry."""

    reason: ClassVar[str] = "ScanError"
    retryable: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.reason = cls.__name__

    def details(self) -> dict[str, Any]:
        return {}


class InvalidInput(ScanError, ValueError):
    """The tokens (or embeddings) handed to `advance` cannot be scanned."""

    def __init__(self, message: str, *, position: int | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.position = position
        self.value = value

    def details(self) -> dict[str, Any]:
        return {"position": self.position, "value": repr(self.value)[:200]}


class NonIntegerInput(InvalidInput):
    """A token is not an integer (a float, a bool, a string, a nested list...)."""


class NonFiniteInput(InvalidInput):
    """A float input holds NaN or infinity."""


class TokenOutOfRange(InvalidInput):
    """A token id is negative or not below the model's vocabulary size."""


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

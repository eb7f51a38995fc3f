"""One root for every failure this package raises on purpose: `Failure`.

A failure's `reason` is its class name, derived once here (`__init_subclass__`), never written
out; `retryable` says whether trying again may help; `details()` are JSON-friendly values that
travel with it. The families keep their homes and their own constructors (the stream's
`workflows.StreamFailure`, state_codec's `StateRejected` and `KeyringError`, the stores'
`StoreError`, the scan's `ScanError`, the registry's `UnknownModel`, the engine's `StreamBusy`,
the worker's `EmbeddedServerError`), all under this root; what crosses Temporal is made in one
place (`application_error`), and `catalogue()` lists every reason.

What is not a failure stays outside on purpose: an engine whose thread died (`EngineDead`) is
the worker's fault, left untyped so that it counts towards the worker's health; control flow
(`NeedsLoad`) is not reported to anyone.

The bottom of the package: the standard library and temporalio only, so that every layer
(state_codec's payload converter included) maps its failures here without importing the layers
above it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from temporalio.exceptions import ApplicationError

__all__ = ["Failure", "InvalidInput", "InvalidRequest", "ScanError", "TokenOutOfRange", "application_error",
           "catalogue", "invalid_request"]


class Failure(Exception):
    """The root. `reason`: the class name (the `ApplicationError.type` a caller sees)."""

    reason: ClassVar[str] = "Failure"
    retryable: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.reason = cls.__name__

    def __init__(self, message: str = "", **details: Any) -> None:
        super().__init__(message)
        self.extra = details

    def details(self) -> dict[str, Any]:
        return dict(getattr(self, "extra", {}))


class InvalidRequest(Failure):
    """A request the stream or the model cannot take: a payload that does not validate, a missing,
    extra or null argument to an update or query, text for a model without an input transform."""


class ScanError(Failure):
    """Base class of every error raised by `scan` (its other classes are in `scan`); none is worth
    a retry."""


class InvalidInput(ScanError, ValueError):
    """The tokens (or embeddings) handed to `advance` cannot be scanned."""

    def __init__(self, message: str = "", *, position: int | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.position = position
        self.value = value

    def details(self) -> dict[str, Any]:
        value = self.value if isinstance(self.value, int) and not isinstance(self.value, bool) else \
            repr(self.value)[:200]
        return {"position": self.position, "value": value}


class TokenOutOfRange(InvalidInput):
    """A token id is negative or not below the model's vocabulary size: refused by the stream's
    admission (before the chunk runs) and by the scan alike."""


def catalogue() -> dict[str, type[Failure]]:
    """Every failure class of the package, by reason (the modules that define them imported)."""
    out: dict[str, type[Failure]] = {}
    todo: list[type[Failure]] = [Failure]
    while todo:
        cls = todo.pop()
        out[cls.reason] = cls
        todo.extend(cls.__subclasses__())
    return out


def application_error(exc: BaseException, *, retryable: bool | None = None) -> ApplicationError:
    """The `ApplicationError` a failure crosses Temporal as: `type` is its reason; a permanent one
    is non-retryable. Anything that is not a `Failure` raises TypeError: an untyped exception is
    a fault, never silently typed.

    `retryable` overrides the class's flag where the caller waits out what would otherwise be
    permanent (a cancel's dispose waits out a read-only store until an operator lifts it)."""
    if not isinstance(exc, Failure):
        raise TypeError(f"{type(exc).__name__} is not a typed failure") from exc
    details = exc.details()
    message = str(exc) or exc.reason
    if retryable is None:
        retryable = bool(exc.retryable)
    return ApplicationError(message, *([details] if details else []), type=exc.reason, non_retryable=not retryable)


def invalid_request(name: str, exc: Any) -> ApplicationError:
    """A value that does not validate as model `name` (`exc`: pydantic's ValidationError), refused
    typed `InvalidRequest`: its first fields in the message, up to eight in the details. An untyped
    ValidationError would be retried (and, in workflow code, fail the workflow task each time)."""
    errors = [{"loc": ".".join(str(p) for p in e["loc"]), "msg": e["msg"]} for e in exc.errors()[:8]]
    first = "; ".join(f"{e['loc'] or name}: {e['msg']}" for e in errors[:3])
    # `field`: the first problem's top-level field (a setting's name), as the stream's own refusals say it
    field = errors[0]["loc"].split(".")[0] if errors and errors[0]["loc"] else ""
    return application_error(InvalidRequest(f"invalid {name}: {first}", field=field, errors=errors))

"""Errors that cross the process boundary: ``{"kind": KIND, "message": TEXT}``.

The kinds are the closed list of docs/wire.md §5; the supervisor kills a
worker that sends any other, so :class:`WireError` refuses an unknown kind
when it is made rather than when it is sent.
"""

from __future__ import annotations

from typing import Any, Dict

BAD_REQUEST = "bad_request"
UNKNOWN_BACKEND = "unknown_backend"
LOAD_FAILED = "load_failed"
NOT_LOADED = "not_loaded"
CANCELLED = "cancelled"
INPUT_TOO_LARGE = "input_too_large"
BACKEND_ERROR = "backend_error"
INTERNAL = "internal"

#: Every kind the wire knows, in the order of docs/wire.md §5.
KINDS = (
    BAD_REQUEST,
    UNKNOWN_BACKEND,
    LOAD_FAILED,
    NOT_LOADED,
    CANCELLED,
    INPUT_TOO_LARGE,
    BACKEND_ERROR,
    INTERNAL,
)


class WireError(Exception):
    """An error a backend raises to fail one load or one request.

    ``kind`` is one of :data:`KINDS` (also available as class attributes,
    e.g. ``WireError.BAD_REQUEST``); ``message`` is for people and should name
    the model and what to do. Raise it from :meth:`Backend.load` or
    :meth:`Backend.handle`; the worker sends it as the load's or request's
    error and goes on serving.
    """

    BAD_REQUEST = BAD_REQUEST
    UNKNOWN_BACKEND = UNKNOWN_BACKEND
    LOAD_FAILED = LOAD_FAILED
    NOT_LOADED = NOT_LOADED
    CANCELLED = CANCELLED
    INPUT_TOO_LARGE = INPUT_TOO_LARGE
    BACKEND_ERROR = BACKEND_ERROR
    INTERNAL = INTERNAL

    def __init__(self, kind: str, message: str) -> None:
        if kind not in KINDS:
            raise ValueError(
                "WireError kind {!r} is not one of the wire's kinds ({})".format(
                    kind, ", ".join(KINDS)
                )
            )
        # A lone surrogate (from bytes decoded with surrogateescape, say)
        # cannot be UTF-8: keep it readable instead of failing the send.
        text = str(message).encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(kind, text)
        self.kind = kind
        self.message = text

    def __str__(self) -> str:
        return "{}: {}".format(self.kind, self.message)

    def __repr__(self) -> str:
        return "{}({!r}, {!r})".format(type(self).__name__, self.kind, self.message)

    def to_wire(self) -> Dict[str, Any]:
        """The error as the wire carries it."""
        return {"kind": self.kind, "message": self.message}


class _FixedKind(WireError):
    """A :class:`WireError` whose kind is fixed by its class."""

    KIND = INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(self.KIND, message)

    def __repr__(self) -> str:
        return "{}({!r})".format(type(self).__name__, self.message)


class BadRequest(_FixedKind):
    """The request (or a load option) could not be understood."""

    KIND = BAD_REQUEST


class UnknownBackend(_FixedKind):
    """The backend named in the load is not in this worker."""

    KIND = UNKNOWN_BACKEND


class LoadFailed(_FixedKind):
    """The model could not be loaded (missing file, bad format)."""

    KIND = LOAD_FAILED


class NotLoaded(_FixedKind):
    """A request arrived before a successful load."""

    KIND = NOT_LOADED


class Cancelled(_FixedKind):
    """The request was cancelled."""

    KIND = CANCELLED


class InputTooLarge(_FixedKind):
    """The input does not fit the model (longer than its context)."""

    KIND = INPUT_TOO_LARGE


class BackendError(_FixedKind):
    """The model failed while serving the request."""

    KIND = BACKEND_ERROR


class Internal(_FixedKind):
    """Anything else: a bug."""

    KIND = INTERNAL


def describe_exception(exc: BaseException) -> str:
    """``TypeName: text`` for an exception, the way error messages show it."""
    name = type(exc).__qualname__
    module = type(exc).__module__
    if module not in ("builtins", "__main__"):
        name = "{}.{}".format(module, name)
    text = str(exc)
    return "{}: {}".format(name, text) if text else name

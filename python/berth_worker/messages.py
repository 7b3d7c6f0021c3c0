"""The messages of docs/wire.md §4: headers the worker sends, and checks on
the ones the supervisor sends (a message missing a member, or with one of the
wrong type, is a :class:`~berth_worker.wire.FrameError`)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from .version import WIRE_VERSION
from .wire import Frame, FrameError, encode_json

#: The wire versions this worker speaks.
WIRE_VERSIONS = [WIRE_VERSION]

#: Message types the supervisor may send.
SUPERVISOR_TYPES = ("welcome", "refused", "load", "request", "cancel", "ping", "shutdown")


# -- worker -> supervisor ------------------------------------------------------


def hello(pid: int, worker_version: str, backends: Sequence[str], runtime: str) -> Dict[str, Any]:
    """The first frame."""
    return {
        "type": "hello",
        "versions": list(WIRE_VERSIONS),
        "pid": pid,
        "worker_version": worker_version,
        "backends": list(backends),
        "runtime": runtime,
        "library": "berth_worker",
    }


def loaded(details: Any, load_micros: int, max_batch: int = 1) -> Dict[str, Any]:
    """The model is ready; it takes up to ``max_batch`` requests at once."""
    return {"type": "loaded", "details": details, "load_micros": load_micros, "max_batch": max_batch}


def load_failed(error: Dict[str, Any]) -> Dict[str, Any]:
    """The model could not be loaded."""
    return {"type": "load_failed", "error": error}


def chunk(request_id: int, body: Any) -> Dict[str, Any]:
    """A streamed piece of an answer (bulk bytes are declared when sent)."""
    return {"type": "chunk", "id": request_id, "body": body}


def done(request_id: int, body: Any, run: Optional[Tuple[int, int]] = None) -> Dict[str, Any]:
    """A request's result (bulk bytes are declared when sent); ``run`` is
    ``(batch size, compute microseconds)`` of the batch it ran in."""
    out = {"type": "done", "id": request_id, "body": body}
    if run is not None:
        out["batch"], out["compute_us"] = run
    return out


# done()'s header as encode_header writes it, around the body's own JSON.
_DONE = '{"type":"done","id":%d,"body":%s}'
_DONE_RUN = '{"type":"done","id":%d,"body":%s,"batch":%d,"compute_us":%d}'


def done_head(request_id: int, body: Any, run: Optional[Tuple[int, int]] = None) -> bytes:
    """:func:`done`'s header, encoded: byte for byte what
    :func:`~berth_worker.wire.encode_header` makes of it, without building
    the dict and encoding its fixed members every time. The integers are
    the worker's own (an id checked to be one, a count, microseconds).
    Raises what ``encode_header`` raises for a body JSON cannot carry."""
    if run is None:
        text = _DONE % (request_id, encode_json(body))
    else:
        text = _DONE_RUN % (request_id, encode_json(body), run[0], run[1])
    return text.encode("utf-8")


def done_error(
    request_id: int, error: Dict[str, Any], run: Optional[Tuple[int, int]] = None
) -> Dict[str, Any]:
    """A request's error."""
    out = {"type": "done", "id": request_id, "error": error}
    if run is not None:
        out["batch"], out["compute_us"] = run
    return out


def pong(seq: int, stats: Dict[str, int]) -> Dict[str, Any]:
    """The answer to a ping."""
    return {"type": "pong", "seq": seq, "stats": stats}


# -- supervisor -> worker ------------------------------------------------------


_U64_END = 1 << 64


def _is_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value < _U64_END


def _member(frame: Frame, key: str, what: str, ok: bool) -> None:
    if not ok:
        raise FrameError(
            "a `{}` message needs `{}` to be {} (got {!r})".format(
                frame.type, key, what, frame.header.get(key)
            )
        )


def check_supervisor_message(frame: Frame) -> None:
    """Checks a supervisor frame's type and the members its type needs.

    ``request`` takes an absent ``body`` as ``null``, and ``load`` an absent
    ``model`` as ``null`` and absent ``options`` as none; every other member
    named here is required. Members this module does not name are ignored.
    """
    kind = frame.type
    h = frame.header
    if kind == "request":
        # The message that comes most, first, its one check inline: it may
        # carry bulk bytes, and its `body` may be anything.
        request_id = h.get("id")
        if not (type(request_id) is int and 0 <= request_id < _U64_END):
            _member(frame, "id", "an integer", False)
        return
    if kind not in SUPERVISOR_TYPES:
        raise FrameError("the supervisor sent a message of unknown type `{}`".format(kind))
    if frame.bulk is not None:
        raise FrameError("a `{}` message carries bulk bytes".format(kind))
    if kind == "welcome":
        _member(frame, "version", "an integer", _is_u64(h.get("version")))
    elif kind == "refused":
        _member(frame, "reason", "a string", isinstance(h.get("reason"), str))
    elif kind == "load":
        _member(frame, "name", "a string", isinstance(h.get("name"), str))
        _member(frame, "backend", "a string", isinstance(h.get("backend"), str))
        model = h.get("model")
        _member(frame, "model", "a string or null", model is None or isinstance(model, str))
        options = h.get("options")
        _member(
            frame,
            "options",
            "an object of strings",
            options is None
            or (isinstance(options, dict) and all(isinstance(v, str) for v in options.values())),
        )
    elif kind == "cancel":
        _member(frame, "id", "an integer", _is_u64(h.get("id")))
    elif kind == "ping":
        _member(frame, "seq", "an integer", _is_u64(h.get("seq")))


def options_of(frame: Frame) -> Dict[str, str]:
    """A checked ``load`` message's options."""
    return dict(frame.header.get("options") or {})

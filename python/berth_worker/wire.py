"""Frames of the berth stream wire (docs/wire.md §2 and §3).

A frame is ``length`` (u32 LE, the bytes that follow it), ``header_length``
(u32 LE), a UTF-8 JSON object header with a string ``"type"``, and a payload
that is the header's inline bulk bytes. Bulk bytes of 65 536 bytes or more
travel in a sealed memfd whose descriptor rides with the frame's first byte
(``SCM_RIGHTS``).

This module knows frames and bulk bytes, not message types: see
:mod:`berth_worker.messages` for those.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import threading
from collections import deque
from json.encoder import c_make_encoder, encode_basestring
from typing import Any, Deque, Dict, List, Optional, Tuple, Union

from .memfd import SEALS, MemfdRefused, make_memfd, map_memfd

__all__ = [
    "MAX_LENGTH",
    "MEMFD_THRESHOLD",
    "SEALS",
    "Frame",
    "FrameError",
    "FrameReader",
    "FrameTooLarge",
    "OutgoingFrame",
    "descriptors",
    "encode_frame",
    "encode_json",
    "frame_of_head",
    "send_frame",
]

#: ``length`` and ``header_length``, both u32 little-endian.
PREFIX = struct.Struct("<II")
#: The smallest ``length``: 4 + the smallest object ``{}``.
MIN_LENGTH = 6
#: The largest ``length`` (64 MiB).
MAX_LENGTH = 64 * 1024 * 1024
#: The smallest header, ``{}``.
MIN_HEADER = 2
#: Bulk bytes of this size or more go in a memfd.
MEMFD_THRESHOLD = 65536

_FD_SIZE = array.array("i").itemsize
# Room for more descriptors than a frame may carry, so that a peer sending
# too many is seen (and refused) rather than silently truncated.
_ANCILLARY_SPACE = socket.CMSG_SPACE(8 * _FD_SIZE)
_READ_BUFFER = 1 << 20

#: What a sender may give as bulk bytes: anything with the buffer protocol
#: (bytes, bytearray, memoryview, mmap, a numpy array).
BulkLike = Union[bytes, bytearray, memoryview, Any]


class FrameError(Exception):
    """The peer broke the wire: a frame that docs/wire.md does not allow."""


class FrameTooLarge(ValueError):
    """A frame to send would be longer than the wire's 64 MiB."""


class Frame:
    """One received frame: its header and its bulk bytes, if any.

    ``bulk`` is ``None`` when the header declares none; otherwise a read-only
    :class:`memoryview` (over a private copy of an inline payload, or over a
    read-only mapping of the memfd: no copy).
    """

    __slots__ = ("header", "bulk", "type")

    def __init__(self, header: Dict[str, Any], bulk: Optional[memoryview]) -> None:
        self.header = header
        self.bulk = bulk
        #: The header's ``"type"`` (checked to be a string when read). A
        #: plain attribute, not a property: the serve loop reads it several
        #: times a request.
        self.type: str = header["type"]

    def __repr__(self) -> str:
        bulk = "" if self.bulk is None else ", {} bulk bytes".format(self.bulk.nbytes)
        return "Frame({!r}{})".format(self.header, bulk)


def _refuse_constant(name: str) -> Any:
    raise ValueError("{} is not JSON".format(name))


# Plain ints: `flags & socket.MSG_CTRUNC` goes through IntFlag's Python code.
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_CMSG_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)

# Made once: json.dumps and json.loads build a new one per call when given
# settings, a few microseconds of every frame.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


_SCAN = _DECODER.scan_once


class _ThreadEncoder(threading.local):
    """CPython's C encoder, made once per thread: ``JSONEncoder.encode``
    makes a new one (and a new circular-reference registry) on every call,
    half of what encoding a small header costs. Each thread gets its own,
    since the registry is the encoder's and the watch thread encodes pongs
    while the model thread encodes answers."""

    def __init__(self) -> None:
        self.markers: Dict[int, Any] = {}
        self.encode = c_make_encoder(
            self.markers,
            _ENCODER.default,
            encode_basestring,
            None,
            _ENCODER.key_separator,
            _ENCODER.item_separator,
            False,
            False,
            False,
        )


_THREAD_ENCODER = _ThreadEncoder() if c_make_encoder is not None else None


def encode_json(value: Any) -> str:
    """Any JSON value as compact JSON text, as it reads inside a header.

    Raises ``TypeError``/``ValueError`` for what JSON cannot carry (an
    object that is not JSON, NaN).
    """
    local = _THREAD_ENCODER
    if local is None or local.markers:
        # No C encoder, or this thread is inside an encode already (a
        # finalizer or a container's own code sending a frame): a fresh one.
        return _ENCODER.encode(value)
    try:
        chunks = local.encode(value, 0)
    except BaseException:
        # A failed encode leaves what it was inside in the registry.
        local.markers.clear()
        raise
    return "".join(chunks)


def encode_header(header: Dict[str, Any]) -> bytes:
    """The header as compact UTF-8 JSON.

    Raises ``TypeError``/``ValueError``/``UnicodeEncodeError`` for what JSON
    cannot carry (an object that is not JSON, NaN, a lone surrogate).
    """
    return encode_json(header).encode("utf-8")


def encode_frame(header: Dict[str, Any], payload: bytes = b"") -> bytes:
    """A whole frame: prefix, header, payload. Raises :class:`FrameTooLarge`."""
    return _frame(encode_header(header), payload, header.get("type"))


def frame_of_head(head: bytes, kind: str) -> bytes:
    """A whole frame of an already encoded header (of type ``kind``) and no
    payload. Raises :class:`FrameTooLarge`."""
    return _frame(head, b"", kind)


def _frame(head: bytes, payload: bytes, kind: Any) -> bytes:
    length = 4 + len(head) + len(payload)
    if length > MAX_LENGTH:
        raise FrameTooLarge(
            "a `{}` frame of {} bytes is longer than the wire's {} bytes".format(
                kind, length, MAX_LENGTH
            )
        )
    return PREFIX.pack(length, len(head)) + head + payload


def decode_header(raw: Union[bytes, bytearray]) -> Dict[str, Any]:
    """Parses and checks a header: UTF-8, one JSON object, a string ``type``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FrameError("the frame header is not UTF-8 ({})".format(e)) from None
    # The scanner alone first (what ``decode`` calls after two regular
    # expressions for surrounding whitespace, which a header rarely has);
    # anything it does not take whole goes through ``decode`` to be judged.
    try:
        header, end = _SCAN(text, 0)
    except (StopIteration, ValueError):
        end = -1
    if end != len(text):
        try:
            header = _DECODER.decode(text)
        except ValueError as e:
            raise FrameError(
                "the frame header is not JSON ({}): {!r}".format(e, text[:200])
            ) from None
    if not isinstance(header, dict):
        raise FrameError("the frame header is not a JSON object: {!r}".format(text[:200]))
    if not isinstance(header.get("type"), str):
        raise FrameError("the frame header has no string `type`: {!r}".format(text[:200]))
    return header


def check_prefix(length: int, header_length: int) -> None:
    """The limits of docs/wire.md §2 on a frame's two integers."""
    if length < MIN_LENGTH or length > MAX_LENGTH:
        raise FrameError(
            "frame length {} is outside {}..{}".format(length, MIN_LENGTH, MAX_LENGTH)
        )
    if header_length < MIN_HEADER or header_length > length - 4:
        raise FrameError(
            "frame header_length {} does not fit a frame of length {} (it is {}..{})".format(
                header_length, length, MIN_HEADER, length - 4
            )
        )


def bulk_view(bulk: BulkLike) -> memoryview:
    """Bulk bytes as a flat byte view, copying only what is not contiguous."""
    view = memoryview(bulk)
    try:
        return view.cast("B")
    except TypeError:
        return memoryview(view.tobytes())


def declared_bulk(header: Dict[str, Any]) -> Tuple[Optional[str], int]:
    """``(form, size)`` of the header's ``bulk`` member: ``(None, 0)`` if absent."""
    bulk = header.get("bulk")
    if bulk is None:
        return None, 0
    if isinstance(bulk, dict) and len(bulk) == 1:
        (form, size), = bulk.items()
        if form in ("inline", "memfd") and type(size) is int and 0 <= size:
            return form, size
    raise FrameError(
        'the `bulk` member {!r} is not {{"inline": N}} or {{"memfd": N}}'.format(bulk)
    )


# -- sending -----------------------------------------------------------------


class OutgoingFrame:
    """A frame ready to send: its bytes and the memfd that rides with them.

    Built outside the connection's write lock (writing a large memfd takes
    time); :meth:`send` is what runs under the lock. The memfd is closed by
    :meth:`send` or :meth:`discard`.
    """

    __slots__ = ("data", "fd")

    def __init__(self, data: bytes, fd: Optional[int]) -> None:
        self.data = data
        self.fd = fd

    @classmethod
    def build(cls, header: Dict[str, Any], bulk: Optional[BulkLike] = None) -> "OutgoingFrame":
        """Encodes ``header`` with ``bulk`` declared in it, inline or in a memfd.

        ``header`` must not have a ``bulk`` member of its own. Raises
        :class:`FrameTooLarge` and the JSON errors of :func:`encode_header`.
        """
        if bulk is None:
            return cls(encode_frame(header), None)
        view = bulk_view(bulk)
        size = view.nbytes
        if size < MEMFD_THRESHOLD:
            head = encode_header(dict(header, bulk={"inline": size}))
            if 4 + len(head) + size <= MAX_LENGTH:
                return cls(_frame(head, view.tobytes(), header.get("type")), None)
        # Encode first: a header too large for a frame makes no memfd.
        data = encode_frame(dict(header, bulk={"memfd": size}))
        return cls(data, make_memfd(view))

    def send(self, sock: socket.socket) -> None:
        """Sends the frame, the memfd (if any) with its first byte."""
        if self.fd is None:
            sock.sendall(self.data)
            return
        try:
            fds = array.array("i", [self.fd])
            sent = sock.sendmsg([self.data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            if sent < len(self.data):
                sock.sendall(memoryview(self.data)[sent:])
        finally:
            self.discard()

    def discard(self) -> None:
        """Closes the memfd without sending."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


def send_frame(sock: socket.socket, header: Dict[str, Any], bulk: Optional[BulkLike] = None) -> None:
    """Builds and sends one frame (no lock: for single-threaded callers)."""
    OutgoingFrame.build(header, bulk).send(sock)


# -- receiving ---------------------------------------------------------------


class FrameReader:
    """Reads frames from a stream socket into one reusable buffer.

    Descriptors arrive with ``recvmsg``; each is matched to the frame whose
    first byte came in the same ``recvmsg`` call. A frame declaring a memfd
    with no descriptor, or a descriptor left over by a frame that declared
    none, is a :class:`FrameError`. End of file raises :class:`EOFError`.
    """

    def __init__(self, sock: socket.socket, buffer_size: int = _READ_BUFFER) -> None:
        self._sock = sock
        self._initial = buffer_size
        # Past this size the buffer goes back to its first once it can.
        self._shrink_above = 4 * buffer_size
        self._buf = bytearray(buffer_size)
        # A view of _buf, made with it: a receive slices it rather than
        # making (and releasing) a view of the whole buffer each time. The
        # buffer is never resized while viewed, only replaced (with its view).
        self._view = memoryview(self._buf)
        self._start = 0  # first unread byte in _buf
        self._end = 0  # end of received bytes in _buf
        self._base = 0  # stream offset of _buf[0]
        # (fd, stream offset where its recvmsg's bytes began, where they ended)
        self._fds: Deque[Tuple[int, int, int]] = deque()

    def read(self) -> Frame:
        """The next frame. Raises :class:`EOFError` or :class:`FrameError`."""
        if self._end - self._start < 8:
            self._fill(8)
        start = self._start
        length, header_length = PREFIX.unpack_from(self._buf, start)
        # check_prefix's limits, tested inline; it says what is wrong.
        if not (MIN_LENGTH <= length <= MAX_LENGTH and MIN_HEADER <= header_length <= length - 4):
            check_prefix(length, header_length)
        if self._end - start < 4 + length:
            self._fill(4 + length)
            start = self._start  # the buffer may have been compacted
        pay_at = start + 8 + header_length
        pay_end = start + 4 + length
        header = decode_header(self._buf[start + 8 : pay_at])
        bulk: Optional[memoryview] = None
        if pay_at == pay_end and header.get("bulk") is None:
            # The common case: no bulk bytes declared and none carried.
            self._start = pay_end
        else:
            bulk = self._bulk(header, start, pay_at, pay_end)
        if self._fds:
            self._check_strays(self._base + pay_end)
        if len(self._buf) > self._shrink_above:
            self._maybe_shrink()
        return Frame(header, bulk)

    def buffered(self) -> bool:
        """True if bytes already received wait here (part or all of a frame):
        the next :meth:`read` starts from them, not from the socket."""
        return self._end > self._start

    def close(self) -> None:
        """Closes any descriptor received but not yet matched to a frame."""
        while self._fds:
            os.close(self._fds.popleft()[0])

    def _bulk(
        self, header: Dict[str, Any], start: int, pay_at: int, pay_end: int
    ) -> Optional[memoryview]:
        """The bulk bytes of the frame at ``start`` in the buffer, checked
        against what its header declares; moves past the frame."""
        form, size = declared_bulk(header)
        payload_size = pay_end - pay_at
        bulk: Optional[memoryview] = None
        if form == "inline":
            if payload_size != size:
                raise FrameError(
                    "a `{}` frame declares {} inline bulk bytes but carries {}".format(
                        header["type"], size, payload_size
                    )
                )
            bulk = memoryview(bytes(self._buf[pay_at:pay_end]))
        elif payload_size:
            raise FrameError(
                "a `{}` frame carries {} payload bytes its header does not declare".format(
                    header["type"], payload_size
                )
            )
        self._start = pay_end
        if form == "memfd":
            bulk = self._take_memfd(header, size, self._base + start)
        return bulk

    def _take_memfd(self, header: Dict[str, Any], size: int, frame_start: int) -> memoryview:
        if not self._fds or not (self._fds[0][1] <= frame_start < self._fds[0][2]):
            raise FrameError(
                "a `{}` frame declares a memfd but no descriptor came with it".format(header["type"])
            )
        fd = self._fds.popleft()[0]
        try:
            return map_memfd(fd, size)
        except MemfdRefused as e:
            raise FrameError(str(e)) from None
        finally:
            os.close(fd)

    def _check_strays(self, next_start: int) -> None:
        # A descriptor whose recvmsg ended before the next frame starts came
        # with this frame or an earlier one, which declared none.
        if self._fds and self._fds[0][2] <= next_start:
            raise FrameError("a descriptor came with a frame that declares no memfd")

    def _maybe_shrink(self) -> None:
        pending = self._end - self._start
        if len(self._buf) > self._shrink_above and pending <= self._initial:
            fresh = bytearray(self._initial)
            fresh[:pending] = self._buf[self._start : self._end]
            self._base += self._start
            self._replace(fresh)
            self._start, self._end = 0, pending

    def _fill(self, need: int) -> None:
        """Reads until ``need`` bytes from ``_start`` are in the buffer."""
        while self._end - self._start < need:
            if self._start == self._end:
                # Nothing pending: receive at the buffer's start, for free.
                self._base += self._start
                self._start = self._end = 0
            if len(self._buf) - self._start < need:
                self._compact(need)
            self._receive()

    def _compact(self, need: int) -> None:
        pending = self._end - self._start
        if len(self._buf) < need:
            fresh = bytearray(max(need, self._initial))
            fresh[:pending] = self._buf[self._start : self._end]
            self._replace(fresh)
        else:
            self._buf[:pending] = self._buf[self._start : self._end]
        self._base += self._start
        self._start, self._end = 0, pending

    def _replace(self, fresh: bytearray) -> None:
        self._buf = fresh
        self._view = memoryview(fresh)

    def _receive(self) -> None:
        nbytes, ancdata, flags, _ = self._sock.recvmsg_into(
            [self._view[self._end :]], _ANCILLARY_SPACE, _CMSG_CLOEXEC
        )
        if nbytes and not ancdata and not flags & _MSG_CTRUNC:
            # The common case: bytes and no descriptor.
            self._end += nbytes
            return
        fds = descriptors(ancdata)
        began = self._base + self._end
        if flags & _MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise FrameError("more descriptors came with one frame than the wire allows")
        if len(fds) > 1:
            for fd in fds:
                os.close(fd)
            raise FrameError("{} descriptors came with one frame; the wire allows one".format(len(fds)))
        if nbytes == 0:
            for fd in fds:
                os.close(fd)
            if self._end > self._start:
                raise EOFError("end of file inside a frame")
            raise EOFError("end of file")
        self._end += nbytes
        for fd in fds:
            self._fds.append((fd, began, began + nbytes))


def descriptors(ancdata: List[Tuple[int, int, bytes]]) -> List[int]:
    """The descriptors an ``SCM_RIGHTS`` message of ``recvmsg`` brought."""
    fds: List[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(data[: len(data) - len(data) % _FD_SIZE])
            fds.extend(got)
    return fds

"""Frames and bulk bytes (docs/wire.md §2, §3), in process over socketpairs.

Run: python3 -m unittest discover -s python/tests -v  (see test_worker.py)
"""

from __future__ import annotations

import array
import fcntl
import mmap
import os
import socket
import struct
import threading
import unittest

import numpy

from berth_worker import wire
from berth_worker.wire import FrameError, FrameReader, encode_frame, send_frame

from fake_supervisor import SEALS, pack, sealed_memfd

MIB = 1 << 20

# The example of docs/wire.md §2, byte for byte.
PING_HEX = (
    "1b 00 00 00"
    " 17 00 00 00"
    " 7b 22 74 79 70 65 22 3a 22 70 69 6e 67 22 2c 22 73 65 71 22 3a 31 7d"
)


def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(10)
    b.settimeout(10)
    return a, b


def raw_receive(sock: socket.socket, size: int):
    """Exactly ``size`` bytes and the descriptors that came with them."""
    data = bytearray()
    fds = []
    while len(data) < size:
        chunk, ancdata, _, _ = sock.recvmsg(size - len(data), socket.CMSG_SPACE(4 * 4))
        for level, kind, raw in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(raw)
                fds.extend(got)
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data), fds


def mapping_names_at(address: int):
    """The /proc/self/maps entries that hold ``address``."""
    names = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                names.append(parts[5] if len(parts) > 5 else "")
    return names


class FrameBytesTests(unittest.TestCase):
    def test_ping_example_byte_for_byte(self) -> None:
        header = b'{"type":"ping","seq":1}'
        by_hand = struct.pack("<I", 4 + len(header)) + struct.pack("<I", len(header)) + header
        self.assertEqual(by_hand, bytes.fromhex(PING_HEX))
        self.assertEqual(len(by_hand), 31)
        self.assertEqual(encode_frame({"type": "ping", "seq": 1}), by_hand)

    def test_ping_example_decodes(self) -> None:
        a, b = pair()
        with a, b:
            a.sendall(bytes.fromhex(PING_HEX) * 2)
            reader = FrameReader(b)
            for _ in range(2):
                frame = reader.read()
                self.assertEqual(frame.header, {"type": "ping", "seq": 1})
                self.assertIsNone(frame.bulk)

    def test_header_is_compact_utf8(self) -> None:
        frame = encode_frame({"type": "chunk", "id": 1, "body": {"delta": "héllo ✓"}})
        self.assertIn('{"delta":"héllo ✓"}'.encode("utf-8"), frame)

    def test_header_refuses_what_json_cannot_carry(self) -> None:
        with self.assertRaises(ValueError):
            encode_frame({"type": "done", "id": 1, "body": float("nan")})
        with self.assertRaises(TypeError):
            encode_frame({"type": "done", "id": 1, "body": object()})

    def test_a_failed_encode_leaves_nothing_behind(self) -> None:
        # The encoder is made once per thread; a failure inside a container
        # must not leave that container marked as being encoded.
        body = {"list": [1, 2]}
        body["list"].append(body)
        with self.assertRaises(ValueError):
            encode_frame({"type": "done", "id": 1, "body": body})
        inner = {"a": [float("nan")]}
        with self.assertRaises(ValueError):
            encode_frame({"type": "done", "id": 2, "body": inner})
        inner["a"] = [1.5]
        self.assertIn(b'{"a":[1.5]}', encode_frame({"type": "done", "id": 3, "body": inner}))

    def test_each_thread_encodes_alike(self) -> None:
        frames = []
        worker = threading.Thread(target=lambda: frames.append(encode_frame({"type": "pong", "seq": 1})))
        worker.start()
        worker.join()
        self.assertEqual(frames, [encode_frame({"type": "pong", "seq": 1})])

    def test_a_frame_longer_than_64_mib_is_refused(self) -> None:
        with self.assertRaises(wire.FrameTooLarge):
            encode_frame({"type": "done", "id": 1, "body": "x" * (64 * MIB)})


class DecodingLimitTests(unittest.TestCase):
    def read_raw(self, data: bytes):
        a, b = pair()
        with a, b:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)
            return FrameReader(b).read()

    def refused(self, data: bytes, fragment: str) -> None:
        with self.assertRaises(FrameError) as caught:
            self.read_raw(data)
        self.assertIn(fragment, str(caught.exception))

    def test_length_below_6(self) -> None:
        self.refused(struct.pack("<II", 5, 2) + b"{}", "frame length 5")

    def test_length_above_64_mib(self) -> None:
        self.refused(struct.pack("<II", 64 * MIB + 1, 2), "frame length 67108865")

    def test_limits_themselves_are_allowed(self) -> None:
        wire.check_prefix(6, 2)
        wire.check_prefix(64 * MIB, 64 * MIB - 4)
        self.assertEqual(self.read_raw(struct.pack("<II", 4 + 12, 12) + b'{"type":"x"}').header, {"type": "x"})

    def test_short_header(self) -> None:
        self.refused(struct.pack("<II", 6, 1) + b"{}", "header_length 1")

    def test_header_longer_than_the_frame(self) -> None:
        self.refused(struct.pack("<II", 8, 5) + b"{}{}", "header_length 5")

    def test_non_object_header(self) -> None:
        self.refused(struct.pack("<II", 6, 2) + b"[]", "not a JSON object")

    def test_header_without_type(self) -> None:
        self.refused(pack({"seq": 1}), "no string `type`")
        self.refused(pack({"type": 1}), "no string `type`")

    def test_header_not_utf8(self) -> None:
        self.refused(struct.pack("<II", 8, 4) + b'"\xff"\x00', "not UTF-8")

    def test_header_not_json(self) -> None:
        self.refused(struct.pack("<II", 7, 3) + b"{x}", "not JSON")
        self.refused(struct.pack("<II", 7, 3) + b"NaN", "not JSON")
        self.refused(struct.pack("<II", 4 + 22, 22) + b'{"type":"x","n":NaN}  ', "not JSON")
        self.refused(struct.pack("<II", 4 + 14, 14) + b'{"type":"x"}{}', "not JSON")

    def test_header_with_whitespace_around_it(self) -> None:
        raw = b' \n{ "type" : "x" }\t '
        self.assertEqual(self.read_raw(struct.pack("<II", 4 + len(raw), len(raw)) + raw).header, {"type": "x"})

    def test_undeclared_payload(self) -> None:
        self.refused(pack({"type": "request", "id": 1}, b"abc"), "does not declare")

    def test_inline_size_mismatch(self) -> None:
        self.refused(pack({"type": "request", "id": 1, "bulk": {"inline": 4}}, b"abc"), "declares 4")

    def test_bad_bulk_member(self) -> None:
        self.refused(pack({"type": "request", "id": 1, "bulk": {"shm": 3}}, b"abc"), "`bulk` member")

    def test_end_of_file(self) -> None:
        with self.assertRaises(EOFError):
            self.read_raw(b"")
        with self.assertRaises(EOFError):
            self.read_raw(bytes.fromhex(PING_HEX)[:10])


class BulkTests(unittest.TestCase):
    def test_inline_below_the_threshold(self) -> None:
        a, b = pair()
        with a, b:
            data = os.urandom(65535)
            send_frame(a, {"type": "done", "id": 1, "body": None}, data)
            raw, fds = raw_receive(b, 8)
            length, header_length = struct.unpack("<II", raw)
            rest, more = raw_receive(b, length - 4)
            self.assertEqual(fds + more, [])
            header = rest[:header_length]
            self.assertEqual(header, b'{"type":"done","id":1,"body":null,"bulk":{"inline":65535}}')
            self.assertEqual(rest[header_length:], data)

    def test_inline_round_trip_is_a_memoryview(self) -> None:
        a, b = pair()
        with a, b:
            send_frame(a, {"type": "request", "id": 3, "body": {}}, b"abc")
            frame = FrameReader(b).read()
            self.assertIsInstance(frame.bulk, memoryview)
            self.assertEqual(bytes(frame.bulk), b"abc")

    def test_empty_bulk_is_not_no_bulk(self) -> None:
        a, b = pair()
        with a, b:
            send_frame(a, {"type": "request", "id": 3, "body": {}}, b"")
            frame = FrameReader(b).read()
            self.assertEqual(frame.header["bulk"], {"inline": 0})
            self.assertEqual(frame.bulk.nbytes, 0)

    def test_threshold_and_above_go_in_a_sealed_memfd(self) -> None:
        a, b = pair()
        with a, b:
            data = os.urandom(65536)
            send_frame(a, {"type": "done", "id": 1, "body": None}, data)
            raw, fds = raw_receive(b, 8)
            self.assertEqual(len(fds), 1, "the descriptor rides with the frame's first byte")
            length, header_length = struct.unpack("<II", raw)
            self.assertEqual(length, 4 + header_length)
            rest, more = raw_receive(b, length - 4)
            self.assertEqual(more, [])
            self.assertEqual(rest, b'{"type":"done","id":1,"body":null,"bulk":{"memfd":65536}}')
            fd = fds[0]
            try:
                self.assertEqual(fcntl.fcntl(fd, fcntl.F_GET_SEALS), SEALS)
                self.assertTrue(os.readlink("/proc/self/fd/{}".format(fd)).startswith("/memfd:"))
                self.assertEqual(os.pread(fd, 65537, 0), data)
            finally:
                os.close(fd)

    def test_64_mib_memfd_round_trip_is_zero_copy(self) -> None:
        a, b = pair()
        with a, b:
            sent = numpy.arange(16 * MIB, dtype=numpy.uint32)  # 64 MiB
            send_frame(a, {"type": "request", "id": 9, "body": {"dtype": "u32"}}, sent)
            frame = FrameReader(b).read()
            self.assertEqual(frame.header["bulk"], {"memfd": 64 * MIB})
            bulk = frame.bulk
            self.assertIsInstance(bulk, memoryview)
            self.assertTrue(bulk.readonly)
            self.assertIsInstance(bulk.obj, mmap.mmap)
            got = numpy.frombuffer(bulk, dtype=numpy.uint32)
            self.assertFalse(got.flags.owndata)
            self.assertFalse(got.flags.writeable)
            address = got.__array_interface__["data"][0]
            names = mapping_names_at(address)
            self.assertEqual(len(names), 1)
            self.assertTrue(names[0].startswith("/memfd:berth-bulk"), names)
            self.assertTrue(numpy.array_equal(got, sent))
            del got, bulk, frame

    def test_non_contiguous_bulk_is_sent_in_order(self) -> None:
        a, b = pair()
        with a, b:
            matrix = numpy.arange(200_000, dtype=numpy.int64).reshape(1000, 200)
            column_major = matrix.T  # not C-contiguous
            send_frame(a, {"type": "done", "id": 1, "body": None}, column_major)
            frame = FrameReader(b).read()
            got = numpy.frombuffer(frame.bulk, dtype=numpy.int64).reshape(200, 1000)
            self.assertTrue(numpy.array_equal(got, column_major))

    def test_frames_glued_around_a_descriptor(self) -> None:
        a, b = pair()
        with a, b:
            big = os.urandom(100_000)
            # Everything is written before the reader runs, so its first
            # recvmsg may take several frames at once.
            send_frame(a, {"type": "ping", "seq": 1})
            send_frame(a, {"type": "request", "id": 1, "body": 1}, big)
            send_frame(a, {"type": "ping", "seq": 2})
            send_frame(a, {"type": "request", "id": 2, "body": 2}, big[::-1])
            send_frame(a, {"type": "request", "id": 3, "body": 3}, big)
            send_frame(a, {"type": "ping", "seq": 3})
            reader = FrameReader(b)
            got = [reader.read() for _ in range(6)]
            self.assertEqual([f.type for f in got], ["ping", "request", "ping", "request", "request", "ping"])
            self.assertEqual(bytes(got[1].bulk), big)
            self.assertEqual(bytes(got[3].bulk), big[::-1])
            self.assertEqual(bytes(got[4].bulk), big)

    def test_memfd_declared_without_a_descriptor(self) -> None:
        a, b = pair()
        with a, b:
            a.sendall(pack({"type": "request", "id": 1, "bulk": {"memfd": 10}}))
            with self.assertRaisesRegex(FrameError, "no descriptor came with it"):
                FrameReader(b).read()

    def test_descriptor_with_a_frame_that_declares_none(self) -> None:
        a, b = pair()
        with a, b:
            fd = sealed_memfd(b"0123456789")
            try:
                a.sendmsg([pack({"type": "ping", "seq": 1})],
                          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            finally:
                os.close(fd)
            a.sendall(pack({"type": "ping", "seq": 2}))
            reader = FrameReader(b)
            with self.assertRaisesRegex(FrameError, "declares no memfd"):
                reader.read()
            reader.close()

    def test_unsealed_memfd_is_refused(self) -> None:
        a, b = pair()
        with a, b:
            fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
            os.write(fd, b"0123456789")
            try:
                a.sendmsg([pack({"type": "request", "id": 1, "bulk": {"memfd": 10}})],
                          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            finally:
                os.close(fd)
            with self.assertRaisesRegex(FrameError, "not sealed"):
                FrameReader(b).read()

    def test_memfd_smaller_than_declared_is_refused(self) -> None:
        a, b = pair()
        with a, b:
            fd = sealed_memfd(b"0123456789")
            try:
                a.sendmsg([pack({"type": "request", "id": 1, "bulk": {"memfd": 11}})],
                          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            finally:
                os.close(fd)
            with self.assertRaisesRegex(FrameError, "fewer than the 11 declared"):
                FrameReader(b).read()

    def test_large_inline_payload_is_accepted(self) -> None:
        # Receivers accept either form at any size.
        a, b = pair()
        with a, b:
            data = os.urandom(8 * MIB)
            frame_bytes = pack({"type": "request", "id": 1, "body": {}, "bulk": {"inline": len(data)}}, data)
            writer = threading.Thread(target=a.sendall, args=(frame_bytes,))
            writer.start()
            frame = FrameReader(b, buffer_size=4096).read()
            writer.join()
            self.assertEqual(bytes(frame.bulk), data)


if __name__ == "__main__":
    unittest.main()

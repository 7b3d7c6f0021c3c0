"""Cuts a Llama-architecture GGUF file down to its first N blocks: the same
tokenizer, chat template, embeddings and tensor types, fewer layers. What
the GPU script carries to a machine with no network (`prepare.sh`): a
2-block SmolLM2 is ~25 MB where the whole file is 98 MB, and runs every
kernel the whole one does.

    python3 tests/gpu/cut_gguf.py IN.gguf OUT.gguf --blocks 2

GGUF v2/v3 (little-endian), standard library only.
"""

from __future__ import annotations

import argparse
import struct
import sys
from typing import BinaryIO, List, Tuple

# GGUF value types: the size of each fixed-size one.
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4


def read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise SystemExit("cut_gguf: the file ends early")
    return data


def u32(f: BinaryIO) -> int:
    return struct.unpack("<I", read(f, 4))[0]


def u64(f: BinaryIO) -> int:
    return struct.unpack("<Q", read(f, 8))[0]


def string(f: BinaryIO) -> bytes:
    n = u64(f)
    return read(f, n)


def value_bytes(f: BinaryIO, kind: int) -> bytes:
    """A value as its raw bytes (type prefix not included)."""
    if kind in FIXED:
        return read(f, FIXED[kind])
    if kind == STRING:
        s = string(f)
        return struct.pack("<Q", len(s)) + s
    if kind == ARRAY:
        inner, count = u32(f), u64(f)
        out = [struct.pack("<IQ", inner, count)]
        for _ in range(count):
            out.append(value_bytes(f, inner))
        return b"".join(out)
    raise SystemExit("cut_gguf: unknown value type {}".format(kind))


def cut(src: str, dst: str, blocks: int) -> Tuple[int, int]:
    with open(src, "rb") as f:
        if read(f, 4) != b"GGUF":
            raise SystemExit("cut_gguf: {} is not a GGUF file".format(src))
        version = u32(f)
        if version not in (2, 3):
            raise SystemExit("cut_gguf: GGUF version {} is not 2 or 3".format(version))
        n_tensors, n_kv = u64(f), u64(f)
        kvs: List[Tuple[bytes, int, bytes]] = []
        alignment = 32
        had_blocks = None
        for _ in range(n_kv):
            key, kind = string(f), u32(f)
            raw = value_bytes(f, kind)
            if key == b"general.alignment" and kind == UINT32:
                alignment = struct.unpack("<I", raw)[0]
            if key.endswith(b".block_count") and kind == UINT32:
                had_blocks = struct.unpack("<I", raw)[0]
                raw = struct.pack("<I", min(blocks, had_blocks))
            kvs.append((key, kind, raw))
        if had_blocks is None:
            raise SystemExit("cut_gguf: no block_count in {}".format(src))
        infos = []
        for _ in range(n_tensors):
            name = string(f)
            dims = [u64(f) for _ in range(u32(f))]
            kind, offset = u32(f), u64(f)
            infos.append((name, dims, kind, offset))
        data_start = (f.tell() + alignment - 1) // alignment * alignment
        offsets = sorted({i[3] for i in infos})
        f.seek(0, 2)
        end = f.tell() - data_start

        def size_of(offset: int) -> int:
            later = [o for o in offsets if o > offset]
            return (later[0] if later else end) - offset

        def kept(name: bytes) -> bool:
            if not name.startswith(b"blk."):
                return True
            return int(name.split(b".")[1]) < blocks

        chosen = [i for i in infos if kept(i[0])]
        out_infos, chunks, at = [], [], 0
        for name, dims, kind, offset in chosen:
            f.seek(data_start + offset)
            chunk = read(f, size_of(offset))
            out_infos.append((name, dims, kind, at))
            chunks.append(chunk)
            at += (len(chunk) + alignment - 1) // alignment * alignment
    with open(dst, "wb") as o:
        o.write(b"GGUF" + struct.pack("<IQQ", version, len(out_infos), len(kvs)))
        for key, kind, raw in kvs:
            o.write(struct.pack("<Q", len(key)) + key + struct.pack("<I", kind) + raw)
        for name, dims, kind, offset in out_infos:
            o.write(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims)))
            o.write(b"".join(struct.pack("<Q", d) for d in dims))
            o.write(struct.pack("<IQ", kind, offset))
        o.write(b"\0" * (-o.tell() % alignment))
        for chunk in chunks:
            o.write(chunk)
            o.write(b"\0" * (-len(chunk) % alignment))
    return had_blocks, min(blocks, had_blocks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--blocks", type=int, default=2)
    args = parser.parse_args()
    was, now = cut(args.src, args.dst, args.blocks)
    print("{}: {} of {} blocks".format(args.dst, now, was))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The bytes on the wire: one frame = magic, header length, JSON header, raw tensor bytes.

    b"JDP1" | u32 little-endian header length | UTF-8 JSON header | payload

The header names the tensor piece, its dtype and full shape, the byte offset of this chunk
inside the piece, the payload size, and who sent it (worker, step, parameter version,
server epoch). The payload is the tensor's raw little-endian bytes: no pickle anywhere, so
a peer can at worst send wrong numbers, never code. A piece larger than one frame travels as
consecutive chunks in a gRPC stream, each below the configured message limit. Whole pieces
that fit in one frame together go as one frame, a run (`frame_parts`): the header names the
first piece and how many follow it (`count`), its shape is their elements together.

A message carries one frame, or (transfers smaller than one frame's budget) several frames
back to back, so a small push or pull is one unary call.

Everything a peer sends is checked before it touches state: `split` rejects a bad magic,
a truncated or oversized header, non-JSON, a payload whose size disagrees with the header;
`Assembler` rejects unknown pieces, wrong dtypes or shapes, chunks out of order or past the
end, fields that change mid-stream, and (at `finish`) pieces left incomplete.
"""

from __future__ import annotations

import itertools
import json
import re
import struct

import numpy as np

MAGIC = b"JDP1"
_PREFIX = struct.Struct("<4sI")
MAX_HEADER_BYTES = 64 * 1024
# What a peer's JSON may nest: ours nests 2 deep (a header's shape, metadata pairs). json's
# parser recurses per level, so 20,000 levels raised RecursionError (a traceback per call).
MAX_JSON_DEPTH = 8
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_OPEN, _CLOSE = np.zeros(256, np.int8), np.zeros(256, np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_CLOSE[[ord("]"), ord("}")]] = 1
# 1-2 MiB frames measured fastest for gRPC streaming on loopback (shared/notes).
DEFAULT_FRAME_BYTES = 1 << 20
FRAME_OVERHEAD = 4096  # room left for the prefix and header under the message limit


class WireError(ValueError):
    """A malformed message; the text says what was wrong."""


def loads(raw, what: str = "header", max_bytes: int = MAX_HEADER_BYTES):
    """JSON from a peer, its size and nesting checked before json.loads sees it (WireError).
    Counting brackets is enough for every message we send; only a peer's input with more
    than MAX_JSON_DEPTH brackets is scanned, outside strings, at C speed."""
    raw = bytes(raw)
    if len(raw) > max_bytes:
        raise WireError(f"{what} of {len(raw)} bytes exceeds {max_bytes}")
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        codes = np.frombuffer(_STRING.sub(b'""', raw), np.uint8)
        depth = np.cumsum(_OPEN[codes] - _CLOSE[codes], dtype=np.int64)
        if depth.size and int(depth.max()) > MAX_JSON_DEPTH:
            raise WireError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(raw.decode())
    except ValueError as e:
        # ValueError covers UnicodeDecodeError, JSONDecodeError and integers past Python's
        # digit limit (int_max_str_digits), which json raises as ValueError
        raise WireError(f"{what} is not JSON: {str(e)[:120]}") from None


def encode(header: dict, payload=b"") -> bytes:
    view = memoryview(payload).cast("B") if not isinstance(payload, bytes) else payload
    header = dict(header, nbytes=len(view))
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((_PREFIX.pack(MAGIC, len(head)), head, view))


def split(message: bytes):
    """(header, payload) of each frame in a message: one frame, or several back to back
    (small transfers travel as one message of many frames)."""
    if not isinstance(message, (bytes, bytearray, memoryview)):
        raise WireError("message is not bytes")
    if not message:
        raise WireError("empty message")
    view = memoryview(message)
    pos = 0
    while pos < len(message):
        if len(message) - pos < _PREFIX.size:
            raise WireError(f"frame of {len(message) - pos} bytes is shorter than its prefix")
        magic, head_len = _PREFIX.unpack_from(message, pos)
        if magic != MAGIC:
            raise WireError("bad magic: not a jaxdist ps frame")
        start = pos + _PREFIX.size
        if head_len > MAX_HEADER_BYTES or start + head_len > len(message):
            raise WireError(f"header length {head_len} exceeds the frame")
        header = loads(view[start:start + head_len])
        if not isinstance(header, dict):
            raise WireError("header is not an object")
        nbytes = get_int(header, "nbytes")
        end = start + head_len + nbytes
        if end > len(message):
            raise WireError(f"payload is {len(message) - start - head_len} bytes, header says "
                            f"{nbytes}")
        yield header, view[start + head_len:end]
        pos = end


def decode(frame: bytes) -> tuple[dict, memoryview]:
    """The one frame of a message (requests and control calls carry exactly one)."""
    frames = list(split(frame))
    if len(frames) != 1:
        raise WireError(f"expected one frame, got {len(frames)}")
    return frames[0]


def get_int(header: dict, key: str, lo: int = 0, hi: int | None = None) -> int:
    value = header.get(key)
    if type(value) is not int:  # bool is an int subclass: reject it too
        raise WireError(f"header field {key!r} must be an integer")
    if value < lo or (hi is not None and value > hi):
        raise WireError(f"header field {key!r}={value} is outside [{lo}, {hi}]")
    return value


def get_str(header: dict, key: str) -> str:
    value = header.get(key)
    if not isinstance(value, str):
        raise WireError(f"header field {key!r} must be a string")
    return value


def frame_bytes(max_message_bytes: int) -> int:
    """Payload bytes per frame: 1 MiB, or less when the message limit is smaller."""
    return max(4, min(DEFAULT_FRAME_BYTES, max_message_bytes - FRAME_OVERHEAD) // 4 * 4)


def frame_parts(op: str, pieces, source: np.ndarray, chunk: int, meta: dict,
                source_offset=None):
    """(prefix + header bytes, payload views) of each frame carrying `pieces`
    (ps.shardmap.Piece) read from the flat float32 `source`; `source_offset(piece)` is where
    the piece starts in `source` (global offset by default). The payload views are of
    `source`: copied once, when the parts are joined into the message (or by the socket).

    Consecutive whole pieces that fit in one frame together travel as one frame, a run:
    its header names the first piece and `count` (shape: the run's elements), and the
    payload is the pieces back to back. A header costs more than a small piece's bytes
    (JSON out and in, checks: ~15 us a frame each side, against 4 KB copied in ~1 us); a
    piece larger than the frame goes alone, in chunks."""
    where = source_offset or (lambda p: p.offset)

    def frame(first, count: int, elements: int, start: int, views: list):
        header = {"op": op, "name": first.name, "dtype": "float32", "shape": [elements],
                  "offset": start, **meta, "nbytes": sum(len(v) for v in views)}
        if count > 1:
            header["count"] = count
        head = json.dumps(header, separators=(",", ":")).encode()
        return _PREFIX.pack(MAGIC, len(head)) + head, views

    run, run_bytes = [], 0
    for piece in pieces:
        data = memoryview(source[where(piece):where(piece) + piece.length]).cast("B")
        if run and run_bytes + len(data) > chunk:
            yield frame(run[0][0], len(run), run_bytes // 4, 0, [v for _, v in run])
            run, run_bytes = [], 0
        if len(data) <= chunk:
            run.append((piece, data))
            run_bytes += len(data)
            continue
        for start in range(0, len(data), chunk):
            view = data[start:start + chunk]
            yield frame(piece, 1, piece.length, start, [view])
    if run:
        yield frame(run[0][0], len(run), run_bytes // 4, 0, [v for _, v in run])


def frames(op: str, pieces, source: np.ndarray, chunk: int, meta: dict, source_offset=None):
    """One message per frame (a stream)."""
    for head, views in frame_parts(op, pieces, source, chunk, meta, source_offset):
        yield b"".join((head, *views))


def bundle_parts(op: str, pieces, source: np.ndarray, chunk: int, meta: dict,
                 source_offset=None, first: bytes = b"") -> list:
    """The parts of `bundle`'s message, not joined: a socket sends them as they are."""
    parts = [first] if first else []
    for head, views in frame_parts(op, pieces, source, chunk, meta, source_offset):
        parts += (head, *views)
    return parts


def bundle(op: str, pieces, source: np.ndarray, chunk: int, meta: dict,
           source_offset=None, first: bytes = b"") -> bytes:
    """Every frame in one message (a small transfer as one unary call), one copy;
    `first` (an encoded frame) leads the message."""
    return b"".join(bundle_parts(op, pieces, source, chunk, meta, source_offset, first))


class Assembler:
    """Collects chunked pieces into a flat float32 destination, validating each frame.

    `layout` maps piece name -> (length in elements, offset in `dest`). `fixed` lists
    header fields that must be identical across the frames of one stream (worker, step...).
    Nothing is written to `dest` that failed validation, but a stream rejected midway
    leaves `dest` partly written: give it a scratch buffer, never live state.
    """

    def __init__(self, op: str, layout: dict, dest: np.ndarray, fixed: tuple = ()):
        self.op, self.layout, self.dest, self.fixed = op, layout, dest, fixed
        self.received = dict.fromkeys(layout, 0)
        self.meta: dict | None = None
        self.bytes = 0

    def add(self, message: bytes) -> None:
        """Take every frame of one message."""
        for header, payload in split(message):
            self._frame(header, payload)
        self.bytes += len(message)

    def _frame(self, header: dict, payload: memoryview) -> None:
        if header.get("op") != self.op:
            raise WireError(f"expected op {self.op!r}, got {str(header.get('op'))[:20]!r}")
        name = get_str(header, "name")
        if name not in self.layout:
            raise WireError(f"unknown tensor {name[:80]!r}")
        if header.get("dtype") != "float32":
            raise WireError(f"{name}: dtype {str(header.get('dtype'))[:20]!r}, expected float32")
        count = get_int(header, "count", 1, len(self.layout)) if "count" in header else 1
        run = self._run(name, count)
        length = sum(self.layout[n][0] for n in run)
        if header.get("shape") != [length]:
            raise WireError(f"{name}: shape {str(header.get('shape'))[:40]}, expected [{length}]")
        offset = get_int(header, "offset")
        if offset != self.received[name] or (count > 1 and offset):
            raise WireError(f"{name}: chunk at byte {offset}, expected {self.received[name]} "
                            f"(chunks must arrive in order, without gaps or overlaps)")
        if len(payload) % 4 or offset + len(payload) > length * 4 or (
                count > 1 and len(payload) != length * 4):
            raise WireError(f"{name}: chunk of {len(payload)} bytes at {offset} does not fit "
                            f"the piece's {length * 4} bytes")
        meta = {key: get_int(header, key) for key in self.fixed}
        if self.meta is None:
            self.meta = meta
        elif meta != self.meta:
            raise WireError(f"{name}: fields {meta} differ from the stream's {self.meta}")
        values = np.frombuffer(payload, dtype="<f4")
        if count == 1:
            start = self.layout[name][1] + offset // 4
            self.dest[start:start + len(values)] = values
            self.received[name] += len(payload)
            return
        pos = 0
        for n in run:
            size, base = self.layout[n]
            self.dest[base:base + size] = values[pos:pos + size]
            self.received[n] = size * 4
            pos += size

    def _run(self, name: str, count: int) -> list:
        """The `count` pieces from `name` on, in the layout's order (a run frame's); each
        must be whole in it, so none may have arrived yet."""
        if count == 1:
            return [name]
        names = iter(self.layout)
        next(n for n in names if n == name)  # the layout holds it: checked by the caller
        run = [name, *itertools.islice(names, count - 1)]
        if len(run) != count:
            raise WireError(f"{name}: a run of {count} pieces goes past the last piece")
        taken = [n for n in run if self.received[n]]
        if taken:
            raise WireError(f"{taken[0]}: chunk at byte 0, expected {self.received[taken[0]]} "
                            f"(chunks must arrive in order, without gaps or overlaps)")
        return run

    def finish(self) -> dict:
        missing = [n for n, got in self.received.items() if got != self.layout[n][0] * 4]
        if missing:
            n = missing[0]
            raise WireError(f"truncated: {len(missing)} piece(s) incomplete, e.g. {n} got "
                            f"{self.received[n]} of {self.layout[n][0] * 4} bytes")
        if self.meta is None:
            self.meta = {}
        return self.meta


def split_first(message: bytes) -> tuple[dict, memoryview]:
    """(header of the first frame, a view of the rest of the message)."""
    header, payload = next(split(message))
    head_len = _PREFIX.unpack_from(message, 0)[1]
    return header, memoryview(message)[_PREFIX.size + head_len + len(payload):]

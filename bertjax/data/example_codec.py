"""Serialized `tf.train.Example`s and TFRecord framing for many rows at once, in NumPy.

`encode_examples` gives, for rows of fixed-size int64 / float32 features, the bytes of
`records.example_bytes` (= `tf.train.Example.SerializeToString(deterministic=True)`) of every row:
features sorted by name, each a map entry `0a len (0a len name 12 len (1a|12 len (0a len payload)))`,
int64 values as packed varints, floats as packed little-endian float32s. Every part of a record
(tags, varint lengths, payload bytes) is a column block of one [rows, bytes] uint8 matrix with a mask
of the bytes that are used; the masked bytes, row by row, are the records one after another.
`frame_records` adds TFRecord's framing (length, masked CRC-32C of it, data, masked CRC-32C).
"""

from __future__ import annotations

import struct

import numpy as np

try:
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - RecordWriter falls back to TensorFlow's writer
    _crc32c = None

_UINT64 = struct.Struct("<Q")
_UINT32 = struct.Struct("<I")


def _varint_parts(values: np.ndarray):
    """Varints of non-negative ints [rows, n]: (bytes [rows, n * m], mask, byte count [rows])."""
    rows, n = values.shape
    top = int(values.max()) if values.size else 0
    if top < 0x80:  # one byte each
        return values.astype(np.uint8), np.broadcast_to(True, (rows, n)), np.full(rows, n, np.int64)
    if top < 1 << 16:  # token ids: 1 to 3 bytes, in 16-bit arithmetic
        v = values.astype(np.uint16)
        two, three = v >= 1 << 7, v >= 1 << 14
        data = np.empty((rows, n, 3), np.uint8)
        data[..., 0] = (v & 0x7F).astype(np.uint8) | (two.view(np.uint8) << 7)
        data[..., 1] = ((v >> 7) & 0x7F).astype(np.uint8) | (three.view(np.uint8) << 7)
        data[..., 2] = (v >> 14).astype(np.uint8)
        mask = np.empty((rows, n, 3), bool)
        mask[..., 0], mask[..., 1], mask[..., 2] = True, two, three
        count = n + two.sum(axis=1) + three.sum(axis=1)
        return data.reshape(rows, -1), mask.reshape(rows, -1), count
    max_bytes = (top.bit_length() + 6) // 7
    v = values.astype(np.uint32 if top < 1 << 32 else np.uint64)
    nbytes = np.ones(v.shape, np.uint8)
    for k in range(1, max_bytes):
        nbytes += v >= 1 << (7 * k)
    out = np.empty((rows, n, max_bytes), np.uint8)
    for k in range(max_bytes):
        out[..., k] = ((v >> (7 * k)) & 0x7F) | ((nbytes > k + 1).astype(v.dtype) << 7)
    mask = np.arange(max_bytes, dtype=np.uint8) < nbytes[..., None]
    count = nbytes.sum(axis=1, dtype=np.int64)
    return out.reshape(rows, -1), mask.reshape(rows, -1), count


def _varint_size(n: np.ndarray) -> np.ndarray:
    size = np.ones(n.shape, np.int64)
    top = int(n.max()) if n.size else 0
    for k in range(1, 10):
        if top < 1 << (7 * k):
            break
        size += n >= (1 << (7 * k))
    return size


def encode_examples(features: list[tuple[str, np.ndarray]]) -> tuple[bytes, np.ndarray]:
    """Serialized Examples of rows, one after another: (bytes, [rows] record lengths).

    `features` are (name, values [rows, n]) pairs: int values (>= 0) become an int64_list,
    float32 values a float_list.
    """
    features = sorted(features, key=lambda f: f[0])
    rows = len(features[0][1])
    payloads, heads = [], []  # heads: per feature the [rows] sizes e, f, g, p (see below)
    total = np.zeros(rows, np.int64)
    for name, values in features:
        if not values.shape[1]:
            raise ValueError(f"feature {name!r} has no values")
        if values.dtype == np.float32:
            data = values.astype("<f4").view(np.uint8).reshape(rows, -1)
            payloads.append((b"\x12", data, np.broadcast_to(True, data.shape)))
            p = np.full(rows, data.shape[1], np.int64)
        else:
            data, mask, p = _varint_parts(values)
            payloads.append((b"\x1a", data, mask))
        g = 1 + _varint_size(p) + p  # the Int64List / FloatList
        f = 1 + _varint_size(g) + g  # the Feature
        e = 3 + len(name.encode("utf-8")) + _varint_size(f) + f  # the map entry (name < 128 B)
        heads += (e, f, g, p)
        total += 1 + _varint_size(e) + e
    head_data, head_mask, _ = _varint_parts(np.stack([total, *heads], axis=1))
    width = head_data.shape[1] // (1 + len(heads))
    data, mask = [], []

    def const(raw: bytes) -> None:
        data.append(np.broadcast_to(np.frombuffer(raw, np.uint8), (rows, len(raw))))
        mask.append(np.broadcast_to(True, (rows, len(raw))))

    def head(h: int) -> None:
        data.append(head_data[:, h * width : (h + 1) * width])
        mask.append(head_mask[:, h * width : (h + 1) * width])

    const(b"\x0a")
    head(0)
    for i, ((name, _), (tag, payload, payload_mask)) in enumerate(zip(features, payloads)):
        key = name.encode("utf-8")
        const(b"\x0a")
        head(1 + 4 * i)  # e
        const(b"\x0a" + bytes([len(key)]) + key + b"\x12")
        head(2 + 4 * i)  # f
        const(tag)
        head(3 + 4 * i)  # g
        const(b"\x0a")
        head(4 + 4 * i)  # p
        data.append(payload)
        mask.append(payload_mask)
    data, mask = np.concatenate(data, axis=1), np.concatenate(mask, axis=1)
    return data[mask].tobytes(), 1 + _varint_size(total) + total


def _masked_crc(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


_HEADERS: dict[int, bytes] = {}


def frame_records(blob: bytes, lengths: list[int]) -> list[bytes]:
    """TFRecord framing of records laid one after another in `blob`: a list of byte strings whose
    concatenation is the framed records (as `records.RecordWriter` writes them)."""
    view = memoryview(blob)
    out = []
    start = 0
    crc, pack, headers = _crc32c.crc32c, _UINT32.pack, _HEADERS
    for n in lengths:
        head = headers.get(n)
        if head is None:
            raw = _UINT64.pack(n)
            head = headers[n] = raw + pack(_masked_crc(crc(raw)))
        record = view[start : start + n]
        out += (head, record, pack(_masked_crc(crc(record))))
        start += n
    return out

"""TFRecord files of `tf.train.Example`s written without TensorFlow, byte for byte as TensorFlow does.

`example_bytes` builds the serialized Example directly (the bytes of
`tf.train.Example.SerializeToString(deterministic=True)`: map entries sorted by key, packed repeated
int64 varints and little-endian float32s); `RecordWriter` frames records as TFRecord (length, masked
CRC-32C of the length, data, masked CRC-32C of the data) with the `crc32c` package, and falls back
to `tf.io.TFRecordWriter` when that package is missing. Tests compare both with TensorFlow.
`read_records` reads them back through `bertjax.fs` (the input pipeline's reader for `gs://`,
which TensorFlow's own GCS client cannot reach behind an emulator).
"""

from __future__ import annotations

import io
import struct
from collections.abc import Mapping, Sequence

import bertjax.fs as fs

try:
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - fall back to TensorFlow's writer
    _crc32c = None

HAS_CRC32C = _crc32c is not None  # else records are framed by TensorFlow's writer
_VARINT_TABLE_SIZE = 1 << 16
_UINT64 = struct.Struct("<Q")
_UINT32 = struct.Struct("<I")
_READ_BLOCK = 8 << 20  # bytes per read of a record file in a bucket


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of an int64 (negative values as 10-byte two's complement)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class _VarintTable(dict):
    """Varints of 0 .. _VARINT_TABLE_SIZE - 1, each made on first use (imports stay cheap)."""

    def __missing__(self, value: int) -> bytes:
        out = self[value] = varint(value)
        return out


_VARINTS = _VarintTable()
_KEYS: dict[str, bytes] = {}  # feature name -> its serialized map-entry key field


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: tag byte(s) (field number << 3 | 2), varint length, payload."""
    n = len(payload)
    return tag + (_VARINTS[n] if n < _VARINT_TABLE_SIZE else varint(n)) + payload


def int64_feature(values: Sequence[int]) -> bytes:
    """Serialized `tf.train.Feature(int64_list=...)` of int64 values."""
    if not len(values):
        return b"\x1a\x00"
    if min(values) < 0 or max(values) >= _VARINT_TABLE_SIZE:
        packed = b"".join(map(varint, map(int, values)))
    else:
        packed = b"".join([_VARINTS[v] for v in values])
    return field(b"\x1a", field(b"\x0a", packed))


def float_feature(values: Sequence[float]) -> bytes:
    """Serialized `tf.train.Feature(float_list=...)` (float32 values)."""
    if not len(values):
        return b"\x12\x00"
    return field(b"\x12", field(b"\x0a", struct.pack(f"<{len(values)}f", *values)))


def example_bytes(features: Mapping[str, bytes]) -> bytes:
    """Serialized `tf.train.Example` of {name: serialized Feature}, keys sorted (deterministic)."""
    entries = []
    for key in sorted(features):
        head = _KEYS.get(key)
        if head is None:
            head = _KEYS[key] = field(b"\x0a", key.encode("utf-8"))
        entries.append(field(b"\x0a", head + field(b"\x12", features[key])))
    return field(b"\x0a", b"".join(entries))


def _masked_crc(data: bytes) -> bytes:
    crc = _crc32c.crc32c(data)
    return _UINT32.pack((((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def frame(record: bytes) -> bytes:
    """One TFRecord: length, masked CRC-32C of the length, the record, masked CRC-32C of it."""
    length = _UINT64.pack(len(record))
    return b"".join((length, _masked_crc(length), record, _masked_crc(record)))


def read_records(path: str | bytes):
    """Yields the records of a TFRecord file (uncompressed), local or remote, checking each CRC:
    a file cut short or corrupted is a one-line ValueError naming it."""
    path = path.decode() if isinstance(path, bytes) else str(path)
    with fs.open_file(path, "rb") as opened:
        # Records are read 12, n and 4 bytes at a time: from a bucket, each small read of the
        # client is a trip through its event loop (2000 records of 400 B: 14 s from the test
        # emulator). Whole blocks are read instead and the records cut from memory.
        f = io.BufferedReader(opened, _READ_BLOCK) if fs.is_gcs(path) else opened
        index = 0
        while header := f.read(12):
            if len(header) < 12 or _masked_crc(header[:8]) != header[8:]:
                raise ValueError(f"{path}: record {index} has a corrupted or cut length")
            (length,) = _UINT64.unpack(header[:8])
            data, crc = f.read(length), f.read(4)
            if len(data) < length or _masked_crc(data) != crc:
                raise ValueError(f"{path}: record {index} is corrupted or cut short")
            yield data
            index += 1


class RecordWriter:
    """Writes TFRecord files (uncompressed), local or remote; the same bytes as tf.io.TFRecordWriter."""

    def __init__(self, path: str):
        if _crc32c is None:  # pragma: no cover
            import tensorflow as tf

            self._tf_writer, self._file = tf.io.TFRecordWriter(path), None
            return
        self._tf_writer, self._file = None, fs.open_file(path, "wb")

    def write(self, record: bytes) -> None:
        if self._tf_writer is not None:  # pragma: no cover
            self._tf_writer.write(record)
            return
        self._file.write(frame(record))

    def write_framed(self, data: bytes) -> None:
        """Records already framed (`example_codec.frame_records`); needs the crc32c package."""
        self._file.write(data)

    def close(self) -> None:
        if self._tf_writer is not None:  # pragma: no cover
            self._tf_writer.close()
        else:
            self._file.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""TensorBoard event files without TensorFlow: the scalars a run logs, in the file format TensorBoard
reads (a TFRecord file of ``Event`` protos, the first one naming the format version).

``tf.summary`` needs TensorFlow, whose import costs a fine-tuning command about 7 CPU-seconds
(fine-tuning reads no tf.data) and which the accelerator machines may not have. The ``Event`` and
``Summary`` bytes are built here as ``records`` builds its ``Example`` bytes: the serialization of
TensorBoard's own protos, field by field (tests compare them with TensorBoard's ``event_pb2`` and
read the files back through TensorBoard's loader beside ``tf.summary``'s).
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time

from bertjax.data.records import field, frame, varint

FILE_VERSION = "brain.Event:2"  # the first event of every file, as TensorFlow writes it
_FILE_COUNTER = itertools.count()  # two writers of one process in one second: two files


def event_bytes(
    wall_time: float,
    step: int = 0,
    scalars: dict[str, float] | None = None,
    file_version: str | None = None,
) -> bytes:
    """Serialized ``tensorboard.Event``: ``wall_time`` (field 1, double), ``step`` (2, int64),
    ``file_version`` (3) or a ``summary`` (5) of ``simple_value`` scalars (Value: tag 1, float 2).
    Fields at their default value are left out, as protobuf's own serializer does."""
    out = [b"\x09" + struct.pack("<d", wall_time)]
    if step:
        out.append(b"\x10" + varint(step))
    if file_version is not None:
        out.append(field(b"\x1a", file_version.encode("utf-8")))
    if scalars:
        values = (
            field(b"\x0a", field(b"\x0a", tag.encode("utf-8")) + b"\x15" + struct.pack("<f", v))
            for tag, v in scalars.items()
        )
        out.append(field(b"\x2a", b"".join(values)))
    return b"".join(out)


class EventFileWriter:
    """Appends scalar events to a new event file in ``directory`` (a local folder), named as
    TensorFlow names its own (``events.out.tfevents.TIME.HOST.PID.N.v2``)."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
        self.path = os.path.join(directory, f"{name}.{next(_FILE_COUNTER)}.v2")
        self._file = open(self.path, "ab")  # noqa: SIM115  (closed by close())
        self._file.write(frame(event_bytes(now, file_version=FILE_VERSION)))
        self._file.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One event at ``step`` holding every value (tag -> float), written through to disk."""
        self._file.write(frame(event_bytes(time.time(), step, values)))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

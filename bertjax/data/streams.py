"""Topology-independent input: the data is cut into a fixed number of streams, hosts own streams.

A stream is one ``PretrainingData`` reading every ``num_streams``-th shard (stream ``s`` reads shards
``s, s + N, ...``) with a per-stream batch of ``global_batch / N``. Host ``p`` of ``P`` owns the
``N / P`` consecutive streams ``p * N / P, ...`` and concatenates their batches in stream order, so
the global batch (hosts' rows in process order) is streams 0..N-1 in that order for any number of
hosts that divides ``N``: the same examples in the same rows, hence the same dropout masks and the
same losses, and a checkpointed position (batches consumed per stream) restores exactly on another
host count. ``data.streams`` defaults to 8 (1, 2, 4 or 8 hosts); a host count that does not divide
it is a one-line error naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from bertjax.data.pipeline import PretrainingData


class StreamedData:
    """The host's share of ``num_streams`` streams, with the iterator/state/restore interface."""

    def __init__(
        self,
        data_dir: str,
        split: str,
        global_batch_size: int,
        *,
        num_streams: int,
        seed: int,
        process_index: int,
        process_count: int,
        **kwargs: Any,
    ):
        if num_streams % process_count:
            raise ValueError(
                f"config key data.streams={num_streams} is not a multiple of the "
                f"{process_count} processes: set --config.data.streams to a multiple of "
                f"{process_count} (the same value on every resume keeps the data order)"
            )
        if global_batch_size % num_streams:
            raise ValueError(
                f"global batch {global_batch_size} is not divisible by data.streams={num_streams}"
            )
        self.num_streams = num_streams
        per_host = num_streams // process_count
        self.owned = list(range(process_index * per_host, (process_index + 1) * per_host))
        self.streams = [
            PretrainingData(
                data_dir,
                split,
                global_batch_size // num_streams,
                seed=seed,
                process_index=s,
                process_count=num_streams,
                **kwargs,
            )
            for s in self.owned
        ]

    def __iter__(self) -> StreamedData:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batches = [next(stream) for stream in self.streams]
        return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}

    def state(self) -> dict:
        """Every stream is at the same position, so one stream's state plus N is the whole state."""
        return {"num_streams": self.num_streams, "stream": self.streams[0].state()}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Exact when ``num_streams`` is unchanged (any host count); else remapped per stream."""
        if "stream" not in state:
            raise ValueError("data iterator state: missing key 'stream' (saved by another reader?)")
        for stream in self.streams:
            stream.restore(
                {**state["stream"], "process_count": self.num_streams}
                if state.get("num_streams") == self.num_streams
                else state["stream"]
            )

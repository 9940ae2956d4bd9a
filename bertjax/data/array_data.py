"""In-memory NumPy features as batches with an exact, resumable position (fine-tuning data).

Same iterator/state/restore interface as ``bertjax.data.pipeline.PretrainingData``.
"""

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


def check_state(state: Mapping[str, Any], required: tuple[str, ...], same: Mapping[str, Any]):
    """One-line errors for a checkpointed iterator state that lacks keys or does not match."""
    for key in required:
        if key not in state:
            raise ValueError(f"data iterator state: missing key {key!r}")
    for key, ours in same.items():
        if key in state and state[key] != ours:
            raise ValueError(
                f"data iterator state: {key}={state[key]!r} but this iterator has {ours!r}"
            )


class ArrayData:
    """Batches from in-memory NumPy features [num_examples, ...] with an exact, resumable position.

    Every host holds all features and takes its slice of each GLOBAL batch of
    per_host_batch_size * process_count examples, so the global batches (and the position, counted
    in global examples) are independent of the host count: `restore` is exact even when
    process_count or the per-host batch size changed. Training (`repeat=True`) reads an endless
    stream of epochs, each a permutation seeded by (seed, epoch) when `shuffle`; batches may span
    epoch boundaries; `arrange` (a function of the epoch's permutation returning another) reorders
    each epoch, e.g. so that no batch holds the same text twice. `repeat=False` is a single pass in which the last global batch is padded with
    copies of example 0. Every batch carries a float32 `mask` [b]: 1 for real examples, 0 for
    padding, so an evaluation weighted by `mask` sees every example exactly once.
    """

    def __init__(
        self,
        features: Mapping[str, np.ndarray],
        per_host_batch_size: int,
        *,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        shuffle: bool = True,
        repeat: bool = True,
        arrange: Callable[[np.ndarray], np.ndarray] | None = None,
    ):
        if not features:
            raise ValueError("ArrayData: no features")
        if "mask" in features:
            raise ValueError("ArrayData: feature name 'mask' is reserved for the padding mask")
        self._features = {k: np.asarray(v) for k, v in features.items()}
        sizes = {k: (v.shape[0] if v.ndim else None) for k, v in self._features.items()}
        self._num = next(iter(sizes.values()))
        for key, size in sizes.items():
            if size is None or size != self._num:
                raise ValueError(
                    f"ArrayData: feature {key!r} has {size} examples, expected {self._num}"
                )
        if not self._num:
            raise ValueError("ArrayData: features hold 0 examples")
        if not 0 <= process_index < process_count or per_host_batch_size <= 0:
            raise ValueError(
                f"ArrayData: bad process_index {process_index} / process_count {process_count} "
                f"/ per_host_batch_size {per_host_batch_size}"
            )
        self._per_host, self._seed = per_host_batch_size, seed
        self._index, self._count = process_index, process_count
        self._shuffle, self._repeat, self._arrange = shuffle, repeat, arrange
        self._examples_consumed = 0  # global stream position
        self._batches_consumed = 0
        self._perm_cache: dict[int, np.ndarray] = {}

    @property
    def num_examples(self) -> int:
        """Examples in one epoch."""
        return self._num

    def num_batches(self) -> int | None:
        """Batches in the single pass (`repeat=False`); None when the stream is endless."""
        if self._repeat:
            return None
        return math.ceil(self._num / (self._per_host * self._count))

    def _order(self, epoch: int) -> np.ndarray:
        if not self._shuffle:
            return np.arange(self._num)
        if epoch not in self._perm_cache:
            if len(self._perm_cache) > 2:
                self._perm_cache.pop(min(self._perm_cache))
            rng = np.random.default_rng([self._seed, epoch])
            order = rng.permutation(self._num)
            self._perm_cache[epoch] = self._arrange(order) if self._arrange else order
        return self._perm_cache[epoch]

    def __iter__(self) -> "ArrayData":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        start = self._examples_consumed
        if not self._repeat and start >= self._num:
            raise StopIteration
        global_batch = self._per_host * self._count
        positions = start + self._index * self._per_host + np.arange(self._per_host)  # [b]
        epochs, offsets = np.divmod(positions, self._num)
        real = np.ones(self._per_host, bool) if self._repeat else positions < self._num
        rows = np.zeros(self._per_host, np.int64)
        for epoch in np.unique(epochs[real]):
            sel = real & (epochs == epoch)
            rows[sel] = self._order(int(epoch))[offsets[sel]]
        batch = {k: v[rows] for k, v in self._features.items()}
        batch["mask"] = real.astype(np.float32)
        self._examples_consumed = start + global_batch
        self._batches_consumed += 1
        return batch

    def state(self) -> dict:
        """JSON-able position (global examples consumed), identical on every host."""
        return {
            "examples_consumed": self._examples_consumed,
            "batches_consumed": self._batches_consumed,
            "seed": self._seed,
            "num_examples": self._num,
            "shuffle": self._shuffle,
            "per_host_batch_size": self._per_host,
            "process_count": self._count,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continues exactly at the saved global example position (any host count or batch size)."""
        same = {"seed": self._seed, "num_examples": self._num, "shuffle": self._shuffle}
        check_state(state, ("examples_consumed", "seed", "num_examples"), same)
        self._examples_consumed = int(state["examples_consumed"])
        self._batches_consumed = int(state.get("batches_consumed", 0))

"""Metrics out of the training loop: the console (with ETA), WORKDIR/metrics.jsonl and TensorBoard.

Only process 0 writes. ``metrics.jsonl`` holds one JSON object per record (``"split"`` is ``train``
or ``eval``); on resume, records after the restored step are dropped so that the file reads as one
uninterrupted run. Files go through ``bertjax.fs`` (``tf.io.gfile`` for remote paths), so WORKDIR may be ``gs://...``: a local file is
appended to, a remote one (no append on object stores) is rewritten whole, atomically, at each record.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

import jax

from bertjax import atomic, fs

log = logging.getLogger("bertjax")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


def _eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    h, rem = divmod(int(seconds), 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _tensorboard_writer(directory: str):
    """(writer, tf.summary) for TensorBoard event files, or None (one warning) without TensorFlow."""
    try:
        import tensorflow as tf
    except ImportError:
        log.warning(
            "TensorBoard logging is off: TensorFlow is not installed (metrics.jsonl has it all)"
        )
        return None
    return tf.summary.create_file_writer(directory), tf.summary


class MetricsWriter:
    """Writes metric records; a no-op on processes other than 0."""

    def __init__(self, workdir: str, *, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.remote = "://" in workdir
        self._lines: list[str] = []
        self._tb = None
        if self.enabled:
            fs.makedirs(workdir)
            if self.remote and fs.exists(self.path):
                with fs.open_file(self.path, "r") as f:
                    self._lines = f.read().splitlines(keepends=True)
            if tensorboard:
                self._tb = _tensorboard_writer(os.path.join(workdir, "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Drops records with a step beyond ``step`` (resume after a crash), atomically."""
        if not self.enabled or not fs.exists(self.path):
            return
        kept = []
        with fs.open_file(self.path, "r") as f:
            for line in f.read().splitlines(keepends=True):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if record.get("step", 0) <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
        self._lines = kept
        self._rewrite(kept)

    def _rewrite(self, lines: list[str]) -> None:
        atomic.write_text(self.path, "".join(lines))

    def write(
        self,
        step: int,
        metrics: dict[str, Any],
        split: str = "train",
        total_steps=None,
        elapsed=None,
    ) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), "split": split}
        record.update({k: (float(v) if hasattr(v, "__float__") else v) for k, v in metrics.items()})
        line = json.dumps(record) + "\n"
        if self.remote:
            self._lines.append(line)
            self._rewrite(self._lines)
        else:
            with open(self.path, "a") as f:
                f.write(line)
        if self._tb is not None:
            writer, summary = self._tb
            with writer.as_default(step=int(step)):
                for k, v in record.items():
                    if isinstance(v, float):
                        summary.scalar(f"{split}/{k}", v)
            writer.flush()
        parts = [f"{k}={_fmt(v)}" for k, v in record.items() if k not in ("step", "split")]
        eta = ""
        if total_steps and elapsed and step > 0:
            eta = f" eta={_eta(elapsed / step * (total_steps - step))}"
        log.info("[%s] step %d%s %s", split, step, eta, " ".join(parts))

    def close(self) -> None:
        if self._tb is not None:
            self._tb[0].close()


class Throughput:
    """Sequences and tokens per second between two log points."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.steps = 0

    def reset(self):
        self.t0 = time.perf_counter()
        self.steps = 0

    def tick(self):
        self.steps += 1

    def rates(self, batch: int, seq_len: int) -> dict[str, float]:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        steps_per_sec = self.steps / dt
        return {
            "steps_per_sec": steps_per_sec,
            "seq_per_sec": steps_per_sec * batch,
            "tokens_per_sec": steps_per_sec * batch * seq_len,
        }

"""Metrics out of the training loop: the console (with ETA), WORKDIR/metrics.jsonl and TensorBoard.

Only process 0 writes. The console gets one short line per record (a train line: step, loss,
accuracies, learning rate, gradient norm, throughput, MFU, ETA); the metrics file and TensorBoard
get every metric. ``metrics.jsonl`` holds one JSON object per record (``"split"`` is ``train``
or ``eval``); on resume, records after the restored step are dropped so that the file reads as one
uninterrupted run. Files go through ``bertjax.fs``, so WORKDIR may be ``gs://...``: a local file is
appended to, a remote one (no append on object stores) is rewritten whole, atomically, at each record.
TensorBoard's event files (``tensorboard_events``, no TensorFlow) of a remote WORKDIR (``gs://`` or
another scheme) are written in a local folder, each copied whole into WORKDIR/tensorboard at each
record.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from typing import Any

import jax

from bertjax import atomic, fs
from bertjax.tensorboard_events import EventFileWriter

log = logging.getLogger("bertjax")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


def _si(value: float) -> str:
    """12345.6 -> "12.3k": a rate at a glance."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.1f}"


def _eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    h, rem = divmod(int(seconds), 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class MetricsWriter:
    """Writes metric records; a no-op on processes other than 0."""

    def __init__(self, workdir: str, *, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.remote = fs.is_remote(workdir)
        self._lines: list[str] = []
        self._tb = None
        self._tb_folder = os.path.join(workdir, "tensorboard")
        self._tb_staging = None  # the local folder of a remote WORKDIR's event files
        if self.enabled:
            fs.makedirs(workdir)
            if self.remote and fs.exists(self.path):
                with fs.open_file(self.path, "r") as f:
                    self._lines = f.read().splitlines(keepends=True)
            if tensorboard:
                if self.remote:  # event files are written locally, then copied whole
                    self._tb_staging = tempfile.mkdtemp(prefix="bertjax-tensorboard-")
                self._tb = EventFileWriter(self._tb_staging or self._tb_folder)

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
        total_steps: int | None = None,
        eta: float | None = None,
    ) -> None:
        """Appends a record to metrics.jsonl and TensorBoard and logs its console line
        (``total_steps``: the run's, shown as ``step N/total``; ``eta``: seconds left, or None)."""
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
            scalars = {f"{split}/{k}": v for k, v in record.items() if isinstance(v, float)}
            self._tb.scalars(int(step), scalars)
            self._upload_events()
        values = {k: v for k, v in record.items() if k not in ("step", "split")}
        log.info("%s", console_line(split, step, values, total_steps, eta))

    def _upload_events(self) -> None:
        """Copies the staged event files whole into the bucket (each one upload)."""
        if self._tb_staging is None:
            return
        for name in sorted(os.listdir(self._tb_staging)):
            with open(os.path.join(self._tb_staging, name), "rb") as f:
                fs.write_bytes(f"{self._tb_folder}/{name}", f.read())

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
            self._upload_events()
        if self._tb_staging is not None:
            shutil.rmtree(self._tb_staging, ignore_errors=True)
            self._tb_staging = None


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

    def rates(self, batch: int, tokens_per_step: int) -> dict[str, float]:
        """Rates of ``batch`` examples and ``tokens_per_step`` tokens (every text a step encodes:
        ``Task.tokens_per_step``) per step."""
        dt = max(time.perf_counter() - self.t0, 1e-9)
        steps_per_sec = self.steps / dt
        return {
            "steps_per_sec": steps_per_sec,
            "seq_per_sec": steps_per_sec * batch,
            "tokens_per_sec": steps_per_sec * tokens_per_step,
        }


class Eta:
    """The time a run has left, from steady-state steps only: the clock starts when ``start`` is
    called (after a phase's first step, which compiles), and there is no estimate until
    ``min_steps`` steps were timed since (the first ones after compilation are slow too)."""

    def __init__(self, total_steps: int, min_steps: int = 3):
        self.total_steps = total_steps
        self.min_steps = min_steps
        self.t0: float | None = None
        self.step0 = 0

    def start(self, step: int) -> None:
        self.t0, self.step0 = time.perf_counter(), step

    def seconds_left(self, step: int) -> float | None:
        timed = step - self.step0
        if self.t0 is None or timed < self.min_steps:
            return None
        return (time.perf_counter() - self.t0) / timed * (self.total_steps - step)


def _key_metrics(metrics: dict[str, Any]) -> list[str]:
    """``loss=... <x>_accuracy=...`` of a record: what the console shows of the model's quality."""
    keys = [k for k in ("loss",) if k in metrics]
    keys += sorted(k for k in metrics if k.endswith("accuracy"))
    return [f"{k}={_fmt(metrics[k])}" for k in keys]


def console_line(
    split: str,
    step: int,
    metrics: dict[str, Any],
    total_steps: int | None = None,
    eta: float | None = None,
) -> str:
    """The console's line of a record. Train: ``[train] step 100/1000 loss=2.3456
    mlm_accuracy=0.4512 lr=1.000e-04 grad_norm=0.8123 5.2 steps/s 12.3k tok/s mfu 41.2% eta
    1m23s``; eval: every metric."""
    head = f"[{split}] step {step}" + (f"/{total_steps}" if total_steps else "")
    if split != "train":
        return " ".join([head, *_pairs(metrics)])
    parts = _key_metrics(metrics)
    if "learning_rate" in metrics:
        parts.append(f"lr={float(metrics['learning_rate']):.3e}")
    if "grad_norm" in metrics:
        parts.append(f"grad_norm={_fmt(float(metrics['grad_norm']))}")
    if metrics.get("steps_per_sec"):
        parts.append(f"{_si(metrics['steps_per_sec'])} steps/s")
    if metrics.get("tokens_per_sec"):
        parts.append(f"{_si(metrics['tokens_per_sec'])} tok/s")
    elif metrics.get("seq_per_sec"):
        parts.append(f"{_si(metrics['seq_per_sec'])} seq/s")
    if metrics.get("mfu"):
        parts.append(f"mfu {metrics['mfu']:.1%}")
    if eta is not None:
        parts.append(f"eta {_eta(eta)}")
    return " ".join([head, *parts])


def _numbers(values: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


def _pairs(values: dict[str, Any]) -> list[str]:
    """``key=value`` of every number in ``values``."""
    return [f"{k}={_fmt(v)}" for k, v in _numbers(values).items()]


def summary(result: dict[str, Any]) -> str:
    """The readable last line of a run from ``train_and_evaluate``'s (or a multi-seed run's)
    result: ``done: step 1000 | train loss=1.2345 mlm_accuracy=0.6543 | eval mlm_accuracy=0.6012
    mlm_loss=1.5000 | final (best params) accuracy=0.8712``."""
    parts = ["done:" + (f" step {result['step']}" if result.get("step") is not None else "")]
    if result.get("train"):
        parts.append(" ".join(["train", *_key_metrics(result["train"])]))
    if result.get("eval"):
        parts.append(" ".join(["eval", *_pairs(result["eval"])]))
    final = result.get("final") or {}
    if isinstance(final.get("dev"), dict):  # a fine-tuning task's dev metrics
        shown = _numbers(final["dev"])
    elif isinstance(final.get("median"), dict):  # a multi-seed run: the median over its seeds
        shown = {f"median_{k}": v for k, v in _numbers(final["median"]).items()}
        shown.update(_numbers({"best_seed": final.get("best_seed")}))
    else:
        bookkeeping = ("best_value", "num_train_examples", "train_steps")
        shown = {k: v for k, v in _numbers(final).items() if k not in bookkeeping}
    if shown:
        chosen = f" ({final['params']} params)" if final.get("params") else ""
        parts.append(" ".join([f"final{chosen}", *_pairs(shown)]))
    return " | ".join(parts)

"""Progress of a command's long phases (embedding a corpus, searching, reranking, mining, the
evaluations of a training run): a bar with rate and time left on a terminal, and where stderr is
not a terminal (a log file, a pipe, a pod's logs) one line every ``BERTJAX_PROGRESS_SECONDS``
seconds (default 30; ``inf`` for none). Both go to stderr: stdout keeps a command's output (a
``--json`` report stays one object).

The code that knows what a phase is and how much of it there is opens it (:func:`phase`); the
batch loops under it say what they finished (:func:`advance`), which does nothing outside a
phase, so a library call such as ``Pretrained.embed`` in a user's program prints nothing. A phase
opened inside another is the outer one (the outer knows the whole): one bar per phase.

    with progress.phase("embedding the corpus", len(texts), "texts"):
        vectors = embed(texts)          # its batch loop calls progress.advance(len(batch))

A line reads ``bertjax: embedding the corpus: 2,048/5,183 texts (40%), 312.4 texts/s, about
10 s left``, and the last one ``... 5,183/5,183 texts (100%), 301.7 texts/s, done in 17 s``. A phase
shorter than the interval (or, on a terminal, than two seconds) shows nothing; one that lasted
longer shows its last line.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import IO

SECONDS_VARIABLE = "BERTJAX_PROGRESS_SECONDS"
DEFAULT_SECONDS = 30.0
BAR_DELAY = 2.0  # seconds before a terminal's bar appears

_CURRENT: contextvars.ContextVar[Display | None] = contextvars.ContextVar(
    "bertjax_progress", default=None
)


def interval() -> float:
    """Seconds between two lines where stderr is not a terminal: ``BERTJAX_PROGRESS_SECONDS``
    (a number >= 0, or ``inf``), else 30."""
    text = os.environ.get(SECONDS_VARIABLE, "").strip()
    if not text:
        return DEFAULT_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(
            f"{SECONDS_VARIABLE}={text!r}: expected seconds between progress lines "
            "(a number >= 0, or inf for none)"
        )
    return value


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Display:
    """One phase's count, shown as lines (not a terminal) or as a tqdm bar (a terminal)."""

    def __init__(self, what: str, total: int, unit: str, stream: IO[str], every: float):
        self.what, self.total, self.unit, self.stream = what, max(int(total), 0), unit, stream
        self.done = 0
        self.start = self.last = time.monotonic()
        self.every = every
        self.printed = False
        self.bar = None
        if is_terminal(stream):
            import tqdm  # only for a visible bar

            self.bar = tqdm.tqdm(
                total=self.total,
                desc=what,
                unit=f" {unit}",
                file=stream,
                delay=BAR_DELAY,
                dynamic_ncols=True,
                smoothing=0.1,
            )

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.every and self.done < self.total:  # the last line: close's
            self.last = now
            self._line(now, final=False)

    def _line(self, now: float, final: bool) -> None:
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        percent = 100.0 * self.done / self.total if self.total else 100.0
        parts = [f"{self.done:,}/{self.total:,} {self.unit} ({percent:.0f}%)"]
        if rate > 0:
            parts.append(f"{rate:,.1f} {self.unit}/s")
        if final:
            parts.append(f"done in {duration(elapsed)}")
        elif rate > 0 and self.total >= self.done:
            parts.append(f"about {duration((self.total - self.done) / rate)} left")
        print(f"bertjax: {self.what}: " + ", ".join(parts), file=self.stream, flush=True)
        self.printed = True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.printed or time.monotonic() - self.start >= self.every:
            self._line(time.monotonic(), final=True)  # a phase as long as the interval ends


def is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def phase(what: str, total: int, unit: str = "texts", stream: IO[str] | None = None) -> Iterator:
    """Shows the progress of the work inside the block (``total`` ``unit``, counted by
    :func:`advance`) on ``stream`` (default: stderr). Inside another phase it does nothing: the
    outer phase counts."""
    if _CURRENT.get() is not None:
        yield
        return
    every = interval()
    if math.isinf(every):
        yield
        return
    shown = Display(what, total, unit, stream or sys.stderr, every)
    token = _CURRENT.set(shown)
    try:
        yield
    finally:
        _CURRENT.reset(token)
        shown.close()


def advance(n: int) -> None:
    """Counts ``n`` finished units in the running phase (nothing outside one)."""
    shown = _CURRENT.get()
    if shown is not None and n:
        shown.update(int(n))

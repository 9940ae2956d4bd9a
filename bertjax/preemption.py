"""Stopping a run cleanly on preemption: SIGTERM (or JAX's multi-host preemption notice) asks for a
checkpoint at the next step, then the run exits with :class:`PreemptionRequested`.

The ``bertjax`` command also turns Ctrl-C into such a request (:class:`CtrlCSaves`); a library
caller's Ctrl-C stays Python's KeyboardInterrupt."""

from __future__ import annotations

import logging
import signal

import jax
from jax.experimental import multihost_utils

log = logging.getLogger("bertjax")


class PreemptionRequested(Exception):
    """Raised after the checkpoint that SIGTERM (or a preemption notice) asked for is saved."""


class StopFlag:
    """Set by SIGTERM (and the command's Ctrl-C); checked once per step (agreed across hosts
    through JAX's sync point)."""

    active: StopFlag | None = None  # the flag of the training loop now running (for Ctrl-C)

    def __init__(self):
        self.requested = False
        self._installed = False
        self._previous = None

    def install(self):
        """Sets this flag as the running loop's and handles SIGTERM (main thread only) until
        :meth:`restore`."""
        StopFlag.active = self
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        except ValueError:  # not the main thread
            self._installed = False

    def _handle(self, signum, frame):
        self.request("SIGTERM")

    def request(self, what: str) -> None:
        """Asks for a checkpoint at the next step boundary, then PreemptionRequested."""
        log.warning("%s received: saving a checkpoint, then exiting", what)
        self.requested = True

    def restore(self):
        """Undoes :meth:`install`: the SIGTERM handler before it comes back, unless another one
        replaced this flag's meanwhile (that one stays)."""
        if StopFlag.active is self:
            StopFlag.active = None
        if self._installed:
            self._installed = False
            _put_back(signal.SIGTERM, self._handle, self._previous)

    def should_stop(self, step: int) -> bool:
        if jax.process_count() > 1:
            return self.requested or multihost_utils.reached_preemption_sync_point(step)
        return self.requested


class CtrlCSaves:
    """While entered (the ``bertjax`` command only): the first Ctrl-C during training asks the
    running loop for a checkpoint at the next step, like SIGTERM; a second one, or one outside a
    training loop, raises KeyboardInterrupt. The previous SIGINT handler comes back on exit."""

    def __init__(self):
        self.pressed = False
        self._previous = None

    def __enter__(self) -> CtrlCSaves:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        _put_back(signal.SIGINT, self._handle, self._previous)

    def _handle(self, signum, frame):
        flag = StopFlag.active
        if self.pressed or flag is None:
            raise KeyboardInterrupt
        self.pressed = True
        flag.request("Ctrl-C (SIGINT)")
        log.warning("press Ctrl-C again to exit at once without saving")


def _put_back(signum: int, ours, previous) -> None:
    """Reinstalls ``previous`` for ``signum`` if ``ours`` is still its handler; a handler not set
    from Python (``previous`` None: Python cannot reinstall it) becomes the default action."""
    if signal.getsignal(signum) == ours:
        signal.signal(signum, signal.SIG_DFL if previous is None else previous)

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
        self._previous = None

    def install(self):
        StopFlag.active = self
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread
            self._previous = None

    def _handle(self, signum, frame):
        self.request("SIGTERM")

    def request(self, what: str) -> None:
        """Asks for a checkpoint at the next step boundary, then PreemptionRequested."""
        log.warning("%s received: saving a checkpoint, then exiting", what)
        self.requested = True

    def restore(self):
        if StopFlag.active is self:
            StopFlag.active = None
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

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
        signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame):
        flag = StopFlag.active
        if self.pressed or flag is None:
            raise KeyboardInterrupt
        self.pressed = True
        flag.request("Ctrl-C (SIGINT)")
        log.warning("press Ctrl-C again to exit at once without saving")

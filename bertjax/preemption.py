"""Stopping a run cleanly on preemption: SIGTERM (or JAX's multi-host preemption notice) asks for a
checkpoint at the next step, then the run exits with :class:`PreemptionRequested`."""

from __future__ import annotations

import logging
import signal

import jax
from jax.experimental import multihost_utils

log = logging.getLogger("bertjax")


class PreemptionRequested(Exception):
    """Raised after the checkpoint that SIGTERM (or a preemption notice) asked for is saved."""


class StopFlag:
    """Set by SIGTERM; checked once per step (agreed across hosts through JAX's sync point)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def install(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread
            self._previous = None

    def _handle(self, signum, frame):
        log.warning("SIGTERM received: saving a checkpoint, then exiting")
        self.requested = True

    def restore(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def should_stop(self, step: int) -> bool:
        if jax.process_count() > 1:
            return self.requested or multihost_utils.reached_preemption_sync_point(step)
        return self.requested

"""What the ``bertjax`` command sets up in its own process; bertjax used as a library sets up nothing.

Importing bertjax and calling it (building a model, ``load_pretrained``, a ``Checkpointer``, a
``train_and_evaluate`` run) leaves ``sys.excepthook``, ``sys.unraisablehook``, the warnings filters
and the logging configuration as they were. The command (``bertjax.cli.main``) calls
:func:`install` once, to drop what Python would otherwise print to stderr, after an error bertjax has
already reported in one line, about the work that error abandoned in Orbax's and TensorStore's
threads:

- after a failed save, Orbax's executor threads may hand their results to the per-save event loops
  it has closed ("RuntimeError: Event loop is closed", through ``sys.unraisablehook``), and log
  their tracebacks of a full disk through absl;
- after a failed restore, TensorStore's other reads of the bad step complete into the closed restore
  loop (the same error, printed by its C++ callbacks through ``sys.excepthook``), or end as
  coroutines nobody awaits ("was never awaited") or as tasks whose error asyncio logs ("Task
  exception was never retrieved"), naming the step directory.

Everything else reaches the hooks and handlers that were in place before. Checkpointing records the
step directories a restore failed on (:func:`mark_unrestorable`) and quiets its own clean-up after a
failure for just that long (:func:`quieted`), so that a library caller sees the one reported error
too. This module imports only the standard library: ``bertjax --help`` stays instant.

The command also keeps TensorFlow off the accelerators (:func:`tensorflow_on_the_cpu`), whenever
its work first imports TensorFlow: a pretraining run when it builds its tf.data input, a fine-tuning
run never unless a task downloads through TFDS or reads a TF checkpoint (:func:`after_import`). That
import leaves out the Keras that TF would load with it (:func:`keras_left_out`).
"""

from __future__ import annotations

import contextlib
import errno
import importlib.abc
import importlib.util
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType

_UNRESTORABLE_DIRS: set[str] = set()  # step directories a restore failed on, in this process
_LOOP_INTERNALS = (f"{os.sep}asyncio{os.sep}", f"{os.sep}concurrent{os.sep}futures{os.sep}")
_UNAWAITED_READS = "coroutine '_read_array_index_and_device_put' was never awaited"


def error_chain(err: BaseException) -> list[BaseException]:
    """``err`` and its causes (at most 10)."""
    chain = [err]
    while len(chain) < 10 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    return chain


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` says the disk (or the user's quota) is full."""
    text = str(err)
    return (
        getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
        or "No space left on device" in text
        or "Disk quota exceeded" in text
    )


def mark_unrestorable(step_dir: str) -> None:
    """Records a checkpoint step directory that a restore failed on: errors naming it later are
    consequences of that (already reported) failure."""
    _UNRESTORABLE_DIRS.add(step_dir)


def _about_unrestorable_text(text: str) -> bool:
    return any(f"{step_dir}/" in text for step_dir in _UNRESTORABLE_DIRS)


def _about_unrestorable(err: BaseException | None) -> bool:
    return err is not None and _about_unrestorable_text(" ".join(map(str, error_chain(err))))


def _closed_loop(err: BaseException | None, tb=None) -> bool:
    """Whether ``err`` is a result handed to a closed event loop by native code or by
    asyncio/concurrent.futures themselves (no other frame in its traceback): the abandoned work of
    Orbax's per-operation loops, never an error of the caller's own code."""
    if not (isinstance(err, RuntimeError) and str(err) == "Event loop is closed"):
        return False
    tb = tb if tb is not None else err.__traceback__
    while tb is not None:
        if not any(part in tb.tb_frame.f_code.co_filename for part in _LOOP_INTERNALS):
            return False
        tb = tb.tb_next
    return True


def is_abandoned_work(err: BaseException | None, tb=None) -> bool:
    """Whether ``err`` (raised with traceback ``tb``) is the end of work that an already reported
    checkpoint failure abandoned (see the module's docstring)."""
    return _closed_loop(err, tb) or _about_unrestorable(err)


class _UnrestorableReadsLogFilter(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" records of the other reads of a step
    that did not restore (the checkpointing code reports that step once, with the reason)."""

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        return not (_about_unrestorable(err) or _about_unrestorable_text(record.getMessage()))


class _DiskFullLogFilter(logging.Filter):
    """Drops Orbax's background-thread tracebacks (logged through absl) of a disk-full save: the
    checkpointing code reports that save in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        return not (err is not None and any(map(is_disk_full, error_chain(err))))


def install() -> Callable[[], None]:
    """Installs the filters described in the module's docstring: ``sys.unraisablehook`` and
    ``sys.excepthook`` wrappers, a warnings filter and filters on the ``asyncio`` and ``absl``
    loggers. Returns a function that removes them again (each hook only while it is still the one
    installed here: a hook installed on top of it since stays)."""
    previous_unraisable, previous_except = sys.unraisablehook, sys.excepthook

    def unraisable_hook(unraisable):
        if not is_abandoned_work(unraisable.exc_value, getattr(unraisable, "exc_traceback", None)):
            previous_unraisable(unraisable)

    def except_hook(kind, err, tb):
        if not is_abandoned_work(err, tb):
            previous_except(kind, err, tb)

    sys.unraisablehook, sys.excepthook = unraisable_hook, except_hook
    before = list(warnings.filters)
    warnings.filterwarnings("ignore", message=_UNAWAITED_READS)
    added = [f for f in warnings.filters if f not in before]  # none if it was there already
    log_filters = [
        (logging.getLogger("asyncio"), _UnrestorableReadsLogFilter()),
        (logging.getLogger("absl"), _DiskFullLogFilter()),
    ]
    for logger, log_filter in log_filters:
        logger.addFilter(log_filter)

    def uninstall() -> None:
        if sys.unraisablehook is unraisable_hook:
            sys.unraisablehook = previous_unraisable
        if sys.excepthook is except_hook:
            sys.excepthook = previous_except
        for entry in added:
            with contextlib.suppress(ValueError):
                warnings.filters.remove(entry)
        for logger, log_filter in log_filters:
            logger.removeFilter(log_filter)

    return uninstall


@contextlib.contextmanager
def quieted() -> Iterator[None]:
    """:func:`install` for the duration of a ``with`` block, then removed."""
    uninstall = install()
    try:
        yield
    finally:
        uninstall()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first import of ``name`` it lets the other finders find the
    module, runs the module inside ``while_running()`` and calls ``callback(module)`` after."""

    def __init__(self, name, callback, while_running):
        self.name, self.callback, self.while_running = name, callback, while_running

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and the search below does not come back here
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run, callback, while_running = spec.loader.exec_module, self.callback, self.while_running

        def exec_module(module: ModuleType) -> None:
            with while_running():
                run(module)
            callback(module)

        spec.loader.exec_module = exec_module  # this module's loader object only
        return spec


def after_import(
    name: str,
    callback: Callable[[ModuleType], None],
    while_running: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> None:
    """Calls ``callback(module)`` right after top-level module ``name`` is first imported in this
    process (at once if it is imported already); the module's own code runs inside
    ``while_running()``."""
    if name in sys.modules:
        callback(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback, while_running))


@contextlib.contextmanager
def left_out(name: str) -> Iterator[None]:
    """``import name`` fails inside the block (when ``name`` is not imported yet), and works again
    after it."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None  # type: ignore[assignment]  # the import system's "not found"
    try:
        yield
    finally:
        if name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]


def keras_left_out() -> contextlib.AbstractContextManager:
    """For TensorFlow's import: TF loads Keras's optimizers at once, to register them for
    SavedModels, and skips that when Keras does not import. bertjax uses no Keras, and TF's import
    takes 3.6 instead of 5.9 CPU-s without it (TF 2.21, Keras 3.15). ``tf.keras`` still loads Keras
    when something asks for it later."""
    return left_out("keras")


def tensorflow_on_the_cpu(tf: ModuleType) -> None:
    """Makes TensorFlow (the module ``tf``) see only the CPU, so that tf.data never takes GPU/TPU
    memory meant for JAX. Process-wide and for good (TF's devices are set once): call it before
    TF's first op, as :func:`after_import` of ``tensorflow`` does."""
    for kind in ("GPU", "TPU"):
        try:
            tf.config.set_visible_devices([], kind)
        except RuntimeError as err:  # TF already initialised its devices: too late to hide them.
            if tf.config.get_visible_devices(kind):
                logging.getLogger("bertjax").warning(
                    "TF already sees %s devices and may use them: %s", kind, err
                )

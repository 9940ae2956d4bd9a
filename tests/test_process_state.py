"""bertjax is a library: importing it and using it (every module imported, a Checkpointer save,
restore and fallback past a corrupted step, a short training run, ``load_pretrained``) leaves the
process as it was: exception hooks, warnings filters, logging (every logger's level, handlers and
filters), absl's verbosity, signal handlers, JAX's config, the environment and TensorFlow's visible
devices. Only the ``bertjax`` command configures its process (``bertjax.process_hooks.install``,
TensorFlow kept off the accelerators).

The check runs in a fresh interpreter (this file run as a script), which first imports the
third-party packages that bertjax imports: what they change at their own import is theirs (Orbax
adds a handler to the root logger, TensorFlow warnings filters)."""

import ast
import contextlib
import importlib
import json
import os
import pathlib
import pkgutil
import signal
import subprocess
import sys
import threading
import warnings

import jax
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _third_party_modules() -> list[str]:
    """Every module outside bertjax that bertjax imports anywhere (functions included)."""
    names = set()
    for path in (REPO / "bertjax").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return sorted(n for n in names if n.split(".")[0] not in ("bertjax", "__future__"))


def _import_quietly(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001  (absent optional dependency, a name that is no module)
        return False
    return True


def _logger_state(logger) -> tuple:
    handlers = tuple((id(h), h.level, tuple(map(id, h.filters))) for h in logger.handlers)
    return logger.level, logger.propagate, logger.disabled, handlers, tuple(map(id, logger.filters))


def snapshot() -> dict:
    """What a library must leave as it was, in comparable (JSON-friendly) form."""
    import logging

    from absl import logging as absl_logging

    loggers = {"<root>": logging.getLogger()}
    loggers.update(
        (name, logger)
        for name, logger in logging.root.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    )
    hooks = {
        "sys.excepthook": sys.excepthook,
        "sys.unraisablehook": sys.unraisablehook,
        "sys.displayhook": sys.displayhook,
        "threading.excepthook": threading.excepthook,
    }
    signals = {}
    for sig in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError):
            signals[signal.Signals(sig).name] = repr(signal.getsignal(sig))
    return {
        "hooks": {name: repr(hook) for name, hook in hooks.items()},
        "warnings.filters": [repr(f) for f in warnings.filters],
        "loggers": {name: repr(_logger_state(lg)) for name, lg in loggers.items()},
        "logging": repr((logging.getLoggerClass(), logging.root.manager.disable)),
        "absl verbosity": absl_logging.get_verbosity(),
        "signals": signals,
        "jax.config": {k: repr(v) for k, v in jax.config.values.items()},
        "os.environ": dict(os.environ),
    }


# A logger created after the first snapshot must look like a new logger: level NOTSET, no
# handlers, no filters, propagating.
_NEW_LOGGER = repr((0, True, False, (), ()))


def differences(before: dict, after: dict) -> list[str]:
    out = []
    for key, old in before.items():
        new = after[key]
        if isinstance(old, dict):
            for name in sorted(set(old) | set(new)):
                default = _NEW_LOGGER if key == "loggers" else None
                was = old.get(name, default)
                if key in ("jax.config",) and name not in old:
                    continue  # an option registered by a module imported since
                if was != new.get(name):
                    out.append(f"{key}[{name}]: {was} -> {new.get(name)}")
        elif old != new:
            extra = [f for f in new if f not in old] if isinstance(new, list) else new
            out.append(f"{key}: {old if not isinstance(old, list) else ''} -> {extra}")
    return out


def _use_bertjax(tmp: pathlib.Path) -> list[str]:
    """Imports every bertjax module, then uses the library; returns the modules not importable."""
    import bertjax

    skipped = []
    for info in pkgutil.walk_packages(bertjax.__path__, "bertjax."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as err:  # an optional dependency that is not installed
            if (err.name or "").startswith("bertjax"):
                raise
            skipped.append(f"{info.name} (no {err.name})")

    import jax.numpy as jnp
    from train_fixtures import tiny_config

    from bertjax import checkpointing, pretrained, train

    ckpt = checkpointing.Checkpointer(str(tmp / "ckpt"), async_save=False)
    state = {"w": jnp.arange(16.0).reshape(4, 4)}
    for step in (1, 2):
        ckpt.save(step, state, {"position": step}, "{}", force=True)
    ckpt.wait()
    abstract = checkpointing.abstract_like(state, {"w": state["w"].sharding})
    restored, data, _, step = ckpt.restore(abstract)
    assert step == 2 and data == {"position": 2} and bool((restored["w"] == state["w"]).all())
    (tmp / "ckpt" / "2" / "state" / "_METADATA").write_text("")  # a corrupted newest step
    *_, step = ckpt.restore_newest(abstract)
    assert step == 1
    ckpt.close()

    workdir = tmp / "run"
    result = train.train_and_evaluate(tiny_config(tmp, steps=2), str(workdir))
    assert result["step"] == 2
    model = pretrained.load_pretrained(str(workdir))
    ids = np.array([[2, 40, 41, 3]], np.int32)
    model(ids, np.zeros_like(ids), np.ones_like(ids))
    return skipped


def main(tmp: str) -> None:
    for name in _third_party_modules():
        _import_quietly(name)
    import tensorflow as tf

    # TensorFlow's visible devices are set once per process and cannot be read back as changed on
    # a machine without accelerators: every call to set them counts as a change.
    device_settings = []
    set_visible_devices = tf.config.set_visible_devices

    def recorded(devices, device_type=None):
        device_settings.append(f"tf.config.set_visible_devices({devices!r}, {device_type!r})")
        return set_visible_devices(devices, device_type)

    tf.config.set_visible_devices = recorded
    before = snapshot()
    skipped = _use_bertjax(pathlib.Path(tmp))
    changed = differences(before, snapshot()) + device_settings
    print(json.dumps({"skipped": skipped, "changed": changed}))


def test_checkpoints_saved_restored_and_skipped_change_no_process_state(tmp_path):
    from bertjax import checkpointing

    before = snapshot()
    ckpt = checkpointing.Checkpointer(str(tmp_path / "ck"), async_save=False)
    state = {"w": np.arange(4.0)}
    for step in (1, 2):
        ckpt.save(step, state, {}, "{}", force=True)
    (tmp_path / "ck" / "2" / "state" / "_METADATA").write_text("")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = checkpointing.abstract_like(state, {"w": device})
    assert ckpt.restore_newest(abstract)[-1] == 1
    ckpt.close()
    assert differences(before, snapshot()) == []


def test_the_commands_hooks_are_installed_by_main_and_removable(monkeypatch):
    from bertjax import cli, process_hooks

    before = snapshot()
    uninstall = process_hooks.install()
    changed = differences(before, snapshot())
    assert any("sys.unraisablehook" in c for c in changed), changed
    assert any("warnings.filters" in c for c in changed), changed
    assert any(c.startswith(("loggers[asyncio]", "loggers[absl]")) for c in changed), changed
    uninstall()
    assert differences(before, snapshot()) == []
    calls = []
    monkeypatch.setattr(process_hooks, "install", lambda: calls.append("hooks"))
    import tensorflow  # noqa: F401  (imported already: the command hides TF's GPUs at once)

    monkeypatch.setattr(process_hooks, "tensorflow_on_the_cpu", lambda tf: calls.append(tf))
    with pytest.raises(SystemExit):
        cli.main(["bertjax", "evaluate", "--help"])
    assert calls == ["hooks", tensorflow]


def test_after_import_runs_once_right_after_the_modules_first_import(tmp_path, monkeypatch):
    """The command's hook on TensorFlow (which fine-tuning never imports): the callback gets the
    package once it has run, before the importer's next line; the finder then leaves."""
    from bertjax import process_hooks

    package = tmp_path / "late_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from late_pkg import inner\nDONE = True\n")
    (package / "inner.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []
    finders = list(sys.meta_path)
    process_hooks.after_import("late_pkg", lambda m: calls.append((m.__name__, m.DONE, m.inner.X)))
    assert calls == [] and len(sys.meta_path) == len(finders) + 1
    import late_pkg  # noqa: F401

    assert calls == [("late_pkg", True, 1)] and sys.meta_path == finders
    import late_pkg.inner  # noqa: F401

    process_hooks.after_import("late_pkg", lambda m: calls.append(m.__name__))  # imported: now
    assert calls == [("late_pkg", True, 1), "late_pkg"]
    for name in ("late_pkg", "late_pkg.inner"):
        monkeypatch.delitem(sys.modules, name)


def test_a_module_left_out_of_an_import_imports_after_it(tmp_path, monkeypatch):
    """As the command imports TensorFlow without the Keras TF would load with it: inside the
    import, the left-out package does not import (TF skips it); after, it imports as usual."""
    from bertjax import process_hooks

    for name, code in (
        ("host_pkg", "try:\n    import extra_pkg\nexcept ImportError:\n    extra_pkg = None\n"),
        ("extra_pkg", "X = 1\n"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    process_hooks.after_import(
        "host_pkg", lambda m: seen.append(m.extra_pkg), lambda: process_hooks.left_out("extra_pkg")
    )
    import host_pkg  # noqa: F401

    assert seen == [None] and "extra_pkg" not in sys.modules
    import extra_pkg

    assert extra_pkg.X == 1
    for name in ("host_pkg", "extra_pkg"):
        monkeypatch.delitem(sys.modules, name)


def test_a_runs_sigterm_handler_goes_and_a_handler_set_during_the_run_stays():
    from bertjax.preemption import StopFlag

    before = signal.getsignal(signal.SIGTERM)
    flag = StopFlag()
    flag.install()
    assert signal.getsignal(signal.SIGTERM) != before and StopFlag.active is flag
    flag.restore()
    assert signal.getsignal(signal.SIGTERM) == before and StopFlag.active is None
    flag.install()

    def callers(signum, frame):  # e.g. the caller's own handler, set from a metrics callback
        pass

    signal.signal(signal.SIGTERM, callers)
    try:
        flag.restore()
        assert signal.getsignal(signal.SIGTERM) is callers
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.slow
def test_importing_and_using_bertjax_changes_no_process_state(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["changed"] == [], "\n".join(report["changed"])


if __name__ == "__main__":
    main(sys.argv[1])

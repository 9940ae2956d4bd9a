"""Checkpoints that go wrong: a corrupted newest checkpoint is skipped (and kept) on resume, one
that cannot be restored is one line naming the file, Orbax's closed-loop noise after such an error
is dropped, and a NaN metric never becomes the best checkpoint or the best seed."""

import gc
import logging
import pathlib
import sys

import numpy as np
import pytest
from train_fixtures import read_metrics, tiny_config

from bertjax import checkpointing, multiseed, train


def test_best_checkpoint_and_best_seed_never_pick_nan(tmp_path):
    nan = float("nan")
    best = checkpointing.BestCheckpoint(("spearman", "max"), str(tmp_path))
    assert best.better(0.1) and not best.better(nan)
    best.value = 0.5
    assert not best.better(nan) and best.better(0.6) and not best.better(0.4)
    best.value = nan  # e.g. kept by an older version
    assert best.better(0.1)
    low = checkpointing.BestCheckpoint(("loss", "min"), str(tmp_path))
    low.value = 2.0
    assert not low.better(nan) and low.better(1.0)
    per_seed = {
        s: {"dev": {"spearman": v, "pearson": 0.5}} for s, v in ((1, nan), (2, 0.3), (3, nan))
    }
    for order in (per_seed, dict(reversed(list(per_seed.items())))):
        summary = multiseed.summarize(order, "spearman")
        assert summary["best_seed"] == 2 and summary["best"]["spearman"] == 0.3
        assert np.isnan(summary["median"]["spearman"]) and summary["median"]["pearson"] == 0.5
        assert summary["nan_seeds"] == [1, 3]


def test_a_best_checkpoint_kept_in_percent_is_read_as_a_fraction(tmp_path):
    """SQuAD/NER metrics were percentages before they became fractions: a run resumed across the
    change compares its new fractions with the kept value read as a fraction (else 0.8 would
    never beat a kept 75.0)."""
    params = {"w": np.zeros(2, np.float32)}
    old = checkpointing.Checkpointer(str(tmp_path / "best"), keep=1, async_save=False)
    old.save(3, {"params": params}, {"metric": "f1", "value": 75.0, "step": 3}, "{}", True)
    old.close()
    best = checkpointing.BestCheckpoint(("f1", "max"), str(tmp_path))
    assert best.value == 0.75 and best.better(0.8) and not best.better(0.7)
    best.update(4, {"f1": 0.8}, params, "{}")
    assert checkpointing.BestCheckpoint(("f1", "max"), str(tmp_path)).value == 0.8  # kept as is


def _newest_data_file(checkpoints: pathlib.Path, step: int) -> pathlib.Path:
    files = [p for p in (checkpoints / str(step) / "state").rglob("d/*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("fault", ["truncate", "flip"])
def test_resume_skips_a_corrupted_newest_checkpoint(tmp_path, caplog, monkeypatch, request, fault):
    """The `bertjax` command's run (its process hooks installed, as cli.main does): the bad step
    is logged once and nothing else is printed, however late its abandoned reads complete (a
    library caller gets the same quiet while the restore runs; see process_hooks.quieted)."""
    from bertjax import process_hooks

    config = tiny_config(tmp_path, steps=4)
    reference = train.train_and_evaluate(config, str(tmp_path / "ref"))
    losses = [r["loss"] for r in read_metrics(tmp_path / "ref")]
    checkpoints = tmp_path / "ref" / "checkpoints"
    path = _newest_data_file(checkpoints, 4)
    data = bytearray(path.read_bytes())
    if fault == "truncate":
        data = data[: len(data) // 2]
    else:
        data[100 : len(data) : 997] = bytes(b ^ 0xFF for b in data[100 : len(data) : 997])
    path.write_bytes(bytes(data))
    unraisable = []  # "Exception ignored in ..." that Python would print to stderr
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    request.addfinalizer(process_hooks.install())  # wraps the hooks above, as cli.main does
    with caplog.at_level(logging.WARNING):
        result = train.train_and_evaluate(config, str(tmp_path / "ref"))
        gc.collect()
    skipped = [r.getMessage() for r in caplog.records if "does not restore" in r.getMessage()]
    assert len(skipped) == 1 and "step 4" in skipped[0] and "\n" not in skipped[0], skipped
    # The bad step's other reads (abandoned TensorStore coroutines) print nothing more.
    assert not [r for r in caplog.records if r.name == "asyncio"]
    assert not unraisable, [str(u.exc_value)[:200] for u in unraisable]
    assert result["step"] == 4 and result["train"]["loss"] == pytest.approx(
        reference["train"]["loss"], rel=1e-6
    )
    assert [r["loss"] for r in read_metrics(tmp_path / "ref")] == pytest.approx(losses, rel=1e-6)
    kept = [p.name for p in checkpoints.iterdir() if p.name.startswith("4.unrestorable")]
    assert len(kept) == 1 and (checkpoints / kept[0] / "state").is_dir()  # never deleted
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["2", "4"]


def test_closed_loop_noise_is_dropped_by_the_commands_hooks(monkeypatch, request):
    """An abandoned read can hand its result to Orbax's closed loop before bertjax has caught the
    restore's error (CI): the `bertjax` command's hooks (process_hooks.install) drop only errors
    raised by the loop machinery itself, called from native code."""
    import asyncio
    import types

    from bertjax import process_hooks

    shown, printed = [], []
    monkeypatch.setattr(sys, "unraisablehook", shown.append)
    monkeypatch.setattr(sys, "excepthook", lambda *args: printed.append(args[1]))
    request.addfinalizer(process_hooks.install())
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as caught:
        err = caught
    from_native = err.__traceback__.tb_next  # as if TensorStore's C++ callback had called it
    for tb in (from_native, err.__traceback__):
        sys.unraisablehook(
            types.SimpleNamespace(exc_value=err, exc_type=type(err), exc_traceback=tb)
        )
        sys.excepthook(type(err), err, tb)
    # Only the one raised through this test's own frame is shown, by each hook.
    assert [u.exc_traceback for u in shown] == [err.__traceback__] and printed == [err]


def test_no_restorable_checkpoint_is_one_line_naming_the_file(tmp_path):
    config = tiny_config(tmp_path, steps=2)
    train.train_and_evaluate(config, str(tmp_path / "run"))
    metadata = tmp_path / "run" / "checkpoints" / "2" / "state" / "_METADATA"
    metadata.write_text("")
    with pytest.raises(ValueError) as err:
        train.train_and_evaluate(config, str(tmp_path / "run"))
    message = str(err.value)
    assert "\n" not in message and str(metadata) in message and "step 2" in message, message
    assert metadata.exists()

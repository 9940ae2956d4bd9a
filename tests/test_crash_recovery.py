"""Crash recovery: kill -9 at seeded random points of prepare, pretraining (mid checkpoint write
included) and fine-tuning (mid write of a result file included), a corrupted newest checkpoint, a
disk that fills while checkpointing; then the same command again loses nothing, leaves nothing
half-written, and gives the losses of an uninterrupted run. Faults in writes come from
tests/fault_inject.py (a `bertjax` with Orbax's and bertjax's writes patched)."""

import errno
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
from etils import epath
from helpers import wait_for
from train_fixtures import read_metrics, tiny_config, write_vocab

from bertjax import checkpointing, train
from bertjax.data import prepare
from bertjax.text import load_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
SEED = int(os.environ.get("BERTJAX_FAULT_SEED", "15"))


def _bertjax(root, workdir, *args, env=None, command="pretrain", config="tiny_pretrain_config"):
    cmd = [sys.executable, str(REPO / "tests" / "fault_inject.py"), command]
    cmd += [f"--config={REPO}/tests/{config}.py:{root}", f"--workdir={workdir}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.Popen(
        [*cmd, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _losses(workdir):
    return [r["loss"] for r in read_metrics(workdir)]


# The pretraining runs' model: the tiny preset with one of its two layers (what is checked is where
# a run stops and resumes, and its losses against the uninterrupted run's; half the compile).
ONE_LAYER = {"model.num_layers": 1}
ONE_LAYER_FLAGS = [f"--config.{k}={v}" for k, v in ONE_LAYER.items()]  # the same, for bertjax


@pytest.mark.slow
def test_kill_mid_checkpoint_corrupt_newest_then_disk_full_then_resume_exactly(tmp_path, caplog):
    rng = np.random.default_rng(SEED)
    config = tiny_config(tmp_path, steps=10, **ONE_LAYER)
    train.train_and_evaluate(config, str(tmp_path / "reference"))
    workdir = tmp_path / "run"
    checkpoints = workdir / "checkpoints"
    # 1. kill -9 while checkpoint step 4 or 6 (seeded) is half-written.
    killed_at = int(rng.choice([4, 6]))
    env = {"BERTJAX_FAULT_SLOW_SAVE_STEP": str(killed_at)}
    proc = _bertjax(tmp_path, workdir, *ONE_LAYER_FLAGS, env=env)
    wait_for(lambda: (checkpoints / f"{killed_at}.orbax-checkpoint-tmp").exists(), proc)
    time.sleep(float(rng.uniform(0.0, 0.5)))
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    # 2. corrupt the newest complete checkpoint: the run falls back to the one before it.
    newest = checkpoints / str(killed_at - 2)
    data_file = max((newest / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
    data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])
    # 3. the disk fills while writing checkpoint step 8: one line naming the path, nothing lost.
    proc = _bertjax(tmp_path, workdir, *ONE_LAYER_FLAGS, env={"BERTJAX_FAULT_DISK_FULL_STEP": "8"})
    out, err = proc.communicate(timeout=600)
    errors = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 1, out[-2000:] + err[-3000:]
    assert len(errors) == 1 and errors[0].startswith("bertjax pretrain: error: "), err[-3000:]
    assert "8.orbax-checkpoint-tmp" in errors[0] and "no space left on device" in errors[0]
    assert "step 6" in errors[0] and "is intact" in errors[0]
    assert f"{killed_at - 2}.unrestorable-" in " ".join(p.name for p in checkpoints.iterdir())
    # 4. a plain run (in process: what it resumes from is on disk) finishes: every step logged
    # once, the losses of the uninterrupted run.
    with caplog.at_level(logging.INFO, logger="bertjax"):
        train.train_and_evaluate(config, str(workdir))
    assert "resumed from" in caplog.text and "step 6" in caplog.text
    assert [r["step"] for r in read_metrics(workdir)] == list(range(1, 11))
    np.testing.assert_allclose(_losses(workdir), _losses(tmp_path / "reference"), rtol=1e-6)
    assert not list(checkpoints.glob("*.orbax-checkpoint-tmp"))


def test_disk_full_in_an_async_save_is_one_error_naming_the_path(tmp_path, monkeypatch, request):
    import jax.numpy as jnp

    from bertjax import process_hooks

    ckpt = checkpointing.Checkpointer(str(tmp_path / "ck"), async_save=True)
    state = {"w": jnp.ones((4, 4))}
    ckpt.save(1, state, {}, "{}", force=True)
    ckpt.wait()
    write_text = epath.Path.write_text

    def full(self, *args, **kwargs):
        if "2.orbax-checkpoint-tmp" in str(self):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(epath.Path, "write_text", full)
    unraisable = []  # what Python would print as "Exception ignored in ..."
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    request.addfinalizer(process_hooks.install())  # what the `bertjax` command installs
    with pytest.raises(checkpointing.CheckpointSaveError) as info:
        ckpt.save(2, state, {}, "{}", force=True)
        ckpt.wait()
    ckpt.close()
    time.sleep(0.3)  # Orbax's executor threads' last callbacks
    noise, real = RuntimeError("Event loop is closed"), RuntimeError("a real one")
    for err in (noise, real):
        sys.unraisablehook(types.SimpleNamespace(exc_value=err, exc_type=type(err)))
    # Orbax's closed-loop noise after the reported save is dropped; anything else still shows.
    # Checked by identity: the hook is process-wide, and one full run under load (not reproduced
    # alone, 15 tries) recorded one more closed-loop entry here, from a thread not identified.
    shown = [u.exc_value for u in unraisable]
    assert any(e is real for e in shown) and not any(e is noise for e in shown)
    message = str(info.value)
    assert "\n" not in message and "2.orbax-checkpoint-tmp" in message
    assert "no space left on device" in message and "step 1" in message
    monkeypatch.setattr(epath.Path, "write_text", write_text)
    again = checkpointing.Checkpointer(str(tmp_path / "ck"), async_save=False)
    assert again.all_steps() == [1]  # the half-written step is no checkpoint
    again.close()


def _corpus(tmp_path, vocab, files=2, docs=600):
    rng = np.random.default_rng(SEED)
    words = [w for w in vocab.read_text().split() if w.startswith("w")]
    paths = []
    for f in range(files):
        text = ["\n".join(" ".join(rng.choice(words, 10)) for _ in range(6)) for _ in range(docs)]
        paths.append(tmp_path / f"corpus-{f}.txt")
        paths[-1].write_text("\n\n".join(text) + "\n")
    return paths


@pytest.mark.slow
def test_kill9_of_prepare_at_a_random_point_then_rerun_equals_an_uninterrupted_run(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.txt")
    corpus = _corpus(tmp_path, vocab)
    options = dict(dupe_factor=2, num_shards=3, eval_fraction=0.1, random_document_buffer=20)
    tok = load_tokenizer(str(vocab), do_lower_case=True)
    ref = prepare.prepare(
        [str(c) for c in corpus],
        str(tmp_path / "ref"),
        tok,
        num_workers=1,
        show_progress=False,
        **options,
    )
    out = tmp_path / "out"
    args = ["--input", ",".join(map(str, corpus)), "--output_dir", str(out), "--vocab", str(vocab)]
    args += ["--num_workers=2", "--no_progress", "--dupe_factor=2", "--num_shards=3"]
    args += ["--eval_fraction=0.1", "--random_document_buffer=20"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "bertjax.cli", "prepare", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(lambda: bool(list(out.glob(".prepare-tmp-*"))), proc)
    time.sleep(float(np.random.default_rng(SEED).uniform(0.5, 3.0)))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "metadata.json").exists() or proc.returncode == 0
    meta = prepare.prepare(
        [str(c) for c in corpus], str(out), tok, num_workers=2, show_progress=False, **options
    )
    assert meta["examples"] == ref["examples"] and meta["shards"] == ref["shards"]
    for name in ref["shards"]:
        assert (out / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir()) == sorted(["metadata.json", *ref["shards"]])
    assert json.loads((out / "metadata.json").read_text())["examples"] == ref["examples"]


# ---- fine-tuning: 2 seeds x 6 steps of GLUE SST-2 (tests/tiny_finetune_config.py) ----------------
FT_WRITES = ("best/3", "sst2-dev.tsv", "SST-2.tsv", "eval_results.json")  # kill-9 points in writes


def _finetune(root, workdir, env):
    return _bertjax(root, workdir, env=env, command="finetune", config="tiny_finetune_config")


def _finetune_in_process(root, workdir):
    """The command's run (tests/tiny_finetune_config.py over ``root``) in this process."""
    from tiny_finetune_config import get_config

    from bertjax import multiseed

    multiseed.run(get_config(str(root)), str(workdir))


@pytest.fixture(scope="module")
def finetune_reference(tmp_path_factory):
    """The uninterrupted fine-tuning run (tiny_finetune_config), in process: its data root."""
    root = tmp_path_factory.mktemp("finetune")
    _finetune_in_process(root, root / "reference")
    return root


def _rows(workdir, split):
    try:
        return [(r["step"], r.get("loss")) for r in read_metrics(workdir, split)]
    except (FileNotFoundError, json.JSONDecodeError):  # not yet written / a line being written
        return []


def _nothing_half_written_looks_complete(workdir):
    """Every file under its final name is whole; every step folder Orbax would list is committed."""
    for path in workdir.rglob("eval_results.json"):
        assert "dev" in json.loads(path.read_text()) or "best" in json.loads(path.read_text())
    for path in workdir.rglob("dev_predictions/*.tsv"):
        assert len(path.read_text().splitlines()) == 11, path  # header + 10 dev sentences
    for path in workdir.rglob("glue_predictions/*.tsv"):
        assert len(path.read_text().splitlines()) == 8, path  # header + 7 test sentences
    for folder in [*workdir.rglob("checkpoints"), *workdir.rglob("best")]:
        for step in folder.iterdir():
            assert not step.name.isdigit() or (step / "_CHECKPOINT_METADATA").exists(), step


@pytest.mark.slow
def test_kill9_of_finetuning_mid_write_and_mid_training_then_resume_exactly(
    tmp_path, finetune_reference
):
    root = finetune_reference
    rng = np.random.default_rng(SEED)
    workdir = tmp_path / "run"
    # 1. kill -9 in the middle of a (seeded) write of seed 0's run: its best checkpoint (step 3),
    # its dev predictions, its GLUE test predictions or its eval_results.json.
    write = str(rng.choice(FT_WRITES))
    fault = {"BERTJAX_FAULT_SLOW_SAVE_STEP": "3"} if write == "best/3" else {}
    fault = fault or {"BERTJAX_FAULT_SLOW_WRITE": write}
    proc = _finetune(root, workdir, fault)
    pattern = "best/3.orbax-checkpoint-tmp" if write == "best/3" else f".{write}.tmp-*"
    wait_for(lambda: bool(list(workdir.rglob(pattern))), proc)
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    _nothing_half_written_looks_complete(workdir)
    assert not (workdir / "eval_results.json").exists()
    # 2. kill -9 at a seeded random training step of seed 1 (after the resumed seed 0 finishes),
    # in a Python without TensorFlow (as the GPU machine is): fine-tuning imports none.
    killed_at = int(rng.integers(1, 7))
    proc = _finetune(
        root, workdir, {"PYTHONPATH": f"{REPO / 'tests' / 'no_tensorflow'}{os.pathsep}{REPO}"}
    )
    wait_for(lambda: killed_at in [s for s, _ in _rows(workdir / "seed_1", "train")], proc)
    time.sleep(float(rng.uniform(0.0, 0.3)))
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    _nothing_half_written_looks_complete(workdir)
    # 3. a plain run (in process: what it resumes from is on disk) finishes: the metrics,
    # predictions and results of the uninterrupted run.
    _finetune_in_process(root, workdir)
    _nothing_half_written_looks_complete(workdir)
    ref = root / "reference"
    for seed in ("seed_0", "seed_1"):
        got, want = _rows(workdir / seed, "train"), _rows(ref / seed, "train")
        assert [s for s, _ in got] == list(range(1, 7)), (seed, write, killed_at)
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-6)
        assert _rows(workdir / seed, "eval") == _rows(ref / seed, "eval")
        for name in ("dev_predictions/sst2-dev.tsv", "glue_predictions/SST-2.tsv"):
            assert (workdir / seed / name).read_text() == (ref / seed / name).read_text()
    got, want = (json.loads((d / "eval_results.json").read_text()) for d in (workdir, ref))
    for key in ("best_seed", "median", "best"):
        assert got[key] == want[key], key
    for seed in ("0", "1"):
        assert got["seeds"][seed]["dev"] == want["seeds"][seed]["dev"]
        assert got["seeds"][seed]["best_value"] == want["seeds"][seed]["best_value"]


def test_a_relative_checkpoint_directory_saves(tmp_path, monkeypatch):
    import jax.numpy as jnp

    monkeypatch.chdir(tmp_path)  # `make pretrain`'s WORKDIR=workdirs/demo is relative
    ckpt = checkpointing.Checkpointer("workdirs/demo/checkpoints", async_save=True)
    ckpt.save(1, {"w": jnp.ones((2,))}, {}, "{}", force=True)
    ckpt.close()
    assert (tmp_path / "workdirs/demo/checkpoints/1/_CHECKPOINT_METADATA").exists()


def test_a_retired_step_is_renamed_aside_before_its_files_are_removed(tmp_path, monkeypatch):
    """Orbax removes an old step file by file: a kill -9 in between (seen in CI) left a step folder
    without its files. bertjax has it renamed into ``.deleted/`` first, then removes it there."""
    import jax.numpy as jnp

    unlinked, rmtree = [], checkpointing.shutil.rmtree
    real_unlink = os.unlink
    monkeypatch.setattr(
        os, "unlink", lambda p, *a, **k: (unlinked.append(str(p)), real_unlink(p, *a, **k))[1]
    )
    # a kill before bertjax removes what Orbax renamed aside
    monkeypatch.setattr(checkpointing.shutil, "rmtree", lambda *a, **k: None)
    directory = tmp_path / "ck"
    ckpt = checkpointing.Checkpointer(str(directory), keep=2, async_save=True)
    for step in (1, 2, 3):
        ckpt.save(step, {"w": jnp.full((2,), step)}, {}, "{}", force=True)
    ckpt.close()
    steps = sorted(p.name for p in directory.iterdir() if p.name.isdigit())
    assert steps == ["2", "3"] and (directory / ".deleted" / "1" / "_CHECKPOINT_METADATA").exists()
    assert not [p for p in unlinked if os.path.relpath(p, directory).split(os.sep)[0].isdigit()]
    monkeypatch.setattr(checkpointing.shutil, "rmtree", rmtree)
    again = checkpointing.Checkpointer(str(directory), keep=2)  # the rerun removes it
    assert again.all_steps() == [2, 3] and list((directory / ".deleted").iterdir()) == []
    again.close()

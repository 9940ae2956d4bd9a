"""The trainer: smoke run, 1-device == 8-device losses, accumulation, resume after SIGTERM, Ctrl-C
and SIGKILL (one run stopped all three ways)."""

import json
import logging
import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import wait_for
from train_fixtures import read_metrics, tiny_config

from bertjax import train
from bertjax.tasks.base import Task, register

REPO = pathlib.Path(__file__).resolve().parent.parent
# The tiny preset with one of its two layers, where what a test compares (1 device against 8,
# accumulated against whole, resumed against uninterrupted) holds at any depth: half the compile.
ONE_LAYER = {"model.num_layers": 1}


def _losses(workdir, key="loss"):
    return [r[key] for r in read_metrics(workdir)]


def test_smoke_run_logs_evaluates_and_checkpoints(tmp_path, caplog):
    config = tiny_config(
        tmp_path, steps=4, **{"train.eval_every": 2, "train.eval_steps": 1, "tensorboard": True}
    )
    with caplog.at_level(logging.INFO, logger="bertjax"):
        result = train.train_and_evaluate(config, str(tmp_path / "run"))
    # The console: the compilation announced before the first step, then its time; short train
    # lines; no ETA until steps after the compiling one were timed.
    lines = [r.getMessage() for r in caplog.records if r.name == "bertjax"]
    train_lines = [x for x in lines if x.startswith("[train]")]
    compiling = lines.index("compiling the train step (phase 1/1, batch 8 x seq 16) ...")
    assert compiling < lines.index(train_lines[0]) and lines[compiling + 1].startswith(
        "compiled the train step in "
    )
    assert train_lines[0].startswith("[train] step 1/4 loss=") and "eta" not in train_lines[0]
    assert " eta " in train_lines[-1] and all(len(x) < 160 for x in train_lines), train_lines
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in (
        "loss",
        "mlm_loss",
        "nsp_loss",
        "mlm_accuracy",
        "nsp_accuracy",
        "learning_rate",
        "grad_norm",
        "seq_per_sec",
        "tokens_per_sec",
        "tflops_per_device",
    ):
        assert all(np.isfinite(r[key]) for r in records), key
    evals = read_metrics(tmp_path / "run", "eval")
    assert [r["step"] for r in evals] == [0, 2, 4] and "mlm_accuracy" in evals[0]
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2", "4"]
    assert os.listdir(tmp_path / "run" / "tensorboard")
    assert result["step"] == 4
    # The learning rate follows warmup (1 step) then linear decay to 0 at step 4.
    np.testing.assert_allclose([r["learning_rate"] for r in records], [0.0, 7.5e-4, 5e-4, 2.5e-4])


def test_eight_devices_with_data_fsdp_tensor_match_one_device(tmp_path):
    """With LAMB, whose per-tensor trust ratios need whole-tensor norms of sharded parameters (its
    numerics against the reference: tests/test_training_parity.py)."""
    lamb = {"optimizer.name": "lamb", **ONE_LAYER}
    one = tiny_config(tmp_path, steps=3, **{"mesh.num_devices": 1, **lamb})
    train.train_and_evaluate(one, str(tmp_path / "one"))
    mesh = {"mesh.num_devices": 0, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}
    eight = tiny_config(tmp_path, steps=3, **{**mesh, **lamb})
    setup = train.build(eight, str(tmp_path / "eight_probe"), _prepared_task(eight, tmp_path))
    # Parameters really are split: the MLP kernel over fsdp x tensor, the embeddings over both too.
    spec = setup.state_shardings.params["bert"]["encoder"]["layer_0"]["intermediate"]["kernel"].spec
    assert tuple(spec) == ("fsdp", "tensor")
    train.train_and_evaluate(eight, str(tmp_path / "eight"))
    for key in ("loss", "mlm_loss", "nsp_loss", "grad_norm"):
        a, b = np.array(_losses(tmp_path / "one", key)), np.array(_losses(tmp_path / "eight", key))
        np.testing.assert_allclose(b, a, rtol=1e-5, err_msg=key)


def _prepared_task(config, tmp_path):
    from bertjax.tasks.registry import get_task

    task = get_task("pretrain", config, str(tmp_path))
    task.after_prepare()
    return task


def test_gradient_accumulation_equals_the_whole_batch(tmp_path):
    whole = tiny_config(tmp_path, steps=2, **ONE_LAYER)
    train.train_and_evaluate(whole, str(tmp_path / "whole"))
    accum = tiny_config(tmp_path, steps=2, **{"train.grad_accum_steps": 4, **ONE_LAYER})
    train.train_and_evaluate(accum, str(tmp_path / "accum"))
    for key in ("loss", "mlm_accuracy", "grad_norm", "param_norm"):
        np.testing.assert_allclose(
            _losses(tmp_path / "accum", key),
            _losses(tmp_path / "whole", key),
            rtol=2e-5,
            err_msg=key,
        )


@register("test/nan_loss")
class _NanTask(Task):
    """Pretraining whose loss turns NaN: the trainer must stop and name the step."""

    def __new__(cls, config, workdir):
        from bertjax.tasks.pretraining import PretrainingTask

        class Nan(PretrainingTask):
            def loss(self, *args, **kwargs):
                loss, metrics = super().loss(*args, **kwargs)
                return loss * jax.numpy.nan, metrics

        return Nan(config, workdir)


def test_non_finite_loss_stops_with_the_step(tmp_path):
    config = tiny_config(tmp_path, steps=3, task="test/nan_loss")
    with pytest.raises(FloatingPointError, match="non-finite loss nan at step 1"):
        train.train_and_evaluate(config, str(tmp_path / "nan"))


def test_vocab_size_disagreeing_with_model_config_is_an_error(tmp_path):
    config = tiny_config(tmp_path, steps=1)
    with config.unlocked():
        config.model.vocab_size = 999
    with pytest.raises(ValueError, match="model.vocab_size=999 disagrees with the vocabulary"):
        train.train_and_evaluate(config, str(tmp_path / "bad"))


# The resume test's run: the 10-step tiny config with these keys, as `bertjax pretrain` flags in
# _cli and as the in-process rerun's overrides.
RESUMED_RUN = {"train.checkpoint_every": 3, "train.async_checkpoints": True, **ONE_LAYER}


def _cli(tmp_path, workdir, *extra, stderr=subprocess.STDOUT, hold_step=None):
    """`bertjax pretrain` of the 10-step tiny config in the background; with ``hold_step``, the run
    waits after that step for a stop request (tests/fault_inject.py), so that a signal sent after an
    earlier step always lands before the end, however busy the machine is."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    if hold_step is not None:
        env["BERTJAX_FAULT_HOLD_STEP"] = str(hold_step)
    cmd = [
        sys.executable,
        str(REPO / "tests" / "fault_inject.py"),
        "pretrain",
        f"--config={REPO}/tests/tiny_pretrain_config.py:{tmp_path}",
        f"--workdir={workdir}",
        *(f"--config.{k}={v}" for k, v in RESUMED_RUN.items()),
        *extra,
    ]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
    )


def _logged_steps(workdir):
    path = pathlib.Path(workdir, "metrics.jsonl")
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:
            pass
    return steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 10-step run of tests/tiny_pretrain_config.py (the same data and losses in
    any folder), shared by the resume tests."""
    root = tmp_path_factory.mktemp("reference")
    train.train_and_evaluate(tiny_config(root, steps=10, **ONE_LAYER), str(root / "run"))
    return root / "run"


def _checkpoints(workdir) -> list[int]:
    return sorted(int(s) for s in os.listdir(pathlib.Path(workdir, "checkpoints")) if s.isdigit())


@pytest.mark.slow
def test_sigterm_ctrl_c_and_sigkill_each_resume_to_the_uninterrupted_run(
    tmp_path, reference, caplog
):
    """One 10-step run stopped three ways, each time resumed by the same command (checkpoints every
    3 steps): SIGTERM after step 2 saves step 2 and exits 0; Ctrl-C after step 5 saves step 5 and
    exits 130 in one line; SIGKILL after step 8 loses steps 7-8, redone from step 6's checkpoint
    (that last run in process).
    The finished run logged each step once and has the uninterrupted run's losses."""
    workdir = tmp_path / "run"
    log_every = "--config.train.log_every=1"

    term = _cli(tmp_path, workdir, log_every, hold_step=2)
    wait_for(lambda: max(_logged_steps(workdir), default=0) >= 2, term)
    term.send_signal(signal.SIGTERM)
    out, _ = term.communicate(timeout=600)
    assert term.returncode == 0, out[-3000:]
    assert "saving a checkpoint" in out
    assert _checkpoints(workdir) == [2] and max(_logged_steps(workdir)) == 2  # where it stopped

    ctrl_c = _cli(tmp_path, workdir, log_every, stderr=subprocess.PIPE, hold_step=5)
    wait_for(lambda: max(_logged_steps(workdir), default=0) >= 5, ctrl_c)
    ctrl_c.send_signal(signal.SIGINT)
    out, err = ctrl_c.communicate(timeout=600)
    assert ctrl_c.returncode == 130, out[-3000:] + err[-3000:]
    assert f"resumed from {workdir / 'checkpoints'} at step 2" in out
    assert err.strip().splitlines() == [
        "bertjax pretrain: interrupted (Ctrl-C): stopped at step 5 after saving a checkpoint; "
        "the same command resumes"
    ], err[-3000:]
    assert "Ctrl-C (SIGINT) received: saving a checkpoint" in out
    assert _checkpoints(workdir)[-1] == 5

    kill = _cli(tmp_path, workdir, log_every, hold_step=8)
    wait_for(lambda: 6 in _checkpoints(workdir) and max(_logged_steps(workdir)) >= 8, kill)
    kill.send_signal(signal.SIGKILL)
    kill.wait()
    assert max(_logged_steps(workdir)) == 8

    # The rerun in process (what it resumes from is on disk; the command's config, as _cli's).
    with caplog.at_level(logging.INFO, logger="bertjax"):
        train.train_and_evaluate(tiny_config(tmp_path, steps=10, **RESUMED_RUN), str(workdir))
    assert f"resumed from {workdir / 'checkpoints'} at step 6" in caplog.text
    assert [r["step"] for r in read_metrics(workdir)] == list(range(1, 11))
    np.testing.assert_allclose(_losses(workdir), _losses(reference), rtol=1e-6)


def test_ctrl_c_is_handled_by_the_command_only():
    """The library leaves SIGINT alone; the command's handler is gone after its run."""
    from bertjax.preemption import CtrlCSaves, StopFlag

    before = signal.getsignal(signal.SIGINT)
    stop = StopFlag()
    stop.install()
    try:
        assert signal.getsignal(signal.SIGINT) is before
        with CtrlCSaves() as ctrl_c:
            signal.raise_signal(signal.SIGINT)  # the first: a checkpoint at the next step
            assert stop.requested and ctrl_c.pressed
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)  # the second: out at once
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before and StopFlag.active is None


def test_unknown_config_key_fails_in_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bertjax.cli",
            "pretrain",
            "--config=configs/demo.py",
            f"--workdir={tmp_path}",
            "--config.train.stepz=3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "stepz" in proc.stderr

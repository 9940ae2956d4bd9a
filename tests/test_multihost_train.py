"""Many hosts: 2 processes == 1 process, restore onto another mesh / process count, FSDP memory; two
processes sharing a WORKDIR in a bucket (the local GCS emulator, tests/gcs_emulator.py)."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import xla_flags
from train_fixtures import read_metrics, tiny_config

from bertjax import compile as aot
from bertjax import fs, train
from bertjax.tasks.registry import get_task
from configs import base

REPO = pathlib.Path(__file__).resolve().parent.parent


# The default data.streams (8; the other tests' tiny runs read 2) and dropout: 2 processes x 2
# devices read the same examples in the same global rows as 1 process x 4 devices, so even the
# dropout masks, and the losses, agree.
DROPOUT = {"model.hidden_dropout": 0.1, "model.attention_dropout": 0.1}
# Every run here, in process and by _local; the tiny preset with one of its two layers (what is
# compared is the losses of process counts and meshes: they agree at any depth; half the compile).
RUN = {"train.checkpoint_every": 3, "model.num_layers": 1, "data.streams": 8, **DROPOUT}


def _losses(workdir):
    if fs.is_remote(str(workdir)):
        lines = fs.read_bytes(f"{workdir}/metrics.jsonl").decode().splitlines()
        return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["split"] == "train"]
    return [(r["step"], r["loss"]) for r in read_metrics(workdir)]


def _local(tmp_path, nproc, devices, workdir, *extra, timeout=420):
    """launch/local.sh NPROC processes of DEVICES devices; their logs in tmp_path/logs."""
    env = dict(
        os.environ,
        BERTJAX_CMD=f"{sys.executable} -m bertjax.cli",
        STOP_GRACE_S="2",
        LOG_DIR=str(tmp_path / "logs"),
        PYTHONUNBUFFERED="1",
    )
    env["XLA_FLAGS"] = xla_flags()  # local.sh adds the device count
    cmd = [
        "bash",
        str(REPO / "launch" / "local.sh"),
        str(nproc),
        "--devices_per_process",
        str(devices),
        "--",
        "pretrain",
        f"--config={REPO}/tests/tiny_pretrain_config.py:{tmp_path}",
        f"--workdir={workdir}",
        "--config.mesh.num_devices=0",  # every device of every process
        "--config.train.steps=6",
        *(f"--config.{k}={v}" for k, v in RUN.items()),
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(step, loss) of the 6-step run of 1 process of 4 devices, shared by the tests that compare
    other process counts with it (the same data in any folder)."""
    root = tmp_path_factory.mktemp("reference")
    config = tiny_config(root, steps=6, **{"mesh.num_devices": 4, **RUN})
    assert config.data.streams == base.get_config().data.streams
    train.train_and_evaluate(config, str(root / "one"))
    return _losses(root / "one")


@pytest.mark.slow
def test_two_processes_in_a_bucket_resume_on_two_and_on_one(gcs_bucket, tmp_path, reference):
    """launch/local.sh 2 with WORKDIR in a bucket, stopped at step 3: the step is written once
    (one commit, each process's arrays). Started again, both processes resume from it; a copy of
    it resumes on one process. Each run gives the one-process run's losses: the default input is
    the same run on any host count, dropout included."""
    run = f"{gcs_bucket}/two"
    _local(tmp_path, 2, 2, run, "--config.train.stop_at_step=3")
    assert [s for s, _ in _losses(run)] == [1, 2, 3]
    step = fs.list_files(f"{run}/checkpoints/3")
    assert step.count("commit_success.txt") == 1
    processes = {n.split("/")[1] for n in step if n.startswith("state/ocdbt.process_")}
    assert processes == {"ocdbt.process_0", "ocdbt.process_1"}, step
    moved = f"{gcs_bucket}/moved"
    for name in fs.list_files(run):
        fs.write_bytes(f"{moved}/{name}", fs.read_bytes(f"{run}/{name}"))
    _local(tmp_path, 2, 2, run)
    assert (
        f"resumed from {run}/checkpoints at step 3" in (tmp_path / "logs/process_0.log").read_text()
    )
    assert (tmp_path / "logs" / "process_1.log").exists()  # only process 0 wrote metrics
    config = tiny_config(tmp_path, steps=6, **{"mesh.num_devices": 2, **RUN})
    train.train_and_evaluate(config, moved)  # 1 process, 2 devices, resumes at step 3
    for workdir in (run, moved):
        got = _losses(workdir)
        assert [s for s, _ in got] == [s for s, _ in reference] == list(range(1, 7))
        np.testing.assert_allclose([v for _, v in got], [v for _, v in reference], rtol=1e-5)
    assert not fs.exists(f"{run}/run.lock")


def test_checkpoint_restores_onto_another_mesh(tmp_path, reference):
    fsdp = {"mesh.num_devices": 4, "mesh.data": 1, "mesh.fsdp": 4}
    first = tiny_config(tmp_path, steps=6, **{**fsdp, **RUN, "train.stop_at_step": 3})
    workdir = tmp_path / "resharded"
    train.train_and_evaluate(first, str(workdir))
    assert sorted(os.listdir(workdir / "checkpoints")) == ["3"]
    # fsdp=4 on 4 devices -> data=2 x tensor=1 on 2 devices, and -> data=8 on 8 devices.
    for name, overrides in (
        ("two", {"mesh.num_devices": 2, "mesh.data": 2}),
        ("eight", {"mesh.num_devices": 0, "mesh.data": -1}),
    ):
        target = tmp_path / f"resharded_{name}"
        shutil.copytree(workdir, target)
        train.train_and_evaluate(tiny_config(tmp_path, steps=6, **RUN, **overrides), str(target))
        np.testing.assert_allclose(
            [v for _, v in _losses(target)], [v for _, v in reference], rtol=1e-5, err_msg=name
        )


def test_compile_reports_fsdp_memory_an_eighth_of_data_parallel(tmp_path):
    reports = {}
    for name, mesh in (("data", {"mesh.data": 8}), ("fsdp", {"mesh.data": 1, "mesh.fsdp": 8})):
        config = tiny_config(tmp_path, steps=2, **{"mesh.num_devices": 0, **mesh})
        task = get_task("pretrain", config, str(tmp_path))
        task.after_prepare()
        reports[name] = aot.compile_train_step(config, str(tmp_path), task=task)
    ratio = reports["fsdp"]["state_bytes_per_device"] / reports["data"]["state_bytes_per_device"]
    assert 0.12 <= ratio < 0.2, ratio  # parameters + Adam moments split 8 ways (small vectors stay)
    assert reports["fsdp"]["argument_size_in_bytes"] < reports["data"]["argument_size_in_bytes"]

"""Tests for launch/: tpu_vm.sh dry runs, slurm_gpu.sbatch with a fake srun, local.sh end to end."""

import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
LAUNCH = REPO_ROOT / "launch"
SCRIPTS = [LAUNCH / "local.sh", LAUNCH / "tpu_vm.sh", LAUNCH / "slurm_gpu.sbatch"]
PROBE = REPO_ROOT / "tests" / "multihost_probe.py"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse_and_pass_shellcheck(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    proc = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


# ----------------------------------------------------------------------------- tpu_vm.sh

TPU_ENV = {"TPU_NAME": "bert-v4", "ZONE": "us-central2-b", "ACCELERATOR_TYPE": "v4-32"}
GCLOUD = ["gcloud", "compute", "tpus", "tpu-vm"]
WHERE = ["--zone=us-central2-b", "--project=my-proj"]


def tpu_vm(*args, env=None, tmp_path=None):
    """Runs tpu_vm.sh with only PATH/HOME from the caller's environment plus ``env``."""
    clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    if tmp_path is not None:
        clean["TMPDIR"] = str(tmp_path)
    clean.update(env or {})
    return subprocess.run(
        ["bash", str(LAUNCH / "tpu_vm.sh"), *args], env=clean, capture_output=True, text=True
    )


def dry_run_lines(*args, env=None, tmp_path=None):
    proc = tpu_vm(*args, "--dry-run", env={**TPU_ENV, **(env or {})}, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_create_dry_run():
    lines = dry_run_lines("create", "--project", "my-proj", "--spot")
    assert lines == [
        shlex.join(
            [*GCLOUD, "create", "bert-v4", *WHERE, "--accelerator-type=v4-32"]
            + ["--version=tpu-ubuntu2204-base", "--spot"]
        )
    ]
    lines = dry_run_lines(
        "create", "--preemptible", env={"ACCELERATOR_TYPE": "v5litepod-16", "PROJECT": "my-proj"}
    )
    assert lines[0].endswith(
        "--accelerator-type=v5litepod-16 --version=v2-alpha-tpuv5-lite --preemptible"
    )
    lines = dry_run_lines(
        "create", "--runtime_version=custom-rt", env={"ACCELERATOR_TYPE": "v9x-8"}
    )
    assert lines[0].endswith("--zone=us-central2-b --accelerator-type=v9x-8 --version=custom-rt")


def test_setup_dry_run_copies_this_checkout(tmp_path):
    lines = dry_run_lines("setup", "--project=my-proj", tmp_path=tmp_path)
    tarball = f"{tmp_path}/bertjax-src-bert-v4.tar.gz"
    repo = str(REPO_ROOT)
    pack = (
        f"git -C {shlex.quote(repo)} ls-files -z --cached --others --exclude-standard | tar --null "
        f"--ignore-failed-read -czf {shlex.quote(tarball)} -C {shlex.quote(repo)} -T -"
    )
    unpack = "mkdir -p bertjax && tar -xzf bertjax-src.tar.gz -C bertjax && rm bertjax-src.tar.gz"
    assert lines == [
        shlex.join(["bash", "-c", pack]),
        shlex.join([*GCLOUD, "scp", tarball, "bert-v4:bertjax-src.tar.gz", *WHERE, "--worker=all"]),
        shlex.join([*GCLOUD, "ssh", "bert-v4", *WHERE, "--worker=all", "--command", unpack]),
        shlex.join(
            [*GCLOUD, "ssh", "bert-v4", *WHERE, "--worker=all", "--command"]
            + ["cd bertjax && make install"]
        ),
    ]


def test_setup_dry_run_clones_a_url():
    url = "https://github.com/example/bertjax.git"
    lines = dry_run_lines("setup", "--repo", url, "--remote_dir", "src/bj")
    fetch = (
        f"if [ -d src/bj/.git ]; then git -C src/bj pull --ff-only; else git clone {url} src/bj; fi"
    )
    assert lines == [
        shlex.join(
            [*GCLOUD, "ssh", "bert-v4", "--zone=us-central2-b", "--worker=all", "--command", fetch]
        ),
        shlex.join(
            [*GCLOUD, "ssh", "bert-v4", "--zone=us-central2-b", "--worker=all", "--command"]
            + ["cd src/bj && make install"]
        ),
    ]


def test_run_dry_run_quotes_args_for_the_remote_shell():
    args = "--config.total_steps=1000 --config.note='it''s'"
    lines = dry_run_lines(
        "run",
        "--config=configs/bert_base.py",
        "--workdir",
        "gs://bkt/run 1".replace(" ", "_"),
        "--args",
        args,
        env={"PROJECT": "my-proj"},
    )
    assert len(lines) == 1
    words = shlex.split(lines[0])
    assert words[:9] == [*GCLOUD, "ssh", "bert-v4", *WHERE, "--worker=all"]
    assert words[9] == "--command" and len(words) == 11
    remote = words[10]
    start = remote.index("setsid nohup ")
    launch = shlex.split(remote[start : remote.index(" > logs/pretrain.log")])
    assert launch == [
        "setsid",
        "nohup",
        "make",
        "pretrain",
        "CONFIG=configs/bert_base.py",
        "WORKDIR=gs://bkt/run_1",
        f"ARGS={args}",
    ]
    assert remote.startswith("cd bertjax && mkdir -p logs || exit 1;")
    assert "2>&1 < /dev/null & echo $! > logs/pretrain.pid;" in remote


def test_status_logs_stop_delete_dry_run():
    status = dry_run_lines("status")
    assert status[0] == shlex.join(
        [*GCLOUD, "describe", "bert-v4", "--zone=us-central2-b"]
        + ["--format", "value(state,health,acceleratorType)"]
    )
    assert shlex.split(status[1])[:8] == [
        *GCLOUD,
        "ssh",
        "bert-v4",
        "--zone=us-central2-b",
        "--worker=all",
    ]
    assert "kill -0" in status[1] and "bertjax/logs/pretrain.pid" in status[1]
    assert dry_run_lines("logs", "--lines=20") == [
        shlex.join(
            [*GCLOUD, "ssh", "bert-v4", "--zone=us-central2-b", "--worker=0", "--command"]
            + ["tail -n 20 -F bertjax/logs/pretrain.log"]
        )
    ]
    stop = shlex.split(dry_run_lines("stop")[0])
    assert stop[:9] == [
        *GCLOUD,
        "ssh",
        "bert-v4",
        "--zone=us-central2-b",
        "--worker=all",
        "--command",
    ]
    assert "kill -TERM -- -$pid" in stop[9] and "kill -KILL -- -$pid" in stop[9]
    assert dry_run_lines("delete", env={"PROJECT": "my-proj"}) == [
        shlex.join([*GCLOUD, "delete", "bert-v4", *WHERE, "--quiet"])
    ]


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["create"], {"ZONE": ""}, "ZONE is not set (use --zone or ZONE=...)"),
        (["create"], {"TPU_NAME": ""}, "TPU_NAME is not set (use --tpu_name or TPU_NAME=...)"),
        (["create"], {"TPU_NAME": "Bert_1"}, "TPU_NAME='Bert_1' is not valid"),
        (
            ["create"],
            {"ACCELERATOR_TYPE": "v9x-8"},
            "RUNTIME_VERSION is not set and there is no default for v9x-8",
        ),
        (["create"], {"ACCELERATOR_TYPE": "tpu4"}, "ACCELERATOR_TYPE='tpu4' is not valid"),
        (["create", "--spot", "--preemptible"], {}, "choose one of --spot and --preemptible"),
        (["launch"], {}, "unknown subcommand 'launch'"),
        ([], {}, "no subcommand"),
        (["run", "stop"], {}, "unexpected argument 'stop' after subcommand 'run'"),
        (["run", "--bogus"], {}, "unknown option '--bogus'"),
        (["run", "--config"], {}, "--config needs a value"),
        (["run", "--workdir=gs://b/w"], {}, "CONFIG is not set (use --config or CONFIG=...)"),
        (["run", "--config=c.py", "--workdir=/tmp/w"], {}, "WORKDIR='/tmp/w' is not valid"),
        (["setup", "--repo=/nonexistent"], {}, "REPO='/nonexistent' is neither a git URL"),
        (["logs", "--worker=x"], {}, "--worker must be a worker number"),
        (["stop", "--project=Bad Project"], {}, "PROJECT='Bad Project' is not a valid project id"),
    ],
)
def test_bad_settings_give_one_line_errors(args, env, message):
    proc = tpu_vm(*args, "--dry-run", env={**TPU_ENV, **env})
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("tpu_vm.sh: error: ")
    assert message in proc.stderr


def test_help_lists_every_subcommand():
    proc = tpu_vm("--help")
    assert proc.returncode == 0
    for sub in ("create", "setup", "run", "status", "logs", "stop", "delete", "--dry-run"):
        assert re.search(rf"^\s+{re.escape(sub)}\b", proc.stdout, re.M), sub


# ----------------------------------------------------------------------------- slurm_gpu.sbatch


@pytest.mark.parametrize(
    "tasks_per_node, expected_extra",
    [("8", []), ("1", ["--distributed.local_device_ids=0,1,2,3"])],
)
def test_sbatch_builds_the_srun_line(tmp_path, tasks_per_node, expected_extra):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$SRUN_LOG"\n')
    (fake_bin / "srun").chmod(0o755)
    (tmp_path / "cfg.py").write_text("")
    env = {
        "PATH": f"{fake_bin}:{os.environ['PATH']}",
        "SRUN_LOG": str(tmp_path / "srun.args"),
        "SLURM_JOB_ID": "77",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURM_NTASKS_PER_NODE": tasks_per_node,
        "SLURM_GPUS_ON_NODE": "4",
        "CONFIG": "cfg.py",
        "WORKDIR": "/shared/w",
        "PYTHON": sys.executable,
        "ARGS": "--config.total_steps=10 --config.seed=3",
    }
    proc = subprocess.run(
        ["bash", str(LAUNCH / "slurm_gpu.sbatch")], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    srun_args = (tmp_path / "srun.args").read_text().splitlines()
    assert srun_args == [
        "--kill-on-bad-exit=1",
        "--label",
        sys.executable,
        "-m",
        "bertjax.cli",
        "pretrain",
        "--config=cfg.py",
        "--workdir=/shared/w",
        "--config.total_steps=10",
        "--config.seed=3",
        *expected_extra,
    ]


def test_sbatch_outside_slurm_fails_with_one_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(
        ["bash", str(LAUNCH / "slurm_gpu.sbatch")], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr == "slurm_gpu.sbatch: error: submit with sbatch (SLURM_JOB_ID is not set)\n"


# ----------------------------------------------------------------------------- local.sh


class LocalRun:
    """launch/local.sh in the background, its console collected line by line by a thread."""

    def __init__(self, tmp_path, nproc, command, *args, extra_env=None):
        env = {**os.environ, "LOG_DIR": str(tmp_path / "logs"), "BERTJAX_CMD": command}
        env.update(extra_env or {})
        self.proc = subprocess.Popen(
            ["bash", str(LAUNCH / "local.sh"), str(nproc), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def console(self) -> str:
        return "".join(self.lines)

    def pids(self) -> list[int]:
        """Process ids local.sh announced, in process order."""
        return [int(p) for p in re.findall(r"started process \d+ \(pid (\d+)\)", self.console)]

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return rc


def probe_results(log_dir: pathlib.Path, nproc: int) -> list[dict]:
    results = []
    for k in range(nproc):
        lines = (log_dir / f"process_{k}.log").read_text().splitlines()
        found = [json.loads(x.split(" ", 1)[1]) for x in lines if x.startswith("PROBE_RESULT ")]
        assert len(found) == 1, f"process {k}: {lines[-20:]}"
        results.append(found[0])
    return results


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_local_two_processes_agree_on_a_cross_process_sum(tmp_path):
    run = LocalRun(
        tmp_path,
        2,
        f"{sys.executable} {PROBE}",
        "--devices_per_process",
        "2",
        "--",
        "--distributed.timeout_s=300",
    )
    assert run.wait(timeout=600) == 0, run.console[-3000:]
    assert "local.sh: all 2 processes finished OK" in run.console
    assert "PROBE_RESULT " in run.console  # process 0 is echoed to the console
    first, second = probe_results(tmp_path / "logs", 2)
    for k, result in enumerate((first, second)):
        assert result["mode"] == "explicit"
        assert result["info"]["process_index"] == k
        assert result["info"]["process_count"] == 2
        assert (result["info"]["local_device_count"], result["info"]["device_count"]) == (2, 4)
        assert result["is_coordinator"] == (k == 0)
        assert result["global_shape"] == [12, 2]
        assert result["total"] == result["expected_total"] == 12132.0
        assert result["broadcast"] == {"seed": 1234}  # process 0's value everywhere
        assert result["disagreement"].startswith("hosts disagree on process index: process ids [1]")
    assert first["total"] == second["total"]
    assert first["info"]["local_devices"] != second["info"]["local_devices"]


def test_local_stops_everyone_when_one_process_is_killed(tmp_path):
    # Process 0 would stay up for an hour after its result: only local.sh can end it this soon.
    run = LocalRun(
        tmp_path,
        2,
        f"{sys.executable} {PROBE}",
        "--devices_per_process=2",
        "--",
        "--sleep_s=3600",
        "--distributed.timeout_s=300",
        extra_env={"STOP_GRACE_S": "2"},
    )
    log1 = tmp_path / "logs" / "process_1.log"
    deadline = time.monotonic() + 600
    while not (log1.exists() and "PROBE_RESULT" in log1.read_text()):
        assert time.monotonic() < deadline and run.proc.poll() is None, run.console[-2000:]
        time.sleep(0.2)
    pid0, pid1 = run.pids()
    os.kill(pid1, signal.SIGKILL)
    assert run.wait(timeout=600) == 1
    message = (
        f"local.sh: error: process 1 (pid {pid1}) exited with status 137 (killed by signal KILL)"
    )
    assert message in run.console and f"see {log1}" in run.console, run.console[-2000:]
    assert not pid_alive(pid0)


def test_local_reports_a_failing_process_by_number(tmp_path):
    script = tmp_path / "fail_one.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['BERTJAX_PROCESS_ID'] == '2':\n    sys.exit('bad config on process 2')\n"
        "time.sleep(3600)\n"
    )
    run = LocalRun(tmp_path, 3, f"{sys.executable} {script}", "--", extra_env={"STOP_GRACE_S": "1"})
    assert run.wait(timeout=600) == 1  # the others (an hour's sleep) were stopped
    assert "process 2 (pid" in run.console and "exited with status 1;" in run.console
    assert "bad config on process 2" in (tmp_path / "logs" / "process_2.log").read_text()
    assert len(run.pids()) == 3 and not any(pid_alive(pid) for pid in run.pids())


@pytest.mark.parametrize(
    "args, message",
    [
        (["0", "--"], "NPROC must be a positive integer, got '0'"),
        (
            ["2", "--devices_per_process", "x", "--"],
            "--devices_per_process must be a positive integer, got 'x'",
        ),
        (["2", "--gpus", "--"], "unknown option '--gpus' before '--' (see --help)"),
    ],
)
def test_local_bad_arguments(tmp_path, args, message):
    proc = subprocess.run(
        ["bash", str(LAUNCH / "local.sh"), *args],
        env={**os.environ, "LOG_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr == f"local.sh: error: {message}\n"

"""Tests for bertjax.distributed: settings, mode choice, the roll call, helpers, fail-fast start-up."""

import os
import pathlib
import socket
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from absl import flags
from helpers import xla_flags
from ml_collections import ConfigDict

from bertjax import distributed

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PROBE = REPO_ROOT / "tests" / "multihost_probe.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clean_env(monkeypatch):
    """No BERTJAX_* and no SLURM_* variables."""
    for key in list(os.environ):
        if key.startswith(("BERTJAX_", "SLURM_")) or key == "JAX_COORDINATOR_PORT":
            monkeypatch.delenv(key)
    return monkeypatch


# ----------------------------------------------------------------------------- flags


def test_define_flags_is_idempotent_and_accepts_dotted_names():
    fv = flags.FlagValues()
    distributed.define_flags(fv)
    distributed.define_flags(fv)
    fv(
        [
            "prog",
            "--distributed.coordinator=10.0.0.2:8476",
            "--distributed.num_processes=4",
            "--distributed.process_id=3",
            "--distributed.local_device_ids=0,1",
            "--distributed.timeout_s=20",
        ]
    )
    assert fv["distributed.coordinator"].value == "10.0.0.2:8476"
    assert fv["distributed.num_processes"].value == 4
    assert fv["distributed.process_id"].value == 3
    assert fv["distributed.local_device_ids"].value == ["0", "1"]
    assert fv["distributed.timeout_s"].value == 20
    assert fv["distributed.heartbeat_timeout_s"].value == 100


def test_flags_reject_negative_process_id():
    fv = flags.FlagValues()
    distributed.define_flags(fv)
    with pytest.raises(flags.IllegalFlagValueError, match="distributed.process_id"):
        fv(["prog", "--distributed.process_id=-1"])


def test_initialize_from_flags_passes_every_flag(monkeypatch):
    fv = flags.FlagValues()
    distributed.define_flags(fv)
    fv(
        ["prog", "--distributed.coordinator=h:1", "--distributed.num_processes=2"]
        + ["--distributed.process_id=1", "--distributed.local_device_ids=2,3"]
    )
    seen = {}
    monkeypatch.setattr(distributed, "initialize", lambda **kw: seen.update(kw) or "explicit")
    assert distributed.initialize_from_flags(fv) == "explicit"
    assert seen == dict(
        coordinator="h:1",
        num_processes=2,
        process_id=1,
        timeout_s=300,
        local_device_ids=[2, 3],
        heartbeat_timeout_s=100,
    )


def test_initialize_from_flags_rejects_non_integer_device_ids():
    fv = flags.FlagValues()
    distributed.define_flags(fv)
    fv(["prog", "--distributed.local_device_ids=0,gpu1"])
    with pytest.raises(distributed.DistributedStartupError, match="local_device_ids=0,gpu1"):
        distributed.initialize_from_flags(fv)


def test_initialize_from_flags_needs_define_flags():
    with pytest.raises(distributed.DistributedStartupError, match="define_flags"):
        distributed.initialize_from_flags(flags.FlagValues())


# ----------------------------------------------------------------------------- mode choice


def test_single_process_is_a_no_op(clean_env):
    clean_env.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("must not run"))
    assert distributed.initialize() == "single"
    assert distributed.initialize(num_processes=1, coordinator="h:1", process_id=0) == "single"


def test_explicit_mode_runs_roll_call_then_jax(clean_env):
    clean_env.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:4567")
    clean_env.setenv(distributed.ENV_NUM_PROCESSES, "3")
    calls = []
    clean_env.setattr(distributed, "roll_call", lambda *a: calls.append(("roll_call", a)))
    clean_env.setattr(jax.distributed, "initialize", lambda **kw: calls.append(("jax", kw)))
    clean_env.setattr(jax.distributed, "is_initialized", lambda: False)
    mode = distributed.initialize(process_id=2, timeout_s=12, heartbeat_timeout_s=7)
    assert mode == "explicit"
    assert calls == [
        ("roll_call", ("127.0.0.1:4567", 3, 2, 12)),
        (
            "jax",
            dict(
                initialization_timeout=12,
                heartbeat_timeout_seconds=7,
                shutdown_timeout_seconds=12,
                coordinator_address="127.0.0.1:4567",
                num_processes=3,
                process_id=2,
            ),
        ),
    ]


def test_jax_value_error_becomes_one_line_startup_error(clean_env):
    clean_env.setattr(distributed, "roll_call", lambda *a: None)
    clean_env.setattr(jax.distributed, "is_initialized", lambda: False)

    def fail(**kw):
        raise ValueError("coordinator_address should be defined.")

    clean_env.setattr(jax.distributed, "initialize", fail)
    with pytest.raises(
        distributed.DistributedStartupError, match=r"^explicit start-up failed: coord"
    ):
        distributed.initialize("h:1", 2, 0)


@pytest.mark.parametrize(
    "env, match",
    [
        ({"BERTJAX_NUM_PROCESSES": "two"}, r"BERTJAX_NUM_PROCESSES='two' is not an integer"),
        (
            {"BERTJAX_NUM_PROCESSES": "2", "BERTJAX_PROCESS_ID": "2", "BERTJAX_COORDINATOR": "h:1"},
            r"process_id=2 is out of range for num_processes=2",
        ),
        ({"BERTJAX_NUM_PROCESSES": "0"}, r"num_processes=0 must be at least 1"),
        (
            {"BERTJAX_NUM_PROCESSES": "2", "BERTJAX_PROCESS_ID": "0", "BERTJAX_COORDINATOR": "h"},
            r"coordinator 'h' is not host:port",
        ),
        (
            {"BERTJAX_NUM_PROCESSES": "2", "BERTJAX_PROCESS_ID": "0", "BERTJAX_COORDINATOR": "h:0"},
            r"coordinator 'h:0' is not host:port",
        ),
        (
            {"BERTJAX_NUM_PROCESSES": "2"},
            r"missing --distributed.coordinator / BERTJAX_COORDINATOR; "
            r"--distributed.process_id / BERTJAX_PROCESS_ID",
        ),
    ],
)
def test_bad_settings_give_one_line_errors(clean_env, env, match):
    for key, value in env.items():
        clean_env.setenv(key, value)
    with pytest.raises(distributed.DistributedStartupError, match=match) as info:
        distributed.initialize()
    assert "\n" not in str(info.value)


def test_parse_coordinator_handles_ipv6():
    assert distributed.parse_coordinator("[::1]:8476") == ("::1", 8476)
    assert distributed.parse_coordinator("node-7.cluster:1234") == ("node-7.cluster", 1234)


def slurm_env(nodelist: str, ntasks: int = 16, procid: int = 5) -> dict:
    return {
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_NTASKS": str(ntasks),
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": "1",
    }


@pytest.mark.parametrize(
    "nodelist", ["gpu001", "gpu001,host2", "gpu[001-0015],host2", "gpu[007,009-015],x", "a1,b[2-3]"]
)
def test_slurm_coordinator_matches_jax_detection(clean_env, nodelist):
    from jax._src.clusters import SlurmCluster

    env = slurm_env(nodelist)
    for key, value in env.items():
        clean_env.setenv(key, value)
    mode, settings = distributed._choose_mode(distributed._Settings(None, None, None), env)
    assert mode == "slurm"
    assert (settings.num_processes, settings.process_id) == (16, 5)
    assert settings.coordinator == SlurmCluster.get_coordinator_address(None, None)


def test_slurm_single_task_is_single_and_port_override(clean_env):
    empty = distributed._Settings(None, None, None)
    assert distributed._choose_mode(empty, slurm_env("n1", ntasks=1, procid=0))[0] == "single"
    env = {**slurm_env("n[3-4]"), "JAX_COORDINATOR_PORT": "5000"}
    assert distributed._choose_mode(empty, env)[1].coordinator == "n3:5000"


def test_tpu_detection_respects_jax_platforms(monkeypatch):
    from jax._src import cloud_tpu_init

    monkeypatch.setattr(cloud_tpu_init, "running_in_cloud_tpu_vm", True)
    empty = distributed._Settings(None, None, None)
    assert distributed._choose_mode(empty, {})[0] == "tpu"
    assert distributed._choose_mode(empty, {"JAX_PLATFORMS": "cpu"})[0] == "single"
    monkeypatch.setattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False)
    assert distributed._choose_mode(empty, {})[0] == "single"


# ----------------------------------------------------------------------------- roll call


def run_roll_call(coordinator, num_processes, process_ids, timeout_s, expected_n=None):
    """Runs roll_call for each id in a thread; returns {id: exception or None}."""
    results = {}

    def one(pid):
        try:
            n = num_processes if expected_n is None else expected_n.get(pid, num_processes)
            distributed.roll_call(coordinator, n, pid, timeout_s)
            results[pid] = None
        except distributed.DistributedStartupError as e:
            results[pid] = e

    threads = [threading.Thread(target=one, args=(pid,)) for pid in process_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 120)  # bounds a hang only: a process that never returns has no result
    return results


def test_roll_call_succeeds_and_frees_the_port():
    coordinator = f"127.0.0.1:{free_port()}"
    assert run_roll_call(coordinator, 3, [2, 1, 0], timeout_s=10) == {0: None, 1: None, 2: None}
    with socket.create_server(("", int(coordinator.rsplit(":", 1)[1]))):
        pass  # JAX's coordination service binds this port next


def test_roll_call_names_missing_processes_on_every_running_process():
    coordinator = f"127.0.0.1:{free_port()}"
    results = run_roll_call(coordinator, 4, [0, 2], timeout_s=1.5)  # both give up after 1.5 s
    expected = "process ids [1, 3] of 4 did not join coordinator"
    assert expected in str(results[0]) and expected in str(results[2])
    assert "(joined: [0, 2])" in str(results[0])
    assert "reported by process 0" in str(results[2])


def test_roll_call_rejects_duplicate_ids_and_count_mismatch():
    coordinator = f"127.0.0.1:{free_port()}"
    results = run_roll_call(coordinator, 3, [0, 1, 1], timeout_s=3)
    assert "process id 1 joined twice" in str(results[0])
    coordinator = f"127.0.0.1:{free_port()}"
    results = run_roll_call(coordinator, 2, [0, 1], timeout_s=3, expected_n={1: 3})
    assert "process 1 on" in str(results[0]) and "expects 3 processes" in str(results[0])
    assert "expects 3 processes" in str(results[1])


def test_roll_call_reports_unreachable_coordinator():
    message = "unreachable from process 1 for 1 s"  # its own timeout, not the OS's
    with pytest.raises(distributed.DistributedStartupError, match=message):
        distributed.roll_call(f"127.0.0.1:{free_port()}", 2, 1, timeout_s=1)


def test_roll_call_reports_busy_port():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(distributed.DistributedStartupError, match=f"listen on .*port {port}"):
            distributed.roll_call(f"127.0.0.1:{port}", 2, 0, timeout_s=1)


# ----------------------------------------------------------------------------- helpers


def test_helpers_in_a_single_process():
    info = distributed.process_info()
    assert info["process_index"] == 0 and info["process_count"] == 1
    assert info["device_count"] == len(info["local_devices"]) == jax.device_count()
    assert distributed.is_coordinator()
    distributed.sync("single-process barrier")
    assert distributed.broadcast_from_coordinator({"step": 7, "ids": (1, 2)}) == {
        "step": 7,
        "ids": [1, 2],
    }
    with pytest.raises(TypeError, match="JSON-serializable"):
        distributed.broadcast_from_coordinator(object())
    distributed.assert_same_across_hosts(ConfigDict({"lr": 1e-4}), "config")
    distributed.assert_same_across_hosts({"w": np.arange(3), "x": np.float32(1)}, "arrays")
    with pytest.raises(TypeError, match="cannot fingerprint"):
        distributed.assert_same_across_hosts({"f": object()}, "bad")


def test_watchdog_ends_a_hung_process_with_one_line():
    # The hang (an hour) outlasts the subprocess timeout: only the watchdog can end it with status 1.
    code = "import time\nfrom bertjax import distributed\nwith distributed._Watchdog(0.5, 'stuck'):\n    time.sleep(3600)\n"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == "bertjax.distributed: error: stuck"


# ----------------------------------------------------------------------------- fail fast


def run_probe_alone(process_id: int, timeout_s: int) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "BERTJAX_COORDINATOR": f"127.0.0.1:{free_port()}",
        "BERTJAX_NUM_PROCESSES": "2",
        "BERTJAX_PROCESS_ID": str(process_id),
        "XLA_FLAGS": xla_flags(2),
    }
    return subprocess.run(
        [sys.executable, str(PROBE), f"--distributed.timeout_s={timeout_s}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # bounds a hang only (JAX's own start-up would wait for process 1 for ever)
    )


def test_process_zero_alone_fails_fast_naming_the_missing_process():
    proc = run_probe_alone(0, timeout_s=4)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("multihost_probe: error: process ids [1] of 2 did not join coordinator")
    assert "within 4 s (joined: [0])" in last, last  # its own timeout, not JAX's


def test_other_process_alone_reports_unreachable_coordinator():
    proc = run_probe_alone(1, timeout_s=3)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "unreachable from process 1 for 3 s" in last, proc.stderr[-2000:]

"""Faults on the way to a bucket, against the local emulator (tests/gcs_emulator.py): HTTP 429
and 503 answers retried with backoff by bertjax.fs (gcsfs under bertjax.gcs's policy) and by
TensorStore (Orbax's checkpoint arrays); a bucket that stays down is one line naming the object,
and the checkpoints resume from the last complete step once it answers; a bucket this account may
not write (HTTP 403) is one line before any work. The backoff is 10 ms here
(BERTJAX_GCS_BACKOFF_SECONDS); TensorStore's own starts at 1 s."""

import random
import time

import jax
import pytest
from train_fixtures import tiny_config

from bertjax import checkpointing, cli, fs, gcs, train
from bertjax.workdir_lock import WorkdirNotWritableError


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setenv(gcs.BACKOFF_SECONDS, "0.01")


def test_the_retry_policy_doubles_its_waits_with_jitter_up_to_32_s(monkeypatch):
    policy = gcs.RetryPolicy(seconds=120.0, backoff_s=1.0)
    rng = random.Random(0)
    waits = [policy.wait(retry, rng) for retry in range(8)]
    floors = [1, 2, 4, 8, 16, 32, 32, 32]
    assert all(f <= w <= f + 1.0 for f, w in zip(floors, waits)), waits
    assert len({w - f for f, w in zip(floors, waits)}) == 8  # jittered
    assert gcs.RetryPolicy.from_environment({}) == gcs.RetryPolicy(120.0, 1.0)
    got = gcs.RetryPolicy.from_environment({gcs.RETRY_SECONDS: "5", gcs.BACKOFF_SECONDS: "0.5"})
    assert got == gcs.RetryPolicy(5.0, 0.5)
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(ValueError, match=f"^{gcs.RETRY_SECONDS}='{bad}': not a number"):
            gcs.RetryPolicy.from_environment({gcs.RETRY_SECONDS: bad})


def test_429_and_503_are_retried_by_bertjax_fs(gcs_emulator, gcs_bucket, fast_retries, tmp_path):
    """Writes, reads, listings and downloads through gcsfs: each answered an error first."""
    emulator, folder = gcs_emulator, f"{gcs_bucket}/a"
    emulator.fail(503, 2, method="POST", bucket=gcs_bucket, agent="gcsfs")
    fs.write_bytes(f"{folder}/x.txt", b"hello")
    emulator.fail(429, 2, method="GET", bucket=gcs_bucket, name="^a/x.txt$", agent="gcsfs")
    assert fs.read_bytes(f"{folder}/x.txt") == b"hello"
    emulator.fail(503, 1, method="GET", bucket=gcs_bucket, name="^a/?$", agent="gcsfs")
    assert fs.list_files(folder) == ["x.txt"]
    emulator.fail(429, 1, method="GET", bucket=gcs_bucket, name="^a/x.txt$", agent="gcsfs")
    fs.download(f"{folder}/x.txt", str(tmp_path / "x.txt"))
    assert (tmp_path / "x.txt").read_bytes() == b"hello"
    assert [f["sent"] for f in emulator.faults()] == [2, 2, 1, 1]


def _state(value: float):
    return {"params": {"w": jax.numpy.full((2, 3), value)}}


def _restored(ckpt):
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), _state(0)
    )
    state, data, _, step = ckpt.restore(abstract)
    return float(state["params"]["w"][0, 0]), data, step


def test_429_and_503_are_retried_by_tensorstore_in_checkpoints(gcs_emulator, gcs_bucket):
    """A checkpoint's arrays written and read by TensorStore, each answered an error first."""
    ckpt = checkpointing.Checkpointer(f"{gcs_bucket}/ckpt", async_save=False)
    gcs_emulator.fail(503, 1, method="POST", bucket=gcs_bucket, agent="tensorstore")
    ckpt.save(1, _state(1.0), {"at": 1}, "{}")
    ckpt.close()
    gcs_emulator.fail(429, 1, method="GET", bucket=gcs_bucket, agent="tensorstore")
    ckpt = checkpointing.Checkpointer(f"{gcs_bucket}/ckpt", read_only=True)
    assert _restored(ckpt) == (1.0, {"at": 1}, 1)
    ckpt.close()
    assert [f["sent"] for f in gcs_emulator.faults()] == [1, 1]


def test_a_bucket_that_stays_down_is_one_line_naming_the_object(
    gcs_emulator, gcs_bucket, fast_retries, monkeypatch
):
    """With the emulator stopped: a write is one line naming the object after the policy's
    seconds; a checkpoint save is one line naming the step; a command prints one line. Once the
    bucket answers again, the checkpoints resume from the last complete step."""
    ckpt = checkpointing.Checkpointer(f"{gcs_bucket}/ckpt", async_save=False)
    ckpt.save(1, _state(1.0), {"at": 1}, "{}")
    monkeypatch.setenv(gcs.RETRY_SECONDS, "0.3")
    gcs_emulator.stop()
    try:
        with pytest.raises(gcs.Unavailable) as down:
            fs.write_bytes(f"{gcs_bucket}/x.txt", b"x")
        assert str(down.value).startswith(f"{gcs_bucket}/x.txt: Cloud Storage failed ")
        assert "Connect call failed" in str(down.value) and "\n" not in str(down.value)
        with pytest.raises(checkpointing.CheckpointSaveError) as failed:
            ckpt.save(2, _state(2.0), {"at": 2}, "{}")
        message = str(failed.value)
        assert message.startswith(
            f"{gcs_bucket}/ckpt/2: saving checkpoint step 2 failed (Unavailable: {gcs_bucket}/ckpt"
        ), message
        assert message.endswith("once the bucket answers, run again to resume from it")
        assert "\n" not in message
        ckpt.close()
        with pytest.raises(SystemExit) as exited:
            cli.main(["bertjax", "plot", f"{gcs_bucket}/run"])
        printed = str(exited.value.code)
        assert printed.startswith(f"bertjax plot: error: {gcs_bucket}/run/metrics.jsonl: Cloud ")
        assert "\n" not in printed
    finally:
        gcs_emulator.start()
    ckpt = checkpointing.Checkpointer(f"{gcs_bucket}/ckpt", read_only=True)
    assert _restored(ckpt) == (1.0, {"at": 1}, 1)
    ckpt.close()


def test_tensorstore_retries_a_checkpoints_arrays_by_the_same_policy(gcs_emulator, gcs_bucket):
    """A bucket that stays down for TensorStore alone while a checkpoint's arrays are written
    (bertjax.fs's requests still served): the save fails in one line within the policy's
    seconds, as bertjax.fs's requests do, not after TensorStore's own quarter of an hour; the
    last complete step is restored once the bucket answers."""
    policy = gcs.RetryPolicy(seconds=0.3, backoff_s=0.01)
    assert policy.tensorstore_retries() == {
        "max_retries": 4, "initial_delay": "10000000ns", "max_delay": "32000000000ns"
    }  # fmt: skip
    assert gcs.RetryPolicy().tensorstore_retries()["max_retries"] == 7  # waits of 1+2+...+32+32 s
    ckpt = checkpointing.Checkpointer(f"{gcs_bucket}/ckpt", async_save=False)
    ckpt.save(1, _state(1.0), {"at": 1}, "{}")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(gcs.RETRY_SECONDS, f"{policy.seconds}")
        env.setenv(gcs.BACKOFF_SECONDS, f"{policy.backoff_s}")
        gcs_emulator.fail(503, None, bucket=gcs_bucket, agent="tensorstore")
        start = time.monotonic()
        with pytest.raises(checkpointing.CheckpointSaveError) as failed:
            ckpt.save(2, _state(2.0), {"at": 2}, "{}")
        elapsed = time.monotonic() - start
    message = str(failed.value)
    assert message.startswith(f"{gcs_bucket}/ckpt/2"), message
    assert "All 4 retry attempts failed" in message and "\n" not in message, message
    assert elapsed < 10, elapsed
    ckpt.close()
    gcs_emulator.clear_faults()
    ckpt = checkpointing.Checkpointer(f"{gcs_bucket}/ckpt", read_only=True)
    assert _restored(ckpt) == (1.0, {"at": 1}, 1)
    ckpt.close()


def test_a_workdir_this_account_may_not_write_is_one_line_before_any_work(
    gcs_emulator, gcs_bucket, tmp_path, monkeypatch
):
    """HTTP 403 on every write to the bucket: the run stops at its lock, in one line naming the
    WORKDIR, before any training work; a command writing there says which object (one line)."""

    def no_work(*args):
        raise AssertionError("training work started")

    monkeypatch.setattr(train, "_train_and_evaluate", no_work)
    gcs_emulator.fail(403, None, method="POST", bucket=gcs_bucket)
    with pytest.raises(WorkdirNotWritableError) as err:
        train.train_and_evaluate(tiny_config(tmp_path), f"{gcs_bucket}/run")
    assert str(err.value) == (
        f"{gcs_bucket}/run: WORKDIR is read-only (permission denied); a run writes its lock, "
        "checkpoints and metrics there: make it writable or use another WORKDIR"
    )
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "split": "train", "loss": 2.0}\n')
    with pytest.raises(SystemExit) as exited:
        cli.main(["bertjax", "plot", str(tmp_path), f"--output={gcs_bucket}/curves.png"])
    assert str(exited.value.code) == (
        f"bertjax plot: error: Forbidden: {gcs_bucket}/curves.png (HTTP 403: Forbidden (fault))"
    )
    assert gcs_emulator.faults()[0]["sent"] >= 2

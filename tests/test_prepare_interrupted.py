"""An interrupted `bertjax prepare`: kill -9 ends its worker processes with it, and the next run
removes (or resumes from) the dead run's temporary folder while a live run's is left alone."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from train_fixtures import write_vocab

from bertjax.data import lifetime, prepare
from bertjax.text import load_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _children(pid: int) -> list[int]:
    path = pathlib.Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _running(pid: int) -> bool:
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status and "\nState:\tX" not in status


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill9_of_prepare_ends_its_workers_and_the_next_run_cleans_up(tmp_path, caplog):
    vocab = write_vocab(tmp_path / "vocab.txt")
    rng = np.random.default_rng(0)
    words = [w for w in vocab.read_text().split() if w.startswith("w")]
    corpus = []
    for f in range(2):
        docs = ["\n".join(" ".join(rng.choice(words, 12)) for _ in range(8)) for _ in range(2000)]
        corpus.append(tmp_path / f"c{f}.txt")
        corpus[-1].write_text("\n\n".join(docs) + "\n")
    out = tmp_path / "out"
    args = ["--input", ",".join(map(str, corpus)), "--output_dir", str(out), "--vocab", str(vocab)]
    args += ["--num_workers", "2", "--dupe_factor", "1", "--num_shards", "2", "--no_progress"]
    args += ["--random_document_buffer", "10"]
    cmd = [sys.executable, "-m", "bertjax.cli", "prepare", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while not list(out.glob(".prepare-tmp-*/*.part-*")) and proc.poll() is None:
        assert time.monotonic() < deadline, "prepare's workers wrote nothing within 600 s"
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    workers = _children(proc.pid)
    assert len(workers) >= 2  # the pool (and its resource tracker)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 120  # bounds a hang only (a busy machine may take seconds)
    while [pid for pid in workers if _running(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if _running(pid)], "workers outlived prepare by 120 s"
    (stale,) = out.glob(".prepare-tmp-*")
    caplog.set_level("INFO")
    tok = load_tokenizer(str(vocab), do_lower_case=True)
    meta = prepare.prepare(
        [str(c) for c in corpus],
        str(out),
        tok,
        dupe_factor=1,
        num_shards=2,
        num_workers=1,
        show_progress=False,
        random_document_buffer=10,
    )
    assert meta["examples"]["train"] > 0 and not list(out.glob(".prepare-tmp-*"))
    # The killed run's folder is either resumed (a unit had finished before the kill: prepare is
    # fast enough for that now) or removed as stale; either way it is gone afterwards.
    resumed = "units were done by an interrupted run" in caplog.text
    removed = f"removed {stale}, the temporary folder of an interrupted run" in caplog.text
    assert resumed or removed, caplog.text


def test_a_live_runs_temp_folder_is_left_alone(tmp_path):
    mine = lifetime.make_tmp_dir(".prepare-tmp-", str(tmp_path))  # this (live) process's
    assert lifetime.remove_stale_tmp_dirs(str(tmp_path), ".prepare-tmp-") == []
    assert os.path.isdir(mine)

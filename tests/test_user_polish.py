"""Issue 15, item 8: what a user notices. Killed prepare workers end and their temp folder is
removed by the next run; a restart from scratch leaves no duplicate metrics rows; short runs log
their first step; plots show single points; `evaluate squad` counts unanswered questions; the
console of a CPU machine carries no TensorFlow/CUDA/TPU start-up noise."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from train_fixtures import read_metrics, tiny_config, write_vocab

from bertjax import console, train
from bertjax.data import lifetime, prepare
from bertjax.text import load_tokenizer
from bertjax.tools import plot, score

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_plot_marks_series_of_few_points():
    records = [
        {"step": 1, "split": "train", "loss": 5.0, "learning_rate": 1e-4, "tokens_per_sec": 9.0},
        {"step": 1, "split": "eval", "loss": 4.0},
    ]
    fig = plot.draw(records)
    lines = [line for ax in fig.axes for line in ax.lines]
    assert len(lines) == 4 and all(line.get_marker() not in ("None", "", None) for line in lines)
    many = [{"step": s, "split": "train", "loss": 1.0 / s} for s in range(1, 200)]
    (line,) = plot.draw(many).axes[0].lines
    assert line.get_marker() in ("None", "", None)  # a long curve: a plain line


def test_evaluate_squad_warns_with_the_count_of_unanswered_questions(tmp_path, capsys):
    qas = [{"id": f"q{i}", "question": "?", "answers": [{"text": "a", "answer_start": 0}]}
           for i in range(10)]  # fmt: skip
    data = {"version": "1.1", "data": [{"paragraphs": [{"context": "a b", "qas": qas}]}]}
    (tmp_path / "dev.json").write_text(json.dumps(data))
    (tmp_path / "pred.json").write_text(json.dumps({"q0": "a", "q1": "a", "zz": "a"}))
    result = score.evaluate_squad_files(str(tmp_path / "dev.json"), str(tmp_path / "pred.json"))
    assert result["exact_match"] == pytest.approx(20.0)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "8 of 10 questions (80%) have no prediction" in err[0]
    assert "pred.json" in err[0]
    (tmp_path / "pred.json").write_text(json.dumps({f"q{i}": "a" for i in range(10)}))
    score.evaluate_squad_files(str(tmp_path / "dev.json"), str(tmp_path / "pred.json"))
    assert capsys.readouterr().err == ""


NOISE = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795462706.772035   32330 port.cc:153] oneDNN custom operations are on.
I0000 00:00:1795462706.774152   32330 cudart_stub.cc:31] Could not find cuda drivers on your machine
E0000 00:00:1795462708.910790   32330 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA
W0000 00:00:1795462708.910790   32330 some.cc:1] a native warning
"""
KEPT = """\
E0000 00:00:1795462708.910790   32330 tfrecord.cc:52] DataLossError: corrupted record at 12
Traceback (most recent call last):
ValueError: a real error
"""


def test_console_filter_drops_start_up_noise_and_keeps_errors():
    assert all(console.is_noise(line, 2) for line in NOISE.splitlines())
    assert not any(console.is_noise(line, 2) for line in KEPT.splitlines())
    assert not console.is_noise(NOISE.splitlines()[-1], 0)  # TF_CPP_MIN_LOG_LEVEL=0: shown


def test_console_filter_process_passes_everything_else(tmp_path):
    if console.has_accelerator():
        pytest.skip("the filter is only installed on machines without accelerators")
    code = (
        "import os, sys; from bertjax import console; console.quiet_native_logs(); "
        f"os.write(2, {(NOISE + KEPT).encode()!r}); os.write(2, b'\\rprogress 50%'); "
        "sys.exit('bertjax: error: the last words')"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("BERTJAX_RAW_STDERR", "JAX_PLATFORMS")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env)
    assert out.returncode == 1
    assert out.stderr.decode() == KEPT + "\rprogress 50%bertjax: error: the last words\n"


def test_restart_from_scratch_rewrites_metrics_and_logs_first_and_last_step(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    old = [{"step": s, "split": "train", "loss": 9.0} for s in range(1, 6)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    c = tiny_config(tmp_path, steps=3, **{"train.log_every": 100, "train.checkpoint_every": 100})
    train.train_and_evaluate(c, str(workdir))  # no checkpoint: a restart from scratch
    rows = read_metrics(workdir)
    assert [r["step"] for r in rows] == [1, 3]  # step 1 and the last, though log_every is 100
    assert all(r["loss"] != 9.0 for r in rows)


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
    deadline = time.time() + 120
    while not list(out.glob(".prepare-tmp-*/*.part-*")) and proc.poll() is None:
        assert time.time() < deadline, "prepare's workers wrote nothing within 120 s"
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    workers = _children(proc.pid)
    assert len(workers) >= 2  # the pool (and its resource tracker)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 3
    while [pid for pid in workers if _running(pid)] and time.time() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if _running(pid)], "workers outlived prepare by 3 s"
    (stale,) = out.glob(".prepare-tmp-*")
    caplog.set_level("INFO")
    tok = load_tokenizer(str(vocab), do_lower_case=True)
    meta = prepare.prepare(
        [str(c) for c in corpus], str(out), tok, dupe_factor=1, num_shards=2, num_workers=1,
        show_progress=False, random_document_buffer=10,
    )  # fmt: skip
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


def test_convert_of_a_bertjax_checkpoint_prints_no_orbax_warning(tmp_path):
    """Orbax knows each item's handler up front: no 'Item "config" was found in the checkpoint,
    but could not be restored' warnings on a successful convert."""
    transformers = pytest.importorskip("transformers")
    from bertjax.convert import main as convert_main

    (tmp_path / "hf").mkdir()
    vocab = write_vocab(tmp_path / "hf" / "vocab.txt")
    config = transformers.BertConfig(
        vocab_size=len(vocab.read_text().split()), hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip
    transformers.BertForPreTraining(config).save_pretrained(tmp_path / "hf")
    convert_main(["--from=hf", str(tmp_path / "hf"), "--to=bertjax", str(tmp_path / "bj")])
    cmd = [str(ROOT / ".venv" / "bin" / "bertjax"), "convert", "--from=bertjax"]
    cmd += [str(tmp_path / "bj"), "--to=hf", str(tmp_path / "out")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert "CheckpointHandlerRegistry" not in out.stderr and "absl" not in out.stderr, out.stderr

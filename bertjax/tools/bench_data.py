"""Data-side benchmarks of ``bertjax bench``: ``prepare`` throughput and input-pipeline speed."""

from __future__ import annotations

import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

from bertjax.data import pipeline
from bertjax.data.prepare import prepare
from bertjax.text import load_tokenizer


def _corpus_copies(corpus: str, scale: int, directory: str) -> str:
    """A glob over ``scale`` symlinked copies of every corpus file (distinct names, same text)."""
    files = sorted(f for pattern in corpus.split(",") for f in glob.glob(pattern))
    if not files:
        raise ValueError(f"--corpus={corpus}: no files (pass --skip_prepare --skip_input?)")
    if scale == 1:
        return ",".join(files)
    os.makedirs(directory, exist_ok=True)
    for copy in range(scale):
        for f in files:
            link = os.path.join(directory, f"copy{copy}-{os.path.basename(f)}")
            if not os.path.lexists(link):
                os.symlink(os.path.abspath(f), link)
    return os.path.join(directory, "*")


def measure_prepare(args, scale: int, output_dir: str) -> dict[str, Any]:
    """Runs ``bertjax prepare`` in a child process; wall time, cores used, peak RSS of its tree."""
    import psutil

    corpus = _corpus_copies(args.corpus, scale, os.path.join(args.cache_dir, f"corpus-x{scale}"))
    shutil.rmtree(output_dir, ignore_errors=True)
    argv = [
        sys.executable,
        "-c",
        "import sys; from bertjax.data.prepare import main; sys.exit(main(sys.argv[1:]))",
        f"--input={corpus}",
        f"--output_dir={output_dir}",
        f"--vocab={args.vocab}",
        f"--format={args.corpus_format}",
        "--no_progress",
        f"--max_seq_length={args.seq}",
        f"--max_predictions_per_seq={args.masked}",
        f"--dupe_factor={args.dupe_factor}",
    ]
    if args.prepare_workers:
        argv.append(f"--num_workers={args.prepare_workers}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = psutil.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = {"rss": 0}

    def poll():  # the tree's summed RSS every 0.2 s (workers included)
        while proc.poll() is None:
            try:
                tree = [proc, *proc.children(recursive=True)]
                peak["rss"] = max(peak["rss"], sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                pass
            time.sleep(0.2)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    _, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    watcher.join()
    if proc.returncode:
        raise RuntimeError(f"bertjax prepare failed (exit {proc.returncode}):\n{stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    with open(os.path.join(output_dir, "metadata.json")) as f:
        meta = json.load(f)
    docs = sum(meta["documents"].values())
    return {
        "scale": scale,
        "input_mb": meta["input_bytes"] / 1e6,
        "documents": docs,
        "examples": sum(meta["examples"].values()),
        "wall_s": wall,
        "docs_per_sec": docs / wall,
        "mb_per_sec": meta["input_bytes"] / 1e6 / wall,
        "cores_used": cpu / wall,
        "peak_rss_bytes": peak["rss"],
        "data_dir": output_dir,
    }


def measure_input(data_dir: str, batch: int, batches: int) -> dict[str, Any]:
    """Examples/s of the trainer's tf.data iterator (shuffled, parsed, batched, to NumPy)."""
    pipeline.hide_accelerators_from_tf()
    data = pipeline.PretrainingData(
        data_dir, "train", batch, seed=0, process_index=0, process_count=1
    )
    for _ in range(5):  # fill the shuffle buffer and the prefetch queue
        next(data)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(data)
    seconds = time.perf_counter() - t0
    return {
        "batches": batches,
        "batch": batch,
        "examples_per_sec": batches * batch / seconds,
        "data_dir": data_dir,
    }


def cached_records(args) -> str:
    """Records for the input benchmark when prepare is not measured: prepared once, then reused."""
    out = os.path.join(args.cache_dir, f"records-seq{args.seq}-pred{args.masked}")
    prepare(
        _corpus_copies(args.corpus, 1, ""),
        out,
        load_tokenizer(args.vocab),
        corpus_format=args.corpus_format,
        max_seq_length=args.seq,
        max_predictions_per_seq=args.masked,
        dupe_factor=args.dupe_factor,
        show_progress=False,
    )
    return out


# ---- peers, output -------------------------------------------------------------------------------

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


def _run_tree(argv: list[str], what: str, env: dict | None = None) -> dict[str, float]:
    """Runs a command; wall and CPU seconds (user + sys of its whole process tree), peak tree RSS."""
    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = psutil.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
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
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": peak["rss"]}


def measure_prepare(
    args, scale: int, output_dir: str, corpus: str | None = None, fmt: str | None = None
) -> dict[str, Any]:
    """Runs ``bertjax prepare`` in a child process: wall and CPU time, throughput per core (MB and
    instances per CPU-second), peak RSS of its process tree."""
    if corpus is None:
        corpus = _corpus_copies(
            args.corpus, scale, os.path.join(args.cache_dir, f"corpus-x{scale}")
        )
    shutil.rmtree(output_dir, ignore_errors=True)
    argv = [
        sys.executable,
        "-c",
        "import sys; from bertjax.data.prepare import main; sys.exit(main(sys.argv[1:]))",
        f"--input={corpus}",
        f"--output_dir={output_dir}",
        f"--vocab={args.vocab}",
        f"--format={fmt or args.corpus_format}",
        "--no_progress",
        f"--max_seq_length={args.seq}",
        f"--max_predictions_per_seq={args.masked}",
        f"--dupe_factor={args.dupe_factor}",
        f"--whole_word_mask={bool(getattr(args, 'whole_word_mask', False))}",
    ]
    if args.prepare_workers:
        argv.append(f"--num_workers={args.prepare_workers}")
    run = _run_tree(argv, "bertjax prepare")
    with open(os.path.join(output_dir, "metadata.json")) as f:
        meta = json.load(f)
    docs = sum(meta["documents"].values())
    examples = sum(meta["examples"].values())
    mb, wall, cpu = meta["input_bytes"] / 1e6, run["wall_s"], run["cpu_s"]
    return {
        "scale": scale,
        "input_mb": mb,
        "documents": docs,
        "examples": examples,
        **run,
        "docs_per_sec": docs / wall,
        "mb_per_sec": mb / wall,
        "cores_used": cpu / wall,
        "mb_per_cpu_s": mb / max(cpu, 1e-9),
        "examples_per_cpu_s": examples / max(cpu, 1e-9),
        "data_dir": output_dir,
    }


def bert_format_copy(args, directory: str) -> str:
    """The corpus in the original one-sentence-per-line format (converted once): a glob."""
    from bertjax.data import corpus as corpus_lib

    if args.corpus_format == "bert":
        return ",".join(sorted(f for p in args.corpus.split(",") for f in glob.glob(p)))
    os.makedirs(directory, exist_ok=True)
    for source in corpus_lib.list_sources(args.corpus):
        out = os.path.join(directory, os.path.basename(source.path))
        if not os.path.exists(out):
            with open(f"{out}.tmp", "w", encoding="utf-8") as f:
                for doc in corpus_lib.iter_source_documents(source, args.corpus_format):
                    f.write("\n".join(doc) + "\n\n")
            os.replace(f"{out}.tmp", out)
    return os.path.join(directory, "*")


_ORIGINAL_SHIM = (  # runs google-research/bert's TF1 script unchanged on TensorFlow 2
    "import os, sys, runpy, tensorflow.compat.v1 as tf; sys.modules['tensorflow'] = tf; "
    "sys.path.insert(0, os.path.dirname(sys.argv[1])); sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def _count_records(path: str) -> int:
    """Records in a TFRecord file (framing only: 8-byte length, 4-byte CRC, data, 4-byte CRC)."""
    count = 0
    with open(path, "rb") as f:
        while header := f.read(12):
            f.seek(int.from_bytes(header[:8], "little") + 4, os.SEEK_CUR)
            count += 1
    return count


def measure_original(args, corpus_glob: str, output_dir: str) -> dict[str, Any]:
    """google-research/bert's ``create_pretraining_data.py`` (``--original_script``) on the same
    corpus and settings, one process as it is written; CPU-seconds and instances per CPU-second."""
    os.makedirs(output_dir, exist_ok=True)
    out = os.path.join(output_dir, "original.tfrecord")
    argv = [
        sys.executable,
        "-c",
        _ORIGINAL_SHIM,
        os.path.abspath(args.original_script),
        f"--input_file={corpus_glob}",
        f"--output_file={out}",
        f"--vocab_file={args.vocab}",
        "--do_lower_case=True",
        f"--max_seq_length={args.seq}",
        f"--max_predictions_per_seq={args.masked}",
        "--masked_lm_prob=0.15",
        f"--dupe_factor={args.dupe_factor}",
        "--random_seed=12345",
        f"--do_whole_word_mask={bool(getattr(args, 'whole_word_mask', False))}",
    ]
    run = _run_tree(argv, "create_pretraining_data.py")
    examples = _count_records(out)
    mb = sum(os.path.getsize(f) for p in corpus_glob.split(",") for f in glob.glob(p)) / 1e6
    return {
        "input_mb": mb,
        "examples": examples,
        **run,
        "mb_per_cpu_s": mb / max(run["cpu_s"], 1e-9),
        "examples_per_cpu_s": examples / max(run["cpu_s"], 1e-9),
    }


def compare_with_original(args) -> dict[str, Any]:
    """bertjax prepare and the original script on the same one-sentence-per-line corpus, same
    settings, in one run; `ratio` is bertjax's instances per CPU-second over the original's."""
    corpus = bert_format_copy(args, os.path.join(args.cache_dir, "corpus-bert-format"))
    ours = measure_prepare(
        args, 1, os.path.join(args.cache_dir, "prepared-vs-original"), corpus, "bert"
    )
    original = measure_original(args, corpus, os.path.join(args.cache_dir, "original"))
    ratio = ours["examples_per_cpu_s"] / max(original["examples_per_cpu_s"], 1e-9)
    return {"bertjax": ours, "original": original, "ratio": ratio}


def measure_input(data_dir: str, batch: int, batches: int) -> dict[str, Any]:
    """Examples/s of the trainer's tf.data iterator (shuffled, parsed, batched, to NumPy)."""
    from bertjax.data import pipeline  # tf.data: the model benchmark runs without TensorFlow

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

"""Texts/s of `bertjax embed` beside `SentenceTransformer.encode` on the same texts (a benchmark
for docs/performance.md, "Embedding a corpus"; not part of the `bertjax` command).

    python -m bertjax.tools.embed_bench --model=MINILM_DIR \
        --corpus=../shared/data/retrieval/scifact/corpus.jsonl [--texts=2000] [--batch_size=32] \
        [--max_length=256] [--rounds=2] [--threads=N]

Each round runs, one after the other in fresh processes, `bertjax embed` (the command, to an
empty output folder, fp32 npy) and sentence-transformers (`encode` with the same batch size and
max length, torch with ``--threads`` threads, default all cores, as XLA uses). Printed per run:
texts/s over the embedding itself (bertjax: tokenizing, compiling, running and writing the
shards; sentence-transformers: ``encode``), model loading and input reading left out of both,
and the CPU-seconds (all threads) each spent on it: on a shared machine the CPU-seconds say more
than the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

_ST_SCRIPT = """
import json, sys, time, torch
from sentence_transformers import SentenceTransformer
model, corpus, batch, length, threads = sys.argv[1:6]
torch.set_num_threads(int(threads))
texts = [json.loads(line)["embedded"] for line in open(corpus, encoding="utf-8")]
st = SentenceTransformer(model, device="cpu")
st.max_seq_length = int(length)
start, cpu = time.perf_counter(), time.process_time()
st.encode(texts, batch_size=int(batch), convert_to_numpy=True)
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"texts": len(texts), "seconds": seconds, "cpu": cpu}))
"""


def _write_corpus(source: str, count: int, folder: str) -> str:
    """The first ``count`` documents of a BEIR corpus.jsonl, with the text both tools embed."""
    from bertjax.retrieval.beir import document_text

    path = os.path.join(folder, "corpus.jsonl")
    with open(source, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
        for number, line in enumerate(f):
            if number == count:
                break
            doc = json.loads(line)
            text = document_text(doc.get("title"), doc["text"])
            out.write(json.dumps({"_id": doc["_id"], "text": text, "embedded": text}) + "\n")
    return path


def _bertjax(args, corpus: str, output: str, env: dict) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "bertjax.cli",
        "embed",
        f"--checkpoint={args.model}",
        f"--input={corpus}",
        f"--output={output}",
        "--title_field=",
        f"--batch_size={args.batch_size}",
        f"--max_length={args.max_length}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"bertjax embed failed: {done.stderr[-2000:]}")
    last = done.stderr.strip().splitlines()[-1]
    found = re.search(r"embedded (\d+) texts in ([\d.]+) s .*, ([\d.]+) CPU-s", last)
    return {"texts": int(found[1]), "seconds": float(found[2]), "cpu": float(found[3])}


def _sentence_transformers(args, corpus: str, env: dict) -> dict:
    cmd = [
        sys.executable,
        "-c",
        _ST_SCRIPT,
        args.model,
        corpus,
        str(args.batch_size),
        str(args.max_length),
        str(args.threads),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"sentence-transformers failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a sentence-transformers folder")
    parser.add_argument("--corpus", required=True, help="a BEIR corpus.jsonl")
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    with tempfile.TemporaryDirectory() as folder:
        corpus = _write_corpus(args.corpus, args.texts, folder)
        for round_ in range(1, args.rounds + 1):
            ours = _bertjax(args, corpus, os.path.join(folder, f"out{round_}"), env)
            theirs = _sentence_transformers(args, corpus, env)
            rates = [r["texts"] / r["seconds"] for r in (ours, theirs)]
            print(
                f"round {round_}: bertjax embed {rates[0]:.2f} texts/s ({ours['seconds']:.1f} s, "
                f"{ours['cpu']:.1f} CPU-s), sentence-transformers {rates[1]:.2f} texts/s "
                f"({theirs['seconds']:.1f} s, {theirs['cpu']:.1f} CPU-s): {rates[0] / rates[1]:.2f}x"
                f" the texts/s, {theirs['cpu'] / ours['cpu']:.2f}x fewer CPU-s",
                flush=True,
            )


if __name__ == "__main__":
    main()

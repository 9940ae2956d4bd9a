"""`bertjax embed`: a corpus -> embedding shards with ids (NumPy or Parquet), resumable.

    bertjax embed --checkpoint=MODEL --input=FILE_OR_GLOB --output=DIR \
        [--format=npy|parquet] [--dtype=float32|float16] [--text_field=text] [--id_field=_id] \
        [--title_field=title] [--batch_size=32] [--shard_size=50000] [--max_length=N] \
        [--prompt=TEXT | --prompt_name=NAME] [--input_format=auto|jsonl|parquet|text]

Progress (shards done, texts/s) goes to stderr, one line per shard; the last line is a summary.
Run again with the same arguments after an interruption: finished shards are kept, the rest are
computed; Ctrl-C says how many shards are written and exits with status 130. On several hosts
(the ``BERTJAX_*`` variables of ``launch/``, SLURM or a TPU VM) each process embeds every
process_count-th shard. Read the result with
``bertjax.retrieval.embedding_store.load_embeddings(DIR)``. Bad input prints one error line and
exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from bertjax.commands.args import Parser
from bertjax.retrieval import embedding_store as store

FAULT_AFTER_SHARDS = "BERTJAX_EMBED_FAULT_AFTER_SHARDS"  # tests: die (os._exit) after N shards


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="bertjax embed", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--checkpoint", required=True, help="model folder (anything load_pretrained reads)")
    add("--input", required=True, help="JSONL / Parquet / text file or glob, local or gs://")
    add("--output", required=True, help="output folder (shards, run.json, manifest.json)")
    add("--format", default="npy", choices=store.FORMATS, help="shard files (default npy)")
    add("--dtype", default="float32", choices=store.DTYPES, help="stored dtype (default float32)")
    add(
        "--input_format",
        default="auto",
        choices=("auto", "jsonl", "parquet", "text"),
        help="default: by file name (.jsonl/.json/.ndjson, .parquet, else text)",
    )
    add("--text_field", default="text", help="JSONL key / Parquet column of the text")
    add("--id_field", default="_id", help="key / column of the id ('' : line or row number)")
    add(
        "--title_field",
        default="title",
        help="optional title put before the text as BEIR/MTEB do ('' : none)",
    )
    add("--batch_size", type=int, default=32, help="texts per batch over all local devices")
    add("--shard_size", type=int, default=50_000, help="texts per output shard")
    add("--max_length", type=int, default=None, help="tokens per text (default: the model's)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="text put before every input")
    prompt.add_argument("--prompt_name", default=None, help="one of the model's prompts")
    return parser


def _progress(started: float):
    def report(done) -> None:
        if done.skipped:
            what = "found finished, skipped"
        else:
            rate = done.texts / max(done.seconds, 1e-9)
            what = f"{done.texts} texts in {done.seconds:.1f} s, {rate:,.1f} texts/s"
        elapsed = time.perf_counter() - started
        print(
            f"bertjax embed: shard {done.index + 1}/{done.count}: {what} ({elapsed:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        report.shards += 1
        limit = os.environ.get(FAULT_AFTER_SHARDS)
        if limit and not done.skipped and report.shards >= int(limit):
            os._exit(17)  # a crash after a finished shard, for the resume test

    report.shards = 0
    return report


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while embedding; its text is the one line `bertjax embed` prints."""


def run(args: argparse.Namespace) -> str:
    """Reads, embeds and writes; returns the summary line."""
    from bertjax import distributed, load_pretrained
    from bertjax.retrieval import corpus_input, embed_corpus

    distributed.initialize()  # several hosts: from the environment; one: nothing
    started = time.perf_counter()
    fields = corpus_input.Fields(text=args.text_field, id=args.id_field, title=args.title_field)
    corpus = corpus_input.read_corpus(args.input, fields, args.input_format)
    model = load_pretrained(args.checkpoint, quiet=True)
    options = embed_corpus.EmbedOptions(
        format=args.format,
        dtype=args.dtype,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        max_length=args.max_length,
        prompt=args.prompt,
        prompt_name=args.prompt_name,
    )
    shards = -(-len(corpus.ids) // options.shard_size)
    print(
        f"bertjax embed: {len(corpus.ids)} texts from {len(corpus.files)} file(s), "
        f"{shards} shard(s) -> {args.output}",
        file=sys.stderr,
        flush=True,
    )
    try:
        summary = embed_corpus.embed_corpus(
            model, corpus, args.output, options, on_shard=_progress(started)
        )
    except KeyboardInterrupt:  # finished shards are whole files (renamed into place): kept
        written = sum(store.shard_done(args.output, args.format, i, shards) for i in range(shards))
        raise Interrupted(
            f"bertjax embed: interrupted (Ctrl-C): {written} of {shards} shards are written; "
            "rerun the same command to resume"
        ) from None
    rate = summary.texts_embedded / max(summary.seconds, 1e-9)
    skipped = f", {summary.shards_skipped} found finished" if summary.shards_skipped else ""
    return (
        f"bertjax embed: {summary.texts} texts, {summary.dim} dims, {args.dtype} {args.format} "
        f"in {summary.shards} shard(s) -> {summary.output}: embedded {summary.texts_embedded} "
        f"texts in {summary.seconds:.1f} s ({rate:,.1f} texts/s, {summary.cpu_seconds:.1f} "
        f"CPU-s){skipped}; "
        f"total {time.perf_counter() - started:.1f} s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `bertjax embed` with the arguments after "embed"; bad input: one line, exit 2;
    Ctrl-C: one line, exit 130."""
    args = _parser().parse_args(argv)
    try:
        line = run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"bertjax embed: error: {' '.join(str(err).split())}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt as stopped:
        if not isinstance(stopped, Interrupted):  # reading the input or loading the model
            stopped = "bertjax embed: interrupted (Ctrl-C) before embedding; nothing written"
        print(stopped, file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    print(line, file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`bertjax mine-negatives`: hard negatives from the current model, as training rows.

    bertjax mine-negatives --checkpoint=MODEL --data=BEIR_DIR [--split=train] --output=rows.jsonl
    bertjax mine-negatives --checkpoint=MODEL --pairs=PAIRS.jsonl [--corpus=corpus.jsonl] \
        --output=rows.jsonl [--num_negatives=3] [--range_min=0] [--range_max=N] \
        [--relative_margin=X] [--absolute_margin=X] [--max_score=X] [--min_score=X] \
        [--sampling=top|random] [--seed=0] [--format=n-tuple|triplet] [--keep_incomplete] \
        [--batch_size=32]

Writes JSON lines ``{"query", "positive", "negatives": [...], "scores": [...]}`` (the retrieval
task's ``data.train_file``) atomically, chosen as sentence-transformers' ``mine_hard_negatives``
chooses them (see bertjax.retrieval.mining), and a summary on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from bertjax.commands.args import Parser
from bertjax.retrieval import mining


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="bertjax mine-negatives", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="model folder (load_pretrained)")
    p.add_argument("--data", default=None, help="BEIR folder: pairs from qrels/SPLIT.tsv")
    p.add_argument("--split", default="train", help="qrels split of --data (default train)")
    p.add_argument("--pairs", default=None, help='JSON lines {"query", "positive"}')
    p.add_argument("--corpus", default=None, help='more candidates: JSON lines {"text"[, "title"]}')
    p.add_argument("--output", required=True, help="rows to write (JSON lines)")
    p.add_argument("--num_negatives", type=int, default=3, help="negatives per query (default 3)")
    p.add_argument("--range_min", type=int, default=0, help="skip this many top candidates")
    p.add_argument("--range_max", type=int, default=None, help="consider this many candidates")
    p.add_argument("--max_score", type=float, default=None, help="no negative scores above this")
    p.add_argument("--min_score", type=float, default=None, help="no negative scores below this")
    p.add_argument(
        "--absolute_margin",
        type=float,
        default=None,
        help="a negative scores at least this much below the positive",
    )
    p.add_argument(
        "--relative_margin",
        type=float,
        default=None,
        help="... at least this fraction of |positive| below it",
    )
    p.add_argument("--sampling", choices=mining.SAMPLING, default="top")
    p.add_argument("--seed", type=int, default=0, help="for --sampling=random")
    p.add_argument(
        "--format",
        choices=mining.FORMATS,
        default="n-tuple",
        help="n-tuple: a row per (query, positive); triplet: per negative",
    )
    p.add_argument(
        "--keep_incomplete",
        action="store_true",
        help="n-tuple: keep rows with fewer than --num_negatives negatives",
    )
    p.add_argument("--batch_size", type=int, default=32, help="texts per embedding batch")
    p.add_argument("--query_prompt_name", default=None, help="default: the model's 'query'")
    p.add_argument("--corpus_prompt_name", default=None, help="default: 'document'/'passage'")
    return p


def _say(text: str) -> None:
    print(f"bertjax mine-negatives: {text}", file=sys.stderr)


def summary(mined: mining.Mined, num_negatives: int, output_format: str, path: str) -> list[str]:
    """The lines printed after mining."""
    lines = [
        f"{mined.num_queries} queries, {len(mined.positive_scores)} (query, positive) pairs, "
        f"{mined.corpus_size} documents, candidates: the top {mined.range_max}",
        f"wrote {len(mined.rows)} rows ({output_format}) to {path}",
    ]
    if mined.too_few:
        lines.append(
            f"{mined.too_few} of {mined.num_queries} queries have fewer than {num_negatives} "
            "negatives (widen --range_max or loosen the margins for more)"
        )
    if len(mined.negative_scores):
        means = [np.mean(s) for s in (mined.positive_scores, mined.negative_scores)]
        lines.append(
            f"mean score: positive {means[0]:.4f}, negative {means[1]:.4f}, difference "
            f"{np.mean(mined.difference_scores):.4f}"
        )
    for name, count in mined.skipped.items():
        if count:
            lines.append(f"skipped {count} candidates for {name}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run `bertjax mine-negatives`; bad input raises ValueError/FileNotFoundError (the `bertjax`
    command prints it as one line)."""
    args = _parser().parse_args(argv)
    if (args.data is None) == (args.pairs is None):
        raise ValueError("mine-negatives takes either --data=BEIR_DIR or --pairs=FILE.jsonl")
    if args.data is not None and args.corpus is not None:
        raise ValueError("--corpus goes with --pairs (a BEIR folder has its corpus.jsonl)")
    if args.data is not None:
        pairs, corpus, missing = mining.beir_pairs(args.data, args.split)
        if missing:
            _say(f"warning: {missing} judged documents of {args.split} are not in the corpus")
    else:
        corpus = mining.read_corpus(args.corpus) if args.corpus else None
        pairs = mining.read_pairs(args.pairs, corpus, args.corpus)
    mining.check_settings(  # before the model loads
        pairs,
        range_min=args.range_min,
        range_max=args.range_max,
        num_negatives=args.num_negatives,
        guarded=(args.absolute_margin, args.relative_margin, args.max_score) != (None,) * 3,
    )
    import bertjax

    model = bertjax.load_pretrained(args.checkpoint, quiet=True)
    if not hasattr(model, "embed"):
        raise ValueError(f"{args.checkpoint}: the loaded model has no embed()")
    mined = mining.mine_hard_negatives(
        pairs,
        model,
        corpus=corpus,
        range_min=args.range_min,
        range_max=args.range_max,
        max_score=args.max_score,
        min_score=args.min_score,
        absolute_margin=args.absolute_margin,
        relative_margin=args.relative_margin,
        num_negatives=args.num_negatives,
        sampling=args.sampling,
        output_format=args.format,
        keep_incomplete=args.keep_incomplete,
        seed=args.seed,
        batch_size=args.batch_size,
        query_prompt_name=args.query_prompt_name,
        corpus_prompt_name=args.corpus_prompt_name,
    )
    mining.write_rows(args.output, mined.rows)
    for line in summary(mined, args.num_negatives, args.format, args.output):
        _say(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

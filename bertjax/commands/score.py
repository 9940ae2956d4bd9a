"""`bertjax evaluate`: SQuAD and GLUE metrics of predictions, BEIR metrics of a run or model.

    bertjax evaluate squad --dataset dev-v1.1.json --predictions predictions.json \
        [--na_prob_file null_odds.json] [--version 1.1|2.0]
    bertjax evaluate glue --task MRPC --labels glue/MRPC (or glue/MRPC/dev.tsv) \
        --predictions MRPC.tsv [--split dev]
    bertjax evaluate retrieval --qrels=QRELS.tsv --run=RUN.trec
    bertjax evaluate retrieval --checkpoint=MODEL --data=BEIR_DIR [--split=test] \
        [--output_run=FILE] [--top_k=100] [--similarity=cosine|dot] [--batch_size=32]
    bertjax evaluate retrieval --rerank=CROSS_ENCODER --data=BEIR_DIR \
        (--run=RUN.trec | --checkpoint=MODEL) [--top_k=100] [--output_run=FILE]

Prints the official JSON (SQuAD: evaluate-v1.1.py / evaluate-v2.0.py keys; GLUE: the task's metrics
as fractions; retrieval: ndcg@10, recall@10, recall@100, mrr@10 and map@100 as fractions, computed
as pytrec_eval computes them, see bertjax.retrieval.ranking_metrics). The GLUE predictions file is the
submission format `index<TAB>prediction` with label strings (or scores for STS-B). Retrieval scores
a TREC run file, or embeds, searches (exactly, on device) and scores a BEIR folder end to end. Bad input prints a one-line error and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

from bertjax import fs
from bertjax.commands.args import Parser
from bertjax.tasks import glue_data, metrics, squad_data


def _load_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{fs.json_error(path, e)} (the {what} file)") from None
    except UnicodeDecodeError as e:
        raise fs.utf8_error(path, e) from None


def evaluate_squad_files(
    dataset_path: str,
    predictions_path: str,
    na_prob_path: str | None = None,
    version: str | None = None,
) -> dict:
    """Score a predictions.json against a SQuAD dataset file (version from the file when None)."""
    full = _load_json(dataset_path, "dataset")
    if not isinstance(full, dict) or "data" not in full:
        raise ValueError(f"{dataset_path}: not a SQuAD file (no top-level 'data' key)")
    dataset = full["data"]
    squad_data.check_squad_data(dataset, dataset_path, scoring=True)
    predictions = _load_json(predictions_path, "predictions")
    if not isinstance(predictions, dict):
        raise ValueError(f"{predictions_path}: predictions must be a JSON object of id -> answer")
    _warn_unanswered(dataset, predictions, predictions_path)
    if version is None:
        declared = str(full.get("version", "1.1"))
        version = "2.0" if declared.lstrip("v").startswith("2") else "1.1"
    if version == "1.1":
        if na_prob_path:
            raise ValueError("--na_prob_file is only used with --version 2.0")
        return metrics.evaluate_squad_v1(dataset, predictions)
    if version != "2.0":
        raise ValueError(f"--version must be 1.1 or 2.0, not {version!r}")
    na_probs = _load_json(na_prob_path, "na_prob") if na_prob_path else None
    if na_probs is not None:
        missing = [k for k in predictions if k not in na_probs]
        if missing:
            raise ValueError(f"{na_prob_path}: no probability for question {missing[0]}")
    return metrics.evaluate_squad_v2(dataset, predictions, na_probs)


def _warn_unanswered(dataset: list, predictions: dict, predictions_path: str) -> int:
    """Warns on stderr (one line, with the count) when questions of the dataset have no prediction
    (the official scripts score them 0, one "Unanswered question" line each); returns the count."""
    ids = [qa["id"] for article in dataset for p in article["paragraphs"] for qa in p["qas"]]
    missing = sum(qid not in predictions for qid in ids)
    if missing:
        share = missing / max(len(ids), 1)
        hint = " (a predictions file of another dataset or split?)" if share > 0.5 else ""
        print(
            f"bertjax evaluate: warning: {predictions_path}: {missing} of {len(ids)} questions "
            f"({share:.0%}) have no prediction and score 0{hint}",
            file=sys.stderr,
        )
    return missing


def evaluate_glue_files(
    task: str, labels_path: str, predictions_path: str, split: str | None = None
) -> dict:
    """Score a GLUE `index<TAB>prediction` file against a labelled TSV file or task folder."""
    spec = glue_data.get_task(task)
    if split is None:
        split = "dev_matched" if spec.name == "mnli" else "dev"
    path = pathlib.Path(labels_path)
    if path.is_dir():
        examples = glue_data.read_glue_split(path, spec.name, split)
    else:
        examples = glue_data.read_glue_tsv(path, spec, split)
    if any(ex.label is None for ex in examples):
        raise ValueError(f"{labels_path}: split {split!r} has no labels to score against")
    preds = glue_data.read_glue_predictions(predictions_path, spec.name)
    if len(preds) != len(examples):
        raise ValueError(
            f"{predictions_path}: {len(preds)} predictions for {len(examples)} examples"
        )
    if spec.is_regression:
        return metrics.glue_metrics(spec.name, [ex.label for ex in examples], preds)
    label_to_id = {label: i for i, label in enumerate(spec.labels)}
    gold = [label_to_id[ex.label] for ex in examples]
    return metrics.glue_metrics(spec.name, gold, [label_to_id[p] for p in preds])


def _model_similarity(model) -> str:
    """The similarity a loaded model was trained for (its ``similarity_fn_name``): cosine unless
    it names the inner product."""
    settings = getattr(model, "embedding", None)
    name = getattr(settings, "similarity_fn_name", None) or "cosine"
    if name not in ("cosine", "dot", "dot_product"):
        raise ValueError(
            f"the model's similarity_fn_name is {name!r}; exact search ranks by cosine or dot: "
            "pass --similarity to choose one"
        )
    return "dot" if name.startswith("dot") else "cosine"


def evaluate_retrieval(args: argparse.Namespace) -> dict:
    """`bertjax evaluate retrieval`: a run file against qrels, or a model on a BEIR folder."""
    from bertjax.retrieval import beir, ranking_metrics, trec_format
    from bertjax.retrieval import evaluate as retrieval

    if getattr(args, "rerank", None):
        return rerank_retrieval(args)
    score_mode = args.qrels is not None or args.run is not None
    model_mode = args.checkpoint is not None or args.data is not None
    if score_mode == model_mode or (score_mode and not (args.qrels and args.run)):
        raise ValueError(
            "retrieval takes either --qrels=FILE --run=FILE (score a run) or "
            "--checkpoint=MODEL --data=BEIR_DIR (embed, search and score)"
        )
    if score_mode:
        result, unanswered = retrieval.score_run_files(args.qrels, args.run)
        if unanswered:
            print(
                f"bertjax evaluate: warning: {args.run}: {len(unanswered)} judged queries have no "
                "line in the run and are not counted (as in pytrec_eval, BEIR and MTEB)",
                file=sys.stderr,
            )
        return result
    if not args.data or not args.checkpoint:
        raise ValueError("--checkpoint=MODEL and --data=BEIR_DIR go together")
    if args.top_k < 100:
        raise ValueError(
            f"--top_k must be at least 100 (recall@100 reads the top 100), not {args.top_k}"
        )
    data = beir.load(args.data, args.split)
    import bertjax

    model = bertjax.load_pretrained(args.checkpoint, quiet=True)
    if not hasattr(model, "embed"):
        raise ValueError(f"{args.checkpoint}: the loaded model has no embed()")
    print(
        f"bertjax evaluate: {args.data} ({args.split}): {len(data.query_ids)} judged queries, "
        f"{len(data.doc_ids)} documents",
        file=sys.stderr,
    )
    if getattr(model, "late_interaction", False):  # ColBERT: per-token vectors, MaxSim
        found = retrieval.retrieve_maxsim(
            model.embed_queries,
            model.embed_documents,
            data,
            top_k=args.top_k,
            batch_size=args.batch_size,
        )
    else:
        found = retrieval.retrieve(
            model.embed,
            data,
            top_k=args.top_k,
            similarity=args.similarity or _model_similarity(model),
            batch_size=args.batch_size,
        )
    if args.output_run:
        trec_format.write_run(args.output_run, found.run)
    took = ", ".join(f"{name} {secs:.1f} s" for name, secs in found.seconds.items())
    print(f"bertjax evaluate: {took}", file=sys.stderr)
    return ranking_metrics.evaluate(data.qrels, found.run)


def rerank_retrieval(args: argparse.Namespace) -> dict:
    """`bertjax evaluate retrieval --rerank=CROSS_ENCODER --data=BEIR_DIR` with `--run=FILE` (a
    first-stage run) or `--checkpoint=MODEL` (a bi-encoder searched first): the top `--top_k`
    documents of each judged query reranked by the cross-encoder (pairs truncated longest-first
    as CrossEncoder does, see bertjax.retrieval.reranker.rerank) and scored; the reranked run holds those
    `--top_k` documents (BEIR's Rerank)."""
    import bertjax
    from bertjax.retrieval import beir, ranking_metrics, trec_format
    from bertjax.retrieval import evaluate as retrieval
    from bertjax.retrieval.reranker import rerank

    if not args.data or args.qrels or (args.run is None) == (args.checkpoint is None):
        raise ValueError(
            "--rerank=MODEL takes --data=BEIR_DIR and one first stage: --run=FILE (a TREC run) "
            "or --checkpoint=MODEL (a bi-encoder searched first)"
        )
    if args.top_k < 1:
        raise ValueError(f"--top_k must be at least 1, not {args.top_k}")
    data = beir.load(args.data, args.split)
    reranker = bertjax.load_pretrained(args.rerank, quiet=True)
    if reranker.module.num_labels != 1:
        raise ValueError(
            f"{args.rerank}: not a cross-encoder (a sequence classifier with one label; it has "
            f"{reranker.module.num_labels})"
        )
    if args.run:
        first = trec_format.read_run(args.run)
        if not any(qid in data.qrels for qid in first):
            raise ValueError(f"{args.run}: no query of the run is judged in {args.data}")
    else:
        model = bertjax.load_pretrained(args.checkpoint, quiet=True)
        first = retrieval.retrieve(
            model.embed,
            data,
            top_k=max(args.top_k, 100),
            similarity=args.similarity or _model_similarity(model),
            batch_size=args.batch_size,
        ).run
    before = ranking_metrics.evaluate(data.qrels, first)
    print(
        f"bertjax evaluate: first stage ndcg@10 {before['ndcg@10']:.4f}; reranking the top "
        f"{args.top_k} of {len(data.query_ids)} judged queries",
        file=sys.stderr,
    )
    reranked = rerank.rerank_run(
        lambda pairs: reranker.rerank_scores(pairs, args.batch_size, args.max_seq_length),
        dict(zip(data.query_ids, data.query_texts)),
        dict(zip(data.doc_ids, data.doc_texts)),
        first,
        args.top_k,
    )
    if args.output_run:
        trec_format.write_run(args.output_run, reranked)
    return ranking_metrics.evaluate(data.qrels, reranked)


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="bertjax evaluate", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="benchmark", required=True)
    squad = sub.add_parser("squad", help="official SQuAD v1.1 / v2.0 evaluation")
    squad.add_argument("--dataset", required=True, help="SQuAD JSON file (e.g. dev-v1.1.json)")
    squad.add_argument("--predictions", required=True, help="predictions.json")
    squad.add_argument(
        "--na_prob_file", default=None, help="v2.0 no-answer scores (null_odds.json)"
    )
    squad.add_argument(
        "--version", choices=("1.1", "2.0"), default=None, help="default: the file's"
    )
    glue = sub.add_parser("glue", help="GLUE metrics of a predictions TSV")
    glue.add_argument("--task", required=True, help="task name, e.g. MRPC, sst2, STS-B")
    glue.add_argument("--labels", required=True, help="labelled TSV file or the task's data folder")
    glue.add_argument("--predictions", required=True, help="index<TAB>prediction file")
    glue.add_argument("--split", default=None, help="split of --labels (default dev / dev_matched)")
    retrieval = sub.add_parser(
        "retrieval", help="nDCG@10, Recall@10/100, MRR@10, MAP@100 of a run or of a model on BEIR"
    )
    retrieval.add_argument(
        "--qrels", default=None, help="qrels (BEIR TSV or TREC) to score against"
    )
    retrieval.add_argument(
        "--run", default=None, help="TREC run file (qid Q0 docid rank score tag)"
    )
    retrieval.add_argument("--checkpoint", default=None, help="model folder (load_pretrained)")
    retrieval.add_argument("--data", default=None, help="BEIR folder (corpus.jsonl, queries.jsonl)")
    retrieval.add_argument("--split", default="test", help="qrels/SPLIT.tsv (default test)")
    retrieval.add_argument("--output_run", default=None, help="also write the run to this file")
    retrieval.add_argument("--top_k", type=int, default=100, help="documents per query (>= 100)")
    retrieval.add_argument(
        "--similarity",
        choices=("cosine", "dot"),
        default=None,
        help="default: the model's (a sentence-transformers or bertjax retrieval model), else cosine",
    )
    retrieval.add_argument("--batch_size", type=int, default=32, help="texts per embedding batch")
    retrieval.add_argument(
        "--rerank",
        default=None,
        help="cross-encoder that reranks the top --top_k (load_pretrained)",
    )
    retrieval.add_argument(
        "--max_seq_length",
        type=int,
        default=None,
        help="--rerank: tokens per query/passage pair (default: the cross-encoder's)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `bertjax evaluate` with the arguments after "evaluate"; prints the JSON and returns 0.

    Bad input prints one error line to stderr and raises SystemExit(2), as argparse errors do.
    """
    args = _parser().parse_args(argv)
    try:
        if args.benchmark == "squad":
            result = evaluate_squad_files(
                args.dataset, args.predictions, args.na_prob_file, args.version
            )
        elif args.benchmark == "glue":
            result = evaluate_glue_files(args.task, args.labels, args.predictions, args.split)
        else:
            result = evaluate_retrieval(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"bertjax evaluate: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

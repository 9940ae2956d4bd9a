"""Fine-tune a sentence-transformers model as a retriever in bertjax and in sentence-transformers,
side by side, and score both the same way.

``python -m bertjax.tools.bench_retrieval --model=ST_DIR --data=BEIR_DIR [--peers]``

* bertjax: the ``retrieval`` task (``configs/retrieval.py``) from ``--model`` on ``qrels/<train>``
  for ``--steps`` (default: one epoch) of ``--batch`` rows, the cached step, AdamW with the
  config's warmup and linear decay; the steady-state examples/s from ``metrics.jsonl``.
* ``--peers``: sentence-transformers' model and ``MultipleNegativesRankingLoss`` (scale 20,
  cosine) under ``torch.optim.AdamW`` with the same batches (the bertjax run's order), learning
  rates, decay groups, clipping and dropout, padded per batch as sentence-transformers pads; its
  median step time. (A loop over sentence-transformers' own model and loss: its trainer needs the
  ``datasets`` package; the step is the one ``tests/test_retrieval_reference.py`` proves equal.)
* Both trained models, and the starting one, are scored by the same code: ``load_pretrained``,
  ``embed``, exact search and the trec_eval measures on ``qrels/<eval>``.

Prints one JSON object. Timings on a shared machine vary: run it twice and report both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _config(args, workdir: str):
    from configs import retrieval as retrieval_config

    c = retrieval_config.get_config()
    c.init_checkpoint = args.model
    c.data_dir = args.data
    c.data.train_split, c.data.eval_split = args.train_split, args.eval_split
    c.data.max_seq_length, c.data.max_query_length = args.seq, args.query_seq
    c.train.global_batch_size = args.batch
    c.train.steps = args.steps
    c.train.log_every = 1
    c.train.checkpoint_every = 10**6
    c.train.seed = args.seed
    c.optimizer.learning_rate = args.lr
    c.retrieval.eval = False  # scored afterwards, both models the same way
    c.tensorboard = False
    c.mesh.num_devices = 1
    return c


def _score(model_dir: str, data, batch_size: int, max_seq_length: int) -> dict:
    """nDCG@10 and the rest on ``data``. A model without a length of its own (a pretraining
    checkpoint: ModernBERT's position table is 8192) is cut at ``max_seq_length`` tokens."""
    import dataclasses

    import bertjax
    from bertjax.retrieval import evaluate, ranking_metrics
    from bertjax.retrieval.bi_encoder.embedding import EmbeddingSettings

    model = bertjax.load_pretrained(model_dir, quiet=True)
    settings = model.embedding or EmbeddingSettings()
    if settings.max_seq_length is None:
        model.embedding = dataclasses.replace(settings, max_seq_length=max_seq_length)
    found = evaluate.retrieve(model.embed, data, top_k=100, batch_size=batch_size)
    return ranking_metrics.evaluate(data.qrels, found.run)


def _order(args, rows: list) -> list[list[int]]:
    """The rows of each of the bertjax run's batches: its shuffle, arranged without repeats."""
    import functools

    import numpy as np

    from bertjax.data.array_data import ArrayData
    from bertjax.retrieval.bi_encoder.task import no_duplicate_batches

    texts = [frozenset((q, p, *negatives[:0])) for q, p, negatives in rows]
    arrange = functools.partial(no_duplicate_batches, row_texts=texts, batch_size=args.batch)
    data = ArrayData({"row": np.arange(len(rows))}, args.batch, seed=args.seed, arrange=arrange)
    return [next(data)["row"].tolist() for _ in range(args.steps)]


def _bertjax(args, workdir: str) -> dict:
    """Trains; returns the steady-state timings (steps after the second, from metrics.jsonl)."""
    from bertjax import train

    config = _config(args, workdir)
    start = time.perf_counter()
    if not (args.reuse and os.path.isdir(os.path.join(workdir, "bertjax", "checkpoints"))):
        train.train_and_evaluate(config, os.path.join(workdir, "bertjax"))
    wall = time.perf_counter() - start
    with open(os.path.join(workdir, "bertjax", "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    rates = [s["steps_per_sec"] for s in steps if s.get("split") == "train" and s["step"] > 2]
    step_s = 1.0 / statistics.median(rates)
    return {"median_step_s": step_s, "examples_per_s": args.batch / step_s, "wall_s": wall}


def _peer(args, workdir: str, order: list[list[int]], rows: list) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.losses import MultipleNegativesRankingLoss

    from bertjax import optim

    config = _config(args, workdir)
    model = SentenceTransformer(args.model, device="cpu")
    model.max_seq_length = args.seq
    model.train()
    loss_fn = MultipleNegativesRankingLoss(model, scale=config.retrieval.scale)
    params = [p for p in model.parameters() if p.requires_grad]
    o = config.optimizer
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=o.learning_rate, betas=(o.b1, o.b2), eps=o.eps)
    warmup = int(round(o.warmup_proportion * args.steps))
    _, schedule = optim.create_optimizer(config, total_steps=args.steps, warmup_steps=warmup)
    times = []
    for step, indices in enumerate(order):
        start = time.perf_counter()
        queries = model.tokenize([rows[i][0] for i in indices])
        queries = {  # bertjax's query cut
            k: v[:, : args.query_seq] if isinstance(v, torch.Tensor) and v.ndim == 2 else v
            for k, v in queries.items()
        }
        docs = model.tokenize([rows[i][1] for i in indices])
        for group in opt.param_groups:
            group["lr"] = float(schedule(step))
        opt.zero_grad()
        loss = loss_fn([queries, docs], None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip_norm)
        opt.step()
        times.append(time.perf_counter() - start)
    model.save(os.path.join(workdir, "torch"))
    step_s = statistics.median(times[2:])
    return {"median_step_s": step_s, "examples_per_s": args.batch / step_s, "wall_s": sum(times)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench_retrieval", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        required=True,
        help="a sentence-transformers directory or any bertjax.load_pretrained path",
    )
    parser.add_argument("--data", required=True, help="BEIR folder")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--train_split", default="train")
    parser.add_argument("--eval_split", default="test")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=0, help="default: one epoch")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--query_seq", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peers", action="store_true", help="also sentence-transformers")
    parser.add_argument("--skip_zero_shot", action="store_true", help="do not score --model")
    parser.add_argument("--timing_only", action="store_true", help="score no model")
    parser.add_argument("--reuse", action="store_true", help="keep WORKDIR's bertjax run")
    args = parser.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, root)  # configs/
    from bertjax.retrieval import beir
    from bertjax.retrieval.bi_encoder.task import beir_training_rows

    rows = beir_training_rows(beir.load(args.data, args.train_split))
    args.steps = args.steps or len(rows) // args.batch
    eval_data = beir.load(args.data, args.eval_split)
    result = {"rows": len(rows), "steps": args.steps, "batch": args.batch, "lr": args.lr}
    if not (args.skip_zero_shot or args.timing_only):
        result["zero_shot"] = _score(args.model, eval_data, 64, args.seq)
    result["bertjax"] = _bertjax(args, args.workdir)
    if not args.timing_only:
        result["bertjax"].update(
            _score(os.path.join(args.workdir, "bertjax"), eval_data, 64, args.seq)
        )
    print(json.dumps(result), file=sys.stderr)  # so far (the peer takes as long again)
    if args.peers:
        order = _order(args, rows)
        result["sentence_transformers"] = _peer(args, args.workdir, order, rows)
        if not args.timing_only:
            scores = _score(os.path.join(args.workdir, "torch"), eval_data, 64, args.seq)
            result["sentence_transformers"].update(scores)
        result["speedup_examples_per_s"] = (
            result["bertjax"]["examples_per_s"] / result["sentence_transformers"]["examples_per_s"]
        )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

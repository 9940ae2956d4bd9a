"""Cross-encoder reranking (the ``reranker`` task): a (query, passage) pair through the encoder and
the GLUE pair-classification head with one logit, trained with binary cross-entropy on the logit as
sentence-transformers' ``CrossEncoder`` with its default ``BinaryCrossEntropyLoss`` (labels in
[0, 1]; ``models.heads.SequenceClassifier``, ``num_labels=1``).

Training pairs (``data.train_file``):

* JSON lines ``{"query", "passage", "label"}``;
* TSV lines ``query<TAB>passage<TAB>label`` (a first line ``query passage label`` is a header);
* JSON lines ``{"query", "positive", "negatives": [...]}`` (the bi-encoder task's rows and the hard
  negative miner's): label 1 for the positive, 0 for each of at most ``data.num_negatives``
  negatives (0: all);

or, without a file, the BEIR folder ``data_dir``: ``qrels/<data.train_split>.tsv``'s judged pairs
(label 1 for relevance >= 1, 0 for a judged 0) plus, from ``data.negatives_file`` (a TREC run, such
as ``bertjax evaluate retrieval --output_run``'s on the training split), each query's top
``data.num_negatives`` documents that are not judged relevant, as label 0.

A pair is ``[CLS] query [SEP] passage [SEP]`` truncated longest-first to ``data.max_seq_length``
tokens, as ``CrossEncoder`` tokenizes it (``rerank``, beside this module). Evaluation, every epoch:
with ``data.eval_run`` (a TREC first-stage run), the top ``data.rerank_top_k`` documents of each
judged query of ``data_dir``'s ``data.eval_split`` are reranked and scored (nDCG@10, Recall@10/100,
MRR@10, MAP@100 as trec_eval; nDCG@10 keeps the best checkpoint); else ``data.dev_file`` (pairs as
above) gives the dev binary cross-entropy and accuracy (logit > 0 against label >= 0.5).
"""

from __future__ import annotations

import json
import logging
import math

import jax.numpy as jnp
import numpy as np
import optax

from bertjax import fs
from bertjax.models.heads import SequenceClassifier
from bertjax.retrieval import beir, ranking_metrics, trec_format
from bertjax.retrieval.reranker import rerank
from bertjax.tasks.base import register
from bertjax.tasks.finetuning import EvalSet, FinetuneTask, subset

log = logging.getLogger("bertjax")

Example = tuple[str, str, float]  # (query, passage, label)
TSV_HEADER = ("query", "passage", "label")


def _label(value, where: str) -> float:
    """A label in [0, 1] (a number or a JSON boolean); one-line errors name ``where``."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{where}: label {value!r} is not a number") from None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: label {value!r} is not a finite number")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{where}: label {value!r} is outside [0, 1]")
    return float(value)


def _text(record: dict, key: str, where: str) -> str:
    if key not in record:
        raise ValueError(f"{where}: no {key!r} key")
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key!r} is not a string")
    if not value.strip():
        raise ValueError(f"{where}: {key!r} is empty")
    return value


def _json_examples(record, where: str, num_negatives: int) -> list[Example]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object")
    query = _text(record, "query", where)
    if "positive" in record:  # a bi-encoder row: label 1 / 0 pairs
        negatives = record.get("negatives") or []
        if not isinstance(negatives, list):
            raise ValueError(f"{where}: 'negatives' is not a list")
        negatives = negatives[:num_negatives] if num_negatives > 0 else negatives
        rows = [(query, _text(record, "positive", where), 1.0)]
        for i, negative in enumerate(negatives):
            if not isinstance(negative, str) or not negative.strip():
                raise ValueError(f"{where}: negatives[{i}] is not a non-empty string")
            rows.append((query, negative, 0.0))
        return rows
    passage = _text(record, "passage", where)
    if "label" not in record:
        raise ValueError(f"{where}: no 'label' key")
    return [(query, passage, _label(record["label"], where))]


def read_pairs(path: str, num_negatives: int = 0) -> list[Example]:
    """(query, passage, label) examples of a JSON-lines or TSV file (see the module docstring):
    ``.tsv`` is TSV, anything else whose first line starts with ``{`` JSON lines."""
    if not fs.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    examples: list[Example] = []
    tsv = None
    try:
        with fs.open_file(path, "r") as f:
            for number, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                if tsv is None:
                    tsv = path.endswith(".tsv") or not line.lstrip().startswith("{")
                if not tsv:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise fs.json_error(path, err, number) from None
                    examples += _json_examples(record, where, num_negatives)
                    continue
                fields = line.split("\t")
                if len(fields) != 3:
                    raise ValueError(
                        f"{where}: expected 3 tab-separated fields (query, passage, label), "
                        f"found {len(fields)}"
                    )
                if not examples and tuple(x.strip().lower() for x in fields) == TSV_HEADER:
                    continue
                record = dict(zip(("query", "passage"), fields))
                query, passage = (_text(record, k, where) for k in ("query", "passage"))
                examples.append((query, passage, _label(fields[2], where)))
    except UnicodeDecodeError as err:
        raise fs.utf8_error(path, err) from None
    if not examples:
        raise ValueError(f"{path}: no (query, passage, label) pairs")
    return examples


def beir_pairs(data: beir.BeirSet, negatives: trec_format.Run | None, k: int) -> list[Example]:
    """The judged pairs of a BEIR split (relevance >= 1: label 1, a judged 0: label 0), then each
    query's top ``k`` (0: all) documents of ``negatives`` not judged relevant, as label 0."""
    texts = dict(zip(data.doc_ids, data.doc_texts))
    queries = dict(zip(data.query_ids, data.query_texts))
    examples = []
    for qid in data.query_ids:
        judged = data.qrels[qid]
        for doc, rel in judged.items():
            if doc in texts:
                examples.append((queries[qid], texts[doc], 1.0 if rel >= 1 else 0.0))
        ranked = trec_format.ranked((negatives or {}).get(qid, {}))
        mined = [d for d, _ in ranked if d in texts and d != qid and d not in judged]
        for doc in mined[:k] if k > 0 else mined:
            examples.append((queries[qid], texts[doc], 0.0))
    return examples


@register("reranker")
class RerankerTask(FinetuneTask):
    """A cross-encoder: binary cross-entropy on one logit of the pair classifier."""

    name = "reranker"
    feature_heads = True
    pooled_head = True

    def __init__(self, config, workdir):
        super().__init__(config, workdir)
        self.main_metric = "ndcg@10" if config.data.get("eval_run") else "accuracy"
        self.rerank_data: tuple | None = None  # (features, keys, qrels) of the eval run

    # ---- data ------------------------------------------------------------------------------------
    def _features(self, examples: list[Example]) -> dict[str, np.ndarray]:
        pairs = [(q, p) for q, p, _ in examples]
        features = rerank.pair_features(self.tokenizer, pairs, self.config.data.max_seq_length)
        features["label"] = np.array([y for _, _, y in examples], np.float32)
        return features

    def load_data(self) -> None:
        d = self.config.data
        k = int(d.num_negatives)
        if d.train_file:
            train = read_pairs(d.train_file, k)
        else:
            folder = self.require_data_dir("a BEIR folder (corpus.jsonl, queries.jsonl, qrels/)")
            negatives = trec_format.read_run(d.negatives_file) if d.negatives_file else None
            train = beir_pairs(beir.load(folder, d.train_split), negatives, k)
        if not any(y < 0.5 for _, _, y in train):
            log.warning("task reranker: no negative (label < 0.5) training pairs")
        self.train_features = self._features(subset(train, d.max_train_examples))
        if d.eval_run:
            self._load_eval_run(d)
        elif d.dev_file:
            dev = subset(read_pairs(d.dev_file, k), d.max_eval_examples, seed=None)
            self.eval_sets.append(EvalSet("dev", self._features(dev)))

    def _load_eval_run(self, d) -> None:
        folder = self.require_data_dir("the BEIR folder data.eval_run is reranked on")
        data = beir.load(folder, d.eval_split)
        run = trec_format.read_run(d.eval_run)
        queries = dict(zip(data.query_ids, data.query_texts))
        if not any(qid in queries for qid in run):
            raise ValueError(
                f"{d.eval_run}: no query of the run is judged in {folder} ({d.eval_split})"
            )
        pairs = []

        def collect(found_pairs):  # rerank_run's score callback: keeps the pairs, scores 0
            pairs.extend(found_pairs)
            return np.zeros(len(found_pairs))

        skeleton = rerank.rerank_run(
            collect, queries, dict(zip(data.doc_ids, data.doc_texts)), run, int(d.rerank_top_k)
        )
        keys = [(qid, doc) for qid, docs in skeleton.items() for doc in docs]
        features = rerank.pair_features(self.tokenizer, pairs, d.max_seq_length)
        self.rerank_data = (keys, list(skeleton), data.qrels)
        self.eval_sets.append(EvalSet("rerank", features))
        log.info("task reranker: eval reranks %d pairs of %d queries", len(keys), len(skeleton))

    # ---- model and loss --------------------------------------------------------------------------
    def build_model(self, model_config):
        return SequenceClassifier(model_config, num_labels=1, **self.head_options(model_config))

    def model_inputs(self, batch):
        inputs = super().model_inputs(batch)
        if "cls_positions" in batch:  # packed rows: one logit per [CLS]
            inputs["cls_positions"] = batch["cls_positions"]
        return inputs

    def head_loss(self, logits, batch, normalizers):
        weights = self.example_weights(batch)  # [b], or [b, k] when packed
        logits = logits[..., 0]
        labels = batch["label"].astype(jnp.float32)
        bce = optax.sigmoid_binary_cross_entropy(logits, labels)
        norm = jnp.maximum(normalizers["examples"], 1e-5)
        correct = (logits > 0) == (labels >= 0.5)
        loss = (bce * weights).sum() / norm
        return loss, {"bce": loss, "accuracy": (correct * weights).sum() / norm}

    def predictions(self, logits, batch):
        return {"score": logits[..., 0]}  # [batch (, k)] raw logit

    # ---- evaluation ------------------------------------------------------------------------------
    def score(self, eval_set, outputs):
        scores = np.asarray(outputs["score"], np.float64)
        if eval_set.name == "rerank":
            keys, qids, qrels = self.rerank_data
            run: trec_format.Run = {qid: {} for qid in qids}
            for (qid, doc), value in zip(keys, scores.tolist()):
                run[qid][doc] = value
            return ranking_metrics.evaluate(qrels, run)
        labels = eval_set.features["label"].astype(np.float64)
        bce = np.maximum(scores, 0) - scores * labels + np.log1p(np.exp(-np.abs(scores)))
        accuracy = np.mean((scores > 0) == (labels >= 0.5))
        return {"bce": float(bce.mean()), "accuracy": float(accuracy)}

    def describe(self) -> str:
        return f"{super().describe()} (cross-encoder, binary cross-entropy)"

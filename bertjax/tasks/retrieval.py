"""Bi-encoder training (dense retrieval): one encoder embeds queries and documents; InfoNCE over
in-batch and hard negatives of the WHOLE global batch (``bertjax.retrieval.losses``).

Data (``data.train_file``, JSON lines ``{"query", "positive", "negatives": [...]}``; or a BEIR
folder ``data_dir`` whose ``qrels/<data.train_split>.tsv`` pairs each query with every relevant
document) become rows of one query, its positive and up to ``data.num_negatives`` hard negatives
(padded rows are masked out of the loss). A row whose positive is another row's too is not that
row's negative (``positive_key``): a batch never scores a query's own positive as a negative.

The loss couples the batch's rows, so the task declares ``micro_batching = "cached"``:
``train.grad_accum_steps = k`` runs the exact two-pass cached step (GradCache) over k
micro-batches, with the gradient of the whole-batch loss. Evaluation embeds the BEIR split
``data.eval_split`` of ``data_dir`` (queries and corpus), searches exactly
(``bertjax.retrieval.search``) and scores nDCG@10, Recall@{10,100}, MRR@10 and MAP@100 as trec_eval
does; nDCG@10 picks the best checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from bertjax import flops, fs
from bertjax.models.heads import SentenceEmbedder
from bertjax.models.pooling import EmbeddingHead
from bertjax.pretrained import encode_batch
from bertjax.retrieval import beir, losses, metrics
from bertjax.retrieval import evaluate as retrieval_eval
from bertjax.tasks.base import register
from bertjax.tasks.finetuning import FinetuneTask

log = logging.getLogger("bertjax")


def read_training_rows(path: str) -> list[tuple[str, str, list[str]]]:
    """(query, positive, negatives) per line of a JSON-lines file; one-line errors name the line."""
    if not fs.exists(path):
        raise FileNotFoundError(f"config key data.train_file={path}: no such file")
    rows = []
    with fs.open_file(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                query, positive = record["query"], record["positive"]
                negatives = record.get("negatives") or []
                if not all(isinstance(t, str) for t in (query, positive, *negatives)):
                    raise TypeError("query, positive and negatives must be strings")
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{number}: {type(err).__name__}: {err}") from None
            rows.append((query, positive, list(negatives)))
    if not rows:
        raise ValueError(f"{path}: no training rows")
    return rows


def beir_training_rows(data: beir.BeirSet) -> list[tuple[str, str, list[str]]]:
    """One (query, relevant document) row per judged pair (relevance >= 1), in qrels order."""
    texts = dict(zip(data.doc_ids, data.doc_texts))
    queries = dict(zip(data.query_ids, data.query_texts))
    return [
        (queries[qid], texts[doc], [])
        for qid, docs in data.qrels.items()
        for doc, rel in docs.items()
        if rel >= 1 and doc in texts and qid in queries
    ]


@register("retrieval")
class RetrievalTask(FinetuneTask):
    """Dense retrieval: a bi-encoder trained with in-batch and hard negatives."""

    name = "retrieval"
    main_metric = "ndcg@10"
    micro_batching = "cached"
    packing_unsupported = "a row is a query with its documents, scored against the whole batch"

    def __init__(self, config, workdir):
        super().__init__(config, workdir)
        self.eval_data: beir.BeirSet | None = None

    # ---- data ------------------------------------------------------------------------------------
    def _encode(self, texts: list[str], length: int) -> dict[str, np.ndarray]:
        out = encode_batch(self.tokenizer, texts, length, pad_to_max_length=True)
        return {k: v.astype(np.int32) for k, v in out.items()}

    def training_rows(self) -> list[tuple[str, str, list[str]]]:
        """(query, positive, negatives) rows of data.train_file or of the BEIR folder's
        data.train_split, the first data.max_train_examples (when > 0)."""
        d = self.config.data
        if d.get("train_file"):
            rows = read_training_rows(d.train_file)
        else:
            folder = self.require_data_dir("a BEIR folder (corpus.jsonl, queries.jsonl, qrels/)")
            rows = beir_training_rows(beir.load(folder, d.train_split))
        return rows[: d.max_train_examples] if d.max_train_examples > 0 else rows

    def load_eval_split(self) -> None:
        """``eval_data``: the BEIR folder's data.eval_split, when it has qrels (and
        ``retrieval.eval`` is on)."""
        d, r = self.config.data, self.config.retrieval
        if r.get("eval", True) and self.config.data_dir and d.eval_split:
            qrels = os.path.join(self.config.data_dir, "qrels", f"{d.eval_split}.tsv")
            if fs.exists(qrels):
                self.eval_data = beir.load(self.config.data_dir, d.eval_split)

    def load_data(self) -> None:
        d = self.config.data
        rows = self.training_rows()
        m = 1 + int(d.num_negatives)
        queries = self._encode([q for q, _, _ in rows], d.max_query_length)
        docs, valid = [], np.zeros((len(rows), m), np.float32)
        for i, (_, positive, negatives) in enumerate(rows):
            group = [positive, *negatives[: m - 1]]
            valid[i, : len(group)] = 1
            docs += group + [""] * (m - len(group))
        encoded = self._encode(docs, d.max_seq_length)
        self.train_features = {
            "input_ids": queries["input_ids"],  # [n, Lq]
            "segment_ids": queries["token_type_ids"],
            "input_mask": queries["attention_mask"],
            "doc_ids": encoded["input_ids"].reshape(len(rows), m, -1),  # [n, m, L]
            "doc_mask": encoded["attention_mask"].reshape(len(rows), m, -1),
            "doc_valid": valid,  # [n, m]
            "positive_key": np.array(  # equal for equal positives (crc32 of the text)
                [zlib.crc32(p.encode("utf-8")) & 0x7FFFFFFF for _, p, _ in rows], np.int32
            ),
        }
        self.load_eval_split()
        log.info(
            "task retrieval: %d training rows (%d hard negatives at most), eval %s",
            len(rows), m - 1,
            f"{len(self.eval_data.query_ids)} queries x {len(self.eval_data.doc_ids)} documents"
            if self.eval_data else "none",
        )  # fmt: skip

    # ---- model -----------------------------------------------------------------------------------
    def embedding_head(self) -> EmbeddingHead:
        r = self.config.retrieval
        return EmbeddingHead(pooling=tuple(r.pooling.split("+")), normalize=bool(r.normalize))

    def build_model(self, model_config):
        return SentenceEmbedder(model_config, head=self.embedding_head())

    def model_inputs(self, batch):
        return dict(
            input_ids=batch["input_ids"],
            token_type_ids=batch["segment_ids"],
            attention_mask=batch["input_mask"],
        )

    def init_batch(self, phase, batch_size):
        batch = super().init_batch(phase, batch_size)
        batch["doc_mask"] = np.ones_like(batch["doc_mask"])
        return batch

    def flops_per_step(self, model_config, phase):
        """Queries and every document (positives, hard negatives) through the encoder."""
        b = phase.global_batch_size
        f = self.train_features
        m, length = f["doc_ids"].shape[1:]
        return flops.train_flops_per_step(
            model_config, b, f["input_ids"].shape[1], 0
        ) + flops.train_flops_per_step(model_config, b * m, length, 0)

    # ---- training: the cached (two-pass) contract ---------------------------------------------------
    def embed(self, model, params, batch, rng):
        """Query embeddings [rows, dim] and document embeddings [rows, m, dim] (training mode)."""
        q_rng, d_rng = jax.random.split(rng)
        queries = model.apply(
            {"params": params},
            **self.model_inputs(batch),
            deterministic=False,
            rngs={"dropout": q_rng},
        )
        rows, m, length = batch["doc_ids"].shape
        docs = model.apply(
            {"params": params},
            batch["doc_ids"].reshape(rows * m, length),
            jnp.zeros((rows * m, length), jnp.int32),
            batch["doc_mask"].reshape(rows * m, length),
            deterministic=False,
            rngs={"dropout": d_rng},
        )
        return {"query": queries, "documents": docs.reshape(rows, m, -1)}

    def batch_loss(self, embeddings, batch):
        r = self.config.retrieval
        kwargs = dict(
            scale=float(r.scale),
            similarity_fn=r.similarity,
            directions=tuple(r.directions),
            document_mask=batch["doc_valid"],
            positive_key=batch["positive_key"],
        )
        q, d = embeddings["query"], embeddings["documents"]
        if r.matryoshka_dims:
            return losses.matryoshka(
                losses.multiple_negatives_ranking_loss, q, d, tuple(r.matryoshka_dims), **kwargs
            )
        return losses.multiple_negatives_ranking_loss(q, d, **kwargs)

    def head_loss(self, outputs, batch, normalizers):
        raise NotImplementedError("retrieval trains through embed/batch_loss (cached)")

    # ---- evaluation ------------------------------------------------------------------------------
    def predictions(self, outputs, batch):
        return {"embedding": outputs}

    def _embed_fn(self, run):
        length = self.config.data.max_seq_length

        def embed(texts, batch_size=32):
            encoded = self._encode(list(texts), length)
            features = {
                "input_ids": encoded["input_ids"],
                "segment_ids": encoded["token_type_ids"],
                "input_mask": encoded["attention_mask"],
            }  # ArrayData adds the padding "mask"
            return self.predict(run, features)["embedding"]

        return embed

    def evaluate(self, run, phase):
        if self.eval_data is None:
            return {}
        found = retrieval_eval.retrieve(
            self._embed_fn(run),
            self.eval_data,
            top_k=100,
            similarity=self.config.retrieval.similarity,
            batch_size=self._eval_batch_size(),
        )
        return metrics.evaluate(self.eval_data.qrels, found.run)

    def finalize(self, run, params, workdir):
        return {
            "task": self.name,
            "main_metric": self.main_metric,
            "dev": self.evaluate(run, None),
            "num_train_examples": int(len(self.train_features["input_ids"])),
            "train_steps": self._total_steps,
        }

"""Bi-encoder training (dense retrieval): one encoder embeds queries and documents; InfoNCE over
in-batch and hard negatives of the WHOLE global batch (``bertjax.retrieval.contrastive_losses``).

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

import dataclasses
import functools
import logging
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from bertjax import flops, fs
from bertjax.convert import unflatten_params
from bertjax.data.array_data import ArrayData
from bertjax.models import architecture
from bertjax.pretrained import encode_batch
from bertjax.retrieval import beir, contrastive_losses, ranking_metrics
from bertjax.retrieval import evaluate as retrieval_eval
from bertjax.retrieval.bi_encoder.embedding import (
    EmbeddingSettings,
    SentenceEmbedder,
    settings_record,
)
from bertjax.retrieval.bi_encoder.pooling import EmbeddingHead
from bertjax.tasks.base import register
from bertjax.tasks.finetuning import FinetuneTask

log = logging.getLogger("bertjax")


Row = tuple[str, str, list[str]]  # (query, positive, hard negatives)


def _row(record: dict, where: str) -> Row:
    """A row of a JSON line or a Parquet row: ``query`` (or ``anchor``), ``positive``, and
    ``negatives`` (a list) or ``negative`` / ``negative_1``, ``negative_2``, ... columns."""
    query = record.get("query", record.get("anchor"))
    positive = record.get("positive")
    if query is None or positive is None:
        missing = "query (or anchor)" if query is None else "positive"
        raise ValueError(f"{where}: no {missing!r} field (has {sorted(record)})")
    negatives = record.get("negatives")
    if negatives is None:
        numbered = sorted(
            (int(k.rsplit("_", 1)[1]), k)
            for k in record
            if k.startswith("negative_") and k.rsplit("_", 1)[1].isdigit()
        )
        negatives = [record[k] for _, k in numbered] or (
            [record["negative"]] if record.get("negative") is not None else []
        )
    negatives = [n for n in negatives if n is not None]
    if not all(isinstance(t, str) for t in (query, positive, *negatives)):
        raise ValueError(f"{where}: query, positive and negatives must be strings")
    if not query.strip() or not positive.strip():
        raise ValueError(f"{where}: empty {'query' if not query.strip() else 'positive'}")
    return query, positive, list(negatives)


def read_training_rows(path: str) -> list[Row]:
    """(query, positive, negatives) rows of JSON lines, Parquet (``.parquet``) or TSV (``.tsv``:
    query, positive, negatives..., a first line ``query<TAB>positive...`` is a header); one-line
    errors name the file and line (row)."""
    if not fs.exists(path):
        raise FileNotFoundError(f"config key data.train_file={path}: no such file")
    rows = []
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fs.open_file(path, "rb") as f:
            table = pq.read_table(f)
        for number, record in enumerate(table.to_pylist(), 1):
            rows.append(_row(record, f"{path}: row {number}"))
    elif path.endswith(".tsv"):
        with fs.open_file(path, "rb") as f:
            for number, line in enumerate(f, 1):
                fields = line.decode("utf-8").rstrip("\r\n").split("\t")
                if number == 1 and [x.lower() for x in fields[:2]] in (
                    ["query", "positive"],
                    ["anchor", "positive"],
                ):
                    continue
                if not line.strip():
                    continue
                if len(fields) < 2:
                    raise ValueError(
                        f"{path}:{number}: {len(fields)} field; a row is query<TAB>positive"
                        "[<TAB>negative...]"
                    )
                record = {"query": fields[0], "positive": fields[1], "negatives": fields[2:]}
                rows.append(_row(record, f"{path}:{number}"))
    else:
        for number, record in beir.json_objects(path):
            rows.append(_row(record, f"{path}:{number}"))
    if not rows:
        raise ValueError(f"{path}: no training rows")
    return rows


def beir_training_rows(data: beir.BeirSet) -> list[Row]:
    """One (query, relevant document) row per judged pair (relevance >= 1), in qrels order."""
    texts = dict(zip(data.doc_ids, data.doc_texts))
    queries = dict(zip(data.query_ids, data.query_texts))
    return [
        (queries[qid], texts[doc], [])
        for qid, docs in data.qrels.items()
        for doc, rel in docs.items()
        if rel >= 1 and doc in texts and qid in queries
    ]


def text_key(text: str) -> int:
    """A 31-bit key of a text (crc32): equal texts, equal keys."""
    return zlib.crc32(text.encode("utf-8")) & 0x7FFFFFFF


def no_duplicate_batches(order: np.ndarray, row_texts: list[frozenset], batch_size: int):
    """``order`` rearranged as sentence-transformers' ``NoDuplicatesBatchSampler`` batches it:
    each batch takes, in order, the remaining rows none of whose texts it holds yet, until it is
    full; a batch that cannot be filled takes what it can, and the next one starts over. The
    batches are returned one after the other (a flat order: the trainer's global batches are its
    consecutive windows, so only the rows after the last full batch may share a text)."""
    order = [int(i) for i in order]
    following = list(range(1, len(order))) + [-1]  # a linked list over the positions left
    head, out = (0 if order else -1), []
    while head != -1:
        seen, taken, position, previous = set(), 0, head, -1
        while position != -1 and taken < batch_size:
            index, after = order[position], following[position]
            if seen.isdisjoint(row_texts[index]):  # take it: unlink its position
                out.append(index)
                taken += 1
                seen |= row_texts[index]
                if previous == -1:
                    head = after
                else:
                    following[previous] = after
            else:  # deferred to a later batch, in order
                previous = position
            position = after
    return np.asarray(out, np.int64)


@register("retrieval")
class RetrievalTask(FinetuneTask):
    """Dense retrieval: a bi-encoder trained with in-batch and hard negatives."""

    name = "retrieval"
    main_metric = "ndcg@10"
    micro_batching = "cached"
    packing_unsupported = "a row is a query with its documents, scored against the whole batch"
    freeze_unsupported = "its embeddings are the encoder's: a bi-encoder trains the encoder"

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

    def positive_keys(self, rows: list[Row], m: int) -> np.ndarray:
        """[n] int32 keys, equal for equal positives (a row's positive is no other row's
        negative); keeps each row's texts (its query and first ``m`` documents) for
        ``data.no_duplicates``."""
        self._row_texts = [frozenset((q, p, *negatives[: m - 1])) for q, p, negatives in rows]
        return np.array([text_key(p) for _, p, _ in rows], np.int32)

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
            "segment_ids": queries["segment_ids"],
            "input_mask": queries["input_mask"],
            "doc_ids": encoded["input_ids"].reshape(len(rows), m, -1),  # [n, m, L]
            "doc_mask": encoded["input_mask"].reshape(len(rows), m, -1),
            "doc_valid": valid,  # [n, m]
            "positive_key": self.positive_keys(rows, m),
        }
        self.load_eval_split()
        log.info("task retrieval: %d training rows (%d hard negatives at most)", len(rows), m - 1)

    def describe_eval(self) -> str:
        if self.eval_data is None:
            return "nothing"
        data = self.eval_data
        return f"{len(data.query_ids)} queries x {len(data.doc_ids)} documents"

    # ---- model -----------------------------------------------------------------------------------
    def init_embedding(self) -> EmbeddingSettings | None:
        """The init checkpoint's sentence-embedding settings (a sentence-transformers directory
        or a bertjax retrieval run), None when it has none."""
        if self.source is None or not self.source.init_checkpoint:
            return None
        return self.source.pretrained.embedding

    def embedding_head(self) -> EmbeddingHead:
        """``retrieval.pooling`` (empty: the init checkpoint's head with its Dense layers and
        Normalize, else mean pooling), L2-normalised when ``retrieval.normalize`` is set."""
        r, init = self.config.retrieval, self.init_embedding()
        head = init.head if init is not None else EmbeddingHead()
        if r.pooling:
            try:
                head = dataclasses.replace(head, pooling=tuple(r.pooling.split("+")))
                head.dimension(self.model_config().hidden_size)
            except ValueError as err:
                raise ValueError(f"config key retrieval.pooling={r.pooling!r}: {err}") from None
        return dataclasses.replace(head, normalize=True) if r.normalize else head

    def embedding_settings(self) -> EmbeddingSettings:
        """What the trained model embeds with (recorded in its checkpoints, so that
        ``load_pretrained(WORKDIR).embed`` and ``convert --to=sentence-transformers`` use it)."""
        init = self.init_embedding() or EmbeddingSettings()
        return dataclasses.replace(
            init,
            head=self.embedding_head(),
            tensors={},
            max_seq_length=int(self.config.data.max_seq_length),
            similarity_fn_name=self.config.retrieval.similarity,
        )

    def checkpoint_record(self) -> dict:
        return {"embedding": settings_record(self.embedding_settings())}

    def build_model(self, model_config):
        return SentenceEmbedder(model_config, head=self.embedding_head())

    def start_params(self, model, fresh):
        """The init checkpoint's encoder, and the Dense layers of its sentence-embedding head
        where it has the same layers (the task picks its head from it), else fresh."""
        pretrained = self.source.pretrained if self.source is not None else None
        if pretrained is None or not isinstance(model, SentenceEmbedder):
            return super().start_params(model, fresh)  # (a subclass's model: its own loading)
        source = self.source.init_checkpoint
        params = pretrained.with_encoder(fresh, source)
        encoder_name = architecture(model.config).encoder_name
        settings = pretrained.embedding
        heads = sorted(k for k in params if k != encoder_name)
        tensors = unflatten_params(settings.tensors) if settings is not None else {}
        for head in heads:
            want = jax.tree.map(lambda x: tuple(x.shape), params[head])
            got = jax.tree.map(lambda x: tuple(np.shape(x)), tensors.get(head))
            if head in tensors and want != got:
                raise ValueError(
                    f"init checkpoint {source}: Dense layer {head!r} has shapes "
                    f"{got}, the model wants {want}"
                )
            if head in tensors:
                params[head] = jax.tree.map(
                    lambda x, f: np.asarray(x).astype(f.dtype), tensors[head], params[head]
                )
        log.info(
            "encoder initialised from %s%s",
            source,
            f"; Dense layers {heads} from it"
            if heads and set(heads) <= set(tensors)
            else f"; Dense layers initialised fresh: {heads}"
            if heads
            else "",
        )
        return params

    def model_inputs(self, batch):
        return dict(
            input_ids=batch["input_ids"],
            segment_ids=batch["segment_ids"],
            input_mask=batch["input_mask"],
        )

    def init_batch(self, phase, batch_size):
        batch = super().init_batch(phase, batch_size)
        batch["doc_mask"] = np.ones_like(batch["doc_mask"])
        return batch

    def tokens_per_step(self, phase):
        """The queries' and every document's (positives, hard negatives) token positions."""
        b = phase.global_batch_size
        f = self.train_features
        m, length = f["doc_ids"].shape[1:]
        return b * f["input_ids"].shape[1] + b * m * length

    def flops_per_step(self, model_config, phase):
        """Queries and every document (positives, hard negatives) through the encoder."""
        b = phase.global_batch_size
        f = self.train_features
        m, length = f["doc_ids"].shape[1:]
        return flops.train_flops_per_step(
            model_config, b, f["input_ids"].shape[1], 0
        ) + flops.train_flops_per_step(model_config, b * m, length, 0)

    def train_data(self, phase, process_index, process_count):
        """Shuffled rows, each epoch arranged so that no global batch holds a text twice
        (``data.no_duplicates``): a repeated text would be scored as its own negative."""
        b = phase.global_batch_size
        arrange = None
        if self.config.data.no_duplicates:
            arrange = functools.partial(
                no_duplicate_batches, row_texts=self._row_texts, batch_size=b
            )
        return ArrayData(
            self.train_features,
            b // process_count,
            seed=self.config.train.seed,
            process_index=process_index,
            process_count=process_count,
            arrange=arrange,
        )

    # ---- training: the cached (two-pass) contract ---------------------------------------------------
    def embed(self, model, params, batch, rng):
        """Query embeddings [rows, ...] and document embeddings [rows, m, ...] in training mode
        (a vector per text here, per token for late interaction)."""
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
        return {"query": queries, "documents": docs.reshape(rows, m, *docs.shape[1:])}

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
            return contrastive_losses.matryoshka(
                contrastive_losses.multiple_negatives_ranking_loss,
                q,
                d,
                tuple(r.matryoshka_dims),
                **kwargs,
            )
        return contrastive_losses.multiple_negatives_ranking_loss(q, d, **kwargs)

    def head_loss(self, outputs, batch, normalizers):
        raise NotImplementedError("retrieval trains through embed/batch_loss (cached)")

    # ---- evaluation ------------------------------------------------------------------------------
    def predictions(self, outputs, batch):
        return {"embedding": outputs}

    def _embed_fn(self, run):
        length = self.config.data.max_seq_length

        def embed(texts, batch_size=32):
            features = self._encode(list(texts), length)  # ArrayData adds the padding "mask"
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
        return ranking_metrics.evaluate(self.eval_data.qrels, found.run)

    def finalize(self, run, params, workdir):
        return {
            "task": self.name,
            "main_metric": self.main_metric,
            "dev": self.evaluate(run, None),
            "num_train_examples": int(len(self.train_features["input_ids"])),
            "train_steps": self._total_steps,
        }

"""Late-interaction retrieval (ColBERT, as PyLate trains it): per-token vectors, MaxSim scores.

The model (``late_interaction``, beside this module): the encoder, a linear projection of every
token (``colbert.dim``, default 128, no bias) and per-token L2 normalisation. Queries are
``[CLS] [Q] ... [SEP]`` padded with [MASK] to ``colbert.query_length``; documents
``[CLS] [D] ... [SEP]`` cut to ``colbert.document_length``, their punctuation
(``colbert.skiplist_words``) left out of scoring.

Data as the bi-encoder task (``bertjax.retrieval.bi_encoder.task``): rows of a query, its positive
and up to ``data.num_negatives`` hard negatives, from ``data.train_file`` (JSON lines) or a BEIR
folder. ``colbert.loss``:

* ``contrastive``: PyLate's ``Contrastive``, cross-entropy of each query's MaxSim scores
  (/ ``colbert.temperature``) over every document of the WHOLE batch, hard negatives included;
* ``distillation``: PyLate's ``Distillation``, KL divergence between the softmax of teacher
  scores (``"scores": [...]`` in each JSON line, aligned with positive + negatives) and of the
  student's min-max normalised MaxSim scores over the row's own documents.

Both couple the batch's rows (contrastive) or are exact per row, so ``micro_batching = "cached"``:
``train.grad_accum_steps`` runs the two-pass cached step with the whole batch's gradient.
Evaluation every epoch: nDCG@10 (and Recall@10/100, MRR@10, MAP@100) of exact MaxSim search over
the BEIR folder's ``data.eval_split``. At the end the best params are written as a PyLate directory
``WORKDIR/pylate`` (``colbert.export``), which ``load_pretrained``, ``bertjax evaluate retrieval``
and PyLate load.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax
import numpy as np

from bertjax import fs
from bertjax.convert import Checkpoint, save_checkpoint
from bertjax.convert.checkpoint import flatten_params, unstack_layers
from bertjax.models import architecture
from bertjax.retrieval import contrastive_losses, ranking_metrics
from bertjax.retrieval import evaluate as retrieval_eval
from bertjax.retrieval.bi_encoder.task import RetrievalTask
from bertjax.retrieval.colbert import late_interaction
from bertjax.retrieval.colbert.late_interaction import (
    LateInteraction,
    LateInteractionSettings,
    TokenLayout,
    document_ids,
    projection_head,
    query_ids,
)
from bertjax.tasks.base import register

log = logging.getLogger("bertjax")

LOSSES = ("contrastive", "distillation")
# (the prefix PyLate adds as a token, Stanford ColBERT's): the first the tokenizer has is used
AUTO_PREFIXES = {"query_prefix": ("[Q] ", "[unused0]"), "document_prefix": ("[D] ", "[unused1]")}


def read_teacher_scores(path: str, rows: list, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores [n, m] float32, valid [n, m]) of the JSON lines' ``scores`` (one per document:
    positive, then negatives), for the first ``len(rows)`` rows; one-line errors name the line."""
    out = np.zeros((len(rows), m), np.float32)
    valid = np.zeros((len(rows), m), np.float32)
    i = 0
    with fs.open_file(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if i == len(rows):
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise fs.json_error(path, err, number) from None
            query, positive, negatives = rows[i]
            if record.get("query", record.get("anchor")) != query:
                raise ValueError(f"{path}:{number}: row {i} is not the training row read there")
            scores = record.get("scores")
            documents = 1 + len(record.get("negatives") or [])
            if not isinstance(scores, list) or not all(
                isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores
            ):
                raise ValueError(
                    f'{path}:{number}: colbert.loss=distillation needs "scores": a list of '
                    "teacher scores (positive first, then the negatives)"
                )
            if len(scores) != documents:
                raise ValueError(
                    f'{path}:{number}: "scores" has {len(scores)} values for {documents} '
                    "documents (positive + negatives)"
                )
            kept = min(m, documents)
            out[i, :kept] = scores[:kept]
            valid[i, :kept] = 1
            i += 1
    if i != len(rows):
        raise ValueError(f"{path}: {i} rows with scores for {len(rows)} training rows")
    return out, valid


@register("colbert")
class ColbertTask(RetrievalTask):
    """Late interaction (ColBERT): per-token vectors, MaxSim, PyLate's losses."""

    name = "colbert"

    def __init__(self, config, workdir):
        super().__init__(config, workdir)
        self._settings: LateInteractionSettings | None = None

    # ---- settings --------------------------------------------------------------------------------
    def check(self) -> None:
        self.check_head_keys()
        c = self.config.colbert
        if c.loss not in LOSSES:
            raise ValueError(f"config key colbert.loss={c.loss!r}: choose one of {LOSSES}")
        if c.dim < 1:
            raise ValueError(f"config key colbert.dim={c.dim} must be at least 1")
        for key in ("query_length", "document_length"):
            if c[key] < 3:
                raise ValueError(f"config key colbert.{key}={c[key]} leaves no room for text")
        self._load_tokenizer()
        self.source.model_config(self.tokenizer.vocab_size, max(c.query_length, c.document_length))

    def _init_settings(self) -> LateInteractionSettings | None:
        pretrained = self.source.pretrained
        settings = pretrained.embedding if pretrained is not None else None
        return settings if isinstance(settings, LateInteractionSettings) else None

    def checkpoint_record(self) -> dict:
        """The ColBERT head (prefixes, lengths, projections): the run's folder then loads as the
        late-interaction model it trained, as its PyLate export does."""
        return {"late_interaction": late_interaction.settings_record(self.settings())}

    def settings(self) -> LateInteractionSettings:
        """The run's settings: config keys colbert.*; prefixes "auto": "[Q] " / "[D] " when the
        tokenizer has them (a PyLate model's), else "[unused0]" / "[unused1]", else none."""
        if self._settings is None:
            c = self.config.colbert
            tok = self.tokenizer
            prefixes = {}
            for key, candidates in AUTO_PREFIXES.items():
                value = c[key]
                if value == "auto":
                    found = [
                        p for p in candidates if tok.convert_tokens_to_ids([p])[0] != tok.unk_id
                    ]
                    value = found[0] if found else ""
                    if not value:
                        log.warning(
                            "task colbert: the tokenizer has none of %s: colbert.%s is empty (no "
                            "prefix token)",
                            candidates,
                            key,
                        )
                prefixes[key] = value
            self._settings = LateInteractionSettings(
                head=projection_head(self._hidden_size(), int(c.dim)),
                query_length=int(c.query_length),
                document_length=int(c.document_length),
                do_query_expansion=bool(c.do_query_expansion),
                attend_to_expansion_tokens=bool(c.attend_to_expansion_tokens),
                skiplist_words=tuple(c.skiplist_words),
                **prefixes,
            )
            init = self._init_settings()
            if init is not None and init.head.dimension(self._hidden_size()) == int(c.dim):
                self._settings = dataclasses.replace(self._settings, head=init.head)
        return self._settings

    def _hidden_size(self) -> int:
        return self.source.model_config(self.tokenizer.vocab_size).hidden_size

    def layout(self) -> TokenLayout:
        return TokenLayout.of(self.settings(), self.tokenizer)

    # ---- data ------------------------------------------------------------------------------------
    def load_data(self) -> None:
        d, c = self.config.data, self.config.colbert
        rows = self.training_rows()
        layout = self.layout()
        m = 1 + int(d.num_negatives)
        q_ids, q_mask, q_keep = query_ids(
            layout, self.tokenizer, [q for q, _, _ in rows], layout.query_length
        )
        docs, valid = [], np.zeros((len(rows), m), np.float32)
        for i, (_, positive, negatives) in enumerate(rows):
            group = [positive, *negatives[: m - 1]]
            valid[i, : len(group)] = 1
            docs += group + [""] * (m - len(group))
        d_ids, d_mask, d_keep = document_ids(layout, self.tokenizer, docs, layout.document_length)
        shape = (len(rows), m, -1)
        self.train_features = {
            "input_ids": q_ids,  # [n, Lq]
            "segment_ids": np.zeros_like(q_ids),
            "input_mask": q_mask,
            "query_keep": q_keep.astype(np.int32),
            "doc_ids": d_ids.reshape(shape),  # [n, m, Ld]
            "doc_mask": d_mask.reshape(shape),
            "doc_keep": d_keep.astype(np.int32).reshape(shape),
            "doc_valid": valid,  # [n, m]
            "positive_key": self.positive_keys(rows, m),
        }
        if c.loss == "distillation":
            if not d.get("train_file") or d.train_file.endswith((".parquet", ".tsv")):
                raise ValueError(
                    "config key colbert.loss=distillation reads teacher scores from "
                    'data.train_file (JSON lines with "scores"); a BEIR folder, Parquet or TSV '
                    "rows have none"
                )
            scores, scored = read_teacher_scores(d.train_file, rows, m)
            self.train_features["teacher_scores"] = scores
            self.train_features["doc_valid"] = valid * scored
        self.load_eval_split()
        log.info(
            "task colbert: %d training rows (%d documents each at most), prefixes %r / %r, eval %s",
            len(rows),
            m,
            self.settings().query_prefix,
            self.settings().document_prefix,
            f"{len(self.eval_data.query_ids)} queries x {len(self.eval_data.doc_ids)} documents"
            if self.eval_data
            else "none",
        )

    def init_batch(self, phase, batch_size):
        batch = super().init_batch(phase, batch_size)
        batch["doc_keep"] = np.ones_like(batch["doc_keep"])
        return batch

    # ---- model -----------------------------------------------------------------------------------
    def build_model(self, model_config):
        return LateInteraction(model_config, self.settings().head)

    def start_params(self, model, fresh):
        """The encoder from the init checkpoint; the projection too when it is a PyLate model
        with the same head (else freshly initialised)."""
        params = super().start_params(model, fresh)
        init = self._init_settings()
        if init is not None and init.head == self.settings().head:
            for path, value in init.tensors.items():
                node = params
                *parents, leaf = path.split("/")
                for part in parents:
                    node = node[part]
                node[leaf] = np.asarray(value).astype(node[leaf].dtype)
            log.info("projection initialised from %s", self.config.init_checkpoint)
        return params

    # ---- training: the cached (two-pass) contract ---------------------------------------------------
    def batch_loss(self, embeddings, batch):
        c = self.config.colbert
        query_mask = None if c.do_query_expansion else batch["query_keep"]
        common = dict(
            query_mask=query_mask,
            document_mask=batch["doc_keep"],
            document_valid=batch["doc_valid"],
        )
        q, d = embeddings["query"], embeddings["documents"]
        if c.loss == "distillation":
            return contrastive_losses.colbert_distillation(
                q, d, batch["teacher_scores"], normalize_scores=bool(c.normalize_scores), **common
            )
        return contrastive_losses.colbert_contrastive(
            q, d, temperature=float(c.temperature), positive_key=batch["positive_key"], **common
        )

    # ---- evaluation ------------------------------------------------------------------------------
    def _token_embed(self, run, is_query: bool):
        layout = self.layout()

        def embed(texts, batch_size=32):
            out = []
            for start in range(0, len(texts), 1024):  # bounded host memory
                part = list(texts[start : start + 1024])
                if is_query:
                    ids, mask, keep = query_ids(layout, self.tokenizer, part, layout.query_length)
                else:
                    ids, mask, keep = document_ids(
                        layout, self.tokenizer, part, layout.document_length
                    )
                features = {"input_ids": ids, "segment_ids": np.zeros_like(ids), "input_mask": mask}
                vectors = self.predict(run, features)["embedding"]  # [n, L, dim]
                out += [v[k] for v, k in zip(vectors, keep)]
            return out

        return embed

    def evaluate(self, run, phase):
        if self.eval_data is None:
            return {}
        found = retrieval_eval.retrieve_maxsim(
            self._token_embed(run, True),
            self._token_embed(run, False),
            self.eval_data,
            top_k=100,
            batch_size=self._eval_batch_size(),
        )
        return ranking_metrics.evaluate(self.eval_data.qrels, found.run)

    def finalize(self, run, params, workdir):
        result = super().finalize(run, params, workdir)
        if self.config.colbert.get("export", True):
            path = os.path.join(workdir, "pylate")
            if self.export(params, path):
                result["pylate"] = path
        return result

    def export(self, params, directory: str) -> bool:
        """Writes ``params`` as a PyLate ColBERT directory (process 0; False where the params
        are not all on this host)."""
        if jax.process_index() != 0:
            return False
        if not all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(params)):
            log.warning("task colbert: params span several hosts; no %s written", directory)
            return False
        model_config = self.model_config()
        name = architecture(model_config).encoder_name
        host = jax.device_get(params)
        encoder = unstack_layers(flatten_params({name: host[name]}))
        encoder = {k: np.asarray(v, np.float32) for k, v in encoder.items()}
        dense = flatten_params({k: v for k, v in host.items() if k != name})
        settings = dataclasses.replace(
            self.settings(), tensors={k: np.asarray(v, np.float32) for k, v in dense.items()}
        )
        ckpt = Checkpoint(
            model_config.replace(scan_layers=False, remat="none", param_dtype="float32"),
            encoder,
            vocab_file=self.tokenizer.vocab_file,
            do_lower_case=getattr(self.tokenizer, "do_lower_case", None),
            source=directory,
            embedding=settings,
        )
        save_checkpoint(ckpt, directory, "pylate", overwrite=True)
        log.info("task colbert: PyLate model written to %s", directory)
        return True

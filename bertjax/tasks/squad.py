"""SQuAD v1.1 / v2.0 fine-tuning (``squad/v1.1``, ``squad/v2.0``): start/end span prediction.

Data: the official JSON files in ``config.data_dir`` (``train-v1.1.json`` / ``dev-v1.1.json``, or the
v2.0 names), or TFDS ``squad/v1.1`` / ``squad/v2.0`` when ``data_dir`` is empty, turned into
sliding-window features exactly as the original ``run_squad.py`` (``squad_data``). Loss: mean of
the start and end cross-entropies per feature (v2.0 impossible questions point at [CLS]).
Evaluation runs the official post-processing (``squad_postprocess``) and the official scoring
(``metrics.evaluate_squad_v1/v2``, as fractions like every task's metrics; ``bertjax evaluate squad``
prints the official percentages). ``finalize`` writes
``WORKDIR/squad/predictions.json`` and ``nbest_predictions.json``; for v2.0 also ``null_odds.json``,
the best-threshold search (``best_f1_thresh`` ...) and ``predictions_best_thresh.json`` re-thresholded
at ``best_f1_thresh``.
"""

from __future__ import annotations

import json
import logging
import os

import jax

from bertjax import atomic, losses
from bertjax.models.heads import SpanClassifier
from bertjax.tasks import squad_data, squad_postprocess
from bertjax.tasks.base import register
from bertjax.tasks.finetuning import EvalSet, FinetuneTask, subset
from bertjax.tasks.metrics import evaluate_squad_v1, evaluate_squad_v2

log = logging.getLogger("bertjax")

SPAN_KEYS = ("input_ids", "input_mask", "segment_ids", "start_positions", "end_positions")


class SquadFinetune(FinetuneTask):
    """Extractive question answering on SQuAD; ``version`` is "1.1" or "2.0"."""

    version = "1.1"
    rows = "features"  # a long context gives one feature per doc_stride window
    packing_unsupported = (
        "its doc_stride windows already fill max_seq_length and its answer spans index whole rows"
    )

    def __init__(self, config, workdir):
        super().__init__(config, workdir)
        self.name = f"squad/v{self.version}"
        self.v2 = self.version == "2.0"
        self.main_metric = "f1"

    def _features(self, examples, first_unique_id: int):
        d = self.config.data
        return squad_data.convert_examples_to_features(
            examples,
            self.tokenizer,
            max_seq_length=d.max_seq_length,
            doc_stride=d.doc_stride,
            max_query_length=d.max_query_length,
            first_unique_id=first_unique_id,
        )

    def _read(self):
        """(train examples, dev examples, dev "data" list) from data_dir JSON files or TFDS."""
        if not self.config.data_dir:
            train, _, _ = squad_data.load_squad_tfds(self.version, "train", is_training=True)
            dev, _, dataset = squad_data.load_squad_tfds(self.version, "dev", is_training=False)
            return train, dev, dataset
        names = {split: f"{split}-v{self.version}.json" for split in ("train", "dev")}
        paths = {}
        for split, name in names.items():
            paths[split] = self.data_path(name)
            if paths[split] is None:
                raise ValueError(f"config key data_dir={self.config.data_dir!r}: no {name}")
        train, _ = squad_data.read_squad_examples(paths["train"], is_training=True)
        dev, _ = squad_data.read_squad_examples(paths["dev"], is_training=False)
        return train, dev, squad_data.load_squad_json(paths["dev"])

    def load_data(self):
        d = self.config.data
        train, dev, dataset = self._read()
        train = subset(train, d.max_train_examples)
        feats = self._features(train, 1_000_000_000)
        self.train_features = {k: v for k, v in feats.arrays().items() if k in SPAN_KEYS}
        dev = subset(dev, d.max_eval_examples, seed=None)
        dev_feats = self._features(dev, 2_000_000_000)
        ids = {e.qas_id for e in dev}
        dataset = _restrict(dataset, ids)
        inputs = {k: v for k, v in dev_feats.arrays().items() if k in SPAN_KEYS[:3]}
        self.eval_sets = [EvalSet("dev", inputs, (dev, dev_feats, dataset))]
        log.info(
            "task %s: %d training examples in %d features, %d dev examples in %d features (a "
            "long context gives one feature per doc_stride window)",
            self.name,
            len(train),
            len(feats),
            len(dev),
            len(dev_feats),
        )

    def build_model(self, model_config):
        return SpanClassifier(model_config, **self.head_options(model_config))

    def head_loss(self, outputs, batch, normalizers):
        start_logits, end_logits = outputs  # [batch, seq] each
        w, norm = batch["mask"], normalizers["examples"]
        start_loss, start_acc = losses.classification_loss(
            start_logits, batch["start_positions"], w, norm
        )
        end_loss, end_acc = losses.classification_loss(end_logits, batch["end_positions"], w, norm)
        loss = (start_loss + end_loss) / 2.0
        return loss, {"span_loss": loss, "start_accuracy": start_acc, "end_accuracy": end_acc}

    def predictions(self, outputs, batch):
        start_logits, end_logits = outputs
        return {"start_logits": start_logits, "end_logits": end_logits}  # [batch, seq] each

    def _postprocess(self, eval_set, outputs):
        d = self.config.data
        examples, feats, _ = eval_set.meta
        return squad_postprocess.compute_predictions(
            examples,
            feats,
            outputs["start_logits"],
            outputs["end_logits"],
            n_best_size=d.n_best_size,
            max_answer_length=d.max_answer_length,
            do_lower_case=self.tokenizer.do_lower_case,
            version_2_with_negative=self.v2,
            null_score_diff_threshold=d.null_score_diff_threshold,
        )

    def _scores(self, dataset, preds) -> dict[str, float]:
        if not self.v2:
            return evaluate_squad_v1(dataset, preds.predictions, percent=False)
        return evaluate_squad_v2(dataset, preds.predictions, preds.null_odds, percent=False)

    def score(self, eval_set, outputs):
        preds = self._postprocess(eval_set, outputs)
        return self._scores(eval_set.meta[2], preds)

    def finalize(self, run, params, workdir):
        eval_set = self.eval_sets[0]
        preds = self._postprocess(eval_set, self.predict(run, eval_set.features))
        dev = self._scores(eval_set.meta[2], preds)
        result = {
            "task": self.name,
            "main_metric": self.main_metric,
            "dev": dev,
            "num_train_features": int(len(self.train_features["input_ids"])),
            "train_steps": self._total_steps,
        }
        if jax.process_index() == 0:
            folder = os.path.join(workdir, "squad")
            files = squad_postprocess.write_predictions(folder, preds)
            if self.v2:
                thresh = dev["best_f1_thresh"]
                best = squad_postprocess.predictions_at_threshold(
                    preds.best_non_null, preds.null_odds, thresh
                )
                files["predictions_best_thresh"] = os.path.join(
                    folder, "predictions_best_thresh.json"
                )
                atomic.write_text(files["predictions_best_thresh"], json.dumps(best, indent=4))
                search = {
                    k: dev[k]
                    for k in ("best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh")
                }
                files["best_threshold"] = os.path.join(folder, "best_threshold.json")
                atomic.write_text(files["best_threshold"], json.dumps(search, indent=2))
            result["predictions"] = {k: str(v) for k, v in files.items()}
        return result


def _restrict(dataset: list, ids: set[str]) -> list:
    """The SQuAD "data" list keeping only the questions in ``ids`` (scoring a dev subset)."""
    out = []
    for article in dataset:
        paragraphs = []
        for paragraph in article["paragraphs"]:
            qas = [qa for qa in paragraph["qas"] if qa["id"] in ids]
            if qas:
                paragraphs.append({**paragraph, "qas": qas})
        if paragraphs:
            out.append({**article, "paragraphs": paragraphs})
    return out


@register("squad/v1.1")
class SquadV1(SquadFinetune):
    """SQuAD v1.1 (every question answerable)."""

    version = "1.1"


@register("squad/v2.0")
class SquadV2(SquadFinetune):
    """SQuAD v2.0 (unanswerable questions: null answer at [CLS], thresholded null odds)."""

    version = "2.0"

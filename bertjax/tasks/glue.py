"""GLUE fine-tuning tasks (``glue/cola`` ... ``glue/ax``): sequence classification / regression.

Data: the official TSV layout under ``config.data_dir`` (the GLUE root or the task folder), or TFDS
``glue/<task>`` when ``data_dir`` is empty. The dev split is evaluated every epoch (MNLI: matched and
mismatched); ``finalize`` re-scores dev with the best params and writes the GLUE server submission
files (``WORKDIR/glue_predictions/{TASK}.tsv``) for every test split that is available. ``glue/mnli``
also predicts the diagnostic set (AX.tsv) when present; ``glue/ax`` is MNLI training that requires it
(AX is always predicted by an MNLI-trained model).

Main (best-kept) metrics follow the BERT paper: F1 for MRPC/QQP, Spearman for STS-B, Matthews
correlation for CoLA, accuracy for the rest (MNLI: matched accuracy).
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from bertjax import losses
from bertjax.models.heads import SequenceClassifier
from bertjax.tasks import glue_data
from bertjax.tasks.base import register
from bertjax.tasks.finetuning import EvalSet, FinetuneTask, subset
from bertjax.tasks.metrics import glue_metrics

log = logging.getLogger("bertjax")

MAIN_METRIC = {"cola": "mcc", "mrpc": "f1", "qqp": "f1", "stsb": "spearman"}


class GlueFinetune(FinetuneTask):
    """One GLUE task; subclasses set ``glue`` (and MNLI its extra dev/test splits)."""

    glue = "sst2"
    dev_splits: tuple[str, ...] = ("dev",)
    # (GLUE task, split) pairs whose predictions go to the submission folder.
    test_splits: tuple[tuple[str, str], ...] = ()
    required_tests: tuple[str, ...] = ()
    feature_heads = True
    pooled_head = True

    def __init__(self, config, workdir):
        super().__init__(config, workdir)
        self.spec = glue_data.get_task(self.glue)
        self.name = f"glue/{self.glue}"
        key = MAIN_METRIC.get(self.glue, "accuracy")
        self.main_metric = key if len(self.dev_splits) == 1 else f"{self.dev_splits[0]}/{key}"
        if not self.test_splits:
            self.test_splits = ((self.glue, "test"),)
        self.test_sets: list[EvalSet] = []

    def read(self, task: str, split: str, required: bool = True):
        """Examples of one split from data_dir (TSV) or TFDS; None for a missing optional split."""
        try:
            if self.config.data_dir:
                return glue_data.read_glue_split(self.config.data_dir, task, split)
            return glue_data.load_glue_tfds(task, split)
        except FileNotFoundError:
            if required:
                raise ValueError(
                    f"config key data_dir={self.config.data_dir!r}: no {split} split "
                    f"of glue/{task} (expected {glue_data.get_task(task).dir_name}/"
                    f"{glue_data.get_task(task).splits[split]})"
                ) from None
            return None

    def encode(self, task: str, examples) -> dict[str, np.ndarray]:
        """[n, max_seq_length] inputs and [n] labels of ``task``'s examples (``encode_examples``)."""
        spec = glue_data.get_task(task)
        return glue_data.encode_examples(
            self.tokenizer, examples, spec.labels, self.config.data.max_seq_length
        )

    def load_data(self):
        d = self.config.data
        train = subset(self.read(self.glue, "train"), d.max_train_examples)
        self.train_features = self.encode(self.glue, train)
        for split in self.dev_splits:
            examples = subset(self.read(self.glue, split), d.max_eval_examples, seed=None)
            feats = self.encode(self.glue, examples)
            self._check_labelled(feats, split)
            self.eval_sets.append(EvalSet(split, feats))
        for task, split in self.test_splits:
            examples = self.read(task, split, required=task in self.required_tests)
            if examples is None:
                log.info("glue/%s %s split not found: no submission file for it", task, split)
                continue
            self.test_sets.append(
                EvalSet(f"{task}:{split}", self.encode(task, examples), (task, split))
            )

    def _check_labelled(self, feats, split):
        labels = feats["label"]
        missing = np.isnan(labels) if self.spec.is_regression else labels < 0
        if missing.any():
            raise ValueError(
                f"glue/{self.glue} {split} split: {int(missing.sum())} examples have no label"
            )

    def build_model(self, model_config):
        num = 1 if self.spec.is_regression else len(self.spec.labels)
        return SequenceClassifier(model_config, num_labels=num, **self.head_options(model_config))

    def model_inputs(self, batch):
        inputs = super().model_inputs(batch)
        if "cls_positions" in batch:  # packed rows: one logit vector per [CLS]
            inputs["cls_positions"] = batch["cls_positions"]
        return inputs

    def head_loss(self, logits, batch, normalizers):
        weights = self.example_weights(batch)  # [b], or [b, k] when packed
        if self.spec.is_regression:
            loss = losses.regression_loss(
                logits[..., 0], batch["label"], weights, normalizers["examples"]
            )
            return loss, {"mse": loss}
        loss, acc = losses.classification_loss(
            logits, batch["label"], weights, normalizers["examples"]
        )
        return loss, {"cross_entropy": loss, "accuracy": acc}

    def predictions(self, logits, batch):
        if self.spec.is_regression:
            return {"prediction": logits[..., 0]}  # [batch (, k)] score
        return {"prediction": jnp.argmax(logits, axis=-1).astype(jnp.int32)}  # [b (, k)] label id

    def score(self, eval_set, outputs):
        labels = eval_set.features["label"]
        metrics = glue_metrics(self.glue, labels, outputs["prediction"])
        if len(self.dev_splits) == 1:
            return metrics
        return {f"{eval_set.name}/{k}": v for k, v in metrics.items()}

    def write_dev_predictions(self, eval_set, outputs, workdir):
        """``WORKDIR/dev_predictions/{task}-{split}.tsv`` (``index<TAB>prediction``, scored by
        ``bertjax evaluate glue``)."""
        folder = os.path.join(workdir, "dev_predictions")
        name = f"{self.glue}-{eval_set.name}.tsv"
        preds = outputs["prediction"].tolist()
        return str(glue_data.write_glue_predictions(folder, self.glue, "", preds, file_name=name))

    def write_outputs(self, run, workdir):
        folder = os.path.join(workdir, "glue_predictions")
        files = {}
        for test in self.test_sets:
            preds = self.predict(run, test.features)["prediction"]
            task, split = test.meta
            if jax.process_index() == 0:
                path = glue_data.write_glue_predictions(folder, task, split, preds.tolist())
                files[f"{task}:{split}"] = str(path)
        return {"predictions": files}


def _define(glue: str, **attrs) -> type:
    cls = type(f"Glue_{glue}", (GlueFinetune,), {"glue": glue, **attrs})
    cls.__doc__ = f"GLUE {glue} fine-tuning."
    return register(f"glue/{glue}")(cls)


for _name in ("cola", "sst2", "mrpc", "stsb", "qqp", "qnli", "rte", "wnli"):
    _define(_name)

_MNLI = dict(
    glue="mnli",
    dev_splits=("dev_matched", "dev_mismatched"),
    test_splits=(("mnli", "test_matched"), ("mnli", "test_mismatched"), ("ax", "test")),
)
_define("mnli", **{k: v for k, v in _MNLI.items() if k != "glue"})


@register("glue/ax")
class GlueAx(GlueFinetune):
    """GLUE diagnostic (AX): an MNLI-trained model's predictions on the diagnostic set (AX.tsv)."""

    glue = "mnli"
    dev_splits = _MNLI["dev_splits"]
    test_splits = _MNLI["test_splits"]
    required_tests = ("ax",)

    def __init__(self, config, workdir):
        super().__init__(config, workdir)
        self.name = "glue/ax"

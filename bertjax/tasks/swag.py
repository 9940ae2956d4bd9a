"""SWAG multiple choice (``swag``): one score per choice from each choice's pooled [CLS].

Data: the official CSV files in ``config.data_dir`` (``train.csv``, ``val.csv``, optional
``test.csv``), each choice encoded as ([CLS] context [SEP] start + ending [SEP]) (``swag_data``).
Loss: softmax cross-entropy over the 4 choice scores. Main metric: dev accuracy. ``finalize``
writes ``WORKDIR/swag_test_predictions.csv`` (``guid,label``) when the test file exists.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from bertjax import atomic, losses
from bertjax.models.heads import MultipleChoice
from bertjax.tasks import swag_data
from bertjax.tasks.base import register
from bertjax.tasks.finetuning import EvalSet, FinetuneTask, subset
from bertjax.tasks.metrics import accuracy

INPUT_KEYS = ("input_ids", "input_mask", "segment_ids")


@register("swag")
class Swag(FinetuneTask):
    """SWAG: pick the most plausible of 4 endings."""

    name = "swag"
    main_metric = "accuracy"
    packing_unsupported = "an example is a fixed group of 4 choice rows scored against each other"

    def __init__(self, config, workdir):
        super().__init__(config, workdir)
        self.test_sets: list[EvalSet] = []

    def _load(self, name: str, limit: int, seed):
        path = self.data_path(name)
        if path is None:
            return None
        examples = subset(swag_data.read_swag(path), limit, seed)
        return examples, swag_data.encode_choices(
            self.tokenizer, examples, self.config.data.max_seq_length
        )

    def load_data(self):
        if not self.config.data_dir:
            swag_data.load_swag_tfds("train")  # raises: TFDS has no SWAG
        d = self.config.data
        for name in ("train.csv", "val.csv"):
            if self.data_path(name) is None:
                raise ValueError(f"config key data_dir={self.config.data_dir!r}: no {name}")
        _, self.train_features = self._load("train.csv", d.max_train_examples, 0)
        if (self.train_features["label"] < 0).any():
            raise ValueError(f"{self.data_path('train.csv')}: training examples need labels")
        examples, dev = self._load("val.csv", d.max_eval_examples, None)
        if (dev["label"] < 0).any():
            raise ValueError(f"{self.data_path('val.csv')}: dev examples need labels")
        self.eval_sets = [EvalSet("dev", {k: dev[k] for k in INPUT_KEYS}, dev["label"])]
        test = self._load("test.csv", 0, None)
        if test is not None:
            examples, feats = test
            self.test_sets = [
                EvalSet("test", {k: feats[k] for k in INPUT_KEYS}, [e.guid for e in examples])
            ]

    def build_model(self, model_config):
        return MultipleChoice(model_config, **self.head_options(model_config))

    def head_loss(self, logits, batch, normalizers):
        loss, acc = losses.classification_loss(
            logits, batch["label"], batch["mask"], normalizers["examples"]
        )
        return loss, {"cross_entropy": loss, "accuracy": acc}

    def predictions(self, logits, batch):
        return {"choice": jnp.argmax(logits, axis=-1).astype(jnp.int32)}  # [batch]

    def score(self, eval_set, outputs):
        return {"accuracy": accuracy(eval_set.meta, outputs["choice"])}

    def write_outputs(self, run, workdir):
        files = {}
        for test in self.test_sets:
            choice = self.predict(run, test.features)["choice"]
            if jax.process_index() == 0:
                path = os.path.join(workdir, "swag_test_predictions.csv")
                lines = ["guid,label", *(f"{g},{int(c)}" for g, c in zip(test.meta, choice))]
                atomic.write_text(path, "\n".join(lines) + "\n")
                files["test"] = path
        return {"predictions": files}

"""Named-entity recognition (``ner/conll2003``): per-token classification on CoNLL column files.

Data: ``config.data_dir`` holds the train / dev / test column files (``train.txt``, ``valid.txt`` or
``dev.txt``, ``test.txt``; or the original ``eng.train``, ``eng.testa``, ``eng.testb``), or TFDS
``conll2003`` (train / dev / test) when ``data_dir`` is empty. IOB1 tags
(the original release) are converted to BIO; the label list is CoNLL-2003's when the training tags
fit it, else built from the training tags. Every word is labelled at its first word piece (the
BERT paper's feature-based/fine-tuning setup); the loss averages over labelled pieces of the global
batch. Evaluation maps piece predictions back to one tag per word and scores entity-level
precision / recall / F1 with conlleval's rules (``metrics.ner_metrics``, fractions). ``finalize``
reports dev and, when the test file exists, test scores (the paper's Table 3 number is test F1).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from bertjax import losses
from bertjax.models.heads import TokenClassifier
from bertjax.tasks import ner_data
from bertjax.tasks.base import register
from bertjax.tasks.finetuning import EvalSet, FinetuneTask, subset
from bertjax.tasks.metrics import ner_metrics

FILES = {
    "train": ("train.txt", "eng.train"),
    "dev": ("valid.txt", "dev.txt", "eng.testa"),
    "test": ("test.txt", "eng.testb"),
}
TRAIN_KEYS = ("input_ids", "input_mask", "segment_ids", "label_ids")


@register("ner/conll2003")
class ConllNer(FinetuneTask):
    """CoNLL-2003 English NER; main metric: dev entity F1."""

    name = "ner/conll2003"
    main_metric = "f1"
    token_outputs = ("tag_ids",)
    feature_heads = True
    bilstm_head = True

    def __init__(self, config, workdir):
        super().__init__(config, workdir)
        if self.bilstm:  # data.packing is then an error; batch and eval packing are off
            self.packing_unsupported = "a BiLSTM head (head.bilstm) reads each row as one sentence"
        self.labels: list[str] = []
        self.test_sets: list[EvalSet] = []

    def _read(self, split: str, required: bool):
        if not self.config.data_dir:
            return f"tfds:conll2003/{split}", ner_data.load_conll2003_tfds(split)
        path = self.data_path(*FILES[split])
        if path is None:
            if required:
                raise ValueError(
                    f"config key data_dir={self.config.data_dir!r}: no {split} file "
                    f"(one of {list(FILES[split])})"
                )
            return None, None
        sentences = ner_data.read_conll(path)
        bio = [
            ner_data.TaggedSentence(s.words, tuple(ner_data.iob1_to_bio(s.tags))) for s in sentences
        ]
        return path, bio

    def _encode(self, path: str, sentences) -> dict[str, np.ndarray]:
        try:
            return ner_data.encode_tagged(
                self.tokenizer, sentences, self.labels, self.config.data.max_seq_length
            )
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    def _eval_set(self, split: str, path: str, sentences) -> EvalSet:
        feats = self._encode(path, sentences)
        inputs = {k: feats[k] for k in TRAIN_KEYS[:3]}
        gold = [list(s.tags) for s in sentences]
        return EvalSet(split, inputs, (gold, feats["word_ids"]))

    def load_data(self):
        d = self.config.data
        path, train = self._read("train", required=True)
        tags = {t for s in train for t in s.tags}
        if tags <= set(ner_data.CONLL2003_LABELS):
            self.labels = list(ner_data.CONLL2003_LABELS)
        else:
            self.labels = ner_data.build_label_list(train)
        train = subset(train, d.max_train_examples)
        feats = self._encode(path, train)
        self.train_features = {k: feats[k] for k in TRAIN_KEYS}
        dev_path, dev = self._read("dev", required=True)
        self.eval_sets = [self._eval_set("dev", dev_path, subset(dev, d.max_eval_examples, None))]
        test_path, test = self._read("test", required=False)
        if test is not None:
            self.test_sets = [self._eval_set("test", test_path, test)]

    def build_model(self, model_config):
        return TokenClassifier(
            model_config, num_labels=len(self.labels), **self.head_options(model_config)
        )

    def _weights(self, batch):
        return (batch["label_ids"] >= 0).astype(jnp.float32) * batch["mask"][:, None]  # [b, seq]

    def normalizers(self, batch):
        return {
            "tokens": self._weights(batch).sum(),
            "examples": self.example_weights(batch).sum(),
        }

    def head_loss(self, logits, batch, normalizers):
        loss, acc = losses.classification_loss(
            logits, batch["label_ids"], self._weights(batch), normalizers["tokens"]
        )
        return loss, {"token_loss": loss, "token_accuracy": acc}

    def predictions(self, logits, batch):
        return {"tag_ids": jnp.argmax(logits, axis=-1).astype(jnp.int32)}  # [batch, seq]

    def _metrics(self, eval_set, outputs) -> dict:
        gold, word_ids = eval_set.meta
        pred = ner_data.predictions_to_tags(
            outputs["tag_ids"], word_ids, self.labels, [len(g) for g in gold]
        )
        return ner_metrics(gold, pred)

    def score(self, eval_set, outputs):
        metrics = self._metrics(eval_set, outputs)
        return {k: v for k, v in metrics.items() if k != "per_type"}

    def write_outputs(self, run, workdir):
        out = {"labels": self.labels}
        for test in self.test_sets:
            out["test"] = self._metrics(test, self.predict(run, test.features))
        return out

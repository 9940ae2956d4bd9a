"""What every fine-tuning task shares: tokenizer, init checkpoint, in-memory data, epochs, evaluation.

A fine-tuning task (GLUE, SQuAD, NER, SWAG) builds its features in memory in ``load_data`` and
supplies a head, a loss and host-side scoring; this base class turns them into the ``Task`` API:

* the tokenizer is ``data.vocab`` or the init checkpoint's
  vocabulary, cased as the checkpoint's tokenizer (else as the vocabulary itself); a set
  ``data.do_lower_case`` that differs applies with
  a warning (a tokenizer.json's normalizer always decides); a vocabulary whose size differs from
  the checkpoint's embedding table is an error;
* the model config is the init checkpoint's (``config.model`` may change only numerics: dtype,
  dropout, attention implementation, remat, scan), else ``config.model`` + the vocabulary size;
* ``start_params`` (``bertjax.model_source``) replaces the fresh encoder with the checkpoint's
  (the pooler stays fresh when the checkpoint has none), and the task head with the checkpoint's own
  task head where it is of the task's kind and its shapes fit (``bertjax.head_init``: a converted
  ``*ForSequenceClassification`` with the task's label count, ...); the log names what was taken;
* training runs ``config.train.epochs`` epochs (``train.steps`` > 0 overrides), with a linear warmup
  over ``optimizer.warmup_proportion`` of the steps (``warmup_steps``; the config is not written), and
  evaluates once per epoch (``train.eval_every`` > 0 overrides) with ``main_metric`` kept as best;
* evaluation predicts every example of each eval set exactly once (padded batches, ``mask``);
* ``data.packing`` packs up to ``data.max_examples_per_row`` examples per row
  (``bertjax.data.packing``), train and eval alike: losses and metrics average over real examples
  (``example_weights``) and predictions come back in the original example order, so they equal the
  unpacked ones. Training rows are packed once (the examples of a row stay together every epoch);
  a step then trains on a batch of rows, so more examples than unpacked: not the same run.
* ``data.batch_packing`` (on by default) packs each training batch alone: the same examples per
  step as unpacked, in fewer rows; ``data.eval_packing`` (on by default) packs evaluation and
  prediction: the same outputs per example (to float rounding) from 2-5x fewer rows.
* ``train.freeze_encoder`` (the BERT paper's feature-based approach, Section 5.3) trains the head
  alone: the encoder's parameters (the pooler excepted: the first layer of the heads that read it)
  get no gradient and no optimizer state and stay bitwise as loaded (``frozen_mask``), and the
  encoder runs without dropout, as the feature extractor it is. ``head.features`` (tasks with
  ``feature_heads``) chooses which layers the head reads, ``head.pooling`` (``pooled_head`` tasks)
  whether a sentence head reads them at [CLS] or as the mean over the example's tokens, and
  ``head.bilstm`` (``bilstm_head`` tasks) adds the paper's BiLSTM (``bertjax.models.heads``); a
  head option the task cannot use is a one-line error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from bertjax import flops, models, progress
from bertjax.data import packing
from bertjax.data.array_data import ArrayData
from bertjax.data.batch_packing import BatchPacked, row_buckets
from bertjax.model_source import ModelSource
from bertjax.models.heads import check_features
from bertjax.tasks.base import Phase, Task

log = logging.getLogger("bertjax")

INPUT_KEYS = ("input_ids", "input_mask", "segment_ids")


@dataclasses.dataclass
class EvalSet:
    """Device features of one evaluation split (inputs and labels, leading axis = examples) and
    whatever host-side data its scoring needs (``meta``)."""

    name: str
    features: dict[str, np.ndarray]
    meta: Any = None

    @property
    def size(self) -> int:
        """Number of examples (rows of every feature)."""
        return len(next(iter(self.features.values())))


def subset(examples: list, limit: int, seed: int | None = 0) -> list:
    """``limit`` examples (all when <= 0): a seeded random subset kept in file order, or the first
    ``limit`` when ``seed`` is None."""
    if limit <= 0 or limit >= len(examples):
        return list(examples)
    if seed is None:
        return list(examples[:limit])
    keep = np.sort(np.random.default_rng(seed).choice(len(examples), limit, replace=False))
    return [examples[i] for i in keep]


# Config keys bertjax 0.2 read under other names: an error naming the new key for this release.
RENAMED_KEYS = {"vocab": "data.vocab", "do_lower_case": "data.do_lower_case"}


def check_renamed_keys(config) -> None:
    """One line naming the new key where ``config`` sets a key by its bertjax 0.2 name."""
    for old, new in RENAMED_KEYS.items():
        if old in config:
            raise ValueError(f"config key {old} was renamed {new} in bertjax 0.3: set {new}")


class FinetuneTask(Task):
    """Base of the fine-tuning tasks; subclasses implement the methods marked "subclass"."""

    name = "finetune"
    main_metric = "accuracy"  # the dev metric kept as best (maximised)
    rows = "examples"  # what a feature row is, in logs (SQuAD: "features")
    packing_unsupported = ""  # why data.packing cannot apply to the task ("" = it can)
    token_outputs: tuple[str, ...] = ()  # eval outputs per token [b, seq] (the others per example)
    feature_heads = False  # its head reads head.features (sequence and token classifiers)
    bilstm_head = False  # its head takes head.bilstm (token classification)
    pooled_head = False  # its head takes head.pooling (sequence classification)
    freeze_unsupported = ""  # why train.freeze_encoder cannot apply to the task ("" = it can)

    def __init__(self, config, workdir):
        super().__init__(config, workdir)
        self.tokenizer = None
        check_renamed_keys(config)
        self.vocab, self.do_lower_case = config.data.vocab, config.data.get("do_lower_case")
        self.source = ModelSource(
            config.model,
            config.init_checkpoint,
            vocab=self.vocab or None,
        )
        self._warned: set[str] = set()
        self.train_features: dict[str, np.ndarray] | None = None
        self.eval_sets: list[EvalSet] = []
        self._total_steps = 0
        self._steps_per_epoch = 0
        self._loaded = False
        self._packed_eval: dict[int, tuple] = {}  # id(features) -> (features, packed, layout)

    # ---- the head: frozen encoder, features, BiLSTM ------------------------------------------------
    @property
    def freeze_encoder(self) -> bool:
        """Whether the head trains alone on the frozen encoder (config key train.freeze_encoder)."""
        return bool(self.config.train.get("freeze_encoder", False))

    @property
    def features(self) -> str:
        """Which combination of layers the head reads (config key head.features)."""
        head = self.config.get("head")
        return str(head.get("features", "last")) if head is not None else "last"

    @property
    def pooling(self) -> str:
        """Where a feature-based sentence head reads its mix: cls | mean (head.pooling)."""
        head = self.config.get("head")
        return str(head.get("pooling", "cls")) if head is not None else "cls"

    @property
    def bilstm(self) -> bool:
        """Whether the token head has the BiLSTM (config key head.bilstm)."""
        head = self.config.get("head")
        return bool(head.get("bilstm", False)) if head is not None else False

    def check_head_keys(self) -> None:
        """One line for a head option the task cannot use (config only: before any data work)."""
        if self.freeze_encoder and self.freeze_unsupported:
            raise ValueError(
                f"config key train.freeze_encoder=True: task {self.name} cannot freeze its "
                f"encoder ({self.freeze_unsupported})"
            )
        if self.features != "last":
            if not self.feature_heads:
                raise ValueError(
                    f"config key head.features={self.features}: the head of task {self.name} "
                    "reads the last layer only (glue/*, reranker and ner/conll2003 read others); "
                    "set head.features=last"
                )
            check_features(self.features, num_layers=4)  # the name; the layers when built
        if self.pooling != "cls":
            if self.pooling != "mean":
                raise ValueError(f"config key head.pooling={self.pooling!r}: choose cls or mean")
            if not self.pooled_head:
                raise ValueError(
                    f"config key head.pooling={self.pooling}: the head of task {self.name} does "
                    "not pool (glue/* and reranker heads do); set head.pooling=cls"
                )
            if self.features == "last":
                raise ValueError(
                    "config key head.pooling=mean pools a layer combination: with "
                    "head.features=last the head reads the pooler on [CLS]; choose head.features"
                )
        if self.bilstm and not self.bilstm_head:
            raise ValueError(
                f"config key head.bilstm=True: task {self.name} has no BiLSTM head (a token "
                "task's: ner/conll2003)"
            )

    def check_head(self, model_config) -> None:
        """One line for ``head.features`` the model cannot give (fewer layers than it reads,
        or scanned layers, whose hidden states are not kept)."""
        if self.features == "last":
            return
        check_features(self.features, model_config.num_layers)
        if getattr(model_config, "scan_layers", False):
            raise ValueError(
                f"config key head.features={self.features} reads every layer's hidden states: "
                "set model.scan_layers=False"
            )

    def head_options(self, model_config) -> dict[str, Any]:
        """The head module's options from the config: ``frozen_encoder``, and ``features`` /
        ``bilstm`` where the task takes them (checked against ``model_config``)."""
        options: dict[str, Any] = {"frozen_encoder": self.freeze_encoder}
        if self.feature_heads:
            self.check_head(model_config)
            options["features"] = self.features
        if self.pooled_head:
            options["pooling"] = self.pooling
        if self.bilstm_head:
            options["bilstm"] = self.bilstm
        return options

    def frozen_mask(self, model, params):
        """With train.freeze_encoder: True for the encoder's parameters (the architecture's
        ``encoder_name`` subtree) but its pooler, the first layer of the sentence and
        multiple-choice heads."""
        if not self.freeze_encoder:
            return None
        name = models.architecture(model.config).encoder_name
        flat = traverse_util.flatten_dict(params)
        mask = {k: k[0] == name and k[1:2] != ("pooler",) for k in flat}
        return traverse_util.unflatten_dict(mask)

    @property
    def packing(self) -> bool:
        """Whether examples are packed several per row (config key data.packing)."""
        return bool(self.config.data.get("packing", False))

    @property
    def batch_packing(self) -> bool:
        """Whether each training batch is packed into fewer rows, keeping its examples (config key
        data.batch_packing, on by default where the task can be packed and data.packing is off):
        the unpacked run's steps at a fraction of the rows (``bertjax.data.batch_packing``)."""
        wanted = bool(self.config.data.get("batch_packing", False)) and not self.packing
        return wanted and not self.packing_unsupported

    @property
    def eval_packing(self) -> bool:
        """Whether evaluation and prediction run packed rows (config key data.eval_packing, on by
        default where the task can be packed): each example's outputs equal its unpacked ones
        (to float rounding), in a fraction of the rows. Training packs only with data.packing."""
        wanted = self.packing or bool(self.config.data.get("eval_packing", False))
        return wanted and not self.packing_unsupported

    def _pack(self, features: dict[str, np.ndarray]):
        return packing.pack_features(features, int(self.config.data.get("max_examples_per_row", 8)))

    # ---- subclass API --------------------------------------------------------------------------
    def load_data(self) -> None:
        """Subclass: reads the splits and sets ``train_features`` and ``eval_sets``."""
        raise NotImplementedError

    def build_model(self, model_config):
        """Subclass: the head module (``bertjax.models.heads``; the encoder is a submodule)."""
        raise NotImplementedError

    def head_loss(self, outputs: Any, batch, normalizers) -> tuple[jax.Array, dict]:
        """Subclass: (loss, metrics) from the model outputs, divided by the global normalisers."""
        raise NotImplementedError

    def predictions(self, outputs: Any, batch) -> dict[str, jax.Array]:
        """Subclass: device-side eval outputs of a batch (leading axis = examples)."""
        raise NotImplementedError

    def score(self, eval_set: EvalSet, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        """Subclass: metrics of one eval set from its outputs (every example once, in order)."""
        raise NotImplementedError

    def write_outputs(self, run, workdir: str) -> dict:
        """Subclass hook for finalize: prediction files (process 0 writes); returns extra results."""
        return {}

    # ---- data and model set-up -----------------------------------------------------------------
    def data_path(self, *names: str) -> str | None:
        """The first of ``names`` present in ``config.data_dir`` (None when none is)."""
        for name in names:
            path = os.path.join(self.config.data_dir, name)
            if os.path.isfile(path):
                return path
        return None

    def require_data_dir(self, what: str) -> str:
        """``config.data_dir``; a one-line error naming ``what`` the task reads when it is empty."""
        if not self.config.data_dir:
            raise ValueError(
                f"config key data_dir is empty: task {self.name} reads {what} from a local folder"
            )
        return self.config.data_dir

    def check(self) -> None:
        """Before reading any split: the tokenizer against the init checkpoint (size, tokens,
        casing), the model's keys and data.max_seq_length against its position table."""
        self.check_head_keys()
        self._load_tokenizer()
        cfg = self.source.model_config(self.tokenizer.vocab_size, self.config.data.max_seq_length)
        self.check_head(cfg)

    def _load_tokenizer(self) -> None:
        """``vocab`` or the init checkpoint's vocabulary (``bertjax.model_source``): cased as the
        checkpoint's tokenizer unless ``do_lower_case`` says otherwise (a warning); a
        tokenizer.json's normalizer always decides (the key is then ignored, with a warning)."""
        if self.tokenizer is None:
            self.tokenizer = self.source.tokenizer(
                self.vocab, self.do_lower_case, warned=self._warned
            )

    def _require_loaded(self) -> None:
        if not self._loaded:
            raise RuntimeError(
                f"task {self.name}: its data is not loaded; call after_prepare() first "
                "(bertjax.train.prepared_task does)"
            )

    def after_prepare(self) -> None:
        """Loads the tokenizer, the init checkpoint and every split; resolves steps and warmup."""
        if self._loaded:
            return
        if self.packing and self.packing_unsupported:
            raise ValueError(
                f"config key data.packing=True: task {self.name} cannot be packed "
                f"({self.packing_unsupported})"
            )
        self._load_tokenizer()
        self.load_data()
        if self.train_features is None or not len(self.train_features["input_ids"]):
            raise ValueError(f"task {self.name}: no training examples")
        if self.packing:
            examples = len(self.train_features["input_ids"])
            self.train_features, _ = self._pack(self.train_features)
            log.info(
                "task %s: %d training examples packed into %d rows",
                self.name,
                examples,
                len(self.train_features["input_ids"]),
            )
        tcfg = self.config.train
        n = len(self.train_features["input_ids"])  # rows when packed
        per_epoch = max(1, n // tcfg.global_batch_size)
        if tcfg.steps > 0:
            self._total_steps = tcfg.steps
        else:
            if tcfg.epochs <= 0:
                raise ValueError(
                    f"config key train.epochs={tcfg.epochs}: set epochs or train.steps"
                )
            self._total_steps = max(1, int(n / tcfg.global_batch_size * tcfg.epochs))
        self._steps_per_epoch = per_epoch
        log.info(
            "task %s: %d training %s, %d steps (%d per epoch), evaluated on %s",
            self.name,
            n,
            self.rows,
            self._total_steps,
            per_epoch,
            self.describe_eval(),
        )
        self._loaded = True

    def warmup_steps(self, total_steps: int) -> int:
        """``optimizer.warmup_proportion`` of the steps when > 0, else ``optimizer.warmup_steps``."""
        proportion = self.config.optimizer.get("warmup_proportion", 0.0)
        if proportion > 0:
            if self.config.optimizer.warmup_steps > 0:
                raise ValueError(
                    f"config keys optimizer.warmup_proportion={proportion} and "
                    f"optimizer.warmup_steps={self.config.optimizer.warmup_steps}: set one of "
                    "them (warmup_proportion=0 to use warmup_steps)"
                )
            return int(total_steps * proportion)
        return super().warmup_steps(total_steps)

    def model_config(self):
        self._require_loaded()
        seq = self.train_features["input_ids"].shape[-1]
        return self.source.model_config(self.tokenizer.vocab_size, seq)

    def phases(self) -> list[Phase]:
        self._require_loaded()
        seq = self.train_features["input_ids"].shape[-1]
        return [
            Phase(
                until_step=self._total_steps,
                global_batch_size=self.config.train.global_batch_size,
                options={"max_seq_length": seq},
            )
        ]

    def init_batch(self, phase: Phase, batch_size: int):
        batch = {
            k: np.zeros((batch_size, *v.shape[1:]), v.dtype) for k, v in self.train_features.items()
        }
        batch["input_mask"] = np.ones_like(batch["input_mask"])
        batch["mask"] = np.ones((batch_size,), np.float32)
        return batch

    def model_inputs(self, batch):
        return dict(
            input_ids=batch["input_ids"],
            segment_ids=batch["segment_ids"],
            input_mask=batch["input_mask"],
            **{k: batch[k] for k in packing.PACKED_KEYS if k in batch},
        )

    def step_shape(self, phase):
        return phase.options["max_seq_length"], 0

    def flops_per_step(self, model_config, phase):
        """The encoder's training FLOPs (the small task head is not counted): its forward pass
        alone when it is frozen (no backward through it)."""
        seq, _ = self.step_shape(phase)
        train = flops.train_flops_per_step(model_config, phase.global_batch_size, seq, 0)
        return train / 3.0 if self.freeze_encoder else train

    # ---- training ------------------------------------------------------------------------------
    def example_weights(self, batch) -> jax.Array:
        """Weight of every example: [b] (``mask``), or [b, k] when packed (0 for empty slots)."""
        mask = batch["mask"].astype(jnp.float32)
        if "example_weights" in batch:
            return batch["example_weights"] * mask[:, None]
        return mask

    def normalizers(self, batch):
        return {"examples": self.example_weights(batch).sum()}

    def loss(self, model, params, batch, rng, normalizers, deterministic):
        outputs = model.apply(
            {"params": params},
            **self.model_inputs(batch),
            deterministic=deterministic,
            rngs={"dropout": rng},
        )
        return self.head_loss(outputs, batch, normalizers)

    def train_data(self, phase, process_index, process_count):
        if self.batch_packing:  # every host packs the global batch and takes its rows
            data = ArrayData(
                self.train_features, phase.global_batch_size, seed=self.config.train.seed
            )
            return BatchPacked(
                data,
                max_examples_per_row=int(self.config.data.get("max_examples_per_row", 8)),
                buckets=row_buckets(phase.global_batch_size, self._batch_shards()),
                process_index=process_index,
                process_count=process_count,
            )
        return ArrayData(
            self.train_features,
            phase.global_batch_size // process_count,
            seed=self.config.train.seed,
            process_index=process_index,
            process_count=process_count,
            shuffle=True,
            repeat=True,
        )

    # ---- evaluation ----------------------------------------------------------------------------
    def eval_outputs(self, model, params, batch):
        outputs = model.apply({"params": params}, **self.model_inputs(batch), deterministic=True)
        return {**self.predictions(outputs, batch), "mask": batch["mask"]}

    def _batch_shards(self) -> int:
        """The devices a batch is split over (all but the tensor axis)."""
        mesh = self.config.mesh
        return (mesh.get("num_devices", 0) or jax.device_count()) // max(1, mesh.tensor)

    def _eval_batch_size(self) -> int:
        """config.data.eval_batch_size rounded up to a multiple of the batch-sharding devices."""
        devices = self._batch_shards()
        size = max(1, self.config.data.eval_batch_size)
        return -(-size // devices) * devices

    def predict(
        self, run: Callable, features: dict[str, np.ndarray], what: str = "predicting"
    ) -> dict[str, np.ndarray]:
        """Every example of ``features`` through ``run`` once: host outputs [n, ...] in order;
        ``what`` names the phase for the progress display (rows: packed, on this process).

        With (eval) packing the examples run packed and the outputs are mapped back to example order.
        """
        layout = None
        if self.eval_packing:
            if id(features) not in self._packed_eval:
                self._packed_eval[id(features)] = (features, *self._pack(features))
            _, features, layout = self._packed_eval[id(features)]
        count = jax.process_count()
        size = self._eval_batch_size()
        size = -(-size // count) * count
        data = ArrayData(
            features,
            size // count,
            seed=0,
            process_index=jax.process_index(),
            process_count=count,
            shuffle=False,
            repeat=False,
        )
        chunks: dict[str, list[np.ndarray]] = {}
        rows = -(-len(next(iter(features.values()))) // count)
        with progress.phase(what, rows, "rows"):
            for batch in data:
                out = run(batch)
                keep = np.asarray(out.pop("mask")) > 0
                for key, value in out.items():
                    chunks.setdefault(key, []).append(np.asarray(value)[keep])
                progress.advance(int(keep.sum()))
        n = len(next(iter(features.values())))
        result = {k: np.concatenate(v) for k, v in chunks.items()}
        for key, value in result.items():
            if len(value) != n:
                raise RuntimeError(f"eval output {key} has {len(value)} rows for {n} examples")
        if layout is not None:
            result = {
                k: packing.unpack_tokens(v, layout)
                if k in self.token_outputs
                else packing.unpack_examples(v, layout)
                for k, v in result.items()
            }
        return result

    def evaluate(self, run, phase):
        metrics: dict[str, float] = {}
        for eval_set in self.eval_sets:
            outputs = self.predict(run, eval_set.features, f"evaluating {eval_set.name}")
            metrics.update(self.score(eval_set, outputs))
        return metrics

    def eval_every(self) -> int:
        self._require_loaded()
        return self.config.train.eval_every or self._steps_per_epoch

    def best_metric(self):
        return (self.main_metric, "max")

    def describe_eval(self) -> str:
        """What the run evaluates on, for its start-up line."""
        return ", ".join(f"{e.name} ({e.size} examples)" for e in self.eval_sets) or "nothing"

    def write_dev_predictions(self, eval_set: EvalSet, outputs: dict, workdir: str) -> str | None:
        """Subclass hook for finalize: writes one eval set's predictions (process 0, atomically);
        returns the file's path (None: the task writes none)."""
        return None

    def finalize(self, run, params, workdir):
        dev, files = {}, {}
        for eval_set in self.eval_sets:
            outputs = self.predict(run, eval_set.features, f"evaluating {eval_set.name}")
            dev.update(self.score(eval_set, outputs))
            if jax.process_index() == 0:
                path = self.write_dev_predictions(eval_set, outputs, workdir)
                if path:
                    files[eval_set.name] = str(path)
        result = {
            "task": self.name,
            "main_metric": self.main_metric,
            "dev": dev,
            "num_train_examples": int(len(self.train_features["input_ids"])),
            "train_steps": self._total_steps,
        }
        if files:
            result["dev_predictions"] = files
        result.update(self.write_outputs(run, workdir))
        return result

    def describe(self) -> str:
        source = self.config.init_checkpoint or "random init"
        return f"{self.name} from {source}"

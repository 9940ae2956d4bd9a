"""The pretraining task: masked LM + next-sentence prediction on prepared TFRecords.

``prepare`` (process 0) builds, when missing, everything the run reads: the demo corpus (offline
default), a vocabulary trained from the corpus (unless ``data.vocab`` names one) and the TFRecord
shards of every sequence-length phase (``bertjax prepare`` with the config's options).
``data.packing`` (MLM only, ``data.nsp=False``) prepares packed rows (``bertjax.data.packing``) and
feeds their ``pack_ids`` / ``position_ids`` to the model; the masked positions are row-global.
"""

from __future__ import annotations

import logging
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from bertjax import flops, fs, losses, models, progress
from bertjax.data.demo_corpus import build_demo_corpus
from bertjax.data.metadata import METADATA_FILE, read_metadata
from bertjax.data.prepare import prepare, vocab_sha256
from bertjax.data.vocab import train_vocab
from bertjax.model_source import ModelSource
from bertjax.models.heads import PreTrainingModel
from bertjax.tasks.base import Phase, Task, register
from bertjax.text import load_tokenizer

log = logging.getLogger("bertjax")

MLM_LOSS_MODES = ("auto", "logits", "chunked")  # train.mlm_loss (PretrainingTask.chunked_mlm_loss)
CHUNKED_ABOVE_BYTES = 2**32  # auto: chunked above 4 GiB of fp32 MLM logits per device


@register("pretrain")
class PretrainingTask(Task):
    """BERT pretraining: weighted MLM cross-entropy (+ NSP cross-entropy when ``data.nsp``)."""

    name = "pretrain"
    eval_at_start = True
    metric_normalizers = {
        "mlm_loss": "mlm_weight",
        "mlm_accuracy": "mlm_weight",
        "nsp_loss": "examples",
        "nsp_accuracy": "examples",
    }

    def __init__(self, config, workdir, *, vocab_size: int | None = None):
        """``vocab_size`` set: a task without data on disk (compiling, benchmarks): nothing is
        prepared or read, and the model's vocabulary has that size."""
        super().__init__(config, workdir)
        self.tokenizer = None
        self.fixed_vocab_size = vocab_size
        self.source = ModelSource(config.model, config.get("init_checkpoint", ""))
        self._warned: set[str] = set()
        d = config.data
        self.prepared_root = d.prepared_dir or os.path.join(workdir, "data")
        self.packing = bool(d.get("packing", False))
        if self.packing and d.nsp:
            raise ValueError(
                "config key data.packing=True needs data.nsp=False (next-sentence pairs cannot be "
                "packed)"
            )
        self._check_streams()

    @classmethod
    def for_compiling(cls, config, workdir):
        """Shapes come from the config and the vocabulary's size: ``data.vocab`` when it is a
        local file, else ``data.vocab_size``; no corpus, prepared data or bucket is read (compiling
        needs no credentials and no network)."""
        path, size = config.data.get("vocab", ""), int(config.data.vocab_size)
        try:
            if path and not fs.is_remote(path) and fs.exists(path):
                size = load_tokenizer(path).vocab_size
        except OSError as err:  # e.g. gs:// without credentials
            log.warning(
                "cannot read data.vocab %s (%s): using data.vocab_size=%d",
                path,
                str(err).splitlines()[0][:120],
                size,
            )
        return cls(config, workdir, vocab_size=size)

    def check(self) -> None:
        """What needs only the config, the init checkpoint and a named vocabulary: the model's
        keys, the vocabulary against the checkpoint (size, tokens, casing), the sequence length
        against the position table."""
        longest = max(s["max_seq_length"] for s in self._phase_specs())
        if self.fixed_vocab_size:
            self.source.model_config(self.fixed_vocab_size, longest)
            return
        vocab = self._vocab_path()
        if self.config.data.vocab or fs.exists(vocab):
            size = self._load_tokenizer(vocab).vocab_size
        else:  # trained from the corpus by prepare, to data.vocab_size tokens
            size = int(self.config.data.vocab_size)
        self.source.model_config(size, longest)

    def _check_streams(self) -> None:
        """Before any data work: the streams split every phase's global batch and the hosts."""
        streams = int(self.config.data.get("streams", 0) or 0)
        if streams < 0:
            raise ValueError(f"config key data.streams={streams} must be >= 0")
        if not streams or self.fixed_vocab_size:
            return
        processes = jax.process_count()
        if streams % processes:
            raise ValueError(
                f"config key data.streams={streams} is not a multiple of the {processes} "
                f"processes: set --config.data.streams to a multiple of {processes} (the same "
                "value on every resume keeps the data order)"
            )
        for i, spec in enumerate(self._phase_specs()):
            batch = spec.get("global_batch_size", self.config.train.global_batch_size)
            if batch % streams:
                where = (
                    f"data.phases[{i}].global_batch_size"
                    if "global_batch_size" in spec
                    else "train.global_batch_size"
                )
                raise ValueError(
                    f"config key {where}={batch} is not divisible by data.streams={streams} "
                    "(set data.streams to a divisor of it)"
                )

    # ---- data on disk --------------------------------------------------------------------------
    def _phase_specs(self) -> list[dict]:
        d = self.config.data
        if not d.phases:
            return [
                dict(
                    until_step=self.config.train.steps,
                    max_seq_length=d.max_seq_length,
                    max_predictions_per_seq=d.max_predictions_per_seq,
                )
            ]
        specs = [dict(p) for p in d.phases]
        for i, spec in enumerate(specs):
            for key in ("until_step", "max_seq_length", "max_predictions_per_seq"):
                if key not in spec:
                    raise ValueError(f"config key data.phases[{i}] lacks {key!r}")
        if specs[-1]["until_step"] != self.config.train.steps:
            raise ValueError(
                f"config key data.phases[-1].until_step={specs[-1]['until_step']} must equal "
                f"train.steps={self.config.train.steps}"
            )
        return specs

    def data_dir(self, max_seq_length: int) -> str:
        if not self.config.data.phases:
            return self.prepared_root
        return os.path.join(self.prepared_root, f"seq{max_seq_length}")

    def _corpus_files(self) -> tuple[str, str]:
        d = self.config.data
        if d.demo_corpus:
            corpus_dir = os.path.join(self.prepared_root, "demo_corpus")
            files = build_demo_corpus(corpus_dir)
            return ",".join(files), "bert"
        if not d.corpus:
            raise ValueError(
                "config key data.corpus is empty: name a corpus (files, glob, tfds:...)"
            )
        return d.corpus, d.corpus_format

    def _load_tokenizer(self, vocab: str):
        """The run's tokenizer (``bertjax.model_source``): a tokenizer.json decides its casing;
        a vocabulary file is cased as data.do_lower_case, else as the init checkpoint's
        tokenizer, else as the vocabulary itself."""
        lower = self.config.data.get("do_lower_case")
        return self.source.tokenizer(vocab, lower, warned=self._warned)

    def _vocab_path(self) -> str:
        d = self.config.data
        if d.vocab:
            return d.vocab
        suffix = ".model" if d.vocab_kind == "sentencepiece" else ".txt"
        return os.path.join(self.prepared_root, "vocab" + suffix)

    def prepare(self) -> None:
        if self.fixed_vocab_size:
            return
        d = self.config.data
        missing = [
            s
            for s in self._phase_specs()
            if not fs.exists(os.path.join(self.data_dir(s["max_seq_length"]), METADATA_FILE))
        ]
        if not missing and (d.vocab or fs.exists(self._vocab_path())):
            return
        corpus, fmt = None, None
        vocab = self._vocab_path()
        if not d.vocab and not fs.exists(vocab):
            corpus, fmt = self._corpus_files()
            log.info(
                "training a %s vocabulary of %d tokens on %s", d.vocab_kind, d.vocab_size, corpus
            )
            fs.makedirs(self.prepared_root)
            train_vocab(
                corpus,
                os.path.splitext(vocab)[0] if d.vocab_kind == "sentencepiece" else vocab,
                d.vocab_size,
                kind=d.vocab_kind,
                do_lower_case=d.get("do_lower_case") is not False,  # unset: lower case
                seed=self.config.data.seed,
                corpus_format=fmt,
                text_column=d.get("text_column", "text"),
                text_column_setting="data.text_column",
            )
        tokenizer = self._load_tokenizer(vocab)
        for spec in self._phase_specs():
            out = self.data_dir(spec["max_seq_length"])
            if fs.exists(os.path.join(out, METADATA_FILE)):
                continue
            if corpus is None:
                corpus, fmt = self._corpus_files()
            log.info("preparing pretraining data (seq %d) in %s", spec["max_seq_length"], out)
            prepare(
                corpus,
                out,
                tokenizer,
                corpus_format=fmt,
                text_column=d.get("text_column", "text"),
                text_column_setting="data.text_column",
                max_seq_length=spec["max_seq_length"],
                max_predictions_per_seq=spec["max_predictions_per_seq"],
                masked_lm_prob=d.masked_lm_prob,
                short_seq_prob=d.short_seq_prob,
                dupe_factor=d.dupe_factor,
                nsp=d.nsp,
                masking=d.masking,
                whole_word_mask=d.whole_word_mask,
                seed=d.seed,
                num_shards=d.num_shards,
                eval_fraction=d.eval_fraction,
                packing=self.packing,
            )

    def after_prepare(self) -> None:
        if self.fixed_vocab_size:
            return
        self.tokenizer = self._load_tokenizer(self._vocab_path())
        for spec in self._phase_specs():
            meta = read_metadata(self.data_dir(spec["max_seq_length"]))
            if meta.get("vocab_size") not in (None, self.tokenizer.vocab_size):
                raise ValueError(
                    f"{self.data_dir(spec['max_seq_length'])}/metadata.json: vocab_size="
                    f"{meta['vocab_size']} but the vocabulary {self._vocab_path()} has "
                    f"{self.tokenizer.vocab_size} tokens; delete the prepared data or fix data.vocab"
                )
            self._check_vocab_hash(meta, self.data_dir(spec["max_seq_length"]))
            if meta["max_seq_length"] != spec["max_seq_length"]:
                raise ValueError(
                    f"{self.data_dir(spec['max_seq_length'])}/metadata.json: "
                    f"max_seq_length={meta['max_seq_length']}, config wants "
                    f"{spec['max_seq_length']}"
                )
            if bool(meta.get("packing", False)) != self.packing:
                raise ValueError(
                    f"{self.data_dir(spec['max_seq_length'])}/metadata.json: packing="
                    f"{bool(meta.get('packing', False))} but config key data.packing="
                    f"{self.packing}; delete the prepared data or fix data.packing"
                )

    def _check_vocab_hash(self, meta: dict, data_dir: str) -> None:
        """Prepared data must come from this very vocabulary (same size is not enough)."""
        recorded, vocab = meta.get("vocab_sha256"), self._vocab_path()
        if recorded is None:
            log.warning(
                "%s/metadata.json records no vocabulary hash (prepared by an older bertjax): "
                "cannot check that it was made with %s",
                data_dir,
                vocab,
            )
        elif recorded != (digest := vocab_sha256(vocab)):
            raise ValueError(
                f"{data_dir}/metadata.json: prepared with another vocabulary (sha256 "
                f"{recorded[:12]}...) than {vocab} (sha256 {digest[:12]}...); delete the prepared "
                "data or fix data.vocab"
            )

    # ---- model ---------------------------------------------------------------------------------
    def model_config(self):
        vocab_size = self.fixed_vocab_size or self.tokenizer.vocab_size
        longest = max(s["max_seq_length"] for s in self._phase_specs())
        return self.source.model_config(vocab_size, longest)

    def build_model(self, model_config):
        return PreTrainingModel(model_config, nsp=self.config.data.nsp)

    def phase_model(self, model, phase):
        """A phase's ``model`` options (e.g. ``dict(global_rope_theta=160_000.0)`` for context
        extension) applied to the run's model config; keys name fields of the architecture."""
        overrides = dict(phase.options.get("model") or {})
        if not overrides:
            return model
        fields = models.config_fields(model.config.architecture)
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise ValueError(
                f"config key data.phases[...].model: {unknown} are not fields of the "
                f"{model.config.architecture} config"
            )
        return self.build_model(model.config.replace(**overrides))

    def phases(self) -> list[Phase]:
        return [
            Phase(
                until_step=s["until_step"],
                global_batch_size=s.get("global_batch_size", self.config.train.global_batch_size),
                options=s,
            )
            for s in self._phase_specs()
        ]

    def init_batch(self, phase, batch_size):
        seq, pred = phase.options["max_seq_length"], phase.options["max_predictions_per_seq"]
        return {
            "input_ids": np.zeros((batch_size, seq), np.int32),
            "input_mask": np.ones((batch_size, seq), np.int32),
            "segment_ids": np.zeros((batch_size, seq), np.int32),
            "masked_lm_positions": np.zeros((batch_size, pred), np.int32),
            "masked_lm_ids": np.zeros((batch_size, pred), np.int32),
            "masked_lm_weights": np.zeros((batch_size, pred), np.float32),
            "next_sentence_labels": np.zeros((batch_size,), np.int32),
            **{k: np.zeros((batch_size, seq), np.int32) for k in self._packed_keys()},
        }

    def _packed_keys(self) -> tuple[str, ...]:
        return ("pack_ids", "position_ids") if self.packing else ()

    def model_inputs(self, batch):
        return dict(
            input_ids=batch["input_ids"],
            segment_ids=batch["segment_ids"],
            input_mask=batch["input_mask"],
            masked_lm_positions=batch["masked_lm_positions"],
            **{k: batch[k] for k in self._packed_keys()},  # packed rows: positions are row-global
        )

    # ---- loss ----------------------------------------------------------------------------------
    def normalizers(self, batch):
        return {
            "mlm_weight": batch["masked_lm_weights"].astype(jnp.float32).sum(),
            "examples": jnp.asarray(batch["input_ids"].shape[0], jnp.float32),
        }

    def chunked_mlm_loss(self, predictions: tuple[int, ...], vocab_size: int) -> bool:
        """Whether the MLM loss runs the decoder and the cross-entropy fused, the vocabulary a
        chunk at a time (``train.mlm_loss``: ``chunked``; ``logits``: the [predictions, vocab]
        logits, then the loss; ``auto``: chunked when those fp32 logits would take more than
        ``CHUNKED_ABOVE_BYTES`` per device, as with a 256k vocabulary). The chunked form computes
        the logits twice (forward, then backward): about a fifth of mmBERT-base's step time for
        a quarter of its memory (docs/performance.md)."""
        mode = self.config.train.get("mlm_loss", "auto")
        if mode not in MLM_LOSS_MODES:
            raise ValueError(f"config key train.mlm_loss={mode!r} is not one of {MLM_LOSS_MODES}")
        if mode != "auto":
            return mode == "chunked"
        per_device = math.prod(predictions) * vocab_size * 4 / jax.device_count()
        return per_device > CHUNKED_ABOVE_BYTES

    def loss(self, model, params, batch, rng, normalizers, deterministic):
        chunked = self.chunked_mlm_loss(batch["masked_lm_ids"].shape, model.config.vocab_size)
        out = model.apply(
            {"params": params},
            **self.model_inputs(batch),
            masked_lm_ids=batch["masked_lm_ids"] if chunked else None,
            deterministic=deterministic,
            rngs={"dropout": rng},
        )
        if chunked:  # the decoder and the cross-entropy fused: no [predictions, vocab] logits
            mlm_loss, mlm_acc = losses.weighted_nll(
                out["mlm_nll"],
                jax.lax.stop_gradient(out["mlm_margin"]) >= 0,
                batch["masked_lm_weights"],
                normalizers["mlm_weight"],
            )
        else:
            mlm_loss, mlm_acc = losses.masked_lm_loss(
                out["mlm_logits"],
                batch["masked_lm_ids"],
                batch["masked_lm_weights"],
                normalizers["mlm_weight"],
            )
        metrics = {"mlm_loss": mlm_loss, "mlm_accuracy": mlm_acc}
        total = mlm_loss
        if self.config.data.nsp:
            nsp_loss, nsp_acc = losses.nsp_loss(
                out["nsp_logits"], batch["next_sentence_labels"], normalizers["examples"]
            )
            metrics.update(nsp_loss=nsp_loss, nsp_accuracy=nsp_acc)
            total = total + nsp_loss
        return total, metrics

    # ---- data ----------------------------------------------------------------------------------
    def _dynamic_masking(self, phase):
        """Dynamic masking as the data was prepared (its metadata.json), which the config must
        describe: a masking key that differs is an error naming it, not a silent change."""
        data_dir = self.data_dir(phase.options["max_seq_length"])
        meta = read_metadata(data_dir)
        if meta["masking"] != "dynamic":
            return None
        d = self.config.data
        for key, want in (
            ("masked_lm_prob", d.masked_lm_prob),
            ("whole_word_mask", d.whole_word_mask),
            ("max_predictions_per_seq", phase.options["max_predictions_per_seq"]),
        ):
            if meta.get(key) != want:
                raise ValueError(
                    f"{data_dir}/{METADATA_FILE}: {key}={meta.get(key)!r} but the config sets "
                    f"data.{key}={want!r}; delete the prepared data or fix data.{key}"
                )
        from bertjax.data import pipeline  # tf.data: the model and the step need no TensorFlow

        return pipeline.dynamic_masking_config(meta, self.tokenizer.word_start_table())

    def _data(self, phase, split, process_index, process_count, *, shuffle):
        """Per-host batches; with ``data.streams`` the global batch is independent of host count."""
        data_dir = self.data_dir(phase.options["max_seq_length"])
        common = dict(
            seed=self.config.train.seed,
            dynamic_masking=self._dynamic_masking(phase),
            shuffle=shuffle,
            shuffle_buffer=self.config.data.shuffle_buffer,
        )
        streams = self.config.data.get("streams", 0)
        if streams and split == "train":
            from bertjax.data.streams import StreamedData  # tf.data, like pipeline below

            return StreamedData(
                data_dir,
                split,
                phase.global_batch_size,
                num_streams=streams,
                process_index=process_index,
                process_count=process_count,
                **common,
            )
        from bertjax.data import pipeline  # tf.data: the model and the step need no TensorFlow

        per_host = phase.global_batch_size // process_count
        return pipeline.PretrainingData(
            data_dir,
            split,
            per_host,
            process_index=process_index,
            process_count=process_count,
            **common,
        )

    def train_data(self, phase, process_index, process_count):
        return self._data(phase, "train", process_index, process_count, shuffle=True)

    def eval_batches(self, phase, process_index, process_count):
        steps = self.config.train.eval_steps
        if steps <= 0:
            return
        from bertjax.data import pipeline

        if pipeline.split_is_empty(self.data_dir(phase.options["max_seq_length"]), "eval"):
            return  # warned once: eval_fraction chose no document
        data = self._data(phase, "eval", process_index, process_count, shuffle=False)
        for _ in range(steps):
            yield next(data)

    def evaluate(self, run, phase):
        with progress.phase("evaluating", self.config.train.eval_steps, "batches"):
            metrics = super().evaluate(run, phase)
        if metrics:
            metrics["loss"] = metrics["mlm_loss"] + metrics.get("nsp_loss", 0.0)
        return metrics

    def step_shape(self, phase):
        return phase.options["max_seq_length"], phase.options["max_predictions_per_seq"]

    def flops_per_step(self, model_config, phase):
        seq, pred = self.step_shape(phase)
        return flops.train_flops_per_step(model_config, phase.global_batch_size, seq, pred)

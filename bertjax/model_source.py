"""Where a run's model comes from: its init checkpoint or its experiment's preset.

One path, shared by pretraining, continued pretraining and every fine-tuning task, from
``init_checkpoint`` (a Hugging Face, original Google or bertjax checkpoint of any architecture,
read by :func:`bertjax.pretrained.load_pretrained`) or ``config.model`` (a preset with field
overrides) to the three things a run needs:

* the tokenizer (:meth:`ModelSource.tokenizer`): the run's vocabulary or the checkpoint's, cased
  as the checkpoint's tokenizer (else as the vocabulary itself); a set ``do_lower_case`` that
  differs applies with a warning; a ``tokenizer.json``'s normalizer always decides its casing; a
  vocabulary that is not the checkpoint's (another size, or another token at any id) is an error;
* the model config (:meth:`ModelSource.model_config`): the checkpoint's, of which ``config.model``
  may change only numerics (``NUMERIC_MODEL_KEYS``), else the preset with ``config.model``'s fields;
* the params (:meth:`ModelSource.load_into`): a freshly initialised model's params with the
  encoder and every head the checkpoint has of the model's taken from the checkpoint: the
  pretraining heads (MLM ``predictions``, NSP ``seq_relationship``) by name, a fine-tuning head
  where it is of the task's kind (``bertjax.head_init``). The log names what was taken.

Everything here needs only the config and the checkpoint, so a run checks it before any data work.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np

from bertjax import models
from bertjax.head_init import carry_task_head, model_kind
from bertjax.pretrained import Pretrained, load_pretrained
from bertjax.text import load_tokenizer

log = logging.getLogger("bertjax")


def _casing(lower: bool) -> str:
    return "folds" if lower else "keeps"


# config.model keys that may change a checkpoint's model config (numerics, not architecture).
NUMERIC_MODEL_KEYS = (
    "dtype",
    "hidden_dropout",
    "attention_dropout",
    "dropout_impl",
    "attention_impl",
    "remat",
    "scan_layers",
)


def init_model_config(ckpt_config: Any, model: Any, source: str) -> Any:
    """The model config of a run that starts from a checkpoint: the checkpoint's architecture with
    the experiment's ``config.model`` numerics (NUMERIC_MODEL_KEYS); other keys set to a different
    value are ignored with a warning naming them."""
    if model.get("architecture") not in (None, ckpt_config.architecture):
        raise ValueError(
            f"config key model.architecture={model.architecture!r} but the init checkpoint "
            f"{source} is {ckpt_config.architecture!r}"
        )
    values = {**model.to_dict(), "architecture": ckpt_config.architecture}
    _, overrides = models.model_overrides(values, ckpt_config.vocab_size)
    fixed = sorted(
        k
        for k, v in overrides.items()
        if k not in NUMERIC_MODEL_KEYS and v != getattr(ckpt_config, k)
    )
    if fixed:  # the checkpoint defines the architecture; only numerics may change
        log.warning(
            "init checkpoint %s defines the architecture: config keys %s ignored",
            source,
            ", ".join(f"model.{k}" for k in fixed),
        )
    return ckpt_config.replace(**{k: v for k, v in overrides.items() if k in NUMERIC_MODEL_KEYS})


class ModelSource:
    """The model of a run: ``init_checkpoint`` (loaded once, here) or ``model`` (config.model).

    ``keys`` names the run's config keys in messages: ``vocab`` (the vocabulary),
    ``do_lower_case`` and ``max_seq_length`` (every task's ``data.*``).
    """

    def __init__(self, model: Any, init_checkpoint: str = "", *, vocab: str | None = None):
        self.model = model
        self.init_checkpoint = init_checkpoint or ""
        self.keys = {
            "vocab": "data.vocab",
            "do_lower_case": "data.do_lower_case",
            "max_seq_length": "data.max_seq_length",
        }
        self._vocab = vocab or None
        self._pretrained: Pretrained | None = None

    @property
    def pretrained(self) -> Pretrained | None:
        """The init checkpoint, loaded at first use (None: the model comes from its preset)."""
        if self.init_checkpoint and self._pretrained is None:
            self._pretrained = load_pretrained(self.init_checkpoint, vocab=self._vocab, quiet=True)
        return self._pretrained

    # ---- the tokenizer -------------------------------------------------------------------------
    def vocab_file(self, vocab: str | None) -> str:
        """``vocab`` when set, else the init checkpoint's vocabulary file (one line when none)."""
        if vocab:
            return vocab
        theirs = self.pretrained.tokenizer if self.pretrained is not None else None
        if theirs is None:
            raise ValueError(
                f"config key {self.keys['vocab']} is empty and no init_checkpoint vocabulary was "
                "found: name a vocab.txt, .model or tokenizer.json file"
            )
        return theirs.vocab_file

    def tokenizer(
        self, vocab: str | None, do_lower_case: bool | None, *, warned: set | None = None
    ):
        """The run's tokenizer (see the module docstring); ``warned`` collects the warnings
        already given, so a run that loads its tokenizer twice warns once."""
        warned = set() if warned is None else warned
        path = self.vocab_file(vocab)
        theirs = self.pretrained.tokenizer if self.pretrained is not None else None
        key = self.keys["do_lower_case"]
        if path.endswith(".json") or os.path.isdir(path):
            tok = load_tokenizer(path)
            if do_lower_case is not None and bool(do_lower_case) != tok.do_lower_case:
                self._warn_once(
                    warned,
                    "json",
                    "config key %s=%s ignored: the normalizer of %s %s case (a "
                    "tokenizer.json decides its own casing)",
                    key,
                    do_lower_case,
                    path,
                    _casing(tok.do_lower_case),
                )
        else:
            follow = theirs.do_lower_case if theirs is not None else None
            lower = follow if do_lower_case is None else do_lower_case
            tok = load_tokenizer(path, do_lower_case=lower)
            if do_lower_case is not None and follow is not None and bool(do_lower_case) != follow:
                self._warn_once(
                    warned,
                    "override",
                    "config key %s=%s overrides the init checkpoint's "
                    "tokenizer (%s %s case): words missing from the vocabulary in that casing "
                    "become [UNK]",
                    key,
                    do_lower_case,
                    theirs.vocab_file,
                    _casing(follow),
                )
        self._check_vocab(tok, path)
        return tok

    @staticmethod
    def _warn_once(warned: set, what: str, message: str, *args) -> None:
        if what not in warned:
            warned.add(what)
            log.warning(message, *args)

    def _check_vocab(self, tok, path: str) -> None:
        """The init checkpoint's vocabulary must be the run's: the same size as its embedding
        table and the same token at every id."""
        if self.pretrained is None:
            return
        table = self.pretrained.config.vocab_size
        if tok.vocab_size != table:
            raise ValueError(
                f"config key {self.keys['vocab']}={path!r} has {tok.vocab_size} tokens but the "
                f"init checkpoint {self.init_checkpoint} embeds {table}"
            )
        theirs = self.pretrained.tokenizer
        if theirs is None:
            log.warning(
                "init checkpoint %s has no vocabulary file: cannot check that it was trained "
                "with %s",
                self.init_checkpoint,
                path,
            )
            return
        if theirs.vocab_file != tok.vocab_file and list(theirs.vocab) != list(tok.vocab):
            diff = [i for i, (a, b) in enumerate(zip(tok.vocab, theirs.vocab)) if a != b]
            where = f"{len(tok.vocab)} tokens here, {len(theirs.vocab)} there"
            if diff:
                i = diff[0]
                where = f"token {i} is {tok.vocab[i]!r} here, {theirs.vocab[i]!r} there"
            raise ValueError(
                f"config key {self.keys['vocab']}={path} is not the vocabulary of the init "
                f"checkpoint {self.init_checkpoint} ({theirs.vocab_file}): {where}"
            )

    # ---- the model config ----------------------------------------------------------------------
    def model_config(self, vocab_size: int, max_seq_length: int | None = None):
        """The run's model config for a vocabulary of ``vocab_size`` tokens; sequences of
        ``max_seq_length`` must fit its position table."""
        if self.pretrained is not None:
            cfg = init_model_config(self.pretrained.config, self.model, self.init_checkpoint)
            if cfg.vocab_size != vocab_size:
                raise ValueError(
                    f"init checkpoint {self.init_checkpoint} embeds {cfg.vocab_size} tokens but "
                    f"the vocabulary ({self.keys['vocab']}) has {vocab_size}"
                )
        else:
            cfg = models.model_config_from(self.model, vocab_size)
        if max_seq_length and max_seq_length > cfg.max_position_embeddings:
            raise ValueError(
                f"config key {self.keys['max_seq_length']}={max_seq_length} exceeds the model's "
                f"max_position_embeddings={cfg.max_position_embeddings}"
            )
        return cfg

    # ---- the params ----------------------------------------------------------------------------
    def load_into(self, model: Any, params: Any) -> Any:
        """``params`` (the fresh params of ``model``) with the encoder and every head of the
        model that the init checkpoint has taken from it (see the module docstring)."""
        if self.pretrained is None:
            return params
        source = self.init_checkpoint
        params = self.pretrained.with_encoder(params, source)
        encoder_name = models.architecture(model.config).encoder_name
        if model_kind(model) is not None:  # a fine-tuning model: its task head
            log.info("encoder initialised from %s", source)
            return carry_task_head(
                params,
                model,
                self.pretrained.task_tensors,
                self.pretrained.task_kinds,
                source,
                hf_class=self.pretrained.hf_class,
                pooler="pooler" not in self.pretrained.missing,
            )
        loaded, fresh = [], []
        if "pooler" in params[encoder_name]:
            (fresh if "pooler" in self.pretrained.missing else loaded).append("pooler")
        for head in sorted(k for k in params if k != encoder_name):
            tensors = self.pretrained.params.get(head)
            if tensors is None:
                fresh.append(head)
                continue
            want = jax.tree.map(lambda x: tuple(x.shape), params[head])
            got = jax.tree.map(lambda x: tuple(np.shape(x)), tensors)
            if want != got:
                raise ValueError(
                    f"init checkpoint {source}: head {head!r} has shapes {got}, the model wants "
                    f"{want}"
                )
            params[head] = jax.tree.map(
                lambda x, f: np.asarray(x).astype(f.dtype), tensors, params[head]
            )
            loaded.append(head)
        log.info(
            "started from %s: heads from the checkpoint %s; initialised fresh %s",
            source,
            loaded or "none",
            fresh or "none",
        )
        return params

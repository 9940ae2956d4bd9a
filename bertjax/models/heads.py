"""Pretraining and fine-tuning heads on any registered encoder (``bertjax.models``).

The encoder is the config's architecture's ``Encoder`` under its ``ENCODER_NAME`` (``bert`` for
BERT), so a pretrained encoder subtree drops in. Parameter trees (shown for BERT)::

    PreTrainingModel:   bert/..., predictions/... (MLM), seq_relationship/... (NSP, optional)

    SequenceClassifier: bert/..., classifier/{kernel [embed, classes], bias [classes]}
    SpanClassifier:     bert/..., qa_outputs/{kernel [embed, 2], bias [2]}
    TokenClassifier:    bert/..., classifier/{kernel [embed, classes], bias [classes]}
    (ModernBERT adds head/{dense,norm} before both: HF's per-token ``head``; see token_head)
    MultipleChoice:     bert/..., classifier/{kernel [embed, 1], bias [1]}

``SequenceClassifier`` and ``TokenClassifier`` also take packed rows (``bertjax.data.packing``):
``position_ids`` and ``pack_ids`` [batch, seq], and for the classifier ``cls_positions`` [batch, k]
(each packed example's [CLS]), which gives logits [batch, k, classes].

Every head applies dropout (``hidden_dropout``) to the encoder output it reads, then one Dense layer
in float32 initialised truncated-normal(initializer_range) with zero bias. The ``classes`` logical
axis has no rule in ``bertjax.sharding.RULES``, so head outputs stay replicated.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.layers.core import gather_positions, output_dense
from bertjax.layers.dropout import Dropout
from bertjax.models import architecture

Array = jax.Array


def encoder(config: Any, add_pooler: bool = True) -> nn.Module:
    """The config's architecture's encoder, named as its checkpoints expect."""
    arch = architecture(config)
    return arch.Encoder(config, add_pooler=add_pooler, name=arch.ENCODER_NAME)


def token_head(config: Any, x: Array) -> Array:
    """The architecture's per-token transform before the token and span classifiers (its
    ``TokenHead``, named ``head``: ModernBERT's dense + act + norm, as HF's ``head``), or ``x``
    unchanged (BERT). Call inside a compact module."""
    head = architecture(config).TokenHead
    return x if head is None else head(config, name="head")(x)


def tied_word_embeddings(config: Any, encoder_module: nn.Module) -> Array:
    """The encoder's word-embedding table [vocab, hidden] (the MLM decoder's tied weights)."""
    table = encoder_module.variables["params"]
    for key in architecture(config).WORD_EMBEDDINGS:
        table = table[key]
    return nn.meta.unbox(table)


class PreTrainingModel(nn.Module):
    """An encoder with the masked-LM head (at chosen positions) and, for BERT's recipe, the
    next-sentence head (``nsp``)."""

    config: Any
    nsp: bool = True

    @nn.compact
    def __call__(
        self,
        input_ids: Array,  # [batch, seq]
        token_type_ids: Array | None = None,  # [batch, seq]
        attention_mask: Array | None = None,  # [batch, seq]
        masked_lm_positions: Array | None = None,  # [batch, k]
        *,
        deterministic: bool = True,
        position_ids: Array | None = None,  # [batch, seq]
        pack_ids: Array | None = None,  # [batch, seq]
    ) -> dict[str, Array]:
        """Returns mlm_logits [batch, k or seq, vocab] and nsp_logits [batch, 2] plus encoder outputs.

        ``masked_lm_positions`` [batch, k] evaluates the MLM head only there (the training path); None
        evaluates every position. ``position_ids`` / ``pack_ids`` [batch, seq] describe packed rows
        (see the encoder); positions are then row-global.
        """
        cfg = self.config
        enc = encoder(cfg, add_pooler=self.nsp or architecture(cfg).POOLER_IN_PRETRAINING)
        out = enc(
            input_ids,
            token_type_ids,
            attention_mask,
            deterministic=deterministic,
            position_ids=position_ids,
            pack_ids=pack_ids,
        )
        seq = out.sequence_output
        if masked_lm_positions is not None:
            seq = gather_positions(seq, masked_lm_positions)  # [batch, k, hidden]
        head = architecture(cfg).MaskedLMHead(cfg, name="predictions")
        result = {
            "sequence_output": out.sequence_output,
            "pooled_output": out.pooled_output,
            "mlm_logits": head(seq, tied_word_embeddings(cfg, enc)),
        }
        if self.nsp:
            result["nsp_logits"] = output_dense(cfg, 2, "seq_relationship")(
                out.pooled_output.astype(jnp.float32)
            )
        return result


class SequenceClassifier(nn.Module):
    """Classification (``num_labels`` logits) or regression (``num_labels=1``) on the pooled [CLS]."""

    config: Any
    num_labels: int

    @nn.compact
    def __call__(
        self,
        input_ids: Array,  # [batch, seq]
        token_type_ids: Array | None = None,  # [batch, seq]
        attention_mask: Array | None = None,  # [batch, seq]
        *,
        deterministic: bool = True,
        position_ids: Array | None = None,  # [batch, seq]
        pack_ids: Array | None = None,  # [batch, seq]
        cls_positions: Array | None = None,  # [batch, k]
    ) -> Array:
        """Returns logits [batch, num_labels], or [batch, k, num_labels] at cls_positions (float32)."""
        out = encoder(self.config)(
            input_ids,
            token_type_ids,
            attention_mask,
            deterministic=deterministic,
            position_ids=position_ids,
            pack_ids=pack_ids,
            pool_positions=cls_positions,
        )
        pooled = out.pooled_output.astype(jnp.float32)  # [batch, (k,) hidden]
        pooled = Dropout(self.config.hidden_dropout, self.config.dropout_impl)(
            pooled, deterministic=deterministic
        )
        return output_dense(self.config, self.num_labels, "classifier")(pooled)  # [b, (k,) labels]


class SpanClassifier(nn.Module):
    """Extractive QA (SQuAD): a start and an end logit for every token (``qa_outputs``, Dense 2)."""

    config: Any

    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        token_type_ids: Array | None = None,
        attention_mask: Array | None = None,
        *,
        deterministic: bool = True,
    ) -> tuple[Array, Array]:
        """Returns (start_logits, end_logits), each [batch, seq] float32."""
        out = encoder(self.config, add_pooler=False)(
            input_ids, token_type_ids, attention_mask, deterministic=deterministic
        )
        seq = token_head(self.config, out.sequence_output).astype(jnp.float32)  # [b, s, hidden]
        if architecture(self.config).TokenHead is not None:  # HF drops out after the head
            seq = Dropout(self.config.hidden_dropout, self.config.dropout_impl)(
                seq, deterministic=deterministic
            )
        logits = output_dense(self.config, 2, "qa_outputs")(seq)  # [batch, seq, 2]
        return logits[..., 0], logits[..., 1]


class TokenClassifier(nn.Module):
    """Per-token classification (NER): ``num_labels`` logits at every position."""

    config: Any
    num_labels: int

    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        token_type_ids: Array | None = None,
        attention_mask: Array | None = None,
        *,
        deterministic: bool = True,
        position_ids: Array | None = None,  # [batch, seq]
        pack_ids: Array | None = None,  # [batch, seq]
    ) -> Array:
        """Returns logits [batch, seq, num_labels] (float32)."""
        out = encoder(self.config, add_pooler=False)(
            input_ids,
            token_type_ids,
            attention_mask,
            deterministic=deterministic,
            position_ids=position_ids,
            pack_ids=pack_ids,
        )
        seq = token_head(self.config, out.sequence_output).astype(jnp.float32)  # [b, s, hidden]
        seq = Dropout(self.config.hidden_dropout, self.config.dropout_impl)(
            seq, deterministic=deterministic
        )
        return output_dense(self.config, self.num_labels, "classifier")(seq)  # [batch, seq, labels]


class MultipleChoice(nn.Module):
    """Multiple choice (SWAG): every choice is encoded alone; one score per choice from its [CLS]."""

    config: Any

    @nn.compact
    def __call__(
        self,
        input_ids: Array,  # [batch, choices, seq]
        token_type_ids: Array | None = None,
        attention_mask: Array | None = None,
        *,
        deterministic: bool = True,
    ) -> Array:
        """Returns logits [batch, choices] (float32)."""
        if input_ids.ndim != 3:
            raise ValueError(
                f"MultipleChoice wants [batch, choices, seq] ids, got {input_ids.shape}"
            )
        b, c, s = input_ids.shape

        def flat(x):
            return None if x is None else x.reshape(b * c, s)  # [batch * choices, seq]

        first = None
        if attention_mask is not None and architecture(self.config).CHOICE_POOLS_FIRST_TOKEN:
            # the first unpadded token (left padding), as attention_mask.argmax(-1)
            first = jnp.argmax(flat(attention_mask), axis=-1).astype(jnp.int32)[:, None]
        out = encoder(self.config)(
            flat(input_ids),
            flat(token_type_ids),
            flat(attention_mask),
            deterministic=deterministic,
            pool_positions=first,
        )
        pooled = out.pooled_output if first is None else out.pooled_output[:, 0]
        pooled = pooled.astype(jnp.float32)  # [batch * choices, hidden]
        pooled = Dropout(self.config.hidden_dropout, self.config.dropout_impl)(
            pooled, deterministic=deterministic
        )
        scores = output_dense(self.config, 1, "classifier")(pooled)  # [batch * choices, 1]
        return scores.reshape(b, c)


HEADS = {
    "sequence": SequenceClassifier,
    "span": SpanClassifier,
    "token": TokenClassifier,
    "choice": MultipleChoice,
}

"""Fine-tuning heads on the shared BERT encoder (submodule ``bert``), as in the original BERT.

Parameter trees (the encoder's is ``modeling.BertModel``'s, so a pretrained ``bert`` subtree drops in)::

    SequenceClassifier: bert/..., classifier/{kernel [embed, classes], bias [classes]}
    SpanClassifier:     bert/..., qa_outputs/{kernel [embed, 2], bias [2]}
    TokenClassifier:    bert/..., classifier/{kernel [embed, classes], bias [classes]}
    MultipleChoice:     bert/..., classifier/{kernel [embed, 1], bias [1]}

``SequenceClassifier`` and ``TokenClassifier`` also take packed rows (``bertjax.data.packing``):
``position_ids`` and ``pack_ids`` [batch, seq], and for the classifier ``cls_positions`` [batch, k]
(each packed example's [CLS]), which gives logits [batch, k, classes].

Every head applies dropout (``hidden_dropout``) to the encoder output it reads, then one Dense layer
in float32 initialised truncated-normal(initializer_range) with zero bias. The ``classes`` logical
axis has no rule in ``bertjax.sharding.RULES``, so head outputs stay replicated.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.dropout import Dropout
from bertjax.model_config import BertConfig
from bertjax.modeling import BertModel, output_dense

Array = jax.Array


class SequenceClassifier(nn.Module):
    """Classification (``num_labels`` logits) or regression (``num_labels=1``) on the pooled [CLS]."""

    config: BertConfig
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
        out = BertModel(self.config, name="bert")(
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

    config: BertConfig

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
        out = BertModel(self.config, add_pooler=False, name="bert")(
            input_ids, token_type_ids, attention_mask, deterministic=deterministic
        )
        seq = out.sequence_output.astype(jnp.float32)  # [batch, seq, hidden]
        logits = output_dense(self.config, 2, "qa_outputs")(seq)  # [batch, seq, 2]
        return logits[..., 0], logits[..., 1]


class TokenClassifier(nn.Module):
    """Per-token classification (NER): ``num_labels`` logits at every position."""

    config: BertConfig
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
        out = BertModel(self.config, add_pooler=False, name="bert")(
            input_ids,
            token_type_ids,
            attention_mask,
            deterministic=deterministic,
            position_ids=position_ids,
            pack_ids=pack_ids,
        )
        seq = out.sequence_output.astype(jnp.float32)  # [batch, seq, hidden]
        seq = Dropout(self.config.hidden_dropout, self.config.dropout_impl)(
            seq, deterministic=deterministic
        )
        return output_dense(self.config, self.num_labels, "classifier")(seq)  # [batch, seq, labels]


class MultipleChoice(nn.Module):
    """Multiple choice (SWAG): every choice is encoded alone; one score per choice from its [CLS]."""

    config: BertConfig

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

        out = BertModel(self.config, name="bert")(
            flat(input_ids), flat(token_type_ids), flat(attention_mask), deterministic=deterministic
        )
        pooled = out.pooled_output.astype(jnp.float32)  # [batch * choices, hidden]
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

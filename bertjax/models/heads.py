"""Pretraining and fine-tuning heads on any registered encoder (``bertjax.models``).

The encoder is the config's architecture's ``Encoder`` under its ``ENCODER_NAME`` (``bert`` for
BERT), so a pretrained encoder subtree drops in. Parameter trees (shown for BERT)::

    PreTrainingModel:   bert/..., predictions/... (MLM), seq_relationship/... (NSP, optional)

    SequenceClassifier: bert/..., classifier/{kernel [embed, classes], bias [classes]}
    SpanClassifier:     bert/..., qa_outputs/{kernel [embed, 2], bias [2]}
    TokenClassifier:    bert/..., classifier/{kernel [embed, classes], bias [classes]}
    (ModernBERT adds head/{dense,norm} before both: HF's per-token ``head``; see token_head)
    MultipleChoice:     bert/..., classifier/{kernel [embed, 1], bias [1]}

The four fine-tuning heads take ``frozen_encoder``: the encoder then always runs deterministically
(no dropout: a frozen encoder is a feature extractor, as in the BERT paper's feature-based
approach, Section 5.3); the trainer then differentiates the head alone (``Task.frozen_mask``).
``SequenceClassifier`` and ``TokenClassifier`` also take ``features`` (``FEATURES``): which
combination of the encoder's layers the head reads. ``last`` (the default) is the fine-tuning head
above; ``sum_last4`` and ``concat_last4`` sum or concatenate the last four layers' hidden states,
``scalar_mix`` is ELMo's learned softmax-weighted sum of every hidden state (the embeddings and each
layer) times a learned ``gamma`` (``scalar_mix/{weights [layers + 1], gamma []}``). These read the
[CLS] position, or with ``pooling="mean"`` the mean over each example's tokens (the sequence
classifier, without pooler), or every token (the token classifier, without the architecture's
``head``). ``TokenClassifier(bilstm=True)`` puts the paper's two-layer BiLSTM
(``bilstm/{forward,backward}_{0,1}``, ``hidden_size`` units each way) between the features and
the classifier.

``SequenceClassifier`` and ``TokenClassifier`` also take packed rows (``bertjax.data.packing``):
``position_ids`` and ``pack_ids`` [batch, seq], and for the classifier ``cls_positions`` [batch, k]
(each packed example's [CLS]), which gives logits [batch, k, classes].

Every head applies dropout (``hidden_dropout``) to the encoder output it reads, then one Dense layer
in float32 initialised truncated-normal(initializer_range) with zero bias. The ``classes`` logical
axis has no rule in ``bertjax.sharding.RULES``, so head outputs stay replicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.layers.core import gather_positions, model_inputs, output_dense
from bertjax.layers.dropout import Dropout
from bertjax.models import architecture

Array = jax.Array


def encoder(config: Any, add_pooler: bool = True) -> nn.Module:
    """The config's architecture's encoder, named as its checkpoints expect."""
    arch = architecture(config)
    return arch.encoder(config, add_pooler=add_pooler, name=arch.encoder_name)


def token_head(config: Any, x: Array) -> Array:
    """The architecture's per-token transform before the token and span classifiers (its
    ``TokenHead``, named ``head``: ModernBERT's dense + act + norm, as HF's ``head``), or ``x``
    unchanged (BERT). Call inside a compact module."""
    head = architecture(config).token_head
    return x if head is None else head(config, name="head")(x)


def tied_word_embeddings(config: Any, encoder_module: nn.Module) -> Array:
    """The encoder's word-embedding table [vocab, hidden] (the MLM decoder's tied weights)."""
    table = encoder_module.variables["params"]
    for key in architecture(config).word_embeddings:
        table = table[key]
    return nn.meta.unbox(table)


def mlm_logits(config: Any, encoder_module: nn.Module, hidden: Array, labels: Array | None = None):
    """The masked-LM head (``predictions``: the architecture's transform, decoder tied to the
    encoder's word embeddings): [..., hidden] -> [..., vocab]; with ``labels`` [...] the
    cross-entropy there and the label's logit minus the largest, [...] each, without the logits
    (``bertjax.layers.fast_ops.decoder_nll``). Call inside a compact module."""
    head = architecture(config).masked_lm_head(config, name="predictions")
    return head(hidden, tied_word_embeddings(config, encoder_module), labels)


def nsp_logits(config: Any, pooled: Array) -> Array:
    """The next-sentence head (``seq_relationship``, float32): [..., hidden] -> [..., 2]."""
    return output_dense(config, 2, "seq_relationship")(pooled.astype(jnp.float32))


def classifier_logits(config: Any, pooled: Array, num_labels: int, deterministic: bool) -> Array:
    """Dropout (``hidden_dropout``) then the ``classifier`` Dense in float32: [..., hidden] ->
    [..., num_labels]. Call inside a compact module."""
    pooled = Dropout(config.hidden_dropout, config.dropout_impl)(
        pooled.astype(jnp.float32), deterministic=deterministic
    )
    return output_dense(config, num_labels, "classifier")(pooled)


# Which combination of the encoder's layers a feature-based head reads (``features``).
FEATURES = ("last", "sum_last4", "concat_last4", "scalar_mix")


def check_features(features: str, num_layers: int) -> None:
    """One-line ValueError for a ``features`` value that is not one of ``FEATURES``, or that reads
    more layers than the encoder has."""
    if features not in FEATURES:
        raise ValueError(
            f"config key head.features={features!r}: choose one of {', '.join(FEATURES)}"
        )
    if features.endswith("_last4") and num_layers < 4:
        raise ValueError(
            f"config key head.features={features}: the encoder has {num_layers} layers (needs 4)"
        )


class ScalarMix(nn.Module):
    """ELMo's scalar mix (Peters et al., 2018, eq. 1): ``gamma * sum_j softmax(w)_j h_j`` over
    every hidden state, with ``w`` (zeros: the mean at the start) and ``gamma`` (one) learned."""

    @nn.compact
    def __call__(self, hidden_states: Sequence[Array]) -> Array:
        weights = self.param("weights", nn.initializers.zeros, (len(hidden_states),), jnp.float32)
        gamma = self.param("gamma", nn.initializers.ones, (), jnp.float32)
        w = jax.nn.softmax(weights)
        mixed = sum(w[j] * h.astype(jnp.float32) for j, h in enumerate(hidden_states))
        return gamma * mixed


def layer_features(hidden_states: Sequence[Array], features: str) -> Array:
    """The combination ``features`` (not ``last``) of an encoder's hidden states (the embeddings,
    then every layer, each [..., seq, hidden]) in float32: [..., seq, hidden] (``concat_last4``:
    [..., seq, 4 * hidden]). Call inside a compact module (``scalar_mix`` has parameters)."""
    if features == "scalar_mix":
        return ScalarMix(name="scalar_mix")(hidden_states)
    last4 = [h.astype(jnp.float32) for h in hidden_states[-4:]]
    if features == "sum_last4":
        return sum(last4[1:], last4[0])
    if features == "concat_last4":
        return jnp.concatenate(last4, axis=-1)
    raise ValueError(f"head.features={features!r} is not one of {FEATURES[1:]}")


def mean_tokens(x: Array, input_mask: Array | None, pack_ids: Array | None, slots: int) -> Array:
    """The mean of ``x`` [batch, seq, F] over each example's tokens: [batch, F] over the
    attention mask, or [batch, slots, F] over each packed example's tokens (``pack_ids`` 1..slots;
    an empty slot gives zeros). Padding is never counted (sentence-transformers' mean pooling)."""
    if pack_ids is None:
        mask = jnp.ones(x.shape[:2]) if input_mask is None else input_mask
        member = mask[:, None, :] > 0  # [batch, 1, seq]
    else:  # [batch, slots, seq]
        member = pack_ids[:, None, :] == jnp.arange(1, slots + 1, dtype=pack_ids.dtype)[:, None]
    member = member.astype(jnp.float32)
    total = jnp.einsum("bks,bsf->bkf", member, x, precision=jax.lax.Precision.HIGHEST)
    mean = total / jnp.maximum(member.sum(-1, keepdims=True), 1.0)
    return mean[:, 0] if pack_ids is None else mean


class BiLSTM(nn.Module):
    """``layers`` bidirectional LSTM layers of ``units`` each way over [batch, seq, features]
    (float32): [batch, seq, 2 * units]. Each row's ``lengths`` first tokens are its sequence (right
    padding): the backward direction starts at its last real token."""

    units: int
    layers: int = 2

    @nn.compact
    def __call__(self, x: Array, lengths: Array) -> Array:
        for i in range(self.layers):
            forward = nn.RNN(nn.OptimizedLSTMCell(self.units, name=f"forward_{i}"))
            backward = nn.RNN(nn.OptimizedLSTMCell(self.units, name=f"backward_{i}"))
            x = nn.Bidirectional(forward, backward)(x, seq_lengths=lengths)
        return x


def first_token_positions(input_mask: Array) -> Array:
    """[batch, 1] the first unpadded token of each row (left padding), as transformers'
    ``input_mask.argmax(-1)``: where an architecture with ``choice_pools_first_token`` pools."""
    return jnp.argmax(input_mask, axis=-1).astype(jnp.int32)[:, None]


class PreTrainingModel(nn.Module):
    """An encoder with the masked-LM head (at chosen positions) and, for BERT's recipe, the
    next-sentence head (``nsp``)."""

    config: Any
    nsp: bool = True

    @model_inputs
    @nn.compact
    def __call__(
        self,
        input_ids: Array,  # [batch, seq]
        segment_ids: Array | None = None,  # [batch, seq]
        input_mask: Array | None = None,  # [batch, seq]
        masked_lm_positions: Array | None = None,  # [batch, k]
        *,
        deterministic: bool = True,
        position_ids: Array | None = None,  # [batch, seq]
        pack_ids: Array | None = None,  # [batch, seq]
        masked_lm_ids: Array | None = None,  # [batch, k]
    ) -> dict[str, Array]:
        """Returns mlm_logits [batch, k or seq, vocab] and nsp_logits [batch, 2] plus encoder outputs.

        ``masked_lm_positions`` [batch, k] evaluates the MLM head only there (the training path); None
        evaluates every position. ``position_ids`` / ``pack_ids`` [batch, seq] describe packed rows
        (see the encoder); positions are then row-global. ``masked_lm_ids`` [batch, k] (the labels
        at those positions) returns ``mlm_nll`` and ``mlm_margin`` (label logit minus the largest;
        >= 0: correct) [batch, k] instead of the logits, which then never exist in full.
        """
        cfg = self.config
        enc = encoder(cfg, add_pooler=self.nsp or architecture(cfg).pooler_in_pretraining)
        out = enc(
            input_ids,
            segment_ids,
            input_mask,
            deterministic=deterministic,
            position_ids=position_ids,
            pack_ids=pack_ids,
        )
        seq = out.sequence_output
        if masked_lm_positions is not None:
            seq = gather_positions(seq, masked_lm_positions)  # [batch, k, hidden]
        result = {"sequence_output": out.sequence_output, "pooled_output": out.pooled_output}
        if masked_lm_ids is None:
            result["mlm_logits"] = mlm_logits(cfg, enc, seq)
        else:
            result["mlm_nll"], result["mlm_margin"] = mlm_logits(cfg, enc, seq, masked_lm_ids)
        if self.nsp:
            result["nsp_logits"] = nsp_logits(cfg, out.pooled_output)
        return result


class SequenceClassifier(nn.Module):
    """Classification (``num_labels`` logits) or regression (``num_labels=1``) on the pooled [CLS]."""

    config: Any
    num_labels: int
    features: str = "last"  # FEATURES: the pooled [CLS] of the last layer, or [CLS] of a mix
    frozen_encoder: bool = False  # the encoder runs without dropout (a feature extractor)
    pooling: str = "cls"  # a mix (features other than last) at [CLS], or its mean over tokens

    @model_inputs
    @nn.compact
    def __call__(
        self,
        input_ids: Array,  # [batch, seq]
        segment_ids: Array | None = None,  # [batch, seq]
        input_mask: Array | None = None,  # [batch, seq]
        *,
        deterministic: bool = True,
        position_ids: Array | None = None,  # [batch, seq]
        pack_ids: Array | None = None,  # [batch, seq]
        cls_positions: Array | None = None,  # [batch, k]
    ) -> Array:
        """Returns logits [batch, num_labels], or [batch, k, num_labels] at cls_positions (float32)."""
        last = self.features == "last"
        out = encoder(self.config, add_pooler=last)(
            input_ids,
            segment_ids,
            input_mask,
            deterministic=deterministic or self.frozen_encoder,
            position_ids=position_ids,
            pack_ids=pack_ids,
            pool_positions=cls_positions if last else None,
            output_hidden_states=not last,
        )
        if last:
            pooled = out.pooled_output
        else:  # [batch, seq, F] -> [batch, (k,) F] at each [CLS]
            x = layer_features(out.hidden_states, self.features)
            if self.pooling == "mean":
                slots = 0 if cls_positions is None else cls_positions.shape[-1]
                pooled = mean_tokens(x, input_mask, pack_ids, slots)
            elif cls_positions is None:
                pooled = x[:, 0]
            else:
                pooled = gather_positions(x, cls_positions)
        # [batch, (k,) hidden] -> [batch, (k,) labels]
        return classifier_logits(self.config, pooled, self.num_labels, deterministic)


class SpanClassifier(nn.Module):
    """Extractive QA (SQuAD): a start and an end logit for every token (``qa_outputs``, Dense 2)."""

    config: Any
    frozen_encoder: bool = False  # the encoder runs without dropout (a feature extractor)

    @model_inputs
    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        *,
        deterministic: bool = True,
    ) -> tuple[Array, Array]:
        """Returns (start_logits, end_logits), each [batch, seq] float32."""
        out = encoder(self.config, add_pooler=False)(
            input_ids,
            segment_ids,
            input_mask,
            deterministic=deterministic or self.frozen_encoder,
        )
        seq = token_head(self.config, out.sequence_output).astype(jnp.float32)  # [b, s, hidden]
        if architecture(self.config).token_head is not None:  # HF drops out after the head
            seq = Dropout(self.config.hidden_dropout, self.config.dropout_impl)(
                seq, deterministic=deterministic
            )
        logits = output_dense(self.config, 2, "qa_outputs")(seq)  # [batch, seq, 2]
        return logits[..., 0], logits[..., 1]


class TokenClassifier(nn.Module):
    """Per-token classification (NER): ``num_labels`` logits at every position."""

    config: Any
    num_labels: int
    features: str = "last"  # FEATURES: the last layer through the token head, or a mix
    frozen_encoder: bool = False  # the encoder runs without dropout (a feature extractor)
    bilstm: bool = False  # a two-layer BiLSTM between the features and the classifier

    @model_inputs
    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        *,
        deterministic: bool = True,
        position_ids: Array | None = None,  # [batch, seq]
        pack_ids: Array | None = None,  # [batch, seq]
    ) -> Array:
        """Returns logits [batch, seq, num_labels] (float32)."""
        last = self.features == "last"
        if self.bilstm and pack_ids is not None:
            raise ValueError(
                "TokenClassifier(bilstm=True) reads each row as one sequence: unpacked"
            )
        out = encoder(self.config, add_pooler=False)(
            input_ids,
            segment_ids,
            input_mask,
            deterministic=deterministic or self.frozen_encoder,
            position_ids=position_ids,
            pack_ids=pack_ids,
            output_hidden_states=not last,
        )
        if last:
            seq = token_head(self.config, out.sequence_output).astype(jnp.float32)  # [b, s, H]
        else:
            seq = layer_features(out.hidden_states, self.features)  # [batch, seq, F]
        seq = Dropout(self.config.hidden_dropout, self.config.dropout_impl)(
            seq, deterministic=deterministic
        )
        if self.bilstm:  # [batch, seq, F] -> [batch, seq, 2 * hidden]
            if input_mask is None:
                lengths = jnp.full(input_ids.shape[:1], input_ids.shape[1], jnp.int32)
            else:
                lengths = input_mask.sum(-1).astype(jnp.int32)
            seq = BiLSTM(self.config.hidden_size, name="bilstm")(seq, lengths)
        return output_dense(self.config, self.num_labels, "classifier")(seq)  # [batch, seq, labels]


class MultipleChoice(nn.Module):
    """Multiple choice (SWAG): every choice is encoded alone; one score per choice from its [CLS]."""

    config: Any
    frozen_encoder: bool = False  # the encoder runs without dropout (a feature extractor)

    @model_inputs
    @nn.compact
    def __call__(
        self,
        input_ids: Array,  # [batch, choices, seq]
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
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
        if input_mask is not None and architecture(self.config).choice_pools_first_token:
            first = first_token_positions(flat(input_mask))
        out = encoder(self.config)(
            flat(input_ids),
            flat(segment_ids),
            flat(input_mask),
            deterministic=deterministic or self.frozen_encoder,
            pool_positions=first,
        )
        pooled = out.pooled_output if first is None else out.pooled_output[:, 0]
        scores = classifier_logits(self.config, pooled, 1, deterministic)  # [batch * choices, 1]
        return scores.reshape(b, c)


class InferenceModel(nn.Module):
    """An encoder plus whichever heads a checkpoint holds (what ``load_pretrained`` runs):
    ``mlm`` (``predictions``), ``nsp`` (``seq_relationship``) and a sequence ``classifier`` of
    ``num_labels``, built by the functions the training models use. ``pool_first_token``: the
    pooler reads the first unpadded token (a multiple-choice scorer of an architecture with
    ``choice_pools_first_token``), not position 0."""

    config: Any
    pooler: bool = True
    mlm: bool = False
    nsp: bool = False
    num_labels: int = 0
    pool_first_token: bool = False

    @model_inputs
    @nn.compact
    def __call__(
        self,
        input_ids: Array,  # [batch, seq]
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        *,
        deterministic: bool = True,
        output_hidden_states: bool = False,
    ) -> dict[str, Any]:
        cfg = self.config
        enc = encoder(cfg, add_pooler=self.pooler)
        first = None
        if self.pool_first_token and input_mask is not None:
            first = first_token_positions(input_mask)  # [batch, 1]
        out = enc(
            input_ids,
            segment_ids,
            input_mask,
            deterministic=deterministic,
            output_hidden_states=output_hidden_states,
            pool_positions=first,
        )
        pooled = out.pooled_output
        if first is not None and pooled is not None:
            pooled = pooled[:, 0]  # [batch, hidden]
        result = {"sequence_output": out.sequence_output, "pooled_output": pooled}
        if output_hidden_states:
            result["hidden_states"] = out.hidden_states  # L + 1 of [batch, seq, hidden]
        if self.mlm:
            result["mlm_logits"] = mlm_logits(cfg, enc, out.sequence_output)  # [b, seq, vocab]
        if self.nsp:
            result["nsp_logits"] = nsp_logits(cfg, pooled)  # [batch, 2]
        if self.num_labels:
            result["logits"] = classifier_logits(cfg, pooled, self.num_labels, deterministic)
        return result


HEADS = {
    "sequence": SequenceClassifier,
    "span": SpanClassifier,
    "token": TokenClassifier,
    "choice": MultipleChoice,
}

"""Load a pretrained BERT from any checkpoint format and run it: ``load_pretrained(path)``.

``path`` may be a Hugging Face model directory, an original Google checkpoint directory or a
bertjax checkpoint directory (see ``bertjax.convert``). The result bundles the Flax module, its
params, the model config and the tokenizer, and is callable on token ids::

    model = load_pretrained("bert-base-uncased/")
    batch = model.encode_batch(["a sentence", ("first", "second")], max_length=128)
    out = model(**batch)  # out.sequence_output [b, seq, hidden], out.mlm_logits [b, seq, vocab]

A sentence-transformers directory (``modules.json``) loads the same way and keeps its pooling,
Dense, Normalize, prompts and ``max_seq_length`` in ``embedding``; ``model.embed(texts)`` gives
the vectors ``SentenceTransformer(path).encode(texts)`` gives. Any other checkpoint embeds as
sentence-transformers wraps a plain HF model: mean pooling, no Normalize, its position table.

The loader knows no family: ``embedding`` is whatever head settings a family's format reader
returned (a :class:`HeadBehaviour`: ``embed``, ``embed_queries``, ``embed_documents``), and what a
checkpoint does not carry (the default embedding head, a classifier's cross-encoder settings) comes
from :func:`default_head`, which the families fill (``bertjax.families``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

import bertjax.models as models
from bertjax import families
from bertjax.convert import Checkpoint, load_checkpoint, unflatten_params
from bertjax.convert.checkpoint import head_of
from bertjax.head_init import checkpoint_kinds
from bertjax.layers.core import model_inputs
from bertjax.models.heads import InferenceModel
from bertjax.text import features, load_tokenizer

log = logging.getLogger("bertjax")

Array = jax.Array
TASK_HEADS = ("classifier", "token_head", "qa")  # a fine-tuning model's heads outside the encoder


def __getattr__(name):
    if name == "PretrainedEncoder":  # bertjax 0.2's name: an error naming the new one, then gone
        raise ImportError(
            "bertjax.pretrained.PretrainedEncoder was renamed "
            "bertjax.models.heads.InferenceModel in bertjax 0.3"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class HeadBehaviour(Protocol):
    """A family's head settings as a loaded model runs them (``Pretrained.embedding``: what the
    family's format reader put in ``Checkpoint.embedding``). ``late_interaction``: one vector per
    token (``embed_queries`` / ``embed_documents``, ColBERT) rather than one per text (``embed``);
    each kind refuses the other's calls in one line."""

    @property
    def late_interaction(self) -> bool: ...

    def embed(
        self,
        model: Pretrained,
        texts: Sequence[str],
        batch_size: int,
        prompt: str | None,
        prompt_name: str | None,
    ) -> np.ndarray: ...

    def embed_queries(
        self, model: Pretrained, texts: Sequence[str], batch_size: int
    ) -> list[np.ndarray]: ...

    def embed_documents(
        self, model: Pretrained, texts: Sequence[str], batch_size: int
    ) -> list[np.ndarray]: ...


class PairScorer(Protocol):
    """How a loaded sequence classifier scores texts and (query, passage) pairs, as
    ``CrossEncoder(source)`` would (``Pretrained.cross_encoder``): tokens per pair (``max_length``),
    the activation ``predict`` applies, and the scoring itself."""

    max_length: int
    activation: str

    def scores(
        self, model: Pretrained, pairs: Sequence, batch_size: int, max_length: int | None
    ) -> np.ndarray: ...

    def predict(
        self,
        model: Pretrained,
        pairs: Sequence,
        batch_size: int,
        activation: str | None,
        max_length: int | None,
    ) -> np.ndarray: ...


# A family's head for a loaded model that its checkpoint did not carry, by kind: "embedding" (a
# HeadBehaviour: how a plain encoder embeds texts) and "cross_encoder" (a PairScorer: how its
# classifier scores pairs), each made from the model. The families register them.
_DEFAULT_HEADS: dict[str, Callable[[Pretrained], Any]] = {}


def register_default_head(kind: str, make: Callable[[Pretrained], Any]) -> None:
    """Makes ``make(model)`` the head of kind ``kind`` of a model whose checkpoint has none."""
    _DEFAULT_HEADS[kind] = make


def default_head(kind: str, model: Pretrained) -> Any:
    """The head of kind ``kind`` a family gives ``model`` (loads the families first)."""
    families.load()
    if kind not in _DEFAULT_HEADS:
        raise ValueError(f"{model.source}: no family gives a {kind} head (see bertjax.families)")
    return _DEFAULT_HEADS[kind](model)


@dataclasses.dataclass(frozen=True)
class PretrainedOutput:
    """Model outputs; a field is None when the checkpoint has no such head."""

    sequence_output: Array  # [batch, seq, hidden]
    pooled_output: Array | None = None  # [batch, hidden]
    mlm_logits: Array | None = None  # [batch, seq, vocab]
    nsp_logits: Array | None = None  # [batch, 2]
    logits: Array | None = None  # [batch, num_labels] (sequence classifier)
    hidden_states: tuple | None = None  # embeddings, then every layer: [batch, seq, hidden] each


def encode_batch(
    tokenizer, texts_or_pairs: Sequence, max_length: int, pad_to_max_length: bool = False
) -> dict[str, np.ndarray]:
    """Texts or (text_a, text_b) pairs -> ``[CLS] A [SEP] (B [SEP])`` padded int32 arrays.

    Returns input_ids, segment_ids and input_mask (the model's argument names and the keys of
    training batches), each
    [batch, length] where length is the longest sequence (or ``max_length`` when
    ``pad_to_max_length``). Longer inputs are truncated as the original BERT truncates (see
    :mod:`bertjax.text.features`).
    """
    if max_length < 3:
        raise ValueError(f"max_length={max_length} leaves no room for [CLS] text [SEP]")
    rows = features.rows(tokenizer, list(texts_or_pairs), max_length)
    return features.pad(
        rows, max_length if pad_to_max_length else features.longest(rows), tokenizer.pad_id
    )


@dataclasses.dataclass
class Pretrained:
    """A loaded checkpoint: Flax ``module`` with ``params``, ``config``, ``tokenizer``, and the
    heads absent from the source (``missing``; freshly initialised when loaded with heads="all").

    ``task_tensors`` are the checkpoint's task-head tensors (flat paths under ``classifier``,
    ``head``, ``qa_outputs``), kept even where ``module`` does not run them, and ``task_kinds`` the
    fine-tuning head kinds they serve (``bertjax.head_init``), from ``hf_class`` or the heads.
    """

    module: InferenceModel
    params: dict
    config: Any
    tokenizer: Any
    missing: tuple[str, ...]
    source: str = ""
    task_tensors: dict = dataclasses.field(default_factory=dict)
    task_kinds: frozenset = frozenset()
    hf_class: str | None = None
    embedding: HeadBehaviour | None = None  # a family's head (sentence-transformers, PyLate)
    directory: str | None = None  # the directory load_pretrained read (cross-encoder settings)

    def __post_init__(self):
        self._apply = _jitted_apply(self.module)

    @property
    def heads(self) -> tuple[str, ...]:
        """Heads this model runs (pooler, mlm, nsp, classifier)."""
        m = self.module
        flags = (m.pooler, m.mlm, m.nsp, m.num_labels > 0)
        return tuple(h for h, on in zip(("pooler", "mlm", "nsp", "classifier"), flags) if on)

    @property
    def encoder_params(self) -> dict:
        """The encoder's params (``bert`` subtree for BERT: what fine-tuning heads start from)."""
        return self.params[models.architecture(self.config).encoder_name]

    bert_params = encoder_params  # the name bertjax 0.1 gave it

    def with_encoder(self, params: dict, source: str) -> dict:
        """``params`` of a model built on this architecture with the encoder subtree replaced by
        this checkpoint's (see :func:`merge_encoder`; ``source`` names it in errors)."""
        arch = models.architecture(self.config)
        name = arch.encoder_name
        return {**params, name: merge_encoder(params[name], self.encoder_params, source, arch)}

    def encode_batch(
        self, texts_or_pairs: Sequence, max_length: int | None = None, pad_to_max_length=False
    ) -> dict[str, np.ndarray]:
        """Tokenizes and pads a batch (see :func:`encode_batch`); needs a vocabulary file."""
        if self.tokenizer is None:
            raise ValueError(f"{self.source}: no vocabulary file found beside the checkpoint")
        max_length = max_length or self.config.max_position_embeddings
        self.check_length(max_length)
        return encode_batch(self.tokenizer, texts_or_pairs, max_length, pad_to_max_length)

    def check_length(self, length: int) -> None:
        """Raises ValueError when ``length`` exceeds the position-embedding table."""
        if length > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {length} exceeds the position table of {self.source} "
                f"(max_position_embeddings={self.config.max_position_embeddings})"
            )

    def embedding_head(self) -> HeadBehaviour:
        """``embedding``, else the head a family gives a plain encoder (sentence-transformers' way
        of wrapping a plain model: mean pooling, no Normalize, the position table)."""
        return self.embedding if self.embedding is not None else default_head("embedding", self)

    def embed(
        self,
        texts: Sequence[str],
        batch_size: int = 32,
        prompt: str | None = None,
        prompt_name: str | None = None,
    ) -> np.ndarray:
        """Sentence embeddings [len(texts), dim] float32, as ``SentenceTransformer.encode``.

        ``prompt`` (text) or ``prompt_name`` (one of ``embedding.prompts``) goes before every
        text; neither: the model's default prompt, if any. Texts are truncated to
        ``embedding.max_seq_length`` tokens with [CLS] and [SEP] (see
        :mod:`bertjax.retrieval.bi_encoder.embedding`). Needs a tokenizer.
        """
        if self.tokenizer is None:
            raise ValueError(f"{self.source}: no vocabulary file found beside the checkpoint")
        return self.embedding_head().embed(self, texts, batch_size, prompt, prompt_name)

    @property
    def late_interaction(self) -> bool:
        """Whether this is a late-interaction (ColBERT) model: per-token vectors, MaxSim."""
        return self.embedding is not None and self.embedding.late_interaction

    def embed_queries(self, texts: Sequence[str], batch_size: int = 32) -> list[np.ndarray]:
        """Per-token vectors [tokens, dim] of each query, as PyLate's ``ColBERT.encode(texts,
        is_query=True)`` (a late-interaction model: see
        :mod:`bertjax.retrieval.colbert.late_interaction`)."""
        return self.embedding_head().embed_queries(self, texts, batch_size)

    def embed_documents(self, texts: Sequence[str], batch_size: int = 32) -> list[np.ndarray]:
        """Per-token vectors [tokens, dim] of each document (skiplist tokens dropped), as
        PyLate's ``ColBERT.encode(texts, is_query=False)``."""
        return self.embedding_head().embed_documents(self, texts, batch_size)

    @functools.cached_property
    def cross_encoder(self) -> PairScorer:
        """What ``CrossEncoder(source)`` reads beside the weights: tokens per pair, activation."""
        return default_head("cross_encoder", self)

    def rerank_scores(
        self, pairs: Sequence, batch_size: int = 32, max_length: int | None = None
    ) -> np.ndarray:
        """The classifier's raw logits of (query, passage) pairs or of single texts (a sentence
        classifier: ``predict(["a fine film", ...])``): [n] float32 for one label (a
        cross-encoder), else [n, num_labels]. Pairs are ``[CLS] query [SEP] passage [SEP]``
        truncated longest-first to ``max_length`` tokens (default ``cross_encoder.max_length``),
        as ``CrossEncoder.predict`` does (see :mod:`bertjax.retrieval.reranker.rerank`)."""
        if not self.module.num_labels:
            raise ValueError(f"{self.source}: no sequence-classification head to score pairs")
        return self.cross_encoder.scores(self, pairs, batch_size, max_length)

    def predict(
        self,
        pairs: Sequence,
        batch_size: int = 32,
        activation: str | None = None,
        max_length: int | None = None,
    ) -> np.ndarray:
        """``CrossEncoder(source).predict(pairs)``: :meth:`rerank_scores` through ``activation``
        (a torch.nn name: Sigmoid, Identity, Tanh; default the directory's ``activation_fn``,
        else Sigmoid for one label)."""
        return self.cross_encoder.predict(self, pairs, batch_size, activation, max_length)

    @model_inputs
    def __call__(
        self,
        input_ids,
        segment_ids=None,
        input_mask=None,
        *,
        output_hidden_states: bool = False,
    ) -> PretrainedOutput:
        """Runs the model (jitted) on [batch, seq] int arrays; ``segment_ids`` default to zeros
        and ``input_mask`` to ones."""
        input_ids = jnp.asarray(input_ids, jnp.int32)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
        self.check_length(input_ids.shape[1])
        segment_ids = jnp.zeros_like(input_ids) if segment_ids is None else segment_ids
        input_mask = jnp.ones_like(input_ids) if input_mask is None else input_mask
        out = self._apply(
            {"params": self.params},
            input_ids,
            jnp.asarray(segment_ids, jnp.int32),
            jnp.asarray(input_mask, jnp.int32),
            output_hidden_states=output_hidden_states,
        )
        return PretrainedOutput(**out)


@functools.lru_cache(maxsize=16)
def _jitted_apply(module: InferenceModel):
    """One jitted ``apply`` per module definition, shared by every model loaded with it."""
    return jax.jit(module.apply, static_argnames=("output_hidden_states",))


def fresh_head_tensors(module: InferenceModel, heads, seed: int) -> dict[str, np.ndarray]:
    """Newly initialised tensors (flat bertjax paths) of ``heads`` (pooler, mlm, nsp) of
    ``module``, by the model's own initialisers (``seed``)."""
    ids = np.zeros((1, 2), np.int32)

    def init_heads(key):  # only the heads leave the program: the encoder's init is dead code
        params = module.init(key, ids, ids, ids)["params"]
        flat = traverse_util.flatten_dict(nn.meta.unbox(params), sep="/")
        return {p: v for p, v in flat.items() if head_of(p) in heads}

    flat = jax.jit(init_heads)(jax.random.key(seed))
    return {p: np.asarray(v, np.float32) for p, v in flat.items()}


def pretrained_from_checkpoint(
    ckpt: Checkpoint,
    heads: str = "available",
    dtype: str = "float32",
    seed: int = 0,
    quiet: bool = False,
) -> Pretrained:
    """Builds a :class:`Pretrained` from a loaded :class:`~bertjax.convert.Checkpoint`;
    ``quiet``: no log lines about its heads (a run that starts from it says what it takes)."""
    say = log.debug if quiet else log.info
    warn = log.debug if quiet else log.warning
    if heads not in ("available", "all"):
        raise ValueError(f"heads={heads!r} must be 'available' or 'all'")
    if ckpt.feature_head:
        warn(
            "%s: its feature-based task head (%s) is not run here: the encoder loads alone",
            ckpt.source,
            ckpt.feature_head,
        )
    present = set(ckpt.heads)
    arch = models.architecture(ckpt.config)
    own = ("pooler", "mlm", "nsp") if arch.nsp else ("pooler", "mlm")  # heads it can run
    missing = tuple(h for h in own if h not in present)
    tensors = {k: np.asarray(v, np.float32) for k, v in ckpt.tensors.items()}
    task_tensors = {k: v for k, v in tensors.items() if head_of(k) in TASK_HEADS}
    task_kinds = checkpoint_kinds(ckpt.heads, ckpt.hf_class, ckpt.num_labels)
    num_labels = ckpt.num_labels
    if "classifier" in present and "pooler" not in present:
        # A classifier beside an encoder without pooler is a per-token (tagging) head.
        warn(
            "%s: classifier without pooler (a token classifier) is not run here (fine-tuning "
            "from it starts from it)",
            ckpt.source,
        )
        present.discard("classifier")
        tensors = {k: v for k, v in tensors.items() if not k.startswith("classifier/")}
        num_labels = 0
    if present & {"token_head", "qa"}:  # run by models.heads.TokenClassifier / SpanClassifier
        warn(
            "%s: the token-classification / QA head is not run here (fine-tuning from it starts "
            "from it)",
            ckpt.source,
        )
        present -= {"token_head", "qa"}
        tensors = {k: v for k, v in tensors.items() if not k.startswith(("head/", "qa_outputs/"))}
    want = set(present)
    if heads == "all":
        want |= set(own)
    if "nsp" in want:
        want.add("pooler")  # NSP reads the pooled output
    config = ckpt.config.replace(dtype=dtype, param_dtype="float32", scan_layers=False)
    choice_pools_first = arch.choice_pools_first_token
    module = InferenceModel(
        config,
        pooler="pooler" in want,
        mlm="mlm" in want,
        nsp="nsp" in want,
        num_labels=num_labels,
        pool_first_token=choice_pools_first and task_kinds == frozenset({"choice"}),
    )
    fresh = sorted(want - present)
    if fresh:
        tensors.update(fresh_head_tensors(module, fresh, seed))
        say("%s: heads %s absent; initialised freshly (seed %d)", ckpt.source, fresh, seed)
    elif missing:
        say("%s: heads %s absent (heads='all' initialises them)", ckpt.source, list(missing))
    params = unflatten_params(tensors)
    tokenizer = None
    if ckpt.vocab_file:
        tokenizer = load_tokenizer(ckpt.vocab_file, ckpt.do_lower_case)
    else:
        log.warning("%s: no vocabulary file found; tokenizer is None", ckpt.source)
    params = jax.device_put(params)
    return Pretrained(
        module,
        params,
        config,
        tokenizer,
        missing,
        ckpt.source,
        task_tensors,
        task_kinds,
        ckpt.hf_class,
        ckpt.embedding,
    )


def load_pretrained(
    path: str,
    *,
    heads: str = "available",
    dtype: str = "float32",
    seed: int = 0,
    vocab: str | None = None,
    fmt: str | None = None,
    quiet: bool = False,
) -> Pretrained:
    """Loads a HF, sentence-transformers, original Google or bertjax checkpoint directory as a
    runnable model (``embed`` for sentence embeddings).

    heads="available" keeps the heads the checkpoint has; "all" adds freshly initialised pooler,
    MLM and NSP heads (seeded by ``seed``) where absent. ``dtype`` is the compute dtype (params
    stay float32). ``vocab`` overrides the vocabulary file found beside the checkpoint and ``fmt``
    (hf, tf, bertjax, sentence-transformers) the detected format. ``quiet``: no log lines about
    the heads.
    """
    ckpt = load_checkpoint(path, fmt, vocab)
    model = pretrained_from_checkpoint(ckpt, heads=heads, dtype=dtype, seed=seed, quiet=quiet)
    model.directory = str(path)
    return model


def merge_encoder(fresh: Any, source: Any, source_name: str, arch: Any) -> Any:
    """The fresh encoder param tree (subtree ``arch.encoder_name`` of a model of architecture
    ``arch``) with every tensor taken from ``source`` (the same subtree of a checkpoint, layers
    unrolled), stacked onto a leading axis where ``fresh`` scans its layers
    (``arch.scanned_layers``).

    A pooler absent from ``source`` stays fresh (the callers' log says so); any other absent tensor or a shape mismatch is a
    ValueError naming the parameter.
    """
    src = {"/".join(k): v for k, v in traverse_util.flatten_dict(source).items()}
    encoder_name = arch.encoder_name
    stacked, unrolled = arch.scanned_layers or ("", "")
    prefix = tuple(stacked.split("/")) if stacked else None
    out = {}
    for path, leaf in traverse_util.flatten_dict(fresh).items():
        name = "/".join(path)
        if prefix and path[: len(prefix)] == prefix:  # scanned: [layers, ...]
            rest = "/".join(path[len(prefix) :])
            names = [f"{unrolled.format(i=i)}/{rest}" for i in range(leaf.shape[0])]
            if all(n in src for n in names):
                value = np.stack([np.asarray(src[n]) for n in names])
            else:
                value = None
        else:
            value = src.get(name)
        if value is None:
            if path[0] == "pooler":
                out[path] = leaf
                continue
            raise ValueError(
                f"init checkpoint {source_name} has no parameter {encoder_name}/{name}"
            )
        value = np.asarray(value)
        if value.shape != tuple(leaf.shape):
            raise ValueError(
                f"init checkpoint {source_name}: {encoder_name}/{name} has shape {value.shape}, "
                f"the model "
                f"wants {tuple(leaf.shape)}"
            )
        out[path] = value.astype(leaf.dtype)
    return traverse_util.unflatten_dict(out)

"""The BERT encoder and its pretraining heads in Flax Linen (pure ``init``/``apply``).

Parameter tree (names chosen so that conversion to/from Google and Hugging Face checkpoints is a
table, see ``bertjax/convert``)::

    bert/embeddings/{word_embeddings,position_embeddings,token_type_embeddings}/embedding
    bert/embeddings/LayerNorm/{scale,bias}
    bert/encoder/layer_{i}/attention/{query,key,value}/{kernel [embed, heads, kv], bias [heads, kv]}
    bert/encoder/layer_{i}/attention/output/{kernel [heads, kv, embed], bias}
    bert/encoder/layer_{i}/{attention_norm,output_norm}/{scale,bias}
    bert/encoder/layer_{i}/intermediate/kernel [embed, mlp];  .../output/kernel [mlp, embed]
    bert/pooler/dense/{kernel,bias}
    predictions/{dense,LayerNorm}, predictions/output_bias [vocab]   (MLM head)
    seq_relationship/{kernel [embed, 2], bias}                        (NSP head)

With ``scan_layers=True`` the layers live under ``bert/encoder/layers`` with a leading ``layers`` axis.
Every kernel carries logical axis names; ``bertjax.sharding.RULES`` maps them onto the mesh.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from bertjax import fast_ops
from bertjax.dropout import Dropout
from bertjax.model_config import BertConfig
from bertjax.splash_attention import segment_ids_from_mask, splash_attention

Array = jax.Array

# Activation sharding: batch over data+fsdp, heads/mlp/vocab over tensor, the rest replicated.
BATCH_LENGTH_EMBED = ("batch", "length", "act_embed")
BATCH_LENGTH_HEADS_KV = ("batch", "length", "act_heads", "kv")
BATCH_LENGTH_MLP = ("batch", "length", "act_mlp")


def _dtype(name: str) -> Any:
    return jnp.dtype(name)


def _init(config: BertConfig, names: tuple[str | None, ...]):
    """Truncated-normal(initializer_range) initializer carrying logical axis names."""
    base = nn.initializers.truncated_normal(stddev=config.initializer_range)
    return nn.with_logical_partitioning(base, names)


def _zeros(names: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def _ones(names: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.ones_init(), names)


def activation(name: str):
    """The feed-forward activation named in the model config."""
    return {
        "gelu": fast_ops.gelu,  # exact (erf) GELU; its backward reuses the forward's Phi(x)
        "gelu_new": functools.partial(nn.gelu, approximate=True),
        "gelu_tanh": functools.partial(nn.gelu, approximate=True),
        "relu": nn.relu,
        "silu": nn.silu,
    }[name]


def layer_norm(config: BertConfig, name: str) -> nn.LayerNorm:
    """LayerNorm with fp32 statistics (Flax promotes them), outputs in the compute dtype."""
    return nn.LayerNorm(
        epsilon=config.layer_norm_eps,
        dtype=_dtype(config.dtype),
        param_dtype=_dtype(config.param_dtype),
        scale_init=_ones(("norm",)),
        bias_init=_zeros(("norm",)),
        name=name,
    )


def attention_bias(attention_mask: Array, dtype: Any, pack_ids: Array | None = None) -> Array:
    """[batch, seq] 0/1 mask (or [batch, q, k]) -> additive bias [batch, 1, q or 1, k] (fp32 softmax).

    With ``pack_ids`` [batch, seq] (packed rows: 1..n per sequence, 0 = padding) the mask is block
    diagonal and ``attention_mask`` is not read: a real token attends exactly to the tokens of its own
    sequence. Padding tokens attend to each other (their outputs are never read), so no query row is
    fully masked (which would be NaN where the bias rounds to -inf, e.g. in bfloat16).
    """
    if pack_ids is not None:
        attention_mask = pack_ids[:, :, None] == pack_ids[:, None, :]  # [batch, q, k]
    if attention_mask.ndim == 2:
        allowed = attention_mask[:, None, None, :]
    else:
        allowed = attention_mask[:, None, :, :]
    return jnp.where(allowed > 0, 0.0, jnp.finfo(dtype).min).astype(dtype)


class BertEmbeddings(nn.Module):
    """Token + position + segment embeddings, LayerNorm, dropout.

    ``position_ids`` [batch, seq] (default 0..seq-1) restart at 0 for every sequence of a packed row.
    """

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        token_type_ids: Array,
        *,
        deterministic: bool,
        position_ids: Array | None = None,
    ) -> Array:
        cfg = self.config
        seq_len = input_ids.shape[-1]
        if seq_len > cfg.max_position_embeddings:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_position_embeddings="
                f"{cfg.max_position_embeddings} of the model"
            )

        def embed(num, names, name):
            return nn.Embed(
                num,
                cfg.hidden_size,
                dtype=_dtype(cfg.dtype),
                param_dtype=_dtype(cfg.param_dtype),
                embedding_init=_init(cfg, names),
                name=name,
            )

        words = embed(cfg.vocab_size, ("vocab", "embed"), "word_embeddings")(input_ids)
        if position_ids is None:
            position_ids = jnp.arange(seq_len)[None, :]  # [1, seq]
        positions = embed(cfg.max_position_embeddings, (None, "embed"), "position_embeddings")(
            position_ids
        )
        types = embed(cfg.type_vocab_size, (None, "embed"), "token_type_embeddings")(token_type_ids)
        x = words + positions + types  # [batch, seq, hidden]
        x = layer_norm(cfg, "LayerNorm")(x)
        x = Dropout(cfg.hidden_dropout, cfg.dropout_impl)(x, deterministic=deterministic)
        return nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)


class HeadProjection(nn.Module):
    """A kernel with head axes: [embed] -> [heads, kv] (``in_heads=False``) or back (True).

    Written with explicit params because nn.DenseGeneral initialises a flattened kernel, which
    breaks the 3-axis logical partitioning of attention kernels.
    """

    config: BertConfig
    in_heads: bool = False

    @nn.compact
    def __call__(self, x: Array | None) -> Array | tuple[Array, Array]:
        """The projection of ``x``, or (kernel, bias) in the compute dtype when ``x`` is None."""
        cfg = self.config
        pdtype, dtype = _dtype(cfg.param_dtype), _dtype(cfg.dtype)
        h, n, d = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        if self.in_heads:
            kernel = self.param("kernel", _init(cfg, ("heads", "kv", "embed")), (n, d, h), pdtype)
            bias = self.param("bias", _zeros(("embed",)), (h,), pdtype)
        else:
            kernel = self.param("kernel", _init(cfg, ("embed", "heads", "kv")), (h, n, d), pdtype)
            bias = self.param("bias", _zeros(("heads", "kv")), (n, d), pdtype)
        kernel, bias = kernel.astype(dtype), bias.astype(dtype)
        if x is None:
            return kernel, bias
        spec = "bshd,hde->bse" if self.in_heads else "bse,ehd->bshd"
        return jnp.einsum(spec, x.astype(dtype), kernel) + bias


def fused_qkv(config: BertConfig, x: Array) -> tuple[Array, Array, Array]:
    """Query, key and value [batch, seq, heads, head_dim] from ONE matmul against the three kernels
    stacked at run time (params stay ``query``/``key``/``value``): on CPU one [embed, 3*embed]
    product and its single input gradient beat three products plus two gradient sums."""
    params = [HeadProjection(config, name=name)(None) for name in ("query", "key", "value")]
    kernel = jnp.stack([k for k, _ in params], axis=1)  # [embed, 3, heads, head_dim]
    bias = jnp.stack([b for _, b in params], axis=0)  # [3, heads, head_dim]
    qkv = jnp.einsum("bse,ethd->bsthd", x.astype(kernel.dtype), kernel) + bias
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


class BertSelfAttention(nn.Module):
    """Multi-head self-attention with fp32 softmax; explicit einsums or jax.nn.dot_product_attention.

    ``attention_impl="splash"`` uses the Pallas TPU splash kernel (``bertjax.splash_attention``)
    with ``attention_segment_ids`` [batch, seq] (0 padding, 1..n sequences; not BERT's token-type
    segment ids) instead of ``bias``. Attention dropout > 0 in training falls back to the explicit path
    (neither kernel has dropout): on TPU set attention_dropout=0 to use splash.
    """

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        x: Array,
        bias: Array,
        *,
        deterministic: bool,
        attention_segment_ids: Array | None = None,
    ) -> Array:
        cfg = self.config
        dtype = _dtype(cfg.dtype)

        q, k, v = fused_qkv(cfg, x)  # [batch, seq, heads, head_dim]
        q = nn.with_logical_constraint(q, BATCH_LENGTH_HEADS_KV)
        k = nn.with_logical_constraint(k, BATCH_LENGTH_HEADS_KV)
        v = nn.with_logical_constraint(v, BATCH_LENGTH_HEADS_KV)
        use_dropout = cfg.attention_dropout > 0.0 and not deterministic
        if cfg.attention_impl == "xla" or use_dropout:
            scale = jnp.asarray(1.0 / jnp.sqrt(cfg.head_dim), dtype)
            logits = jnp.einsum("bqhd,bkhd->bhqk", q * scale, k).astype(jnp.float32)
            probs = jax.nn.softmax(logits + bias.astype(jnp.float32), axis=-1)  # [b, h, q, k]
            if use_dropout:
                probs = Dropout(cfg.attention_dropout, cfg.dropout_impl)(probs, deterministic=False)
            ctx = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(dtype), v)
        elif cfg.attention_impl == "splash":
            if attention_segment_ids is None:
                raise ValueError("attention_impl='splash' needs attention_segment_ids [batch, seq]")
            ctx = splash_attention(q, k, v, attention_segment_ids)  # [batch, seq, heads, head_dim]
        else:
            implementation = "cudnn" if cfg.attention_impl == "cudnn" else None
            ctx = jax.nn.dot_product_attention(
                q, k, v, bias=bias.astype(dtype), implementation=implementation
            )
        ctx = nn.with_logical_constraint(ctx, BATCH_LENGTH_HEADS_KV)
        out = HeadProjection(cfg, in_heads=True, name="output")(ctx)
        return nn.with_logical_constraint(out, BATCH_LENGTH_EMBED)  # [batch, seq, hidden]


class BertLayer(nn.Module):
    """One post-LN Transformer layer: x = LN(x + Attn(x)); x = LN(x + FFN(x))."""

    config: BertConfig

    @nn.compact
    def __call__(
        self, x: Array, bias: Array, deterministic: bool, attention_segment_ids: Array | None = None
    ) -> Array:
        cfg = self.config
        dtype, pdtype = _dtype(cfg.dtype), _dtype(cfg.param_dtype)
        drop = Dropout(cfg.hidden_dropout, cfg.dropout_impl)
        attn = BertSelfAttention(cfg, name="attention")(
            x, bias, deterministic=deterministic, attention_segment_ids=attention_segment_ids
        )
        x = layer_norm(cfg, "attention_norm")(x + drop(attn, deterministic=deterministic))
        h = nn.Dense(
            cfg.intermediate_size,
            dtype=dtype,
            param_dtype=pdtype,
            kernel_init=_init(cfg, ("embed", "mlp")),
            bias_init=_zeros(("mlp",)),
            name="intermediate",
        )(x)
        h = activation(cfg.hidden_act)(h)
        h = nn.with_logical_constraint(h, BATCH_LENGTH_MLP)  # [batch, seq, intermediate]
        h = nn.Dense(
            cfg.hidden_size,
            dtype=dtype,
            param_dtype=pdtype,
            kernel_init=_init(cfg, ("mlp", "embed")),
            bias_init=_zeros(("embed",)),
            name="output",
        )(h)
        x = layer_norm(cfg, "output_norm")(x + drop(h, deterministic=deterministic))
        return nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)


class _ScanLayer(BertLayer):
    """BertLayer with the (carry, xs) -> (carry, ys) signature nn.scan needs."""

    @nn.compact
    def __call__(  # type: ignore[override]
        self, x: Array, bias: Array, deterministic: bool, attention_segment_ids: Array | None = None
    ):
        return super().__call__(x, bias, deterministic, attention_segment_ids), None


def _remat(cls, policy: str):
    if policy == "none":
        return cls
    saveable = (
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        if policy == "dots"
        else jax.checkpoint_policies.nothing_saveable
    )
    # static_argnums counts self: (self, x, bias, deterministic, attention_segment_ids)
    return nn.remat(cls, policy=saveable, static_argnums=(3,))


class BertEncoder(nn.Module):
    """A stack of BertLayer, unrolled (``layer_{i}``) or scanned (``layers`` with a leading axis)."""

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        x: Array,
        bias: Array,
        *,
        deterministic: bool,
        output_hidden_states: bool = False,
        attention_segment_ids: Array | None = None,
    ):
        cfg = self.config
        if cfg.scan_layers:
            if output_hidden_states:
                raise ValueError("output_hidden_states needs scan_layers=False")
            scanned = nn.scan(
                _remat(_ScanLayer, cfg.remat),
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = scanned(cfg, name="layers")(x, bias, deterministic, attention_segment_ids)
            return x, ()
        layer_cls = _remat(BertLayer, cfg.remat)
        hidden_states = [x]
        for i in range(cfg.num_layers):
            x = layer_cls(cfg, name=f"layer_{i}")(x, bias, deterministic, attention_segment_ids)
            hidden_states.append(x)
        return x, tuple(hidden_states) if output_hidden_states else ()


@flax.struct.dataclass
class BertOutput:
    """Encoder outputs: sequence_output [batch, seq, hidden], pooled_output [batch, hidden]."""

    sequence_output: Array
    pooled_output: Array
    hidden_states: tuple = ()  # embeddings + every layer's output when asked


class BertModel(nn.Module):
    """The BERT encoder with its tanh pooler on ``[CLS]``.

    Packed rows (several sequences per row) pass ``pack_ids`` [batch, seq] (1..n: the sequence a
    token belongs to, 0 = padding; attention becomes block diagonal, ``attention_mask`` is unused) and
    ``position_ids`` [batch, seq] restarting at 0 per sequence. ``pool_positions`` [batch, k] applies
    the pooler at those positions (each packed sequence's [CLS]): pooled_output [batch, k, hidden].
    """

    config: BertConfig
    add_pooler: bool = True

    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        token_type_ids: Array | None = None,
        attention_mask: Array | None = None,
        *,
        deterministic: bool = True,
        output_hidden_states: bool = False,
        position_ids: Array | None = None,
        pack_ids: Array | None = None,
        pool_positions: Array | None = None,
    ) -> BertOutput:
        cfg = self.config
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        x = BertEmbeddings(cfg, name="embeddings")(
            input_ids, token_type_ids, deterministic=deterministic, position_ids=position_ids
        )
        bias = attention_bias(attention_mask, jnp.float32, pack_ids)
        # [batch, seq] ids for the splash kernel: 0 at padding, 1 (or the pack id) at real tokens
        attention_segment_ids = None
        if cfg.attention_impl == "splash":
            attention_segment_ids = segment_ids_from_mask(attention_mask, pack_ids)
        x, hidden = BertEncoder(cfg, name="encoder")(
            x,
            bias,
            deterministic=deterministic,
            output_hidden_states=output_hidden_states,
            attention_segment_ids=attention_segment_ids,
        )
        pooled = None
        if self.add_pooler:
            pooled = nn.Dense(
                cfg.hidden_size,
                dtype=_dtype(cfg.dtype),
                param_dtype=_dtype(cfg.param_dtype),
                kernel_init=_init(cfg, ("embed", "embed_out")),
                bias_init=_zeros(("embed_out",)),
                name="pooler",
            )(x[:, 0] if pool_positions is None else gather_positions(x, pool_positions))
            pooled = jnp.tanh(pooled)  # [batch, hidden], or [batch, k, hidden] at pool_positions
        return BertOutput(sequence_output=x, pooled_output=pooled, hidden_states=hidden)


def output_dense(config: BertConfig, features: int, name: str) -> nn.Dense:
    """A float32 output layer [embed] -> [features] (NSP and task heads), logically named."""
    return nn.Dense(
        features,
        dtype=jnp.float32,
        param_dtype=_dtype(config.param_dtype),
        kernel_init=_init(config, ("embed", "classes")),
        bias_init=_zeros(("classes",)),
        name=name,
    )


def gather_positions(sequence: Array, positions: Array) -> Array:
    """[batch, seq, hidden] gathered at positions [batch, k] -> [batch, k, hidden]."""
    return jnp.take_along_axis(sequence, positions[..., None].astype(jnp.int32), axis=1)


class MaskedLMHead(nn.Module):
    """Dense + activation + LayerNorm transform, decoder tied to the word embeddings, output bias."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: Array, word_embeddings: Array) -> Array:
        cfg = self.config
        dtype = _dtype(cfg.dtype)
        x = nn.Dense(
            cfg.hidden_size,
            dtype=dtype,
            param_dtype=_dtype(cfg.param_dtype),
            kernel_init=_init(cfg, ("embed", "embed_out")),
            bias_init=_zeros(("embed_out",)),
            name="dense",
        )(x)
        x = activation(cfg.hidden_act)(x)
        x = layer_norm(cfg, "LayerNorm")(x)
        output_bias = self.param("output_bias", _zeros(("vocab",)), (cfg.vocab_size,))
        return fast_ops.tied_decoder(x, word_embeddings.astype(dtype), output_bias)  # [..., vocab]


class BertForPreTraining(nn.Module):
    """BERT with the masked-LM head (at chosen positions) and the next-sentence head."""

    config: BertConfig
    nsp: bool = True

    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        token_type_ids: Array | None = None,
        attention_mask: Array | None = None,
        masked_lm_positions: Array | None = None,
        *,
        deterministic: bool = True,
        position_ids: Array | None = None,
        pack_ids: Array | None = None,
    ) -> dict[str, Array]:
        """Returns mlm_logits [batch, k or seq, vocab] and nsp_logits [batch, 2] plus encoder outputs.

        ``masked_lm_positions`` [batch, k] evaluates the MLM head only there (the training path); None
        evaluates every position. ``position_ids`` / ``pack_ids`` [batch, seq] describe packed rows
        (see BertModel); positions are then row-global.
        """
        cfg = self.config
        bert = BertModel(cfg, name="bert")
        out = bert(
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
        word_embeddings = bert.variables["params"]["embeddings"]["word_embeddings"]["embedding"]
        word_embeddings = nn.meta.unbox(word_embeddings)
        transform = MaskedLMHead(cfg, name="predictions")
        result = {
            "sequence_output": out.sequence_output,
            "pooled_output": out.pooled_output,
            "mlm_logits": transform(seq, word_embeddings),
        }
        if self.nsp:
            result["nsp_logits"] = output_dense(cfg, 2, "seq_relationship")(
                out.pooled_output.astype(jnp.float32)
            )
        return result

"""Building blocks every architecture shares: initialisers with logical axis names, activations,
LayerNorm with fp32 statistics, attention masks, output layers and position gathers.

The functions that take a ``config`` read only the fields every model config has
(``initializer_range``, ``dtype``, ``param_dtype``); see ``bertjax.models``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any, ClassVar

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from bertjax.layers import fast_ops
from bertjax.layers.dropout import DROPOUT_IMPLS

Array = jax.Array

# Activation sharding: batch over data+fsdp, heads/mlp/vocab over tensor, the rest replicated.
BATCH_LENGTH_EMBED = ("batch", "length", "act_embed")
BATCH_LENGTH_HEADS_KV = ("batch", "length", "act_heads", "kv")
BATCH_LENGTH_MLP = ("batch", "length", "act_mlp")

ATTENTION_IMPLS = ("auto", "xla", "dot_product", "cudnn", "splash")
REMAT_POLICIES = ("none", "dots", "full")
DTYPES = ("float32", "bfloat16", "float16")
# Hugging Face's ACT2FN names with no parameters (prelu and xielu have learned ones).
ACTIVATIONS = (
    "gelu",
    "gelu_new",
    "gelu_tanh",
    "gelu_pytorch_tanh",
    "relu",
    "silu",
    "swish",
    "gelu_10",
    "gelu_accurate",
    "gelu_fast",
    "gelu_python",
    "gelu_python_tanh",
    "hardswish",
    "laplace",
    "leaky_relu",
    "linear",
    "mish",
    "quick_gelu",
    "relu2",
    "relu6",
    "sigmoid",
    "sqrtsoftplus",
    "tanh",
)


def dtype_of(name: str) -> Any:
    return jnp.dtype(name)


def normal_init(config, names: tuple[str | None, ...]):
    """Truncated-normal(initializer_range) initializer carrying logical axis names."""
    base = nn.initializers.truncated_normal(stddev=config.initializer_range)
    return nn.with_logical_partitioning(base, names)


def zeros_init(names: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def ones_init(names: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.ones_init(), names)


def _gelu_fast(x: Array) -> Array:  # HF FastGELUActivation
    return 0.5 * x * (1.0 + jnp.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _laplace(x: Array) -> Array:  # HF LaplaceActivation (mu=0.707107, sigma=0.282095)
    return 0.5 * (1.0 + jax.lax.erf((x - 0.707107) / (0.282095 * math.sqrt(2.0))))


def activation(name: str):
    """The activation a model config names: Hugging Face's ``ACT2FN`` names and formulas."""
    tanh_gelu = functools.partial(nn.gelu, approximate=True)
    return {
        "gelu": fast_ops.gelu,  # exact (erf) GELU; its backward reuses the forward's Phi(x)
        "gelu_python": fast_ops.gelu,
        "gelu_10": lambda x: jnp.clip(fast_ops.gelu(x), -10.0, 10.0),
        "gelu_new": tanh_gelu,
        "gelu_tanh": tanh_gelu,
        "gelu_pytorch_tanh": tanh_gelu,
        "gelu_python_tanh": tanh_gelu,
        "gelu_accurate": tanh_gelu,
        "gelu_fast": _gelu_fast,
        "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
        "relu": nn.relu,
        "relu2": lambda x: jnp.square(nn.relu(x)),
        "relu6": jax.nn.relu6,
        "leaky_relu": functools.partial(jax.nn.leaky_relu, negative_slope=0.01),
        "silu": nn.silu,
        "swish": nn.silu,
        "hardswish": jax.nn.hard_swish,
        "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x)),
        "sigmoid": jax.nn.sigmoid,
        "tanh": jnp.tanh,
        "sqrtsoftplus": lambda x: jnp.sqrt(jax.nn.softplus(x)),
        "laplace": _laplace,
        "linear": lambda x: x,
    }[name]


def layer_norm(
    config, name: str, *, epsilon: float, use_bias: bool = True, exact_variance: bool = False
) -> nn.Module:
    """LayerNorm with fp32 statistics, outputs in the compute dtype.

    The variance is Flax's fast ``E[x^2] - E[x]^2`` unless ``exact_variance``: then
    ``E[(x - E[x])^2]`` as PyTorch computes it (one more pass; the fast form loses every digit
    when the mean dwarfs the spread, e.g. a few features with a large common offset). The exact
    form is :class:`LayerNorm`, whose gradient keeps the statistics: autodiff made XLA's GPU
    compiler recompute both passes in the backward (modernbert-base on an H100, roofline: 55.3 ->
    53.9 ms a step at 32 x 1024). The fast form stays Flax's: XLA fuses its autodiff better
    (BERT-base: 34.1 ms, 34.9 with :class:`LayerNorm`)."""
    kwargs = dict(
        epsilon=epsilon,
        use_bias=use_bias,
        dtype=dtype_of(config.dtype),
        param_dtype=dtype_of(config.param_dtype),
        name=name,
    )
    if exact_variance:
        return LayerNorm(exact_variance=True, **kwargs)
    return nn.LayerNorm(
        use_fast_variance=True,
        scale_init=ones_init(("norm",)),
        bias_init=zeros_init(("norm",)),
        **kwargs,
    )


class LayerNorm(nn.Module):
    """``flax.linen.LayerNorm`` over the last axis (the same parameters ``scale`` and ``bias``
    [features], named ``("norm",)``, and the same forward values), with the hand-written gradient
    of :func:`bertjax.layers.fast_ops.layer_norm`."""

    epsilon: float
    use_bias: bool = True
    exact_variance: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array, add: Array | None = None) -> Array | tuple[Array, Array]:
        """The norm of ``x``; given ``add``, ``(x + add, the norm of x + add)`` with one backward
        for the sum and its norm (:func:`bertjax.layers.fast_ops.add_layer_norm`)."""
        features = (x.shape[-1],)
        scale = self.param("scale", ones_init(("norm",)), features, self.param_dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", zeros_init(("norm",)), features, self.param_dtype)
        kwargs = dict(epsilon=self.epsilon, exact_variance=self.exact_variance, dtype=self.dtype)
        if add is not None:
            return fast_ops.add_layer_norm(x, add, scale, bias, **kwargs)
        return fast_ops.layer_norm(x, scale, bias, **kwargs)


def dense(config, features: int, names: tuple[str, str], name: str, use_bias: bool = True):
    """A Dense layer in the compute dtype with logically named kernel [in, out] and bias [out]."""
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=dtype_of(config.dtype),
        param_dtype=dtype_of(config.param_dtype),
        kernel_init=normal_init(config, names),
        bias_init=zeros_init(names[1:]),
        dot_general=fast_ops.dense_dot_general,  # bf16: fp32 accumulation, also in the backward
        name=name,
    )


class Linear(nn.Module):
    """``x [..., *in] -> [..., *out]`` with a kernel [*in, *out] whose axes have logical names;
    ``num_in`` leading kernel axes are contracted, the bias (if any) is [*out]. The kernel is
    truncated-normal(``std``, default the config's ``initializer_range``), the bias zero."""

    config: Any
    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    num_in: int = 1
    use_bias: bool = False
    std: float | None = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        pdtype, dtype = dtype_of(cfg.param_dtype), dtype_of(cfg.dtype)
        std = cfg.initializer_range if self.std is None else self.std
        init = nn.with_logical_partitioning(
            nn.initializers.truncated_normal(stddev=std), self.names
        )
        kernel = self.param("kernel", init, self.shape, pdtype)
        y = fast_ops.contract(x.astype(dtype), kernel.astype(dtype), self.num_in)
        if self.use_bias:
            out_shape, out_names = self.shape[self.num_in :], self.names[self.num_in :]
            y = y + self.param("bias", zeros_init(out_names), out_shape, pdtype).astype(dtype)
        return y


class RMSNorm(nn.Module):
    """Root-mean-square norm as transformers' Llama-style ``RMSNorm``: ``x / sqrt(mean(x^2) +
    eps)`` in float32, cast back to the input dtype, times ``scale`` [hidden] (ones at init)."""

    config: Any
    epsilon: float

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param(
            "scale", ones_init(("norm",)), (x.shape[-1],), dtype_of(self.config.param_dtype)
        )
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.epsilon)
        return scale.astype(dtype_of(self.config.dtype)) * y.astype(x.dtype)


def pool_members(
    input_mask: Array, pack_ids: Array | None, pool_positions: Array | None
) -> tuple[Array, Array]:
    """(positions [batch, k], members [batch, k, seq] bool) of a pooler: ``pool_positions`` (None:
    position 0 of every row, k = 1) and the tokens each pooled mean there averages: the row's real
    tokens, or with ``pack_ids`` and ``pool_positions`` the tokens of the packed sequence there."""
    batch, seq_len = input_mask.shape
    if pool_positions is None:
        positions = jnp.zeros((batch, 1), jnp.int32)
    else:
        positions = pool_positions
    if pack_ids is not None and pool_positions is not None:
        ids = jnp.take_along_axis(pack_ids, positions, axis=1)  # [batch, k]
        return positions, pack_ids[:, None, :] == ids[:, :, None]  # [batch, k, seq]
    tokens = input_mask if pack_ids is None else pack_ids
    members = jnp.broadcast_to((tokens > 0)[:, None, :], (batch, positions.shape[1], seq_len))
    return positions, members


def tanh_pooler(config, x: Array, pool_positions: Array | None, name: str) -> Array:
    """BERT's pooler: a Dense [hidden, hidden] (``name``) and tanh on the first token of every row
    ([batch, hidden]) or at ``pool_positions`` [batch, k] ([batch, k, hidden]). Call inside a
    compact module."""
    first = x[:, 0] if pool_positions is None else gather_positions(x, pool_positions)
    return jnp.tanh(dense(config, config.hidden_size, ("embed", "embed_out"), name)(first))


def output_dense(config, features: int, name: str) -> nn.Dense:
    """A float32 output layer [embed] -> [features] (NSP and task heads), logically named."""
    return nn.Dense(
        features,
        dtype=jnp.float32,
        param_dtype=dtype_of(config.param_dtype),
        kernel_init=normal_init(config, ("embed", "classes")),
        bias_init=zeros_init(("classes",)),
        name=name,
    )


# A model's inputs are named as its training batches' keys: input_ids, segment_ids, input_mask.
# bertjax 0.4 called the last two token_type_ids and attention_mask; for one release those names
# are a one-line error naming the new ones.
RENAMED_INPUTS = {"token_type_ids": "segment_ids", "attention_mask": "input_mask"}


def refuse_renamed_inputs(kwargs: dict[str, Any]) -> None:
    """A TypeError naming the new keyword for an input keyword bertjax 0.5 renamed."""
    for old, new in RENAMED_INPUTS.items():
        if old in kwargs:
            raise TypeError(
                f"{old}= is now {new}= (bertjax 0.5 names a model's inputs as its batches are "
                "named: input_ids, segment_ids, input_mask)"
            )


def model_inputs(call):
    """Decorates a model's ``__call__`` (above ``nn.compact``): :func:`refuse_renamed_inputs`."""

    @functools.wraps(call)
    def checked(self, *args, **kwargs):
        refuse_renamed_inputs(kwargs)
        return call(self, *args, **kwargs)

    return checked


def attention_bias(input_mask: Array, dtype: Any, pack_ids: Array | None = None) -> Array:
    """[batch, seq] 0/1 mask (or [batch, q, k]) -> additive bias [batch, 1, q or 1, k] (fp32 softmax).

    With ``pack_ids`` [batch, seq] (packed rows: 1..n per sequence, 0 = padding) the mask is block
    diagonal and ``input_mask`` is not read: a real token attends exactly to the tokens of its own
    sequence. Padding tokens attend to each other (their outputs are never read), so no query row is
    fully masked (which would be NaN where the bias rounds to -inf, e.g. in bfloat16).
    """
    if pack_ids is not None:
        input_mask = pack_ids[:, :, None] == pack_ids[:, None, :]  # [batch, q, k]
    if input_mask.ndim == 2:
        allowed = input_mask[:, None, None, :]
    else:
        allowed = input_mask[:, None, :, :]
    return jnp.where(allowed > 0, 0.0, jnp.finfo(dtype).min).astype(dtype)


def embed_table(config, num: int, names: tuple[str | None, str], name: str) -> nn.Embed:
    """An embedding table [num, hidden] (normal(initializer_range), logically named), read with
    :func:`embedding_lookup`."""
    return nn.Embed(
        num,
        config.hidden_size,
        dtype=dtype_of(config.dtype),
        param_dtype=dtype_of(config.param_dtype),
        embedding_init=normal_init(config, names),
        name=name,
    )


def embedding_lookup(table: nn.Embed, ids: Array) -> Array:
    """``table``'s rows at ``ids`` [...] -> [..., features] in its compute dtype.

    Equal to ``table(ids)``, but the rows are gathered in the parameter dtype and cast afterwards,
    so the gradient is a scatter-add in fp32 rather than in bf16: on a GPU a bf16 scatter-add is a
    compare-and-swap loop, and with many tokens per row it dominated a bf16 BERT-base step on an
    H100 (docs/performance.md). A table of a few rows (token types) is read by a select per row
    instead: its gradient is then a reduction, with no scatter at all.
    """
    weights = table.embedding  # [rows, features], the parameter dtype
    if weights.shape[0] <= 16:
        rows = [jnp.where((ids == r)[..., None], weights[r], 0) for r in range(weights.shape[0])]
        return sum(rows[1:], rows[0]).astype(table.dtype)
    return jnp.take(weights, ids, axis=0).astype(table.dtype)


def gather_positions(sequence: Array, positions: Array) -> Array:
    """[batch, seq, hidden] gathered at positions [batch, k] -> [batch, k, hidden].

    As a product with the positions' one-hot rows: exact (one term of each sum is ``1 * x``, at
    full precision), and its gradient is the transposed product, where ``take_along_axis``'s is a
    scatter-add whose indices collide (repeated padding positions), which on a GPU ran as a
    slow bf16 scatter (``bertjax compile --topology=h100`` lists the program's scatters)."""
    one_hot = positions[..., None].astype(jnp.int32) == jnp.arange(sequence.shape[1])
    return jnp.einsum(
        "bks,bsh->bkh",
        one_hot.astype(sequence.dtype),
        sequence,
        precision=jax.lax.Precision.HIGHEST,
    )


def remat(cls, policy: str, static_argnums: tuple[int, ...]):
    """``cls`` rematerialised per call: none | dots (save matmuls) | full (save nothing)."""
    if policy == "none":
        return cls
    saveable = (
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        if policy == "dots"
        else jax.checkpoint_policies.nothing_saveable
    )
    return nn.remat(cls, policy=saveable, static_argnums=static_argnums)


@functools.cache
def _carried(layer_cls):
    """``layer_cls`` with the ``(carry, *xs) -> (carry, ys)`` signature nn.scan needs."""

    class Carried(layer_cls):
        @nn.compact
        def __call__(self, x, *args):  # type: ignore[override]
            return super().__call__(x, *args), None

    Carried.__name__ = Carried.__qualname__ = f"Scanned{layer_cls.__name__}"
    return Carried


def layer_stack(
    layer_cls,
    config,
    x: Array,
    *args,
    static_argnums: tuple[int, ...],
    options: dict[str, Any] | None = None,
    output_hidden_states: bool = False,
) -> tuple[Array, tuple[Array, ...]]:
    """``config.num_layers`` identical layers ``layer_cls(config, **options)``, each called as
    ``layer(x, *args) -> x`` and rematerialised as ``config.remat`` says (``static_argnums``
    counts self: the position of ``deterministic``). Returns the last output and, with
    ``output_hidden_states``, the input followed by every layer's output.

    Unrolled, layer ``i`` is the submodule ``layer_{i}``. With ``config.scan_layers`` one nn.scan
    named ``layers`` runs them: every parameter gets a leading axis (logical name ``layers``), each
    layer its own params and dropout keys, ``args`` are shared by all (broadcast); it keeps no
    hidden states (``output_hidden_states`` is then a ValueError)."""
    options = options or {}
    if config.scan_layers:
        if output_hidden_states:
            raise ValueError("output_hidden_states needs scan_layers=False")
        scanned = nn.scan(
            remat(_carried(layer_cls), config.remat, static_argnums),
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(nn.broadcast,) * len(args),
            length=config.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, _ = scanned(config, **options, name="layers")(x, *args)
        return x, ()
    layer_cls = remat(layer_cls, config.remat, static_argnums)
    hidden_states = [x]
    for i in range(config.num_layers):
        x = layer_cls(config, **options, name=f"layer_{i}")(x, *args)
        hidden_states.append(x)
    return x, tuple(hidden_states) if output_hidden_states else ()


def config_error(config, key: str, why: str) -> ValueError:
    """The one-line error for a bad model config field: ``model config: KEY=VALUE WHY``."""
    return ValueError(f"model config: {key}={getattr(config, key)!r} {why}")


def check_common_fields(config, positive: tuple[str, ...] = ()) -> None:
    """Validates the fields every model config shares, and the family's own ``positive`` fields
    (each must be > 0); a ValueError names the key."""

    def bad(key, why):
        raise config_error(config, key, why)

    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size"):
        if getattr(config, key) <= 0:
            bad(key, "must be positive")
    if config.hidden_size % config.num_heads:
        bad("hidden_size", f"is not divisible by num_heads={config.num_heads}")
    if config.hidden_act not in ACTIVATIONS:
        bad("hidden_act", f"is not one of {ACTIVATIONS}")
    if config.attention_impl not in ATTENTION_IMPLS:
        bad("attention_impl", f"is not one of {ATTENTION_IMPLS}")
    if config.dropout_impl not in DROPOUT_IMPLS:
        bad("dropout_impl", f"is not one of {DROPOUT_IMPLS}")
    if config.remat not in REMAT_POLICIES:
        bad("remat", f"is not one of {REMAT_POLICIES}")
    for key in ("dtype", "param_dtype"):
        if getattr(config, key) not in DTYPES:
            bad(key, f"is not one of {DTYPES}")
    for key in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(config, key) < 1.0:
            bad(key, "must be in [0, 1)")
    for key in positive:
        if getattr(config, key) <= 0:
            bad(key, "must be positive")


@flax.struct.dataclass
class EncoderOutput:
    """Encoder outputs: sequence_output [batch, seq, hidden], pooled_output [batch, hidden] (or
    [batch, k, hidden] at pool positions; None without a pooler), hidden_states when asked."""

    sequence_output: Array
    pooled_output: Array
    hidden_states: tuple = ()  # embeddings + every layer's output when asked


class EncoderConfig:
    """What every architecture's frozen config dataclass shares (mixed in): the head size, copies
    with changes, and the dict/JSON form with its ``architecture``."""

    architecture: ClassVar[str]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def replace(self, **changes: Any):
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": self.architecture, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        """Builds a config from a dict (``architecture`` ignored); unknown keys are an error."""
        values = {k: v for k, v in values.items() if k != "architecture"}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"model config: unknown keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)

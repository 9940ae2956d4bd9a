"""Multi-head attention pieces shared by the encoders: head-shaped projections and the attention
kernel switch (explicit einsums, ``jax.nn.dot_product_attention`` / cuDNN, Pallas splash on TPU).
"""

from __future__ import annotations

import functools
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bertjax.layers import fast_ops
from bertjax.layers.band_attention import band_applies, band_attention
from bertjax.layers.core import dtype_of, normal_init, zeros_init
from bertjax.layers.dropout import Dropout
from bertjax.layers.platform import current_platform
from bertjax.layers.splash_attention import splash_attention

Array = jax.Array


class HeadProjection(nn.Module):
    """A kernel with head axes: [embed] -> [heads, kv] (``in_heads=False``) or back (True).

    Written with explicit params because nn.DenseGeneral initialises a flattened kernel, which
    breaks the 3-axis logical partitioning of attention kernels.
    """

    config: object
    in_heads: bool = False
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: Array | None) -> Array | tuple[Array, Array | None]:
        """The projection of ``x``, or (kernel, bias) in the compute dtype when ``x`` is None."""
        cfg = self.config
        pdtype, dtype = dtype_of(cfg.param_dtype), dtype_of(cfg.dtype)
        h, n = cfg.hidden_size, cfg.num_heads
        d = h // n
        if self.in_heads:
            kernel = self.param(
                "kernel", normal_init(cfg, ("heads", "kv", "embed")), (n, d, h), pdtype
            )
            bias_shape, bias_names = (h,), ("embed",)
        else:
            kernel = self.param(
                "kernel", normal_init(cfg, ("embed", "heads", "kv")), (h, n, d), pdtype
            )
            bias_shape, bias_names = (n, d), ("heads", "kv")
        bias = None
        if self.use_bias:
            bias = self.param("bias", zeros_init(bias_names), bias_shape, pdtype).astype(dtype)
        kernel = kernel.astype(dtype)
        if x is None:
            return kernel, bias
        spec = "bshd,hde->bse" if self.in_heads else "bse,ehd->bshd"
        y = fast_ops.einsum(spec, x.astype(dtype), kernel)
        return y if bias is None else y + bias


# What ``attention_impl="auto"`` is on each platform (see :func:`resolve_impl`).
AUTO_IMPLS = {"cpu": "xla", "gpu": "cudnn", "cuda": "cudnn", "rocm": "dot_product", "tpu": "splash"}


def resolve_impl(impl: str, platform: str | None = None, dtype=None) -> str:
    """``auto`` -> the attention path for ``platform`` (default: JAX's default backend) and the
    compute ``dtype`` (default: bf16/fp16).

    CPU: ``xla`` (explicit einsums; sliding windows by blocks of the band). NVIDIA GPU: ``cudnn``
    fused attention for global layers, the band blocks for sliding-window layers (memory and time
    grow with seq x window, packed rows included); cuDNN takes fp16/bf16 only, so fp32 gets
    ``xla``. TPU: the Pallas ``splash`` kernel (its ``LocalMask`` skips the blocks outside a
    window). Other names are returned unchanged.
    """
    if impl != "auto":
        return impl
    platform = platform or current_platform()
    chosen = AUTO_IMPLS.get(platform, "xla")
    if chosen == "cudnn" and dtype is not None and jnp.dtype(dtype).itemsize > 2:
        return "xla"
    return chosen


def attend(
    q: Array,
    k: Array,
    v: Array,
    bias: Array,
    *,
    impl: str,
    dropout_rate: float,
    dropout_impl: str,
    deterministic: bool,
    segment_ids: Array | None = None,
    local_window: int = 0,
    kernel_seed: int = 0,
) -> Array:
    """Softmax attention of q/k/v [batch, seq, heads, head_dim] -> [batch, seq, heads, head_dim].

    ``bias`` [batch, 1, q|1, k] is additive (fp32 softmax). ``impl``: ``xla`` explicit einsums
    (the reference), ``dot_product``/``cudnn`` = ``jax.nn.dot_product_attention``, ``splash`` =
    the Pallas TPU kernel with ``segment_ids`` [batch, seq] instead of ``bias``. Attention dropout
    in training falls back to the explicit path (no kernel has dropout). ``local_window`` > 0
    restricts every query to keys with ``|i - j| <= local_window // 2`` (sliding-window layers):
    ``xla`` adds it to the bias; ``dot_product`` passes ``local_window_size`` (jax masks inside);
    ``splash`` uses a ``LocalMask`` kernel, which skips the key blocks outside the band;
    ``cudnn`` has no two-sided window (jax raises for one): there, and on the explicit path, a
    window whose half tiles the sequence (``band_applies``) is computed by blocks of the band
    (``band_attention``; packed rows read ``segment_ids`` on the band, never a [q, k] mask; on
    ``cudnn`` every query block is one small fused attention over its three key blocks), and
    any other window joins the bias of a full product. ``auto`` is :func:`resolve_impl`'s choice
    for the platform. Call inside a compact module (the dropout submodule is created there).

    ``dropout_impl="kernel"`` keeps attention dropout inside cuDNN's fused kernel (global layers
    and the band blocks of sliding-window layers; see :func:`cudnn_dropout_attention`), seeded by
    ``kernel_seed``; the other dropouts draw as ``flax``.
    """
    impl = resolve_impl(impl, dtype=q.dtype)
    dtype = q.dtype
    head_dim = q.shape[-1]
    use_dropout = dropout_rate > 0.0 and not deterministic
    half = local_window // 2
    kernel_dropout = use_dropout and dropout_impl == "kernel"
    if kernel_dropout:
        check_kernel_dropout(impl, current_platform(), dtype)
        if not local_window:
            return cudnn_dropout_attention(q, k, v, bias, dropout_rate, kernel_seed)
    explicit = impl == "xla" or use_dropout
    banded = explicit or impl == "cudnn"
    if local_window and banded and bias is not None and band_applies(q.shape[1], half):
        # The band by blocks (bertjax.layers.band_attention): no full [q, k] matrix; on cuDNN
        # each query block is one small fused attention over its three key blocks.
        per_query = bias.shape[2] != 1  # packed rows: the band from the ids, when given
        ids = segment_ids if per_query else None
        if kernel_dropout:
            fused = functools.partial(cudnn_dropout_attention, rate=dropout_rate, seed=kernel_seed)
            return band_attention(q, k, v, bias, half, segment_ids=ids, fused=fused)
        if impl == "cudnn" and not use_dropout:
            return band_attention(q, k, v, bias, half, segment_ids=ids, fused=cudnn_attention)
        dropout = None
        if use_dropout:
            module = Dropout(dropout_rate, dropout_impl)
            dropout = lambda p: module(p, deterministic=False)  # noqa: E731
        return band_attention(q, k, v, bias, half, dropout, segment_ids=ids)
    if local_window and (impl in ("xla", "cudnn") or use_dropout):
        pos = jnp.arange(q.shape[1])
        near = jnp.abs(pos[:, None] - pos[None, :]) <= half  # [q, k]
        bias = jnp.where(near, bias.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    if impl == "xla" or use_dropout:
        scale = jnp.asarray(1.0 / jnp.sqrt(head_dim), dtype)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q * scale, k).astype(jnp.float32)
        probs = jax.nn.softmax(logits + bias.astype(jnp.float32), axis=-1)  # [b, h, q, k]
        if use_dropout:
            probs = Dropout(dropout_rate, dropout_impl)(probs, deterministic=False)
        return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(dtype), v)
    if impl == "splash":
        if segment_ids is None:
            raise ValueError("attention_impl='splash' needs attention segment ids [batch, seq]")
        # A sliding window is the kernel's LocalMask: the blocks outside the band are skipped.
        return splash_attention(q, k, v, segment_ids, local_window=local_window)
    if impl == "cudnn":
        return cudnn_attention(q, k, v, bias)
    window = (half, half) if local_window else None
    return jax.nn.dot_product_attention(q, k, v, bias=bias.astype(dtype), local_window_size=window)


def cudnn_attention(q: Array, k: Array, v: Array, bias: Array) -> Array:
    """cuDNN's fused attention (``__cudnn$fmhaScaleBiasSoftmax``) of q [b, t, heads, dim] and
    k/v [b, s, heads, dim] with the additive ``bias`` [b, 1, 1 or t, s]."""
    # cuDNN takes a bias with the query axis ([b, 1, 1, k] padding masks raise there).
    b, t = q.shape[:2]
    full = jnp.broadcast_to(bias.astype(q.dtype), (b, 1, t, k.shape[1]))
    return jax.nn.dot_product_attention(q, k, v, bias=full, implementation="cudnn")


def check_kernel_dropout(impl: str, platform: str, dtype) -> None:
    """``dropout_impl="kernel"`` runs only where training attention is cuDNN's: else one line
    naming the key (a dropout setting the run would ignore is an error)."""
    if impl != "cudnn":
        raise ValueError(
            f"config key model.dropout_impl=kernel (attention dropout inside cuDNN's kernel) "
            f"needs cuDNN attention: model.attention_impl is {impl!r} on {platform} in "
            f"{jnp.dtype(dtype).name} (auto picks cudnn on an NVIDIA GPU in bfloat16/float16)"
        )


def kernel_seed(module: nn.Module) -> int:
    """A fused kernel's static dropout seed for a module: a hash of its path (``encoder/layer_3/
    attention``), so that every layer draws its own masks."""
    return zlib.crc32("/".join(module.scope.path).encode()) & 0x7FFFFFFF


def cudnn_dropout_attention(
    q: Array, k: Array, v: Array, bias: Array, rate: float, seed: int
) -> Array:
    """cuDNN's fused attention with dropout inside the kernel (``__cudnn$fmhaScaleBiasSoftmax
    Dropout`` and its backward): no [batch, heads, q, k] probabilities or mask in memory.

    The masks come from cuDNN's Philox stream: ``seed`` (static, one per layer) and an offset that
    XLA's runtime advances at every call, so they change from step to step and the backward
    regenerates the forward's, but they do not come from the run's key: a run restarted from a
    checkpoint draws other masks than the uninterrupted run (the explicit path, dropout_impl
    ``flax`` or ``bits16``, reproduces a run exactly). ``jax.nn.dot_product_attention`` has no
    dropout argument: this calls JAX's cuDNN wrapper, which does."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # not exported by jax.nn

    b, s = q.shape[:2]
    full = jnp.broadcast_to(bias.astype(q.dtype), (b, 1, s, k.shape[1]))
    return cudnn.dot_product_attention(
        q,
        k,
        v,
        bias=full,
        scale=float(1.0 / np.sqrt(q.shape[-1])),
        seed=int(seed) & 0x7FFFFFFF,
        dropout_rate=float(rate),
        qkv_layout="BTNH",
    )


def sees_a_key(input_mask: Array, half: int | None) -> Array:
    """[batch, seq, 1, 1] float32: 1 where a query has an unmasked key (within ``half`` positions
    of it in sliding-window layers; anywhere when ``half`` is None), else 0.

    Only padding queries far from every token (or rows of padding alone) see none. transformers'
    default attention (PyTorch SDPA) gives such a fully masked row a zero context (its eager
    attention averages every value instead), so their outputs match SDPA's with this mask."""
    m = (input_mask > 0).astype(jnp.int32)  # [batch, seq]
    seq = m.shape[1]
    if half is None:
        seen = jnp.broadcast_to(m.max(axis=1, keepdims=True), m.shape)
    else:
        total = jnp.pad(jnp.cumsum(m, axis=1), ((0, 0), (1, 0)))  # total[:, j] = sum(m[:, :j])
        pos = np.arange(seq)
        hi, lo = np.minimum(pos + half + 1, seq), np.maximum(pos - half, 0)
        seen = total[:, hi] - total[:, lo]  # tokens within the window
    return (seen > 0).astype(jnp.float32)[:, :, None, None]

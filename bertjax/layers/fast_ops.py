"""Ops of the model with hand-written gradients: the same numbers as autodiff, computed in the
order XLA (notably XLA CPU) runs fastest. Each has an equality test in tests/test_fast_ops.py.

* :func:`tied_decoder` - the MLM decoder ``x @ E^T + b`` against the tied word embeddings. Autodiff
  gives ``dE = g^T x`` as a transposed copy of the [predictions, vocab] cotangent followed by a
  product, and ``db = sum(g)`` as a row reduction (YNNPACK's reduction on XLA CPU: 86 ms of a 4 s
  BERT-small step); here ``dE`` is one ``dot_general`` contracting the predictions axis and ``db``
  a [1, n] x [n, vocab] product.
* :func:`decoder_nll` - the decoder and the softmax cross-entropy at the labels in one op, the
  vocabulary a chunk at a time (forward: an online log-sum-exp; backward: each chunk's logits
  recomputed): no [predictions, vocab] logits or gradient buffer exists, only one chunk's. With a
  256,000-token vocabulary (mmBERT) that buffer was the step's largest temporary.
* :func:`gelu` - exact (erf) GELU that keeps ``Phi(x)`` from the forward pass, so the backward
  pass needs one ``exp`` instead of re-evaluating XLA's erf (a rational polynomial with divides):
  3.16-3.36 s vs 3.29-3.88 s per BERT-small step in three alternating pairs of runs.
* :func:`layer_norm` - LayerNorm with fp32 statistics, the forward of ``flax.linen.LayerNorm``
  op for op; the backward keeps the per-row mean and ``1/std`` (behind an optimization barrier,
  so XLA cannot fold them back into the backward) and computes
  ``dx = rstd (g - mean(g) - xhat mean(g xhat))`` with ``g = dy * scale``. With PyTorch's
  two-pass variance, autodiff made XLA's GPU compiler recompute both passes inside the backward
  and write an fp32 [tokens, hidden] product for the scale's gradient: per norm 9 passes over
  [tokens, hidden] in the backward, 5 here. :func:`add_layer_norm` is a pre-LN block's
  ``x + delta`` and its norm, whose backward adds the residual's gradient in the same pass.
* :func:`einsum` - a two-operand einsum that, on CPU, accumulates in fp32 when its operands are
  bf16, forward and backward. XLA CPU's matmul library runs bf16 x bf16 -> fp32 at twice its fp32
  rate, but a product with a bf16 result, and autodiff's backward products (which upcast the
  operands), run as fp32 matmuls: modernbert-base's bf16 step was slower than its fp32 step.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


def tied_decoder(x: Array, embeddings: Array, bias: Array) -> Array:
    """Logits [..., vocab] fp32 = x [..., hidden] @ embeddings [vocab, hidden]^T + bias [vocab].
    bf16 operands on CPU: every product accumulates in fp32 (see :func:`einsum`)."""
    mixed = functools.partial(_tied_decoder, mixed=True)
    plain = functools.partial(_tied_decoder, mixed=False)
    return _fp32_accumulation_on_cpu(mixed, plain, x, embeddings, bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tied_decoder(x: Array, embeddings: Array, bias: Array, mixed: bool) -> Array:
    f32 = jnp.float32 if mixed else None
    logits = jnp.einsum("...h,vh->...v", x, embeddings, preferred_element_type=f32)
    return logits.astype(jnp.float32) + bias.astype(jnp.float32)


def _tied_decoder_fwd(x, embeddings, bias, mixed):
    return _tied_decoder(x, embeddings, bias, mixed), (x, embeddings, bias)


def _tied_decoder_bwd(mixed, residuals, g):
    x, embeddings, bias = residuals
    vocab, hidden = embeddings.shape
    g2 = g.reshape(-1, vocab)  # [n, vocab] fp32
    gx = g2.astype(x.dtype)
    f32 = jnp.float32 if mixed else None
    dx = jnp.matmul(gx, embeddings, preferred_element_type=f32).astype(x.dtype)  # [n, hidden]
    dx = dx.reshape(x.shape)  # [..., hidden]
    x2 = x.reshape(-1, hidden)
    dims = (((0,), (0,)), ((), ()))
    d_embeddings = lax.dot_general(gx, x2, dims, preferred_element_type=f32)  # [vocab, hidden]
    if mixed:  # CPU: a [1, n] x [n, vocab] product beat XLA CPU's column reduction
        d_bias = (jnp.ones((1, g2.shape[0]), g2.dtype) @ g2)[0]  # [vocab]
    else:  # a reduction: a GPU fuses it with the gradient's producer (no fp32 [n, vocab] buffer)
        d_bias = jnp.sum(g2, axis=0, dtype=jnp.float32)
    return dx, d_embeddings.astype(embeddings.dtype), d_bias.astype(bias.dtype)


_tied_decoder.defvjp(_tied_decoder_fwd, _tied_decoder_bwd)


# Vocabulary columns per chunk of decoder_nll: [predictions, 8192] fp32 logits at a time (320 MB
# at 32 x 1024 tokens with 30% masked).
DECODER_CHUNK = 8192


def decode(x: Array, embeddings: Array, bias: Array, labels: Array | None = None, chunk: int = 0):
    """The MLM decoder: logits [..., vocab] (:func:`tied_decoder`) or, given ``labels`` [...],
    ``(nll, label - max)`` [...] (:func:`decoder_nll`) without the logits."""
    if labels is None:
        return tied_decoder(x, embeddings, bias)
    return decoder_nll(x, embeddings, bias, labels, chunk)


def decoder_nll(
    x: Array, embeddings: Array, bias: Array, labels: Array, chunk: int = 0
) -> tuple[Array, Array]:
    """``(-log softmax(l)[label], l[label] - max(l))`` for ``l = x @ embeddings^T + bias`` in fp32
    (``x`` [..., H], ``embeddings`` [V, H], ``bias`` [V], ``labels`` [...] int): what
    ``losses.nll_and_correct(tied_decoder(x, embeddings, bias), labels)`` computes, the vocabulary
    ``chunk`` columns at a time (0: ``DECODER_CHUNK``). The gradient flows into the first output
    only (the second is a metric), to ``x``, ``embeddings`` and ``bias`` in their dtypes."""
    lead = labels.shape
    flat = x.reshape(-1, x.shape[-1])
    chunk = _chunk_size(embeddings.shape[0], chunk or DECODER_CHUNK)
    nll, margin = _decoder_nll(flat, embeddings, bias, labels.reshape(-1).astype(jnp.int32), chunk)
    return nll.reshape(lead), margin.reshape(lead)


def _chunk_size(vocab: int, target: int) -> int:
    """``target`` columns, or fewer where that many divide the vocabulary (no remainder chunk:
    256,000 -> 8,000), down to half of it."""
    if vocab <= target:
        return vocab
    for size in range(target, target // 2, -1):
        if vocab % size == 0:
            return size
    return target


def _chunk_logits(x, embeddings, bias, start, size):
    """fp32 logits [n, size] of the vocabulary rows [start, start + size)."""
    rows = lax.dynamic_slice_in_dim(embeddings, start, size, axis=0)
    b = lax.dynamic_slice_in_dim(bias, start, size, axis=0)
    logits = jnp.einsum("nh,ch->nc", x, rows, preferred_element_type=jnp.float32)
    return logits + b.astype(jnp.float32), rows


def _over_chunks(step, carry, vocab: int, chunk: int):
    """``carry`` through ``step(carry, start, size)`` over the chunks: a scan over the equal ones,
    then the remainder."""
    full = vocab // chunk
    if full:
        starts = jnp.arange(full, dtype=jnp.int32) * chunk
        carry, _ = lax.scan(lambda c, start: (step(c, start, chunk), None), carry, starts)
    if vocab % chunk:
        carry = step(carry, full * chunk, vocab % chunk)
    return carry


def _label_hits(labels, start, size):
    return (labels - start)[:, None] == jnp.arange(size, dtype=jnp.int32)  # [n, size]


def _decoder_nll_forward(x, embeddings, bias, labels, chunk):
    n = x.shape[0]

    def step(carry, start, size):
        peak, total, label = carry
        logits, _ = _chunk_logits(x, embeddings, bias, start, size)
        new_peak = jnp.maximum(peak, jnp.max(logits, axis=-1))
        total = total * jnp.exp(peak - new_peak) + jnp.sum(
            jnp.exp(logits - new_peak[:, None]), axis=-1
        )
        label = label + jnp.sum(jnp.where(_label_hits(labels, start, size), logits, 0.0), axis=-1)
        return new_peak, total, label

    init = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32))
    init += (jnp.zeros((n,), jnp.float32),)
    peak, total, label = _over_chunks(step, init, embeddings.shape[0], chunk)
    return peak + jnp.log(total), peak, label


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _decoder_nll(x, embeddings, bias, labels, chunk):
    lse, peak, label = _decoder_nll_forward(x, embeddings, bias, labels, chunk)
    return lse - label, label - peak


def _decoder_nll_fwd(x, embeddings, bias, labels, chunk):
    lse, peak, label = _decoder_nll_forward(x, embeddings, bias, labels, chunk)
    return (lse - label, label - peak), (x, embeddings, bias, labels, lse)


def _decoder_nll_bwd(chunk, residuals, cotangents):
    x, embeddings, bias, labels, lse = residuals
    g = cotangents[0].astype(jnp.float32)  # [n]; the margin is a metric: no gradient

    def step(dx, start, size):
        logits, rows = _chunk_logits(x, embeddings, bias, start, size)
        grad = jnp.exp(logits - lse[:, None]) * g[:, None]
        grad = grad - jnp.where(_label_hits(labels, start, size), g[:, None], 0.0)  # [n, size]
        gx = grad.astype(x.dtype)
        dx = dx + jnp.einsum("nc,ch->nh", gx, rows, preferred_element_type=jnp.float32)
        d_rows = lax.dot_general(
            gx, x, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return dx, (d_rows.astype(embeddings.dtype), jnp.sum(grad, axis=0).astype(bias.dtype))

    # The chunks' gradients are the scan's outputs, stacked and reshaped (no update of a [V, H]
    # carry in the loop); a remainder chunk is concatenated after them.
    vocab, hidden = embeddings.shape
    full = vocab // chunk
    dx = jnp.zeros(x.shape, jnp.float32)
    parts_e, parts_b = [], []
    if full:
        starts = jnp.arange(full, dtype=jnp.int32) * chunk
        dx, (d_e, d_b) = lax.scan(lambda c, start: step(c, start, chunk), dx, starts)
        parts_e.append(d_e.reshape(full * chunk, hidden))
        parts_b.append(d_b.reshape(full * chunk))
    if vocab % chunk:
        dx, (d_e, d_b) = step(dx, full * chunk, vocab % chunk)
        parts_e.append(d_e)
        parts_b.append(d_b)
    d_embeddings = parts_e[0] if len(parts_e) == 1 else jnp.concatenate(parts_e)
    d_bias = parts_b[0] if len(parts_b) == 1 else jnp.concatenate(parts_b)
    return dx.astype(x.dtype), d_embeddings, d_bias, None


_decoder_nll.defvjp(_decoder_nll_fwd, _decoder_nll_bwd)


_SQRT_2 = 1.4142135623730951
_INV_SQRT_2PI = 0.3989422804014327


@jax.custom_vjp
def gelu(x: Array) -> Array:
    """Exact GELU ``x * Phi(x)`` (``jax.nn.gelu(x, approximate=False)``), Phi(x) kept for backward."""
    return x * _phi(x)


def _phi(x: Array) -> Array:
    return (lax.erf(x / jnp.asarray(_SQRT_2, x.dtype)) + 1) / 2


def _gelu_fwd(x):
    cdf = _phi(x)
    return x * cdf, (x, cdf)


def _gelu_bwd(residuals, g):
    x, cdf = residuals
    pdf = jnp.exp(-0.5 * x * x) * jnp.asarray(_INV_SQRT_2PI, x.dtype)
    return (g * (cdf + x * pdf),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


def layer_norm(
    x: Array,
    scale: Array,
    bias: Array | None,
    *,
    epsilon: float,
    exact_variance: bool = False,
    dtype: Any = None,
) -> Array:
    """LayerNorm over the last axis with fp32 statistics: what ``flax.linen.LayerNorm(epsilon,
    use_fast_variance=not exact_variance, dtype=dtype)`` computes with parameters ``scale`` and
    ``bias`` (None: no bias), op for op. ``exact_variance``: ``E[(x - E[x])^2]`` as PyTorch,
    else ``E[x^2] - E[x]^2`` clipped at 0 (one pass)."""
    return _layer_norm(x, *_norm_args(x, scale, bias, epsilon, exact_variance, dtype))


def _norm_args(x, scale, bias, epsilon, exact_variance, dtype) -> tuple:
    """``(scale, bias, epsilon, exact_variance, dtype)`` as the custom VJPs take them (the
    non-differentiable ones hashable; dtype defaulting to the inputs' result type)."""
    if dtype is None:
        dtype = jnp.result_type(x, scale, *([] if bias is None else [bias]))
    return scale, bias, float(epsilon), bool(exact_variance), jnp.dtype(dtype)


def _layer_norm_stats(x: Array, epsilon: float, exact_variance: bool) -> tuple[Array, Array]:
    """(mean, 1 / sqrt(var + epsilon)) fp32 [..., 1], flax's ``_compute_stats`` and
    ``_normalize`` op for op."""
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = xf.mean(-1)
    if exact_variance:
        var = lax.square(xf - mean[..., None]).mean(-1)
    else:
        var = jnp.maximum(0.0, lax.square(xf).mean(-1) - lax.square(mean))
    return mean[..., None], lax.rsqrt(var + epsilon)[..., None]


def _normalized(x, mean, rstd, scale, bias, dtype) -> Array:
    """Flax's ``_normalize``: ``(x - mean) * (rstd * scale) + bias`` in fp32, then ``dtype``."""
    y = (x - mean) * (rstd * scale)
    return (y if bias is None else y + bias).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _layer_norm(x, scale, bias, epsilon, exact_variance, dtype):
    return _normalized(x, *_layer_norm_stats(x, epsilon, exact_variance), scale, bias, dtype)


def _layer_norm_fwd(x, scale, bias, epsilon, exact_variance, dtype):
    mean, rstd = _layer_norm_stats(x, epsilon, exact_variance)
    y = _normalized(x, mean, rstd, scale, bias, dtype)
    # Kept as computed: without the barrier XLA recomputes them in the backward from x.
    mean, rstd = lax.optimization_barrier((mean, rstd))
    return y, (x, mean, rstd, scale, bias)


def _layer_norm_bwd(epsilon, exact_variance, dtype, residuals, dy):
    del epsilon, exact_variance, dtype
    dx, d_scale, d_bias = _layer_norm_grads(residuals, dy)
    return dx.astype(residuals[0].dtype), d_scale, d_bias


def _layer_norm_grads(residuals, dy) -> tuple[Array, Array, Array | None]:
    """(dx fp32, d_scale, d_bias) from the forward's (x, mean, rstd, scale, bias)."""
    x, mean, rstd, scale, bias = residuals
    g = dy.astype(jnp.float32)
    xhat = (x - mean) * rstd  # fp32
    rows = tuple(range(x.ndim - 1))
    d_scale = jnp.sum(g * xhat, axis=rows).astype(scale.dtype)
    d_bias = None if bias is None else jnp.sum(g, axis=rows).astype(bias.dtype)
    gh = g * scale
    dx = rstd * (gh - gh.mean(-1, keepdims=True) - xhat * (gh * xhat).mean(-1, keepdims=True))
    return dx, d_scale, d_bias


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def add_layer_norm(
    x: Array,
    delta: Array,
    scale: Array,
    bias: Array | None,
    *,
    epsilon: float,
    exact_variance: bool = False,
    dtype: Any = None,
) -> tuple[Array, Array]:
    """``(h, layer_norm(h))`` for the residual stream ``h = x + delta`` of a pre-LN block, with
    one backward for both: the gradient reaching ``h`` from later layers and the norm's own are
    summed in the pass that computes the norm's (autodiff summed them in one more pass over
    [tokens, hidden]). ``h`` is materialised before the norm reads it (an optimization barrier:
    XLA CPU otherwise recomputes the sum inside each pass of the statistics)."""
    args = _norm_args(x, scale, bias, epsilon, exact_variance, dtype)
    if x.dtype != delta.dtype:  # the sum's gradient would need two dtypes: the plain form
        h = lax.optimization_barrier(x + delta)
        return h, _layer_norm(h, *args)
    return _add_layer_norm(x, delta, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _add_layer_norm(x, delta, scale, bias, epsilon, exact_variance, dtype):
    h = lax.optimization_barrier(x + delta)
    return h, _layer_norm(h, scale, bias, epsilon, exact_variance, dtype)


def _add_layer_norm_fwd(x, delta, scale, bias, epsilon, exact_variance, dtype):
    h = lax.optimization_barrier(x + delta)
    y, residuals = _layer_norm_fwd(h, scale, bias, epsilon, exact_variance, dtype)
    return (h, y), residuals


def _add_layer_norm_bwd(epsilon, exact_variance, dtype, residuals, cotangents):
    dh, dy = cotangents
    dx, d_scale, d_bias = _layer_norm_grads(residuals, dy)
    d = (dx + dh.astype(jnp.float32)).astype(residuals[0].dtype)  # one rounding for the sum
    return d, d, d_scale, d_bias


_add_layer_norm.defvjp(_add_layer_norm_fwd, _add_layer_norm_bwd)


def einsum(spec: str, a: Array, b: Array, out_dtype: Any = None) -> Array:
    """``jnp.einsum(spec, a, b)`` in ``out_dtype`` (default ``a.dtype``). With bf16 operands
    the forward and both backward products take those operands and accumulate in fp32
    (``preferred_element_type``), the backward's cotangent rounded to ``a.dtype`` as under
    PyTorch's autocast. Other dtypes: the plain einsum. Every index must appear in two of the
    three terms or in all three (batch), so that each gradient is an einsum of the other two."""
    out_dtype = jnp.dtype(a.dtype if out_dtype is None else out_dtype)

    def plain(a, b):
        return jnp.einsum(spec, a, b).astype(out_dtype)

    def mixed(a, b):
        return _mixed_einsum(a, b, spec, out_dtype)

    return _fp32_accumulation_on_cpu(mixed, plain, a, b)


def _fp32_accumulation_on_cpu(mixed, plain, a: Array, b: Array, *rest: Array) -> Array:
    """``mixed(a, b, *rest)`` when ``a`` and ``b`` are bf16 and the program is lowered for CPU,
    else ``plain(...)``. The choice is made when lowering for a platform: a TPU program (also one
    compiled on a CPU host by `bertjax compile --topology`) keeps the plain products, which its
    compiler prices lower."""
    if not _both_bf16(a, b):
        return plain(a, b, *rest)
    return lax.platform_dependent(a, b, *rest, cpu=mixed, default=plain)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mixed_einsum(a: Array, b: Array, spec: str, out_dtype) -> Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out_dtype)


def _mixed_einsum_fwd(a, b, spec, out_dtype):
    return _mixed_einsum(a, b, spec, out_dtype), (a, b)


def _mixed_einsum_bwd(spec, out_dtype, residuals, g):
    a, b = residuals
    ins, out = spec.replace(" ", "").split("->")
    sa, sb = ins.split(",")
    g = g.astype(a.dtype)
    da = jnp.einsum(f"{out},{sb}->{sa}", g, b, preferred_element_type=jnp.float32)
    db = jnp.einsum(f"{sa},{out}->{sb}", a, g, preferred_element_type=jnp.float32)
    return da.astype(a.dtype), db.astype(b.dtype)


_mixed_einsum.defvjp(_mixed_einsum_fwd, _mixed_einsum_bwd)


def contract(x: Array, kernel: Array, num_in: int) -> Array:
    """``jnp.tensordot(x, kernel, num_in)`` (x [..., *in] . kernel [*in, *out]), as :func:`einsum`
    for bf16 operands."""
    if not _both_bf16(x, kernel):
        return jnp.tensordot(x, kernel, axes=num_in)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lead, out = x.ndim - num_in, kernel.ndim - num_in
    batch, ins, outs = letters[:lead], letters[lead : lead + num_in], letters[26 - out :]
    return einsum(f"{batch}{ins},{ins}{outs}->{batch}{outs}", x, kernel)


def dense_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """``lax.dot_general`` for ``nn.Dense(dot_general=...)``: its product ``[..., in] . [in, out]``
    goes through :func:`contract` (fp32 accumulation for bf16 operands, forward and backward);
    any other product is ``lax.dot_general`` itself."""
    dense = (((lhs.ndim - 1,), (0,)), ((), ()))
    plain = precision is not None or preferred_element_type is not None
    if not plain and dimension_numbers == dense and rhs.ndim == 2 and _both_bf16(lhs, rhs):
        return contract(lhs, rhs, 1)
    return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)


def _both_bf16(a: Array, b: Array) -> bool:
    return a.dtype == jnp.bfloat16 and b.dtype == jnp.bfloat16

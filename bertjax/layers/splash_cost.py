"""The splash kernel's declared cost: what XLA's TPU cost model charges for its ``pallas_call``\\ s.

jax's splash kernel gives its three ``pallas_call``\\ s (forward, backward dq, backward dk/dv) no
``cost_estimate``, and XLA counts a Mosaic custom call without one as free: it schedules around the
kernel as if it took no time, and ``bertjax compile --topology`` priced a splash step as the rest of
the step. :func:`priced` runs a splash kernel with each of its ``pallas_call``\\ s given a
``pl.CostEstimate``:

* forward: ``pl.estimate_cost`` of the reference attention (``softmax(q k^T) v`` by einsums) on one
  example's [heads, seq, head_dim], its FLOPs and exponentials scaled by the share of (query block,
  key block) pairs the mask keeps (a ``LocalMask`` skips the blocks outside the band); bytes: q, k,
  v and the output once;
* backward dq and backward dk/dv: each recomputes the scores and the probabilities (one product and
  the exponentials) and makes three more products, so each is twice the forward's FLOPs with the
  forward's exponentials; bytes: q, k, v, the output gradient and the one or two results.

Under ``vmap`` (one kernel per example) Pallas multiplies the estimate by the batch. These are
declared estimates: a report built on them says so (``compile``: ``kernel_cost`` = ``declared``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

_KERNEL_MODULE = "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel"
_LOCK = threading.Lock()


def _reference(q, k, v):
    """Softmax attention of one example, [heads, seq, head_dim] each (the kernel's layout)."""
    logits = jnp.einsum("hqd,hkd->hqk", q, k).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("hqk,hkd->hqd", probs.astype(v.dtype), v)


def kept_share(seq_len: int, block: int, half_window: int) -> float:
    """The share of (query block, key block) pairs the kernel computes: 1 for a full mask, the
    blocks that meet the band ``|i - j| <= half_window`` for a ``LocalMask``."""
    if not half_window:
        return 1.0
    n = seq_len // block
    starts = np.arange(n) * block
    # blocks qi and kj meet the band when their closest positions are within half_window
    gap = np.maximum(starts[None, :] - (starts[:, None] + block - 1), 0)
    gap = np.maximum(gap, np.maximum(starts[:, None] - (starts[None, :] + block - 1), 0))
    return float((gap <= half_window).sum()) / (n * n)


@functools.lru_cache(maxsize=64)
def kernel_costs(
    num_heads: int, seq_len: int, head_dim: int, dtype: str, block: int, half_window: int
) -> dict[str, pl.CostEstimate]:
    """``forward``, ``dq`` and ``dkv`` estimates of one example's kernel calls."""
    shape = jax.ShapeDtypeStruct((num_heads, seq_len, head_dim), jnp.dtype(dtype))
    reference = pl.estimate_cost(_reference, shape, shape, shape)
    share = kept_share(seq_len, block, half_window)
    flops = math.ceil(reference.flops * share)
    exps = math.ceil(reference.transcendentals * share)
    tensor = num_heads * seq_len * head_dim * jnp.dtype(dtype).itemsize
    lse = num_heads * seq_len * 4  # the float32 softmax statistics the backward reads
    return {
        "forward": pl.CostEstimate(flops=flops, transcendentals=exps, bytes_accessed=4 * tensor),
        "dq": pl.CostEstimate(
            flops=2 * flops, transcendentals=exps, bytes_accessed=6 * tensor + lse
        ),
        "dkv": pl.CostEstimate(
            flops=2 * flops, transcendentals=exps, bytes_accessed=7 * tensor + lse
        ),
    }


def _kind(kernel) -> str:
    name = getattr(getattr(kernel, "func", kernel), "__name__", "")
    if "dkv" in name:
        return "dkv"
    return "dq" if "dq" in name else "forward"


class _PallasWithCosts:
    """The ``pl`` module as the splash kernel sees it while :func:`declared` is active: every
    attribute is Pallas's own, except that ``pallas_call`` fills in a missing ``cost_estimate``."""

    def __init__(self, pallas, costs):
        self._pallas, self._costs = pallas, costs

    def __getattr__(self, name):
        return getattr(self._pallas, name)

    def pallas_call(self, kernel, *args, **kwargs):
        if kwargs.get("cost_estimate") is None:
            kwargs["cost_estimate"] = self._costs[_kind(kernel)]
        return self._pallas.pallas_call(kernel, *args, **kwargs)


@contextlib.contextmanager
def declared(costs: dict[str, pl.CostEstimate]):
    """While active (tracing only; one thread at a time), the splash kernel's ``pallas_call``\\ s
    carry ``costs``. jax's splash module takes no estimate of its own; this is the one place
    bertjax hands it one, and it leaves the module as it found it."""
    module = importlib.import_module(_KERNEL_MODULE)
    with _LOCK:
        original = module.pl
        module.pl = _PallasWithCosts(original, costs)
        try:
            yield
        finally:
            module.pl = original


def priced(call, costs: dict[str, pl.CostEstimate]):
    """``call(q, k, v, ids)`` (one example through a splash kernel) with ``costs`` declared on the
    forward and, when differentiated, on the backward ``pallas_call``\\ s (traced in this
    function's backward rule, inside the same declaration). Same outputs and gradients."""

    @jax.custom_vjp
    def run(q, k, v, ids):
        with declared(costs):
            return call(q, k, v, ids)

    def forward(q, k, v, ids):
        with declared(costs):
            out, vjp = jax.vjp(lambda q, k, v: call(q, k, v, ids), q, k, v)
        return out, vjp

    def backward(vjp, g):
        with declared(costs):
            dq, dk, dv = vjp(g)
        return dq, dk, dv, None

    run.defvjp(forward, backward)
    return run

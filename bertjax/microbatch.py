"""The gradient of one training batch run as micro-batches (``train.grad_accum_steps``).

A task says how its loss behaves when a batch is split (``Task.micro_batching``):

* ``additive``: the loss is a sum of per-row terms over global normalisers, so the micro-batches'
  losses and gradients add up to the whole batch's (``accumulate``).
* ``cached``: the loss couples the rows (in-batch negatives), so micro-batch losses do not add up.
  ``cached_value_and_grad`` is the two-pass GradCache step (Gao et al., 2021): every micro-batch is
  embedded without keeping activations, the whole-batch loss and its gradient with respect to the
  embeddings are computed once, then every micro-batch is embedded again (same dropout key) and its
  vector-Jacobian product with its share of that gradient is added up. The result is the gradient of
  the whole-batch loss, with the memory of one micro-batch.

Micro-batch ``i`` takes rows ``i, i + k, i + 2k, ...`` of the batch (``k`` micro-batches), so each
device keeps its share of every micro-batch; ``split_rows``/``join_rows`` go back and forth.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def split_rows(x: jax.Array, k: int) -> jax.Array:
    """``[b, ...] -> [k, b // k, ...]``: micro-batch ``i`` holds rows ``i, i + k, ...``."""
    return x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)


def join_rows(x: jax.Array) -> jax.Array:
    """The inverse of ``split_rows``: ``[k, b // k, ...] -> [b, ...]`` in the batch's row order."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def accumulate(
    grad_fn: Callable, params: Any, micro: Any, rng: jax.Array, k: int, unroll: bool = False
) -> tuple[jax.Array, Any, Any]:
    """(loss, metrics, grads) summed over the ``k`` stacked micro-batches ``micro`` (``[k, ...]``
    leaves); ``grad_fn(params, micro_batch, rng) -> ((loss, metrics), grads)`` is called with
    ``fold_in(rng, i)`` for micro-batch ``i``."""

    def body(carry, xs):
        index, mb = xs
        (loss_i, metrics_i), grads_i = grad_fn(params, mb, jax.random.fold_in(rng, index))
        return jax.tree.map(jnp.add, carry, (loss_i, metrics_i, grads_i)), None

    first = jax.tree.map(lambda x: x[0], micro)
    zero_metrics = jax.eval_shape(lambda: grad_fn(params, first, rng))[0][1]
    init = (
        jnp.zeros((), jnp.float32),
        jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), zero_metrics),
        jax.tree.map(jnp.zeros_like, params),
    )
    (loss, metrics, grads), _ = jax.lax.scan(
        body, init, (jnp.arange(k), micro), unroll=k if unroll else 1
    )
    return loss, metrics, grads


def cached_value_and_grad(
    embed: Callable,
    batch_loss: Callable,
    params: Any,
    micro: Any,
    rng: jax.Array,
    k: int,
    constrain: Callable = lambda x: x,
    unroll: bool = False,
) -> tuple[jax.Array, Any, Any]:
    """(loss, metrics, grads) of a whole-batch loss over ``k`` micro-batches, exactly (GradCache).

    ``embed(params, micro_batch, rng)``: a pytree of arrays whose leading axis is the micro-batch's
    rows, called with ``fold_in(rng, i)`` for micro-batch ``i`` in both passes (same dropout).
    ``batch_loss(embeddings) -> (loss, metrics)``: the whole batch's loss from every row's
    embedding, rows in the batch's order. ``micro``: the stacked micro-batches (``[k, ...]``
    leaves, as ``split_rows`` makes them). ``constrain``: applied to each ``[k, ...]`` array of
    embedding gradients (the trainer's sharding constraint)."""
    indices = jnp.arange(k)
    scan_unroll = k if unroll else 1

    def first_pass(_, xs):  # no gradient is taken: no activations are kept
        index, mb = xs
        return None, embed(params, mb, jax.random.fold_in(rng, index))

    _, stacked = jax.lax.scan(first_pass, None, (indices, micro), unroll=scan_unroll)
    embeddings = jax.tree.map(join_rows, jax.lax.stop_gradient(stacked))
    (loss, metrics), d_embeddings = jax.value_and_grad(batch_loss, has_aux=True)(embeddings)
    d_stacked = jax.tree.map(lambda d: constrain(split_rows(d, k)), d_embeddings)

    def second_pass(grads, xs):
        index, mb, d_mb = xs
        _, vjp = jax.vjp(lambda p: embed(p, mb, jax.random.fold_in(rng, index)), params)
        (grads_i,) = vjp(d_mb)
        return jax.tree.map(jnp.add, grads, grads_i), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, _ = jax.lax.scan(second_pass, zeros, (indices, micro, d_stacked), unroll=scan_unroll)
    return loss, metrics, grads

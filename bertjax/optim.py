"""Optimizers and schedules: BERT's AdamW (the paper's settings) and LAMB with the warmup +
linear-decay schedule, and the modern encoder recipe's StableAdamW with a warmup-stable-decay one.

Weight decay is applied to kernels and embeddings only, never to LayerNorm parameters or biases; the
gradient is clipped to global norm 1.0 first, as in the original implementation. The schedule is the
original one: ``lr = peak * step / warmup`` during warmup, then ``peak * (1 - step / total)``.
Adam applies bias correction (the original TF optimizer did not); this is stated here because it
changes the first few hundred steps slightly.

Each optimizer equals a reference update for update (tests/test_optim_reference.py):

* ``adamw`` is ``torch.optim.AdamW``: ``p -= lr_t * (m_hat / (sqrt(v_hat) + eps) + wd * p)``.
* ``lamb`` is Algorithm 2 of the LAMB paper (You et al., 2020), as ``optax.lamb``: the AdamW step
  ``r = m_hat / (sqrt(v_hat) + eps) + wd * p`` scaled by ``||p|| / ||r||`` (1 where a norm is 0) on
  every tensor. NVIDIA's FusedLAMB and TF Addons' LAMB skip that ratio on tensors without decay.
* ``stableadamw`` (Wortsman et al., 2023; ModernBERT's optimizer) is optimi's ``StableAdamW``: the
  AdamW step, decay included, with each tensor's learning rate divided by
  ``max(1, sqrt(mean(g^2 / max(v_hat, eps^2))))``, Adafactor-style update clipping that replaces
  global gradient clipping (``grad_clip_norm`` is then usually 0).

``decouple_lr=True`` (adamw, stableadamw; optimi's option of that name, ModernBERT's recipe) makes
the decay follow the schedule but not the peak: ``p -= lr_t * update + (lr_t / peak) * wd * p``
with ``peak = learning_rate``, so ``weight_decay`` is the fraction removed per step at the peak
(ModernBERT: 1e-5). ``schedule="wsd"`` is warmup-stable-decay (trapezoidal): linear warmup, the
peak held, then a decay over the last ``decay_fraction`` of the steps (``linear`` or ``1-sqrt``) to
``peak * end_lr_factor``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import traverse_util


def learning_rate_schedule(
    peak: float, warmup_steps: int, total_steps: int, end_factor: float = 0.0
) -> optax.Schedule:
    """Linear warmup to ``peak`` then linear decay to ``peak * end_factor`` at ``total_steps``."""
    if total_steps <= 0:
        raise ValueError(f"optimizer: total steps must be positive, got {total_steps}")
    if warmup_steps < 0:
        raise ValueError(f"optimizer: warmup_steps must be >= 0, got {warmup_steps}")

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        frac = jnp.minimum(step, total_steps) / total_steps
        decayed = peak * ((1.0 - frac) * (1.0 - end_factor) + end_factor)
        if warmup_steps == 0:
            return decayed
        warm = peak * step / warmup_steps
        return jnp.where(step < warmup_steps, warm, decayed)

    return schedule


def wsd_schedule(
    peak: float,
    warmup_steps: int,
    total_steps: int,
    decay_fraction: float = 0.1,
    end_factor: float = 0.0,
    shape: str = "linear",
) -> optax.Schedule:
    """Warmup-stable-decay: linear warmup to ``peak``, constant, then a decay over the last
    ``decay_fraction`` of ``total_steps`` to ``peak * end_factor`` (``linear`` or ``1-sqrt``)."""
    if total_steps <= 0:
        raise ValueError(f"optimizer: total steps must be positive, got {total_steps}")
    if not 0.0 <= decay_fraction <= 1.0:
        raise ValueError(f"config key optimizer.decay_fraction={decay_fraction} must be in [0, 1]")
    if shape not in ("linear", "1-sqrt"):
        raise ValueError(f"config key optimizer.decay_shape={shape!r}: choose linear or 1-sqrt")
    decay_steps = decay_fraction * total_steps
    decay_start = total_steps - decay_steps

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        progress = jnp.clip((step - decay_start) / max(decay_steps, 1.0), 0.0, 1.0)
        left = 1.0 - progress if shape == "linear" else 1.0 - jnp.sqrt(progress)
        value = peak * (end_factor + (1.0 - end_factor) * left)
        if warmup_steps > 0:
            value = jnp.where(step < warmup_steps, peak * step / warmup_steps, value)
        return value

    return schedule


def bias_correction(decay: float, count: jax.Array) -> jax.Array:
    """``1 - decay**count`` to fp32 precision, as torch and optimi get it in float64: fp32's own
    ``1 - 0.999**t`` is off by ~1e-5 relative in the first steps (0.999 is inexact in fp32)."""
    if decay == 0:
        return jnp.ones([], jnp.float32)
    return -jnp.expm1(count.astype(jnp.float32) * math.log(decay))


def scale_by_adam(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """Adam's ``m_hat / (sqrt(v_hat) + eps)``: ``optax.scale_by_adam`` (and its state) with the
    bias corrections of ``bias_correction``."""
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)

    def update(grads, state, params=None):
        _, state = adam.update(grads, state)
        c1, c2 = bias_correction(b1, state.count), bias_correction(b2, state.count)

        def step(m, v):
            return (m / c1.astype(m.dtype)) / (jnp.sqrt(v / c2.astype(v.dtype)) + eps)

        return jax.tree.map(step, state.mu, state.nu), state

    return optax.GradientTransformation(adam.init, update)


def stable_adamw(
    learning_rate, b1: float, b2: float, eps: float, weight_decay: float, mask
) -> optax.GradientTransformation:
    """StableAdamW (optimi's ``StableAdamW``): each tensor's step ``lr * (adam + wd * param)``,
    decay included, divided by ``max(1, sqrt(mean(g^2 / max(v_hat, eps^2))))``. ``weight_decay``
    multiplies ``lr``: pass ``wd / peak`` for optimi's ``decouple_lr``."""
    adam = scale_by_adam(b1, b2, eps)
    decay = optax.add_decayed_weights(weight_decay, mask)
    scale = optax.scale_by_learning_rate(learning_rate)

    def init(params):
        return adam.init(params), decay.init(params), scale.init(params)

    def update(grads, state, params=None):
        adam_state, decay_state, scale_state = state
        updates, adam_state = adam.update(grads, adam_state, params)
        correction = bias_correction(b2, adam_state.count)

        def rms(g, nu):
            ratio = jnp.square(g.astype(jnp.float32)) / jnp.maximum(nu / correction, eps * eps)
            return jnp.sqrt(jnp.mean(ratio))

        ratios = jax.tree.map(rms, grads, adam_state.nu)
        updates, decay_state = decay.update(updates, decay_state, params)
        updates = jax.tree.map(
            lambda u, r: u / jnp.maximum(1.0, r).astype(u.dtype), updates, ratios
        )
        updates, scale_state = scale.update(updates, scale_state, params)
        return updates, (adam_state, decay_state, scale_state)

    return optax.GradientTransformation(init, update)


def weight_decay_mask(params: Any) -> Any:
    """True for parameters that get weight decay: kernels and embeddings, not biases or LayerNorm."""
    flat = traverse_util.flatten_dict(params)
    mask = {}
    for path, _ in flat.items():
        name = path[-1]
        in_norm = any("norm" in part.lower() for part in path)
        mask[path] = name in ("kernel", "embedding") and not in_norm
    return traverse_util.unflatten_dict(mask)


def create_optimizer(
    config: ml_collections.ConfigDict, total_steps: int, warmup_steps: int | None = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Builds the optimizer named in ``config.optimizer`` (adamw | lamb | stableadamw) and its
    schedule.

    ``warmup_steps`` (default ``optimizer.warmup_steps``) is what the task resolved, e.g. a
    fine-tuning task's ``warmup_proportion`` of its steps; more than ``total_steps`` is an error.
    """
    opt = config.optimizer
    warmup = opt.warmup_steps if warmup_steps is None else warmup_steps
    if warmup > total_steps:  # warmup_proportion cannot exceed the run: the key is warmup_steps
        raise ValueError(
            f"config key optimizer.warmup_steps={warmup} is longer than the run ({total_steps} "
            "steps): the learning rate would never reach optimizer.learning_rate; lower it"
        )
    kind = opt.get("schedule", "linear")
    if kind == "linear":
        schedule = learning_rate_schedule(
            opt.learning_rate, warmup, total_steps, opt.get("end_lr_factor", 0.0)
        )
    elif kind == "wsd":
        schedule = wsd_schedule(
            opt.learning_rate,
            warmup,
            total_steps,
            opt.get("decay_fraction", 0.1),
            opt.get("end_lr_factor", 0.0),
            opt.get("decay_shape", "linear"),
        )
    else:
        raise ValueError(f"config key optimizer.schedule={kind!r}: choose 'linear' or 'wsd'")
    name = opt.name.lower()
    if name not in ("adamw", "lamb", "stableadamw"):
        raise ValueError(
            f"config key optimizer.name={opt.name!r}: choose 'adamw', 'lamb' or 'stableadamw'"
        )
    weight_decay = opt.weight_decay
    decouple_lr = opt.get("decouple_lr", False)
    if decouple_lr:
        if name == "lamb":
            raise ValueError(
                "config key optimizer.decouple_lr=True: lamb has no learning-rate-decoupled "
                "weight decay (adamw and stableadamw have); set it False"
            )
        if not opt.learning_rate > 0:
            raise ValueError(
                "config key optimizer.decouple_lr=True needs optimizer.learning_rate > 0, "
                f"got {opt.learning_rate}"
            )
        # p -= lr_t * (update + weight_decay / peak * p): the decay follows lr_t / peak.
        weight_decay = opt.weight_decay / opt.learning_rate
    adam = scale_by_adam(opt.b1, opt.b2, opt.eps)
    decay = optax.add_decayed_weights(weight_decay, weight_decay_mask)
    if name == "adamw":  # optax.adamw, and its state
        core = optax.chain(adam, decay, optax.scale_by_learning_rate(schedule))
    elif name == "lamb":  # optax.lamb, and its state
        core = optax.chain(
            adam, decay, optax.scale_by_trust_ratio(), optax.scale_by_learning_rate(schedule)
        )
    else:
        core = stable_adamw(schedule, opt.b1, opt.b2, opt.eps, weight_decay, weight_decay_mask)
    chain = [core]
    if opt.grad_clip_norm and opt.grad_clip_norm > 0:
        chain.insert(0, optax.clip_by_global_norm(opt.grad_clip_norm))
    return optax.chain(*chain), schedule


def global_norm(tree: Any) -> jax.Array:
    return optax.global_norm(tree)

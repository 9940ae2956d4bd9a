"""Optimizers and schedules: BERT's AdamW (the paper's settings) and LAMB with the warmup +
linear-decay schedule, and the modern encoder recipe's StableAdamW with a warmup-stable-decay one.

Weight decay is applied to kernels and embeddings only, never to LayerNorm parameters or biases; the
gradient is clipped to global norm 1.0 first, as in the original implementation. The schedule is the
original one: ``lr = peak * step / warmup`` during warmup, then ``peak * (1 - step / total)``.
Optax's Adam applies bias correction (the original TF optimizer did not); this is stated here
because it changes the first few hundred steps slightly.

``stableadamw`` (Wortsman et al., 2023; ModernBERT's optimizer) is AdamW whose update of each tensor
is divided by ``max(1, sqrt(mean(g^2 / v_hat)))``: Adafactor-style update clipping, which replaces
global gradient clipping (``grad_clip_norm`` is then usually 0). ``schedule="wsd"`` is
warmup-stable-decay (trapezoidal): linear warmup, the peak held, then a decay over the last
``decay_fraction`` of the steps (``linear`` or ``1-sqrt``) to ``peak * end_lr_factor``.
"""

from __future__ import annotations

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


def scale_by_stable_adam(
    b1: float = 0.9, b2: float = 0.98, eps: float = 1e-6
) -> optax.GradientTransformation:
    """Adam's update ``m_hat / (sqrt(v_hat) + eps)``, per tensor divided by
    ``max(1, sqrt(mean(g^2 / max(v_hat, eps^2))))`` (StableAdamW's update clipping)."""
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)

    def init(params):
        return adam.init(params)

    def update(grads, state, params=None):
        updates, state = adam.update(grads, state, params)
        count = state.count.astype(jnp.float32)
        correction = 1.0 - b2**count

        def clip(g, u, nu):
            v_hat = nu / correction
            ratio = jnp.mean(jnp.square(g.astype(jnp.float32)) / jnp.maximum(v_hat, eps * eps))
            return u / jnp.maximum(1.0, jnp.sqrt(ratio)).astype(u.dtype)

        return jax.tree.map(clip, grads, updates, state.nu), state

    return optax.GradientTransformation(init, update)


def stable_adamw(
    learning_rate, b1: float, b2: float, eps: float, weight_decay: float, mask
) -> optax.GradientTransformation:
    """StableAdamW: the clipped Adam update, decoupled weight decay (masked), the learning rate."""
    return optax.chain(
        scale_by_stable_adam(b1, b2, eps),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )


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
    """Builds the optimizer named in ``config.optimizer`` (adamw | lamb) and its schedule.

    ``warmup_steps`` (default ``optimizer.warmup_steps``) is what the task resolved, e.g. a
    fine-tuning task's ``warmup_proportion`` of its steps.
    """
    opt = config.optimizer
    warmup = opt.warmup_steps if warmup_steps is None else warmup_steps
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
    if name == "adamw":
        core = optax.adamw(
            schedule,
            b1=opt.b1,
            b2=opt.b2,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            mask=weight_decay_mask,
        )
    elif name == "lamb":
        core = optax.lamb(
            schedule,
            b1=opt.b1,
            b2=opt.b2,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            mask=weight_decay_mask,
        )
    elif name == "stableadamw":
        core = stable_adamw(
            schedule, opt.b1, opt.b2, opt.eps, opt.weight_decay, mask=weight_decay_mask
        )
    else:
        raise ValueError(
            f"config key optimizer.name={opt.name!r}: choose 'adamw', 'lamb' or 'stableadamw'"
        )
    chain = [core]
    if opt.grad_clip_norm and opt.grad_clip_norm > 0:
        chain.insert(0, optax.clip_by_global_norm(opt.grad_clip_norm))
    return optax.chain(*chain), schedule


def global_norm(tree: Any) -> jax.Array:
    return optax.global_norm(tree)

"""BERT's optimizers: AdamW (the paper's settings) and LAMB, with the warmup + linear-decay schedule.

Weight decay is applied to kernels and embeddings only, never to LayerNorm parameters or biases; the
gradient is clipped to global norm 1.0 first, as in the original implementation. The schedule is the
original one: ``lr = peak * step / warmup`` during warmup, then ``peak * (1 - step / total)``.
Optax's Adam applies bias correction (the original TF optimizer did not); this is stated here
because it changes the first few hundred steps slightly.
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
    schedule = learning_rate_schedule(
        opt.learning_rate, warmup, total_steps, opt.get("end_lr_factor", 0.0)
    )
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
    else:
        raise ValueError(f"config key optimizer.name={opt.name!r}: choose 'adamw' or 'lamb'")
    chain = [core]
    if opt.grad_clip_norm and opt.grad_clip_norm > 0:
        chain.insert(0, optax.clip_by_global_norm(opt.grad_clip_norm))
    return optax.chain(*chain), schedule


def global_norm(tree: Any) -> jax.Array:
    return optax.global_norm(tree)

"""Rotary position embeddings (RoPE): the frequency schedules of Hugging Face transformers'
``modeling_rope_utils`` ("rope types"), the cos/sin tables and the rotation.

A schedule is transformers' ``rope_parameters`` entry of one layer type without ``rope_theta``
(``{"rope_type": "yarn", "factor": 4.0, ...}``; ``{}`` = default RoPE). :func:`frequencies` turns
it into the inverse frequencies [head_dim // 2] and the factor cos/sin are scaled by, computed the
way transformers computes them for ModernBERT (float32, the same operations in the same order):

* ``default``: ``1 / theta ** (2i / head_dim)`` (ModernBERT ignores any other key here);
* ``linear``: default / ``factor``;
* ``dynamic``: NTK-scaled theta for ``max(seq_len, max_position_embeddings)``, i.e. default up to
  ``max_position_embeddings`` (the longest input bertjax's ModernBERT accepts);
* ``yarn``: interpolation / extrapolation blend with ``attention_factor`` scaling cos/sin
  (``truncate`` is read from the top level of ModernBERT's nested ``rope_parameters``, where it
  never is: always true, as transformers does);
* ``longrope``: ``short_factor`` or, for inputs longer than ``original_max_position_embeddings``,
  ``long_factor``, with its attention factor;
* ``llama3``: the wavelength-banded scaling of Llama 3.1;
* ``proportional``: the first ``partial_rotary_factor`` of the frequencies, zeros after.

Anything transformers' ModernBERT cannot run (a ``partial_rotary_factor`` below 1 outside
``proportional``: its cos/sin no longer cover a head) or does not know is a ValueError.
"""

from __future__ import annotations

import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bertjax.layers.core import config_error

Array = jax.Array

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")


def parse_schedule(text: str) -> dict[str, Any]:
    """A schedule from its JSON form ("" = default RoPE)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"is not a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise ValueError("is not a JSON object")
    return value


def schedule_json(params: dict[str, Any] | None) -> str:
    """The canonical JSON form of a schedule ("" for default RoPE, whose other keys ModernBERT
    ignores); ``rope_theta`` is not part of it."""
    params = {k: v for k, v in (params or {}).items() if k != "rope_theta"}
    if "type" in params and "rope_type" not in params:  # transformers' legacy spelling
        params["rope_type"] = params.pop("type")
    if params.get("rope_type", "default") == "default":
        return ""
    return json.dumps(params, sort_keys=True)


def _arange_over(stop: int, dim: int) -> np.ndarray:
    """``torch.arange(0, stop, 2).float() / dim`` in float32."""
    return np.arange(0, stop, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)


def _required(params: dict[str, Any], key: str) -> Any:
    if params.get(key) is None:
        raise ValueError(f"rope_type {params['rope_type']!r} needs {key!r}")
    return params[key]


def frequencies(
    params: dict[str, Any],
    theta: float,
    head_dim: int,
    max_position_embeddings: int,
    seq_len: int | None = None,
) -> tuple[np.ndarray, float]:
    """(inverse frequencies float32 [head_dim // 2], cos/sin scale) of a schedule for inputs of
    ``seq_len`` tokens (None: the schedule at load time). ValueError: unsupported schedule."""
    try:
        inv, scale = _frequencies(params, theta, head_dim, max_position_embeddings, seq_len)
    except (TypeError, KeyError, ZeroDivisionError, OverflowError) as e:
        raise ValueError(f"malformed RoPE parameters {params} ({type(e).__name__}: {e})") from None
    if inv.shape != (head_dim // 2,) or not np.all(np.isfinite(inv)) or not math.isfinite(scale):
        raise ValueError(f"RoPE parameters {params} give no finite frequency per head pair")
    return inv, scale


def _frequencies(params, theta, head_dim, max_position_embeddings, seq_len):
    kind = params.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_type {kind!r} is not one of {ROPE_TYPES}")
    if kind == "default":
        return (1.0 / (theta ** _arange_over(head_dim, head_dim))).astype(np.float32), 1.0
    partial = params.get("partial_rotary_factor")
    partial = 1.0 if partial is None else float(partial)
    if kind == "proportional":
        factor = params.get("factor", 1.0)
        angles = int(partial * head_dim // 2)
        rotated = 1.0 / (theta ** _arange_over(2 * angles, head_dim))
        inv = np.concatenate([rotated, np.zeros(head_dim // 2 - angles, np.float32)])
        return (inv / np.float32(factor)).astype(np.float32), 1.0
    dim = int(head_dim * partial)
    if dim != head_dim:
        raise ValueError(
            f"partial_rotary_factor={partial} with rope_type {kind!r} rotates {dim} of "
            f"{head_dim} dimensions per head (transformers' ModernBERT fails on it)"
        )
    exponent = _arange_over(dim, dim)
    scale = 1.0
    if kind == "linear":
        inv = (1.0 / (theta**exponent)) / np.float32(_required(params, "factor"))
    elif kind == "dynamic":
        factor = _required(params, "factor")
        if dim <= 2:
            raise ValueError(f"rope_type 'dynamic' needs head_dim > 2 (head_dim={head_dim})")
        length = max(seq_len or 0, max_position_embeddings)
        base = theta * ((factor * length / max_position_embeddings) - (factor - 1)) ** (
            dim / (dim - 2)
        )
        inv = 1.0 / (base**exponent)
    elif kind == "yarn":
        inv, scale = _yarn(params, theta, dim, max_position_embeddings)
    elif kind == "longrope":
        inv, scale = _longrope(params, theta, dim, max_position_embeddings, seq_len)
    else:
        inv = _llama3(params, 1.0 / (theta**exponent))
    return np.asarray(inv, np.float32), float(scale)


def _yarn(params, theta, dim, max_position_embeddings) -> tuple[np.ndarray, float]:
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    if factor is None:
        factor = max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(
                get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** _arange_over(dim, dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp.astype(np.float32)  # the extrapolation factor
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _longrope(params, theta, dim, max_position_embeddings, seq_len) -> tuple[np.ndarray, float]:
    original = _required(params, "original_max_position_embeddings")
    factor, attention_factor = params.get("factor"), params.get("attention_factor")
    if factor is None:
        factor = max_position_embeddings / original
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    long_inputs = seq_len is not None and seq_len > original
    key = "long_factor" if long_inputs else "short_factor"
    ext = np.asarray(_required(params, key), np.float32)
    for name in ("short_factor", "long_factor"):
        if len(_required(params, name)) != dim // 2:
            raise ValueError(
                f"{name} has {len(params[name])} values, not head_dim // 2 = {dim // 2}"
            )
    return 1.0 / (ext * theta ** _arange_over(dim, dim)), attention_factor


def _llama3(params, inv_freq: np.ndarray) -> np.ndarray:
    factor = _required(params, "factor")
    low_factor = _required(params, "low_freq_factor")
    high_factor = _required(params, "high_freq_factor")
    old_context = _required(params, "original_max_position_embeddings")
    low_wavelen, high_wavelen = old_context / low_factor, old_context / high_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def rope_tables(position_ids: Array, inv_freq: np.ndarray, scale: float = 1.0):
    """cos, sin [batch or 1, seq, head_dim] float32 at ``position_ids`` [batch or 1, seq]."""
    freqs = position_ids[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # [batch, seq, head_dim]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * jnp.float32(scale), sin * jnp.float32(scale)
    return cos, sin


def apply_rope(x: Array, rope: tuple[Array, Array]) -> Array:
    """Rotates x [batch, seq, heads, head_dim] (in float32, as HF does) by cos/sin tables."""
    cos, sin = (t[:, :, None, :] for t in rope)  # [batch, seq, 1, head_dim]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


class RopeConfig:
    """Mixed into a rotary encoder's config dataclass with ``rope_theta``, ``rope_scaling`` (a
    schedule's JSON, "" = default), ``head_dim`` and ``max_position_embeddings``."""

    def rope(self, seq_len: int | None = None) -> tuple[np.ndarray, float]:
        """(inverse frequencies float32 [head_dim // 2], cos/sin scale) for ``seq_len`` tokens."""
        schedule = parse_schedule(self.rope_scaling)
        return frequencies(
            schedule, self.rope_theta, self.head_dim, self.max_position_embeddings, seq_len
        )

    def check_rope(self) -> None:
        """ValueError naming the key: an odd head_dim, a non-positive rope_theta, a schedule
        that gives no frequencies."""

        def bad(key, why):
            raise config_error(self, key, why)

        if self.head_dim % 2:
            bad("hidden_size", f"gives an odd head_dim={self.head_dim} (RoPE needs it even)")
        if self.rope_theta <= 0:
            bad("rope_theta", "must be positive")
        if self.max_position_embeddings < 1:
            bad("max_position_embeddings", "must be >= 1")
        try:
            self.rope()
        except ValueError as e:
            bad("rope_scaling", str(e))

"""Training FLOPs of a step and a peak-FLOP/s table for MFU.

Each architecture counts its own forward FLOPs (``forward_flops_per_sequence`` in its module of
``bertjax.models``; multiply-add = 2 FLOPs); backward = 2x forward, so a training step is 3x forward.
"""

from __future__ import annotations

import jax

from bertjax import models

# Dense bf16 peak TFLOP/s per chip (vendor figures), matched against jax's device_kind.
PEAK_TFLOPS = {
    "TPU v2": 45.0,
    "TPU v3": 123.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v5": 459.0,
    "TPU v6 lite": 918.0,
    "TPU v6e": 918.0,
    "TPU7x": 2307.0,
    "NVIDIA H200": 989.0,
    "NVIDIA H100": 989.0,
    "NVIDIA A100": 312.0,
    "NVIDIA L4": 121.0,
    "NVIDIA A10G": 125.0,
    "Tesla V100": 125.0,
    "NVIDIA V100": 125.0,
    "Tesla T4": 65.0,
}


def train_flops_per_step(cfg, batch: int, seq_len: int, num_masked: int) -> float:
    """Training FLOPs of one step: 3x the forward pass (forward + backward)."""
    return 3.0 * batch * models.forward_flops_per_sequence(cfg, seq_len, num_masked)


def device_peak_tflops(device=None, override: float = 0.0) -> float:
    """Peak TFLOP/s of one device: ``override`` if set, else the table; 0.0 when unknown."""
    if override and override > 0:
        return float(override)
    device = device or jax.devices()[0]
    kind = getattr(device, "device_kind", "")
    for name, peak in sorted(PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])):
        if kind.lower().startswith(name.lower()):
            return peak
    return 0.0

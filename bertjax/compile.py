"""Ahead-of-time compilation of the train step (``bertjax compile`` / ``pretrain --dry_run``): the
memory XLA will use per device, before a job pays for hardware."""

from __future__ import annotations

import time
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np

from bertjax import checkpointing, sharding
from bertjax.tasks.base import Task
from bertjax.train import build, jit_train_step, prepared_task


def compile_train_step(
    config: ml_collections.ConfigDict, workdir: str, task: Task | None = None
) -> dict[str, Any]:
    """Lowers and compiles the first phase's step ahead of time; returns XLA's memory analysis.

    Catches out-of-memory and sharding errors before a job pays for hardware.
    """
    setup = build(config, workdir, task or prepared_task(config, workdir))
    phase = setup.phases[0]
    batch = setup.task.init_batch(phase, phase.global_batch_size)
    batch_sharding = sharding.batch_sharding(setup.mesh, setup.rules)
    abstract_batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding) for k, v in batch.items()
    }
    abstract_state = checkpointing.abstract_like(setup.abstract_state, setup.state_shardings)
    step = jit_train_step(setup, config.train.grad_accum_steps)
    t0 = time.perf_counter()
    with jax.set_mesh(setup.mesh), nn.logical_axis_rules(setup.rules):
        compiled = step.lower(abstract_state, abstract_batch).compile()
    mem = compiled.memory_analysis()
    state_bytes = sum(
        int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
        for x, s in zip(
            jax.tree.leaves(setup.abstract_state), jax.tree.leaves(setup.state_shardings)
        )
    )
    report = {
        "compile_seconds": time.perf_counter() - t0,
        "devices": len(setup.mesh.devices.flat),
        "mesh": dict(setup.mesh.shape),
        "state_bytes_per_device": state_bytes,
    }
    for key in (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    ):
        report[key] = int(getattr(mem, key, 0) or 0) if mem is not None else None
    return report

"""Ahead-of-time compilation of the train step (``bertjax compile`` / ``pretrain --dry_run``): the
memory XLA will use per device, and on a (simulated) TPU slice the TPU compiler's own estimate of
the step time, before a job pays for hardware.

With ``devices`` from :func:`bertjax.topology.devices` the real ``jit_train_step`` is lowered and
compiled for any TPU slice on any machine. Every time and rate this module reports for such a
compile comes from XLA's cost model (``cost_analysis()["optimal_seconds"]``): an estimate, labelled
``est_`` in the report, never a measurement.
"""

from __future__ import annotations

import re
import time
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np

from bertjax import checkpointing, flops, gpu_topology, hlo_roofline, sharding, topology
from bertjax.tasks.base import Task
from bertjax.tasks.registry import task_class
from bertjax.train import build, jit_train_step, phase_setup, prepared_task

ESTIMATE_NOTE = "est_* are XLA TPU cost-model estimates (compiled.cost_analysis), not measurements"
KERNEL_COST_NOTE = (
    "declared: the splash kernel's cost is its pl.CostEstimate (bertjax.layers.splash_cost, from "
    "the reference attention), not a measurement of the kernel"
)
# On v4, v5e and v6e the TPU compiler's sliced prefetches (slices of an operand copied into VMEM and
# joined by a ``ConcatBitcast`` custom call) have no cost in its cost model: each adds -1 s to
# ``optimal_seconds``. The same step compiled without them gets a time.
NO_SLICED_PREFETCH = {"xla_tpu_sliced_prefetch_max_slices": 0}
MEMORY_KEYS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "temp_size_in_bytes",
    "alias_size_in_bytes",
    "generated_code_size_in_bytes",
)


def with_overrides(config: ml_collections.ConfigDict, overrides: dict[str, Any]):
    """A copy of ``config`` with dotted keys set (the copy is unlocked, the original untouched)."""
    config = ml_collections.ConfigDict(config.to_dict())
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config


def shapes_only_task(config: ml_collections.ConfigDict, workdir: str | None) -> Task:
    """The config's task for compiling: built from its config alone where it can be
    (``Task.for_compiling``: pretraining reads no corpus or prepared data), else prepared and
    loaded as in training (fine-tuning tasks take their shapes from their data, from the config's
    paths). Nothing is read from or written to ``workdir`` (None is fine)."""
    workdir = workdir or ""
    task = task_class(config.task).for_compiling(config, workdir)
    if task is None:
        return prepared_task(config, workdir)
    task.check()
    return task


def compile_train_step(
    config: ml_collections.ConfigDict,
    workdir: str | None,
    task: Task | None = None,
    *,
    devices: list | None = None,
    phase_index: int = 0,
) -> dict[str, Any]:
    """Lowers and compiles one phase's train step ahead of time; returns a report.

    ``devices``: the mesh's devices (default: this machine's); compile-only TPU devices from
    ``bertjax.topology.devices`` give a TPU slice's memory use and cost-model step time.
    ``workdir``: where this machine's compile prepares the pretraining data it lowers the step
    for; unused with ``devices`` or ``task`` (None).
    """
    if workdir is None and task is None and devices is None:
        raise ValueError(
            "compile without --topology needs --workdir (the data are prepared there); "
            "with --topology it is not used"
        )
    task = task or (
        shapes_only_task(config, workdir) if devices else prepared_task(config, workdir)
    )
    setup = build(config, workdir, task, devices=devices)
    if not 0 <= phase_index < len(setup.phases):
        raise ValueError(f"--phase={phase_index}: the config has {len(setup.phases)} phase(s)")
    phase = setup.phases[phase_index]
    setup = phase_setup(setup, phase)
    accum = config.train.grad_accum_steps
    mesh_devices = list(setup.mesh.devices.flat)
    on_tpu = mesh_devices[0].platform == "tpu"
    arrays = state_arrays(setup.abstract_state, setup.state_shardings)
    report: dict[str, Any] = {
        "devices": len(mesh_devices),
        "device_kind": mesh_devices[0].device_kind,
        "platform": mesh_devices[0].platform,
        "mesh": dict(setup.mesh.shape),
        "phase": phase_index,
        "global_batch_size": phase.global_batch_size,
        "grad_accum_steps": accum,
        "state_bytes_per_device": sum(r["bytes_per_device"] for r in arrays),
    }
    t0 = time.perf_counter()
    try:
        compiled = compile_step(setup, phase, accum)
    except jax.errors.JaxRuntimeError as err:
        oom = out_of_memory(err, topology.hbm_bytes(mesh_devices[0])) if on_tpu else None
        if oom is None:
            raise
        # The TPU compiler refuses a program larger than HBM: that is the answer, not a crash.
        report["compile_seconds"] = round(time.perf_counter() - t0, 2)
        if "temp_size_in_bytes" in oom:  # the state alone is an argument: a lower bound
            oom["hbm_bytes_at_least"] = report["state_bytes_per_device"] + oom["temp_size_in_bytes"]
        return {**report, "hbm_bytes_per_device": None, **oom, "largest_arrays": arrays[:6]}
    compile_seconds = time.perf_counter() - t0
    timed, timed_setup, unroll, est_from = compiled, setup, False, []
    scan = bool(config.model.get("scan_layers"))
    if (accum > 1 or scan) and on_tpu:
        # XLA's cost model counts a loop's body once: time the same step without loops (layers
        # unrolled, micro-batches unrolled), keep the real program's memory.
        if scan:
            unscanned = with_overrides(config, {"model.scan_layers": False})
            twin = build(unscanned, workdir, shapes_only_task(unscanned, workdir), devices=devices)
            timed_setup = phase_setup(twin, phase)
        unroll = True
        timed = compile_step(timed_setup, phase, accum, unroll=True)
        est_from.append("its loops unrolled (the cost model counts a loop once)")
    if on_tpu and _estimate(_costs(timed)) < 0:
        timed = compile_step(timed_setup, phase, accum, unroll=unroll, options=NO_SLICED_PREFETCH)
        est_from.append("no sliced prefetches (the cost model gives them no cost on this chip)")
    report["compile_seconds"] = round(compile_seconds, 2)
    report.update(memory_report(compiled, mesh_devices[0]))
    seq_len, _ = setup.task.step_shape(phase)
    report.update(
        speed_report(
            timed,
            analytic_flops=setup.task.flops_per_step(setup.task.model_config(), phase),
            tokens_per_step=phase.global_batch_size * seq_len,
            devices=mesh_devices,
            peak_tflops=config.train.get("peak_tflops", 0.0),
        )
    )
    if mesh_devices[0].platform == "gpu":
        report.update(
            gpu_report(
                compiled,
                report["analytic_flops_per_step"],
                phase.global_batch_size * seq_len,
                mesh_devices,
            )
        )
    report["largest_arrays"] = arrays[:6]
    if est_from:
        report["est_from"] = "the same step with " + " and ".join(est_from)
    if setup.model.config.attention_impl == "splash":
        report["kernel_cost"] = KERNEL_COST_NOTE
    return report


def compile_step(setup, phase, accum_steps: int, unroll: bool = False, options: dict | None = None):
    """The phase's jitted train step lowered for abstract (sharded) state and batch, compiled
    (``options``: XLA compiler options)."""
    batch = setup.task.init_batch(phase, phase.global_batch_size)
    batch_sharding = sharding.batch_sharding(setup.mesh, setup.rules)
    abstract_batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding) for k, v in batch.items()
    }
    abstract_state = checkpointing.abstract_like(setup.abstract_state, setup.state_shardings)
    step = jit_train_step(setup, accum_steps, unroll=unroll)
    with jax.set_mesh(setup.mesh), nn.logical_axis_rules(setup.rules):
        return step.lower(abstract_state, abstract_batch).compile(compiler_options=options)


def _costs(compiled) -> dict[str, Any]:
    """XLA's cost analysis of the program ({} where there is none)."""
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list | tuple) else costs  # older jax: one per program
    return costs or {}


def _estimate(costs: dict[str, Any]) -> float:
    """``optimal_seconds`` of XLA's cost model (0 where there is none, negative where an op of
    the program has no cost)."""
    return float(costs.get("optimal_seconds", 0.0) or 0.0)


_BYTES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}  # XLA's human-readable sizes


def out_of_memory(err: Exception, capacity: int) -> dict[str, Any] | None:
    """The TPU compiler's "ran out of memory on HBM" error as report fields (``fits`` False, the
    compiler's own sentence, the bytes it says the temporaries need); None for other errors."""
    text = str(err)
    if "RESOURCE_EXHAUSTED" not in text or "memory" not in text.lower():
        return None
    sentence = next(line for line in text.splitlines() if "memory" in line.lower())
    report: dict[str, Any] = {"fits": False, "compile_error": sentence.strip()}
    if capacity:
        report["hbm_capacity_bytes"] = capacity
    needed = re.search(r"required for HLO temporaries \(([\d.]+)([KMGT]?)", text)
    if needed:
        report["temp_size_in_bytes"] = int(float(needed.group(1)) * _BYTES[needed.group(2)])
    return report


def memory_report(compiled, device) -> dict[str, Any]:
    """XLA's per-device memory analysis, the total, and whether it fits the device's HBM."""
    mem = compiled.memory_analysis()
    report = {k: int(getattr(mem, k, 0) or 0) if mem is not None else None for k in MEMORY_KEYS}
    if mem is None:
        return report
    used = (
        report["argument_size_in_bytes"]
        + report["output_size_in_bytes"]
        + report["temp_size_in_bytes"]
        - report["alias_size_in_bytes"]
        + report["generated_code_size_in_bytes"]
    )
    report["hbm_bytes_per_device"] = used
    capacity = topology.hbm_bytes(device) if device.platform in ("tpu", "gpu") else 0
    if capacity:
        report["hbm_capacity_bytes"] = capacity
        report["fits"] = used <= capacity
        report["hbm_headroom_bytes"] = capacity - used
    return report


def speed_report(
    compiled, *, analytic_flops: float, tokens_per_step: int, devices: list, peak_tflops: float
) -> dict[str, Any]:
    """The cost model's step time and what follows from it: tokens/s per chip and MFU.

    MFU = analytic training FLOPs of the step / (estimated step time x chips x peak FLOP/s).
    """
    costs = _costs(compiled)
    est = _estimate(costs)
    chips = len(devices)
    peak = flops.device_peak_tflops(devices[0], peak_tflops) * 1e12
    report: dict[str, Any] = {
        "analytic_flops_per_step": analytic_flops,
        "xla_flops_per_device": float(costs.get("flops", 0.0) or 0.0),
        "peak_flops_per_device": peak,
    }
    if devices[0].platform == "gpu":  # priced from the program instead (gpu_report)
        return report
    if est <= 0:  # CPU: no estimate; TPU: a negative sentinel for ops it cannot price
        if devices[0].platform == "tpu":
            report["est_unavailable"] = (
                f"XLA's cost model gave no step time for {devices[0].device_kind} "
                f"(optimal_seconds={est:g}: some op of the step has no cost on this chip)"
            )
        return report
    report.update(
        est_step_seconds=est,
        est_tokens_per_sec_per_chip=tokens_per_step / est / chips,
        est_mfu=analytic_flops / (est * chips * peak) if peak else None,
        note=ESTIMATE_NOTE,
    )
    return report


def gpu_report(
    compiled, analytic_flops: float, tokens_per_step: int, devices: list
) -> dict[str, Any]:
    """A GPU program's kernel inventory and roofline estimate (XLA's GPU compiler has no cost
    model: :mod:`bertjax.hlo_roofline` reads the optimized program)."""
    chip = gpu_topology.chip_of_kind(devices[0].device_kind)
    program = hlo_roofline.Program(compiled.as_text())
    out: dict[str, Any] = {"kernels": program.inventory()}
    if chip is None:
        out["est_unavailable"] = f"no roofline figures for {devices[0].device_kind}"
        return out
    roof = program.roofline(chip.roofline)
    est = roof.pop("est_step_seconds")
    out.update(
        est_step_seconds=est,
        est_tokens_per_sec_per_chip=tokens_per_step / est / len(devices),
        est_mfu=analytic_flops / (est * len(devices) * chip.roofline.bf16_flops),
        roofline=roof,
        note=hlo_roofline.NOTE,
    )
    return out


def state_arrays(abstract_state, shardings) -> list[dict[str, Any]]:
    """The train state's arrays, largest per device first: path, global shape, spec, bytes."""
    rows = []
    flat = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    for (path, leaf), spec in zip(flat, jax.tree.leaves(shardings)):
        per_device = int(np.prod(spec.shard_shape(leaf.shape))) * leaf.dtype.itemsize
        rows.append(
            {
                "path": jax.tree_util.keystr(path, simple=True, separator="/"),
                "shape": list(leaf.shape),
                "spec": str(tuple(spec.spec)),
                "bytes_per_device": per_device,
            }
        )
    return sorted(rows, key=lambda r: -r["bytes_per_device"])


def _size(num_bytes: int) -> str:
    """Bytes in GiB from 1 GiB up, else in MiB."""
    gib = 1024**3
    return f"{num_bytes / gib:.2f} GiB" if num_bytes >= gib else f"{num_bytes / 2**20:.1f} MiB"


def format_report(report: dict[str, Any], title: str = "") -> str:
    """The human-readable form of a compile report."""
    gib = 1024**3
    lines = [title] if title else []
    lines.append(
        f"devices     {report['devices']} x {report['device_kind']}  mesh {report['mesh']}  "
        f"phase {report['phase']}  global batch {report['global_batch_size']}"
    )
    if report.get("hbm_bytes_per_device") is not None:
        used = report["hbm_bytes_per_device"] / gib
        if "hbm_capacity_bytes" in report:
            cap = report["hbm_capacity_bytes"] / gib
            verdict = "fits" if report["fits"] else "DOES NOT FIT"
            lines.append(
                f"memory      {used:.2f} GiB per device of {cap:.1f} GiB: {verdict} "
                f"(headroom {report['hbm_headroom_bytes'] / gib:+.2f} GiB)"
            )
        else:
            lines.append(f"memory      {used:.2f} GiB per device")
        lines.append(
            f"            (arguments {_size(report['argument_size_in_bytes'])}, temporaries "
            f"{_size(report['temp_size_in_bytes'])}, code "
            f"{_size(report['generated_code_size_in_bytes'])}: as the compiler lays the step out "
            f"for {report['device_kind']}; another chip's differs)"
        )
    if "compile_error" in report:
        lines.append(f"memory      DOES NOT FIT: {report['compile_error']}")
    if "est_step_seconds" in report:
        mfu = report["est_mfu"]
        lines.append(
            f"est. step   {report['est_step_seconds'] * 1e3:.1f} ms, "
            f"{report['est_tokens_per_sec_per_chip']:,.0f} tokens/s per chip, "
            + (f"MFU {mfu:.1%}" if mfu is not None else "MFU unknown (no peak for this device)")
        )
        lines.append(f"            ({report.get('note', ESTIMATE_NOTE)})")
        if "est_from" in report:  # the memory above is always the real program's
            lines.append(
                f"            (est. from {report['est_from']}; the memory is the step's as it runs)"
            )
        if "kernel_cost" in report:
            lines.append(f"            (kernel cost {report['kernel_cost']})")
    if "est_unavailable" in report:
        lines.append(f"est. step   unavailable: {report['est_unavailable']}")
    if "kernels" in report:  # a GPU program's inventory (bertjax.hlo_roofline)
        k = report["kernels"]
        lines.append(
            f"kernels     {k['kernels']}: {k['fusions']} fusions, {k['copies']} copies, "
            f"{k['transposes']} transposes, scatters {k['scatters'] or 'none'}, "
            f"custom calls {k['custom_calls'] or 'none'}, collectives {k['collectives'] or 'none'}"
        )
        for row in report.get("roofline", {}).get("top_kernels", [])[:5]:
            lines.append(f"  {row['est_us']:9.1f} us x{row['runs']}  {row['name']}  {row['op']}")
    lines.append(f"compiled in {report['compile_seconds']:.1f} s")
    lines.append("largest state arrays per device:")
    for row in report["largest_arrays"]:
        lines.append(
            f"  {row['bytes_per_device'] / 2**20:9.1f} MiB  {row['path']} {row['shape']} "
            f"spec {row['spec']}"
        )
    return "\n".join(lines)

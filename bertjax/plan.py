"""``bertjax plan``: which mesh, remat policy, micro-batch, layer scan and attention kernel to train
a config with on a TPU slice, by compiling candidates for the simulated slice and ranking those
that fit by the TPU compiler's estimated step time (XLA's cost model: estimates, not measurements).

The search keeps the config's global batch (micro-batches by ``train.grad_accum_steps``) and its
model; it changes only how the step is laid out and computed, so every candidate trains the same
model on the same data. Candidates are ordered cheapest-first (no remat, no accumulation, plain
data parallelism) and compiled until ``max_candidates`` or ``budget_seconds`` is reached.
"""

from __future__ import annotations

import concurrent.futures as futures
import itertools
import multiprocessing
import time
from typing import Any

import ml_collections

from bertjax import models, topology

SEARCH_KEYS = (
    "mesh.data",
    "mesh.fsdp",
    "mesh.tensor",
    "model.remat",
    "train.grad_accum_steps",
    "model.scan_layers",
    "model.attention_impl",
)
REMATS = ("none", "dots", "full")


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


def candidates(config: ml_collections.ConfigDict, chips: int) -> list[dict[str, Any]]:
    """Every layout worth compiling for ``chips`` devices, the likely fastest first.

    Order: fewer micro-batches, then less recomputation, then the mesh (pure data parallel, fsdp
    over all chips, then mixes with tensor parallelism), then scan and the attention kernel.
    """
    phases = config.data.get("phases") or ()
    seqs = [p.get("max_seq_length", config.data.max_seq_length) for p in phases] or [
        config.data.max_seq_length
    ]
    cfg = models.model_config_from(config.model, int(config.data.vocab_size))
    global_batch = int(config.train.global_batch_size)
    heads = cfg.num_heads
    meshes = []
    for tensor in (1, 2, 4, 8):
        if chips % tensor or heads % tensor:
            continue
        rest = chips // tensor
        fsdps = [1, rest] + [f for f in (2, 4, 8, 16, 32, 64) if f < rest and rest % f == 0]
        for fsdp in dict.fromkeys(fsdps):
            meshes.append((rest // fsdp, fsdp, tensor))
    accums = [a for a in (1, 2, 4, 8, 16, 32) if global_batch % a == 0]
    scans = (False, True) if cfg.architecture == "bert" else (False,)  # modernbert: no scan
    attentions = ("xla", "splash") if all(s % 128 == 0 for s in seqs) else ("xla",)
    out = []
    for accum, remat, (data, fsdp, tensor), scan, attention in itertools.product(
        accums, REMATS, meshes, scans, attentions
    ):
        if (global_batch // accum) % (data * fsdp):
            continue  # each micro-batch must split evenly over the batch devices
        out.append(
            {
                "mesh.data": data,
                "mesh.fsdp": fsdp,
                "mesh.tensor": tensor,
                "model.remat": remat,
                "train.grad_accum_steps": accum,
                "model.scan_layers": scan,
                "model.attention_impl": attention,
            }
        )
    return out


def _compile_one(config_dict: dict, workdir: str, slice_args: tuple, phase_index: int) -> dict:
    """One candidate, compiled in this process (also the worker of a process pool)."""
    from bertjax import compile as aot

    config = ml_collections.ConfigDict(config_dict)
    devices = topology.devices(topology.parse(*slice_args))
    try:
        return aot.compile_train_step(config, workdir, devices=devices, phase_index=phase_index)
    except Exception as err:  # noqa: BLE001  (a candidate that fails to compile is a result)
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def run(
    config: ml_collections.ConfigDict,
    workdir: str,
    slice_: topology.Slice,
    *,
    phase_index: int = 0,
    budget_seconds: float = 1800.0,
    max_candidates: int = 24,
    jobs: int = 1,
    search: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Compiles candidates for ``slice_`` and ranks them; returns the table and the winner."""
    chips = len(topology.devices(slice_))
    search = (search if search is not None else candidates(config, chips))[:max_candidates]
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    slice_args = (slice_.name, slice_.num_slices)

    def record(overrides, report):
        row = {"overrides": overrides}
        row.update(
            {
                k: report.get(k)
                for k in (
                    "error",
                    "fits",
                    "hbm_bytes_per_device",
                    "hbm_capacity_bytes",
                    "est_step_seconds",
                    "est_tokens_per_sec_per_chip",
                    "est_mfu",
                    "compile_seconds",
                )
            }
        )
        rows.append(row)

    if jobs <= 1:
        for overrides in search:
            if time.perf_counter() - start > budget_seconds:
                break
            report = _compile_one(
                with_overrides(config, overrides).to_dict(), workdir, slice_args, phase_index
            )
            record(overrides, report)
    else:
        # Each worker is a fresh process holding its own libtpu; they may share the lock file.
        ctx = multiprocessing.get_context("spawn")
        with futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            pending = {}
            queue = list(search)
            while queue or pending:
                while queue and len(pending) < jobs:
                    if time.perf_counter() - start > budget_seconds:
                        queue.clear()
                        break
                    overrides = queue.pop(0)
                    cfg = with_overrides(config, overrides).to_dict()
                    fut = pool.submit(_compile_one, cfg, workdir, slice_args, phase_index)
                    pending[fut] = overrides
                if not pending:
                    break
                done, _ = futures.wait(pending, return_when=futures.FIRST_COMPLETED)
                for fut in done:
                    record(pending.pop(fut), fut.result())
    ranked = sorted(
        (r for r in rows if r.get("fits")), key=lambda r: r.get("est_step_seconds") or 1e9
    )
    return {
        "topology": slice_.describe(),
        "phase": phase_index,
        "searched": len(rows),
        "of": len(search),
        "seconds": round(time.perf_counter() - start, 1),
        "ranked": ranked,
        "rejected": [r for r in rows if not r.get("fits")],
        "best_overrides": overrides_flags(ranked[0]["overrides"]) if ranked else None,
        "note": "est_* are XLA TPU cost-model estimates, not measurements",
    }


def overrides_flags(overrides: dict[str, Any]) -> str:
    """``--config.key=value`` flags to paste."""
    return " ".join(f"--config.{k}={v}" for k, v in overrides.items())


def format_table(result: dict[str, Any]) -> str:
    """The ranked candidates as a table, then the winning overrides."""
    gib = 1024**3
    lines = [
        f"plan for {result['topology']}, phase {result['phase']}: compiled {result['searched']} "
        f"of {result['of']} candidates in {result['seconds']:.0f} s "
        "(est. = XLA TPU cost-model estimates)",
        f"{'rank':>4} {'est. ms':>8} {'est. MFU':>8} {'tok/s/chip':>11} {'HBM GiB':>8}  layout",
    ]
    for i, row in enumerate(result["ranked"], 1):
        o = row["overrides"]
        layout = (
            f"mesh {o['mesh.data']}x{o['mesh.fsdp']}x{o['mesh.tensor']} remat={o['model.remat']} "
            f"accum={o['train.grad_accum_steps']} scan={o['model.scan_layers']} "
            f"attn={o['model.attention_impl']}"
        )
        mfu = row.get("est_mfu")
        lines.append(
            f"{i:>4} {row['est_step_seconds'] * 1e3:8.1f} "
            f"{(f'{mfu:.1%}' if mfu is not None else '?'):>8} "
            f"{row['est_tokens_per_sec_per_chip']:11,.0f} "
            f"{row['hbm_bytes_per_device'] / gib:8.2f}  {layout}"
        )
    for row in result["rejected"]:
        o = row["overrides"]
        why = row.get("error") or (
            f"needs {row['hbm_bytes_per_device'] / gib:.1f} GiB of "
            f"{row['hbm_capacity_bytes'] / gib:.0f}"
        )
        lines.append(f"   - does not fit: {overrides_flags(o)}: {why}")
    if result["best_overrides"]:
        lines.append(f"best: {result['best_overrides']}")
    else:
        lines.append("no candidate fits: a larger slice, or a smaller global batch or sequence")
    return "\n".join(lines)

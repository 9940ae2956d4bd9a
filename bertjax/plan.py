"""``bertjax plan``: which mesh, remat policy, micro-batch, layer scan and attention kernel to train
a config with on a TPU slice, by compiling candidates for the simulated slice and ranking those
that fit by the TPU compiler's estimated step time (XLA's cost model: estimates, not measurements).

The search keeps the config's global batch (micro-batches by ``train.grad_accum_steps``) and its
model; it changes only how the step is laid out and computed, so every candidate trains the same
model on the same data. Candidates are ordered cheapest-first (no remat, no accumulation, plain
data parallelism) and compiled until ``max_candidates`` or ``budget_seconds`` is reached; a line
per compiled candidate (fits or not, its memory, its estimated step time, the time spent) goes to
``progress`` (stderr by default, so that ``plan --json`` prints one JSON object on stdout).
"""

from __future__ import annotations

import concurrent.futures as futures
import itertools
import math
import multiprocessing
import sys
import time
from collections.abc import Callable
from typing import Any

import ml_collections

from bertjax import compile as aot
from bertjax import hlo_roofline, models, topology
from bertjax.compile import with_overrides

SEARCH_KEYS = (
    "mesh.data",
    "mesh.fsdp",
    "mesh.tensor",
    "model.remat",
    "train.grad_accum_steps",
    "model.scan_layers",
    "model.attention_impl",
)
REMATS = ("none", "dots", "full")  # least recomputation (and most memory) first
ROW_KEYS = (
    "error",
    "fits",
    "hbm_bytes_per_device",
    "hbm_capacity_bytes",
    "hbm_bytes_at_least",
    "compile_error",
    "est_step_seconds",
    "est_tokens_per_sec_per_chip",
    "est_mfu",
    "compile_seconds",
    "est_unavailable",
)


def lower_bound_bytes(cfg, seq: int, micro_batch: int, state_shards: int, remat: str) -> float:
    """A lower bound of a candidate's HBM per device, to skip compiles that cannot fit: the fp32
    parameters, gradients and two Adam moments (16 bytes a parameter) over the devices that shard
    them, plus half of Megatron-LM's activation count without remat (34 s h + 5 a s^2 bytes per
    sequence and layer in 16-bit; Korthikanti et al. 2022) or one layer's input per layer with it."""
    state = 16.0 * cfg.num_params() / state_shards
    h, a, layers = cfg.hidden_size, cfg.num_heads, cfg.num_layers
    per_layer = 34 * seq * h + 5 * a * seq * seq if remat == "none" else 2 * seq * h
    return state + 0.5 * layers * micro_batch * per_layer


def candidates(
    config: ml_collections.ConfigDict, chips: int, hbm_bytes: int = 0, platform: str = "tpu"
) -> list[dict[str, Any]]:
    """Every layout worth compiling for ``chips`` devices, the likely fastest first.

    Order: unscanned layers and the XLA attention first, then fewer micro-batches, then less
    recomputation, then the mesh (pure data parallel, fsdp over all chips, mixes, then with
    tensor parallelism).
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
    scans = (False, True) if models.architecture(cfg).can_scan else (False,)
    # A kernel only where it runs in training: with attention dropout, training attention takes
    # the explicit path whatever attention_impl says (on a GPU, unless dropout_impl=kernel puts
    # the dropout in cuDNN's kernel). Splash: sequences of 128-multiples; cuDNN: bf16/fp16.
    if platform == "gpu":
        kernel_dropout = getattr(cfg, "dropout_impl", "") == "kernel"
        kernel_ok = cfg.dtype in ("bfloat16", "float16") and (
            not cfg.attention_dropout or kernel_dropout
        )
        # cuDNN first (the fast path); with dropout_impl=kernel it is the only valid one
        attentions = ("cudnn",) if kernel_dropout else ("cudnn", "xla") if kernel_ok else ("xla",)
    else:
        kernel_ok = all(s % 128 == 0 for s in seqs) and not cfg.attention_dropout
        attentions = ("xla", "splash") if kernel_ok else ("xla",)
    out = []
    for scan, attention, accum, remat, (data, fsdp, tensor) in itertools.product(
        scans, attentions, accums, REMATS, meshes
    ):
        if (global_batch // accum) % (data * fsdp):
            continue  # each micro-batch must split evenly over the batch devices
        micro = global_batch // accum // (data * fsdp)
        if hbm_bytes and lower_bound_bytes(cfg, max(seqs), micro, fsdp * tensor, remat) > hbm_bytes:
            continue  # cannot fit: not worth a compile
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
    config = ml_collections.ConfigDict(config_dict)
    devices = topology.devices(topology.parse(*slice_args))
    try:
        return aot.compile_train_step(config, workdir, devices=devices, phase_index=phase_index)
    except Exception as err:  # noqa: BLE001  (a candidate that fails to compile is a result)
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def dominated(candidate: dict[str, Any], outcome: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether ``outcome`` of ``candidate`` makes compiling ``other`` pointless.

    It fit: the same mesh with as much or more recomputation and as many or more micro-batches is
    only slower. It ran out of memory: the same micro-batches, as little or less recomputation and
    no more state sharding (same tensor axis) holds at least as much per device.
    """

    def layout(c):
        return c["mesh.tensor"], c["model.scan_layers"], c["model.attention_impl"]

    if layout(other) != layout(candidate) or other == candidate:
        return False
    frugal = REMATS.index(other["model.remat"]) - REMATS.index(candidate["model.remat"])
    accum = other["train.grad_accum_steps"] - candidate["train.grad_accum_steps"]
    same_mesh = all(other[k] == candidate[k] for k in ("mesh.data", "mesh.fsdp"))
    if outcome.get("fits"):
        return same_mesh and frugal >= 0 and accum >= 0
    if not _out_of_memory(outcome):
        return False
    return accum == 0 and frugal <= 0 and other["mesh.fsdp"] <= candidate["mesh.fsdp"]


def _out_of_memory(outcome: dict[str, Any]) -> bool:
    error = outcome.get("error") or ""
    return outcome.get("fits") is False or "RESOURCE_EXHAUSTED" in error or "memory" in error


class NothingFits(ValueError):
    """No candidate of a plan fits the slice (or none was compiled): the one-line reason."""


def to_stderr(line: str) -> None:
    """The default ``progress`` of :func:`run`: the line on stderr (stdout keeps the report)."""
    print(line, file=sys.stderr, flush=True)


def run(
    config: ml_collections.ConfigDict,
    workdir: str | None,
    slice_: topology.Slice | topology.gpu_topology.GpuSystem,
    *,
    phase_index: int = 0,
    budget_seconds: float = 1800.0,
    max_candidates: int = 24,
    jobs: int = 1,
    search: list[dict[str, Any]] | None = None,
    progress: Callable[[str], None] | None = to_stderr,
) -> dict[str, Any]:
    """Compiles candidates for ``slice_`` (skipping those an outcome already decides, see
    ``dominated``) and ranks those that fit by estimated step time.

    ``workdir`` is not read or written (compiling for a slice needs no data; None is fine).
    ``progress``: called with a line when the search starts, per compiled candidate and when it
    stops early (None: silent). ``stopped_by`` in the result names the limit that ended the search
    (None: every candidate was compiled or decided), ``not_tried`` counts what it left.
    """
    for flag, value in (
        ("budget_seconds", budget_seconds),
        ("max_candidates", max_candidates),
        ("jobs", jobs),
    ):
        if not value > 0:
            raise ValueError(f"--{flag}={value}: must be positive")
    say = progress or (lambda line: None)
    devices = topology.devices(slice_)
    capacity = topology.hbm_bytes(devices[0])
    if search is None:
        search = candidates(config, len(devices), capacity, devices[0].platform)
    queue = list(search)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    slice_args = (slice_.name, slice_.num_slices)
    stopped_by: list[str] = []  # the limit that ended the search, if one did
    limit = min(max_candidates, len(search))
    say(
        f"plan: compiling up to {limit} of {len(search)} candidates for {slice_.describe()}, "
        f"phase {phase_index}, within {budget_seconds:g} s"
    )

    def record(overrides, report):
        row = {"overrides": overrides}
        row.update({k: report.get(k) for k in ROW_KEYS})
        if not row.get("fits"):
            row["reason"] = _why_rejected(row)
        rows.append(row)
        queue[:] = [c for c in queue if not dominated(overrides, report, c)]
        spent = time.perf_counter() - start
        say(
            f"plan: candidate {len(rows)}/{limit} {layout(overrides)}: {_outcome(row)} "
            f"[{spent:.0f} s of {budget_seconds:g} s]"
        )

    pending: dict[futures.Future, dict[str, Any]] = {}

    def take() -> dict[str, Any] | None:
        """The next candidate to compile; None once the queue, the count or the time is spent."""
        if not queue:
            return None
        if len(rows) + len(pending) >= max_candidates:
            stopped_by[:] = ["max_candidates"]
            return None
        if time.perf_counter() - start > budget_seconds:
            stopped_by[:] = ["budget_seconds"]
            return None
        return queue.pop(0)

    def compile_args(overrides):
        return with_overrides(config, overrides).to_dict(), workdir, slice_args, phase_index

    if jobs <= 1:
        while (overrides := take()) is not None:
            record(overrides, _compile_one(*compile_args(overrides)))
    else:
        # Each worker is a fresh process with its own compile-only libtpu.
        ctx = multiprocessing.get_context("spawn")
        with futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            while True:
                while len(pending) < jobs and (overrides := take()) is not None:
                    pending[pool.submit(_compile_one, *compile_args(overrides))] = overrides
                if not pending:
                    break
                done, _ = futures.wait(pending, return_when=futures.FIRST_COMPLETED)
                for fut in done:
                    record(pending.pop(fut), fut.result())
    if queue and stopped_by:
        say(f"plan: stopped at --{stopped_by[0]}: {len(queue)} candidate(s) not tried")
    # By estimated step time; where the chip's cost model gives none (see compile's
    # est_unavailable), in search order: less recomputation and fewer micro-batches first.
    ranked = sorted(
        (r for r in rows if r.get("fits")), key=lambda r: r.get("est_step_seconds") or math.inf
    )
    return {
        "topology": slice_.describe(),
        "phase": phase_index,
        "searched": len(rows),
        "of": len(search),
        "seconds": round(time.perf_counter() - start, 1),
        "budget_seconds": budget_seconds,
        "max_candidates": max_candidates,
        "hbm_capacity_bytes": capacity,
        "stopped_by": stopped_by[0] if queue and stopped_by else None,
        "not_tried": len(queue),
        "ranked": ranked,
        "rejected": [r for r in rows if not r.get("fits")],
        "best_overrides": overrides_flags(ranked[0]["overrides"]) if ranked else None,
        "platform": devices[0].platform,
        "note": (
            "est_* are XLA TPU cost-model estimates, not measurements"
            if devices[0].platform == "tpu"
            else hlo_roofline.NOTE
        ),
    }


def verdict(result: dict[str, Any]) -> str:
    """One line: the flags of the best candidate, or why there is none."""
    if result["best_overrides"]:
        return f"best: {result['best_overrides']}"
    searched, left, by = result["searched"], result.get("not_tried"), result.get("stopped_by")
    limit = f"--{by}={result.get(by)}" if by else ""
    if not result["of"]:
        cap = result.get("hbm_capacity_bytes", 0) / topology.GIB
        return (
            f"no candidate can fit: each layout's lower bound exceeds the {cap:.2f} GiB per device "
            "(nothing compiled): a larger slice, or a smaller global batch or sequence"
        )
    if not searched:
        return f"no candidate compiled: the {limit} s budget ran out before the first one"
    if left and by:
        return (
            f"none of the {searched} compiled candidates fits; {limit} stopped the search with "
            f"{left} not tried: raise {limit.split('=')[0]} to try them"
        )
    return (
        f"no candidate fits (all {searched} compiled): a larger slice, or a smaller global batch "
        "or sequence"
    )


def require_fit(result: dict[str, Any]) -> None:
    """Raises :class:`NothingFits` with :func:`verdict`'s line where no candidate fits (``plan``
    prints its report, then exits non-zero)."""
    if not result["best_overrides"]:
        raise NothingFits(f"plan for {result['topology']}: {verdict(result)}")


def layout(overrides: dict[str, Any]) -> str:
    """A candidate in a few words: mesh data x fsdp x tensor, remat, micro-batches, scan, kernel."""
    o = overrides
    return (
        f"mesh {o['mesh.data']}x{o['mesh.fsdp']}x{o['mesh.tensor']} remat={o['model.remat']} "
        f"accum={o['train.grad_accum_steps']} scan={o['model.scan_layers']} "
        f"attn={o['model.attention_impl']}"
    )


def _outcome(row: dict[str, Any]) -> str:
    """A compiled candidate's outcome: fits with its memory and est. step time, or why not."""
    if not row.get("fits"):
        return f"does not fit: {row['reason']}"
    gib = topology.GIB
    used = f"{row['hbm_bytes_per_device'] / gib:.2f} GiB per device"
    if row.get("hbm_capacity_bytes"):
        used += f" of {row['hbm_capacity_bytes'] / gib:.2f}"
    est = row.get("est_step_seconds")
    return f"fits, {used}, " + (f"est. {est * 1e3:.1f} ms a step" if est else "no est. step time")


def overrides_flags(overrides: dict[str, Any]) -> str:
    """``--config.key=value`` flags to paste."""
    return " ".join(f"--config.{k}={v}" for k, v in overrides.items())


def _why_rejected(row: dict[str, Any]) -> str:
    """Why a candidate does not fit: its error, its measured size, the lower bound from the TPU
    compiler's refusal (``compile.out_of_memory``), or the refusal's sentence; each size against
    the HBM a device has."""
    if row.get("error"):
        return row["error"]
    gib = topology.GIB
    cap = f"{(row.get('hbm_capacity_bytes') or 0) / gib:.2f} GiB available"
    if row.get("hbm_bytes_per_device") is not None:
        return f"needs {row['hbm_bytes_per_device'] / gib:.2f} GiB per device, {cap}"
    if row.get("hbm_bytes_at_least"):
        at_least = row["hbm_bytes_at_least"] / gib
        return f"needs at least {at_least:.2f} GiB per device, {cap} (the TPU compiler refused it)"
    return row.get("compile_error") or "the TPU compiler refused it"


def format_table(result: dict[str, Any]) -> str:
    """The ranked candidates as a table, the rejected ones with why, then :func:`verdict`."""
    gib = topology.GIB
    lines = [
        f"plan for {result['topology']}, phase {result['phase']}: compiled {result['searched']} "
        f"of {result['of']} candidates in {result['seconds']:.0f} s "
        + (
            "(est. = roofline lower bounds of the GPU program)"
            if result.get("platform") == "gpu"
            else "(est. = XLA TPU cost-model estimates)"
        ),
        f"{'rank':>4} {'est. ms':>8} {'est. MFU':>8} {'tok/s/chip':>11} {'HBM GiB':>8}  layout",
    ]
    for i, row in enumerate(result["ranked"], 1):
        mfu, est, tps = (
            row.get("est_mfu"),
            row.get("est_step_seconds"),
            row.get("est_tokens_per_sec_per_chip"),
        )
        lines.append(
            f"{i:>4} {(f'{est * 1e3:.1f}' if est else '-'):>8} "
            f"{(f'{mfu:.1%}' if mfu is not None else '-'):>8} "
            f"{(f'{tps:,.0f}' if tps else '-'):>11} "
            f"{row['hbm_bytes_per_device'] / gib:8.2f}  {layout(row['overrides'])}"
        )
    for row in result["rejected"]:
        why = row.get("reason") or _why_rejected(row)
        lines.append(f"   - does not fit: {overrides_flags(row['overrides'])}: {why}")
    if any(r.get("est_unavailable") for r in result["ranked"]):
        lines.append(
            "(-: XLA's cost model gives no step time for this chip; ranked in search order)"
        )
    lines.append(verdict(result))
    return "\n".join(lines)

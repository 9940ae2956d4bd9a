"""The one trainer: pretraining and every fine-tuning task run through ``train_and_evaluate``.

A task (``bertjax.tasks.base.Task``) supplies the model head, loss, data and evaluation;
``bertjax.train_step`` builds the mesh, the sharded train state and the pure jitted ``train_step``;
this module runs the phases' loop: the console and metrics, evaluation and checkpoint/resume
(re-running on the same WORKDIR continues; SIGTERM saves, then exits).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from bertjax import atomic, checkpointing, flops, fs, sharding
from bertjax.metrics_logging import Eta, MetricsWriter, Throughput
from bertjax.preemption import PreemptionRequested, StopFlag
from bertjax.train_step import (
    Setup,
    TrainState,
    build,
    check_batch_size,
    jit_train_step,
    make_train_step,
    phase_setup,
    prepared_task,
)
from bertjax.workdir_lock import WorkdirLock

__all__ = [
    "PhaseResult",
    "Setup",
    "TrainState",
    "build",
    "jit_train_step",
    "make_train_step",
    "phase_setup",
    "prepared_task",
    "train_and_evaluate",
]

log = logging.getLogger("bertjax")


def _host_metrics(sums: dict, count: int) -> dict[str, float]:
    values = jax.device_get(sums)
    return {k: float(v) / count for k, v in values.items()}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains (resuming from WORKDIR if it holds a checkpoint), evaluates, checkpoints.

    Returns the last train and eval metrics. WORKDIR is locked for the run (``WorkdirLock``). A run
    that fails before writing anything (a bad config value, a missing data file) removes the
    folders it created for WORKDIR; a folder that was there before, or holds a file, is kept.
    """
    check_batch_size("train.global_batch_size", config.train.global_batch_size)  # before prepare
    created = fs.missing_folders(workdir)
    fs.makedirs(workdir)
    try:
        with WorkdirLock(workdir):
            return _train_and_evaluate(config, workdir)
    except BaseException:
        fs.remove_empty_folders(created)
        raise


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    task = prepared_task(config, workdir)
    setup = build(config, workdir, task)
    tcfg = config.train
    writer = MetricsWriter(workdir, tensorboard=config.get("tensorboard", True))
    ckpt = checkpointing.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        keep=tcfg.keep_checkpoints,
        async_save=tcfg.async_checkpoints,
    )
    config_json = config.to_json_best_effort(sort_keys=True)
    total_steps = setup.phases[-1].until_step
    latest = ckpt.latest_step()
    finished = _finished_results(workdir, latest, total_steps)
    if finished is not None:  # a rerun of a finished run: said, not redone
        ckpt.close()
        writer.close()
        return {"final": finished, "step": latest}
    data_state: dict = {}
    if latest is not None:
        abstract = checkpointing.abstract_like(setup.abstract_state, setup.state_shardings)
        state, data_state, _, start = ckpt.restore_newest(abstract)
        writer.truncate_after(start)
        log.info("resumed from %s at step %d", ckpt.directory, start)
    else:
        state = setup.init_state(jax.random.key_data(jax.random.key(tcfg.seed)))
        start = 0
        writer.truncate_after(-1)  # rows of an earlier run that saved no checkpoint: redone now
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(setup.abstract_state.params))
    log.info(
        "task %s: %s parameters, mesh %s, %d steps",
        task.describe(),
        f"{n_params:,}",
        dict(setup.mesh.shape),
        total_steps,
    )
    best = checkpointing.BestCheckpoint(task.best_metric(), workdir)
    stop = StopFlag()
    stop.install()
    result: dict[str, Any] = {}
    step = start
    peak = flops.device_peak_tflops(override=tcfg.get("peak_tflops", 0.0))
    run = _Run(setup, config, writer, ckpt, stop, config_json, peak, best, Eta(total_steps))
    halted = False
    try:
        for phase_index, phase in enumerate(setup.phases):
            if step >= phase.until_step:
                continue
            done = _run_phase(run, phase, phase_index, state, step, data_state)
            state, step = done.state, done.step
            result = {"train": done.train, "eval": done.eval}
            data_state = {}
            if done.halted:
                halted = True
                break
        ckpt.wait()
        if not halted:
            final = _finalize(setup, state, best, workdir, config_json, step, run.final_eval)
            if final:
                result["final"] = final
    except BaseException:
        stop.restore()
        _close_after_error(ckpt, writer)
        raise
    stop.restore()
    ckpt.close()
    writer.close()
    result["step"] = step
    return result


def _close_after_error(*closables) -> None:
    """Closes each of ``closables`` after an error stopped the run: one that fails too (its
    bucket still down, say) is logged in one line, so that the error reported is the one that
    stopped the run."""
    for closable in closables:
        try:
            closable.close()
        except Exception as err:  # noqa: BLE001
            log.warning("closing the %s failed too: %s", type(closable).__name__, err)


@dataclasses.dataclass
class _Run:
    """What every phase of one ``train_and_evaluate`` call shares."""

    setup: Setup
    config: ml_collections.ConfigDict
    writer: MetricsWriter
    ckpt: checkpointing.Checkpointer
    stop: StopFlag
    config_json: str
    peak: float
    best: Any
    eta: Eta
    # The final evaluation's model outputs by batch, and its step: finalize reuses them when it
    # scores the same params (the best are the last), instead of evaluating them again.
    final_eval: tuple[int, dict] | None = None


def _finished_results(workdir: str, latest: int | None, total_steps: int) -> dict | None:
    """The results of a run that already finished in ``workdir`` (its last checkpoint at the last
    step and its ``eval_results.json`` written), logged as such; None for a run with work left."""
    path = os.path.join(workdir, "eval_results.json")
    if latest is None or latest < total_steps or not fs.exists(path):
        return None
    try:
        results = json.loads(fs.read_bytes(path))
    except ValueError as err:
        raise fs.json_error(path, err) from None
    log.info(
        "%s: the run finished at step %d and its results are in eval_results.json: nothing to do "
        "(delete that file to evaluate the last checkpoint again, or raise train.steps to train on)",
        workdir,
        latest,
    )
    return results


@dataclasses.dataclass(frozen=True)
class PhaseResult:
    """Where a phase left the run: its state and step, its last train and eval metrics, and
    whether ``train.stop_at_step`` halted the run there."""

    state: TrainState
    step: int
    train: dict[str, float]
    eval: dict[str, float]
    halted: bool = False


def batch_shape_text(examples: int, rows: int, seq: int) -> str:
    """The global batch as the start-up line says it: ``batch 32 x seq 128``, or where the batch's
    examples are packed into fewer rows ``batch 32 examples in 8 packed rows x seq 128``."""
    if rows < examples:
        return f"batch {examples} examples in {rows} packed rows x seq {seq}"
    return f"batch {rows} x seq {seq}"


def _compile(p_step, state, batch, phase, phase_index: int, num_phases: int, accum: int) -> None:
    """Compiles the phase's step ahead of its first call (which then finds it compiled), saying
    so first: the first step of a large model waits minutes on the compiler."""
    ids = batch["input_ids"] if "input_ids" in batch else next(iter(batch.values()))
    shape = batch_shape_text(phase.global_batch_size, ids.shape[0], ids.shape[-1])
    micro = f", {accum} micro-batches" if accum > 1 else ""
    log.info(
        "compiling the train step (phase %d/%d, %s%s) ...",
        phase_index + 1,
        num_phases,
        shape,
        micro,
    )
    t0 = time.perf_counter()
    p_step.lower(state, batch).compile()
    log.info("compiled the train step in %.1f s", time.perf_counter() - t0)


def _run_phase(run: _Run, phase, phase_index, state, step, data_state) -> PhaseResult:
    """Runs one phase (fixed shapes) from ``step`` to ``phase.until_step``."""
    setup, config, writer, ckpt, stop = run.setup, run.config, run.writer, run.ckpt, run.stop
    setup = phase_setup(setup, phase)
    config_json = checkpointing.run_config_json(
        run.config_json,
        setup.model.config,
        config,
        getattr(setup.task, "tokenizer", None),
        setup.task.checkpoint_record(),
    )
    peak, best = run.peak, run.best
    task, tcfg = setup.task, config.train
    pcount, pindex = jax.process_count(), jax.process_index()
    if phase.global_batch_size % (pcount * tcfg.grad_accum_steps):
        raise ValueError(
            f"config key train.global_batch_size={phase.global_batch_size} is not divisible by "
            f"processes*grad_accum_steps={pcount}*{tcfg.grad_accum_steps}"
        )
    p_step = jit_train_step(setup, tcfg.grad_accum_steps)  # before the data: a task error first
    data = task.train_data(phase, pindex, pcount)
    if data_state.get("phase") == phase_index and data_state.get("iterator"):
        data.restore(data_state["iterator"])
    eval_every = task.eval_every()
    step_tokens = task.tokens_per_step(phase)
    step_flops = task.flops_per_step(setup.model.config, phase)
    n_devices = len(setup.mesh.devices.flat)
    meter = Throughput()
    sums, count, rows = None, 0, 0  # rows: global batch rows (fewer when batches are packed)
    last_train: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    guard = "disallow" if tcfg.get("transfer_guard", True) else "allow"
    first_step = step

    total = setup.phases[-1].until_step

    def run_eval(params, at_step=-1):
        runner = _runner(setup, params)
        if at_step == total:  # the run's last evaluation: keep its outputs for finalize
            outputs: dict = {}
            run.final_eval = (at_step, outputs)
            runner = _recording(runner, outputs)
        return task.evaluate(runner, phase)

    if step == 0 and eval_every and task.eval_at_start:  # the start of the eval curve
        last_eval = run_eval(state.params)
        if last_eval:
            writer.write(0, last_eval, "eval")
    while step < phase.until_step:
        host_batch = next(data)
        rows += len(host_batch["input_ids"]) * pcount
        batch = sharding.global_batch(host_batch, setup.mesh, setup.rules)
        with (
            jax.set_mesh(setup.mesh),
            nn.logical_axis_rules(setup.rules),
            jax.transfer_guard(guard),
        ):
            if step == first_step:
                n = len(setup.phases)
                _compile(p_step, state, batch, phase, phase_index, n, tcfg.grad_accum_steps)
                meter.reset()
            state, metrics = p_step(state, batch)
        step += 1
        if step == first_step + 1:  # the rate of the steps after the first: the ETA's
            jax.block_until_ready(metrics)
            run.eta.start(step)
        meter.tick()
        sums = metrics if sums is None else jax.tree.map(jnp.add, sums, metrics)
        count += 1
        is_last = step == phase.until_step
        if step % tcfg.log_every == 0 or is_last or step == 1:  # short runs: the first step too
            last_train = _host_metrics(sums, count)
            if not math.isfinite(last_train["loss"]):
                raise FloatingPointError(
                    f"non-finite loss {last_train['loss']} at step {step} (task {task.name}); "
                    "lower optimizer.learning_rate or check the data"
                )
            rates = meter.rates(phase.global_batch_size, step_tokens)
            rows_share = rows / count / phase.global_batch_size  # FLOPs scale with the rows run
            achieved = rates["steps_per_sec"] * step_flops * rows_share / n_devices / 1e12
            last_train.update(rates, tflops_per_device=achieved)
            if peak:
                last_train["mfu"] = achieved / peak
            total = setup.phases[-1].until_step
            writer.write(step, last_train, "train", total, run.eta.seconds_left(step))
            sums, count, rows = None, 0, 0
            meter.reset()
        if (eval_every and step % eval_every == 0) or is_last:
            last_eval = run_eval(state.params, step)
            if last_eval:
                writer.write(step, last_eval, "eval")
                best.update(step, last_eval, state.params, config_json)
            meter.reset()
        the_end = is_last and phase_index + 1 == len(setup.phases)  # a phase boundary may halt
        halting = bool(tcfg.get("stop_at_step", 0)) and step >= tcfg.stop_at_step and not the_end
        stopping = stop.should_stop(step)
        if step % tcfg.checkpoint_every == 0 or is_last or stopping or halting:
            data_pos = {"phase": phase_index, "iterator": data.state()}
            if is_last and phase_index + 1 < len(setup.phases):
                data_pos = {"phase": phase_index + 1, "iterator": {}}
            ckpt.save(step, state, data_pos, config_json, force=True)
        if stopping:
            ckpt.wait()
            raise PreemptionRequested(f"stopped at step {step} after saving a checkpoint")
        if halting:
            log.info(
                "train.stop_at_step=%d reached at step %d: checkpoint saved, stopping",
                tcfg.stop_at_step,
                step,
            )
            return PhaseResult(state, step, last_train, last_eval, halted=True)
    return PhaseResult(state, step, last_train, last_eval)


def _runner(setup: Setup, params):
    """host batch -> host NumPy outputs of ``task.eval_outputs`` (what tasks' evaluate() calls)."""

    def run(batch):
        gb = sharding.global_batch(batch, setup.mesh, setup.rules)
        with jax.set_mesh(setup.mesh), nn.logical_axis_rules(setup.rules):
            return jax.device_get(setup.eval_fn(params, gb))

    return run


def _batch_key(batch: dict) -> bytes:
    """A digest of a host batch (names, shapes, dtypes, bytes): the same batch, the same key."""
    digest = hashlib.sha256()
    for name in sorted(batch):
        value = np.ascontiguousarray(batch[name])
        digest.update(f"{name}{value.shape}{value.dtype}".encode())
        digest.update(value.tobytes())
    return digest.digest()


def _recording(run, outputs: dict):
    """``run`` that keeps each batch's outputs in ``outputs`` by :func:`_batch_key`."""

    def recorded(batch):
        out = run(batch)
        outputs[_batch_key(batch)] = jax.tree.map(lambda x: x, out)  # callers may pop keys
        return out

    return recorded


def _replaying(run, outputs: dict):
    """``run`` that answers a batch it has seen from ``outputs`` (the same params' outputs)."""

    def replayed(batch):
        key = _batch_key(batch)
        return jax.tree.map(lambda x: x, outputs[key]) if key in outputs else run(batch)

    return replayed


def _finalize(
    setup: Setup,
    state: TrainState,
    best: checkpointing.BestCheckpoint,
    workdir: str,
    config_json: str,
    last_step: int,
    final_eval: tuple[int, dict] | None = None,
):
    """Runs task.finalize with the best (or last) params and writes WORKDIR/eval_results.json.

    When those params are the ones the run's last evaluation scored (``final_eval``: its step and
    outputs), finalize reads that evaluation's outputs instead of computing them again."""
    if best.step is not None and best.step == last_step:
        params, chosen = state.params, "best"  # the best are the last: no restore
    else:
        params = best.params(setup.abstract_state.params, setup.state_shardings.params)
        chosen = "best" if params is not None else "last"
        params = state.params if params is None else params
    runner = _runner(setup, params)
    if final_eval is not None and final_eval[0] == last_step and params is state.params:
        log.info(
            "final evaluation: the outputs of step %d's evaluation (the same params)", last_step
        )
        runner = _replaying(runner, final_eval[1])
    final = setup.task.finalize(runner, params, workdir)
    if not final:
        return {}
    final = {
        "params": chosen,
        "best_metric": best.metric and best.metric[0],
        "best_value": best.value,
        **final,
    }
    if jax.process_index() == 0:
        atomic.write_json(os.path.join(workdir, "eval_results.json"), final)
    return final

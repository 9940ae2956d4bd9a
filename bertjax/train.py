"""The one trainer: pretraining and every fine-tuning task run through ``train_and_evaluate``.

A task (``bertjax.tasks.base.Task``) supplies the model head, loss, data and evaluation; this module owns
the mesh, the sharded train state, the pure jitted ``train_step``, logging, evaluation and
checkpoint/resume (re-running on the same WORKDIR continues; SIGTERM saves, then exits).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from bertjax import atomic, checkpointing, flops, fs, sharding
from bertjax.layers.attention import resolve_impl as resolve_attention_impl
from bertjax.layers.core import dtype_of
from bertjax.layers.dropout import resolve_impl as resolve_dropout_impl
from bertjax.metrics_logging import MetricsWriter, Throughput
from bertjax.optim import create_optimizer, global_norm
from bertjax.preemption import PreemptionRequested, StopFlag
from bertjax.tasks.base import Phase, Task
from bertjax.tasks.registry import get_task
from bertjax.workdir_lock import WorkdirLock

log = logging.getLogger("bertjax")


@flax.struct.dataclass
class TrainState:
    """Everything that changes during training (all of it is checkpointed)."""

    step: jax.Array  # [] int32
    params: Any
    opt_state: Any
    rng: jax.Array  # [2] uint32, raw key data (per-step keys are fold_in(rng, step))


@dataclasses.dataclass
class Setup:
    """The pieces ``train_and_evaluate`` and ``bertjax.compile.compile_train_step`` share."""

    task: Task
    model: nn.Module
    mesh: Any
    rules: tuple
    tx: optax.GradientTransformation
    schedule: Callable
    phases: list[Phase]
    abstract_state: Any  # unboxed ShapeDtypeStructs
    state_shardings: Any
    init_state: Callable[[jax.Array], TrainState]
    eval_fn: Callable  # jitted task.eval_outputs(params, batch); shared by evaluation and finalize


def build(
    config: ml_collections.ConfigDict,
    workdir: str,
    task: Task | None = None,
    devices: list | None = None,
) -> Setup:
    """Creates the task, model, mesh, optimizer and the (abstract) sharded train state.

    ``devices``: the mesh's devices (default: ``config.mesh.num_devices`` of ``jax.devices()``);
    compile-only devices of a simulated TPU slice for ahead-of-time compilation.
    """
    _check_batch_size("train.global_batch_size", config.train.global_batch_size)
    task = task or get_task(config.task, config, workdir)
    num = config.mesh.get("num_devices", 0)
    if devices is None and num:
        devices = jax.devices()[:num]
    mesh = sharding.create_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor, devices)
    model_cfg = task.model_config()
    platform = mesh.devices.flat[0].platform
    if getattr(model_cfg, "dropout_impl", None) == "auto":  # the mesh platform's mask generator
        model_cfg = model_cfg.replace(dropout_impl=resolve_dropout_impl("auto", platform))
    if getattr(model_cfg, "attention_impl", None) == "auto":  # the mesh platform's kernel
        impl = resolve_attention_impl("auto", platform, dtype_of(model_cfg.dtype))
        model_cfg = model_cfg.replace(attention_impl=impl)
    impl, rate = model_cfg.attention_impl, model_cfg.attention_dropout
    if impl != "xla" and rate > 0:
        log.warning(
            f"model.attention_impl={impl} is not used in training: model.attention_dropout={rate:g}"
            " > 0 and no fused kernel has attention dropout, so training attention runs on the "
            f"explicit xla path (evaluation uses {impl}); set model.attention_dropout=0 to train "
            "with it"
        )
    model = task.build_model(model_cfg)
    rules = sharding.rules_from_config(config.mesh.get("rules"))
    phases = task.phases()
    for phase in phases:
        _check_batch_size("train.global_batch_size", phase.global_batch_size, mesh, rules)
    total_steps = phases[-1].until_step
    tx, schedule = create_optimizer(config, total_steps, task.warmup_steps(total_steps))
    init_batch = task.init_batch(phases[0], 1)

    def init_boxed(rng):
        params_rng, train_rng = jax.random.split(jax.random.wrap_key_data(rng))
        params = task.fresh_params(model, params_rng, init_batch)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=jax.random.key_data(train_rng),
        )

    rng0 = jax.random.key_data(jax.random.key(config.train.seed))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract_boxed = jax.eval_shape(init_boxed, rng0)
    abstract = nn.meta.unbox(abstract_boxed)
    state_shardings = sharding.logical_shardings(abstract_boxed, mesh, rules)

    def init_state(rng):
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            state = jax.jit(lambda r: nn.meta.unbox(init_boxed(r)), out_shardings=state_shardings)(
                rng
            )
        params = task.start_params(model, state.params)
        if params is not state.params:
            params = jax.device_put(params, state_shardings.params)
            state = state.replace(params=params, opt_state=jax.jit(tx.init)(params))
            state = jax.device_put(state, state_shardings)
        return state

    eval_fn = _jit_eval(task, model, state_shardings, mesh, rules)
    return Setup(
        task,
        model,
        mesh,
        rules,
        tx,
        schedule,
        phases,
        abstract,
        state_shardings,
        init_state,
        eval_fn,
    )


def _jit_eval(task: Task, model: nn.Module, state_shardings, mesh, rules) -> Callable:
    """``task.eval_outputs(params, batch)`` jitted: batch sharded, outputs replicated."""
    return jax.jit(
        lambda params, batch: task.eval_outputs(model, params, batch),
        in_shardings=(state_shardings.params, sharding.batch_sharding(mesh, rules)),
        out_shardings=sharding.replicated(mesh),
    )


def phase_setup(setup: Setup, phase: Phase) -> Setup:
    """The setup of one phase: the task's model for it (``Task.phase_model``, e.g. a larger RoPE
    base for context extension) with its eval function. The phase model must have exactly the
    parameters of the run's model (same names and shapes): a ValueError says which differ."""
    model = setup.task.phase_model(setup.model, phase)
    if model is setup.model:
        return setup
    init_batch = setup.task.init_batch(phase, 1)

    def shapes(m):  # under the run's mesh: the kernels are chosen for its devices (splash on TPU)
        with jax.set_mesh(setup.mesh), nn.logical_axis_rules(setup.rules):
            return jax.eval_shape(
                lambda: setup.task.fresh_params(m, jax.random.key(0), init_batch)
            )

    want, got = nn.meta.unbox(shapes(setup.model)), nn.meta.unbox(shapes(model))
    if jax.tree.structure(want) != jax.tree.structure(got) or any(
        a.shape != b.shape for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got))
    ):
        raise ValueError(
            f"phase until step {phase.until_step}: its model options change the parameters "
            "(only numerics such as RoPE bases, windows and kernels may change between phases)"
        )
    eval_fn = _jit_eval(setup.task, model, setup.state_shardings, setup.mesh, setup.rules)
    return dataclasses.replace(setup, model=model, eval_fn=eval_fn)


def _check_batch_size(key: str, value, mesh=None, rules=None) -> None:
    """One-line ValueError naming ``key`` for a batch that is not a positive integer or that the
    devices sharding the batch do not divide."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"config key {key}={value!r} must be a positive integer")
    if mesh is not None and value % (devices := sharding.batch_devices(mesh, rules)):
        raise ValueError(
            f"config key {key}={value} is not divisible by the {devices} devices that shard the "
            f"batch (mesh {dict(mesh.shape)}); use a multiple of {devices}"
        )


def make_train_step(setup: Setup, accum_steps: int, unroll: bool = False) -> Callable:
    """The pure ``train_step(state, batch) -> (state, metrics)`` of a setup (not yet jitted).

    ``unroll``: the micro-batch loop unrolled (same result), for XLA's TPU cost model, which
    counts a loop's body once."""
    task, model, tx = setup.task, setup.model, setup.tx
    batch_axes = dict(setup.rules).get("batch", ("data", "fsdp"))

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        norms = task.normalizers(batch)
        step_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

        def loss_fn(params, micro, rng):
            return task.loss(model, params, micro, rng, norms, deterministic=False)

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if accum_steps == 1:
            (loss, metrics), grads = grad_fn(state.params, batch, step_rng)
        else:
            # Micro-batch i takes rows i, i+accum, ...: every device keeps its share of each one.
            def split(x):
                x = x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:]).swapaxes(0, 1)
                spec = PartitionSpec(None, batch_axes, *([None] * (x.ndim - 2)))
                return jax.lax.with_sharding_constraint(x, NamedSharding(setup.mesh, spec))

            micro = jax.tree.map(split, batch)

            def body(carry, xs):
                index, mb = xs
                (loss_i, metrics_i), grads_i = grad_fn(
                    state.params, mb, jax.random.fold_in(step_rng, index)
                )
                return jax.tree.map(jnp.add, carry, (loss_i, metrics_i, grads_i)), None

            zero_metrics = jax.eval_shape(
                lambda: grad_fn(state.params, jax.tree.map(lambda x: x[0], micro), step_rng)
            )[0][1]
            init = (
                jnp.zeros((), jnp.float32),
                jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), zero_metrics),
                jax.tree.map(jnp.zeros_like, state.params),
            )
            (loss, metrics, grads), _ = jax.lax.scan(
                body, init, (jnp.arange(accum_steps), micro), unroll=accum_steps if unroll else 1
            )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics)
        metrics.update(
            loss=loss,
            learning_rate=setup.schedule(state.step),
            grad_norm=global_norm(grads),
            param_norm=global_norm(params),
            update_norm=global_norm(updates),
        )
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return train_step


def jit_train_step(setup: Setup, accum_steps: int, unroll: bool = False):
    """``train_step`` jitted with explicit state/batch shardings and the state donated."""
    batch_sharding = sharding.batch_sharding(setup.mesh, setup.rules)
    return jax.jit(
        make_train_step(setup, accum_steps, unroll),
        in_shardings=(setup.state_shardings, batch_sharding),
        out_shardings=(setup.state_shardings, sharding.replicated(setup.mesh)),
        donate_argnums=(0,),
    )


def prepared_task(config: ml_collections.ConfigDict, workdir: str) -> Task:
    """The config's task with its data built (by process 0, the others wait) and loaded."""
    task = get_task(config.task, config, workdir)
    task.check()  # config-only errors before any data work
    if jax.process_index() == 0:
        task.prepare()
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("bertjax: data prepared")
    task.after_prepare()
    return task


def _host_metrics(sums: dict, count: int) -> dict[str, float]:
    values = jax.device_get(sums)
    return {k: float(v) / count for k, v in values.items()}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains (resuming from WORKDIR if it holds a checkpoint), evaluates, checkpoints.

    Returns the last train and eval metrics. WORKDIR is locked for the run (``WorkdirLock``).
    """
    _check_batch_size("train.global_batch_size", config.train.global_batch_size)  # before prepare
    fs.makedirs(workdir)
    with WorkdirLock(workdir):
        return _train_and_evaluate(config, workdir)


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
    data_state: dict = {}
    if ckpt.latest_step() is not None:
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
    t_start = time.perf_counter()
    peak = flops.device_peak_tflops(override=tcfg.get("peak_tflops", 0.0))
    run = _Run(setup, config, writer, ckpt, stop, config_json, t_start, start, peak, best)
    try:
        for phase_index, phase in enumerate(setup.phases):
            if step >= phase.until_step:
                continue
            result = _run_phase(run, phase, phase_index, state, step, data_state)
            state, step = result.pop("_state"), result.pop("_step")
            data_state = {}
            if result.pop("_halted", False):
                ckpt.wait()
                result["step"] = step
                return result
        ckpt.wait()
        final = _finalize(setup, state, best, workdir, config_json)
        if final:
            result["final"] = final
    finally:
        stop.restore()
        ckpt.close()
        writer.close()
    result["step"] = step
    return result


@dataclasses.dataclass
class _Run:
    """What every phase of one ``train_and_evaluate`` call shares."""

    setup: Setup
    config: ml_collections.ConfigDict
    writer: MetricsWriter
    ckpt: checkpointing.Checkpointer
    stop: StopFlag
    config_json: str
    t_start: float
    first_step: int
    peak: float
    best: Any


def _run_phase(run: _Run, phase, phase_index, state, step, data_state) -> dict:
    """Runs one phase (fixed shapes) from ``step`` to ``phase.until_step``."""
    setup, config, writer, ckpt, stop = run.setup, run.config, run.writer, run.ckpt, run.stop
    setup = phase_setup(setup, phase)
    config_json, t_start, first_step, peak, best = (
        checkpointing.run_config_json(run.config_json, setup.model.config, config),
        run.t_start,
        run.first_step,
        run.peak,
        run.best,
    )
    task, tcfg = setup.task, config.train
    pcount, pindex = jax.process_count(), jax.process_index()
    if phase.global_batch_size % (pcount * tcfg.grad_accum_steps):
        raise ValueError(
            f"config key train.global_batch_size={phase.global_batch_size} is not divisible by "
            f"processes*grad_accum_steps={pcount}*{tcfg.grad_accum_steps}"
        )
    data = task.train_data(phase, pindex, pcount)
    if data_state.get("phase") == phase_index and data_state.get("iterator"):
        data.restore(data_state["iterator"])
    p_step = jit_train_step(setup, tcfg.grad_accum_steps)
    eval_every = task.eval_every()
    seq_len, masked = task.step_shape(phase)
    step_flops = task.flops_per_step(setup.model.config, phase)
    n_devices = len(setup.mesh.devices.flat)
    meter = Throughput()
    sums, count, rows = None, 0, 0  # rows: global batch rows (fewer when batches are packed)
    last_train: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    guard = "disallow" if tcfg.get("transfer_guard", True) else "allow"

    def run_eval(params):
        return task.evaluate(_runner(setup, params), phase)

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
            state, metrics = p_step(state, batch)
        step += 1
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
            rates = meter.rates(phase.global_batch_size, seq_len)
            rows_share = rows / count / phase.global_batch_size  # FLOPs scale with the rows run
            achieved = rates["steps_per_sec"] * step_flops * rows_share / n_devices / 1e12
            last_train.update(rates, tflops_per_device=achieved)
            if peak:
                last_train["mfu"] = achieved / peak
            writer.write(
                step,
                last_train,
                "train",
                setup.phases[-1].until_step,
                time.perf_counter() - t_start if step > first_step else None,
            )
            sums, count, rows = None, 0, 0
            meter.reset()
        if (eval_every and step % eval_every == 0) or is_last:
            last_eval = run_eval(state.params)
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
            return {
                "_state": state,
                "_step": step,
                "train": last_train,
                "eval": last_eval,
                "_halted": True,
            }
    return {"_state": state, "_step": step, "train": last_train, "eval": last_eval}


def _runner(setup: Setup, params):
    """host batch -> host NumPy outputs of ``task.eval_outputs`` (what tasks' evaluate() calls)."""

    def run(batch):
        gb = sharding.global_batch(batch, setup.mesh, setup.rules)
        with jax.set_mesh(setup.mesh), nn.logical_axis_rules(setup.rules):
            return jax.device_get(setup.eval_fn(params, gb))

    return run


def _finalize(
    setup: Setup,
    state: TrainState,
    best: checkpointing.BestCheckpoint,
    workdir: str,
    config_json: str,
):
    """Runs task.finalize with the best (or last) params and writes WORKDIR/eval_results.json."""
    params = best.params(setup.abstract_state.params, setup.state_shardings.params)
    chosen = "best" if params is not None else "last"
    params = state.params if params is None else params
    final = setup.task.finalize(_runner(setup, params), params, workdir)
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

"""The run's set-up and its step: the sharded train state, the task's model and optimizer, and the
pure ``train_step(state, batch) -> (state, metrics)`` with its micro-batching (``bertjax.microbatch``).

``bertjax.train`` runs the loop; ``bertjax.compile`` compiles the same step ahead of time.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import traverse_util
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from bertjax import microbatch, sharding
from bertjax.layers.attention import check_kernel_dropout
from bertjax.layers.attention import resolve_impl as resolve_attention_impl
from bertjax.layers.core import dtype_of
from bertjax.layers.dropout import resolve_impl as resolve_dropout_impl
from bertjax.optim import create_optimizer, global_norm
from bertjax.tasks.base import MICRO_BATCHING, Phase, Task
from bertjax.tasks.registry import get_task

log = logging.getLogger("bertjax")


@flax.struct.dataclass
class TrainState:
    """Everything that changes during training (all of it is checkpointed)."""

    step: jax.Array  # [] int32
    params: Any
    opt_state: Any
    rng: jax.Array  # [2] uint32, raw key data (per-step keys are fold_in(rng, step))


@dataclasses.dataclass(frozen=True)
class Partition:
    """The params split into the trained and the frozen ones (``Task.frozen_mask``): the step
    differentiates and updates the trained ones alone, and the optimizer state holds only them.
    ``frozen``: the flat paths (tuples of names) of the frozen parameters."""

    frozen: frozenset

    def split(self, params: Any) -> tuple[Any, Any]:
        """(trained, frozen): two nested dicts that :meth:`merge` joins back into ``params``."""
        flat = traverse_util.flatten_dict(params)
        trained = {k: v for k, v in flat.items() if k not in self.frozen}
        frozen = {k: v for k, v in flat.items() if k in self.frozen}
        return traverse_util.unflatten_dict(trained), traverse_util.unflatten_dict(frozen)

    def merge(self, trained: Any, frozen: Any) -> Any:
        flat = {**traverse_util.flatten_dict(trained), **traverse_util.flatten_dict(frozen)}
        return traverse_util.unflatten_dict(flat)


def param_partition(task: Task, model: nn.Module, params: Any) -> Partition | None:
    """The task's :class:`Partition` of ``params`` (boxed, abstract or concrete), or None when
    every parameter trains; a task that freezes every parameter is a one-line error."""
    mask = task.frozen_mask(model, params)
    if mask is None:
        return None
    flat = traverse_util.flatten_dict(mask)
    frozen = frozenset(k for k, v in flat.items() if v)
    if not frozen:
        return None
    if len(frozen) == len(flat):
        raise ValueError(f"task {task.name}: every parameter is frozen, nothing would train")
    return Partition(frozen)


def trained_params(partition: Partition | None, params: Any) -> Any:
    """The params the optimizer updates (all of them without a partition)."""
    return params if partition is None else partition.split(params)[0]


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
    partition: Partition | None = None  # frozen params (Task.frozen_mask); None: all train


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
    check_batch_size("train.global_batch_size", config.train.global_batch_size)
    task = task or prepared_task(config, workdir)
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
    kernel_dropout = getattr(model_cfg, "dropout_impl", None) == "kernel"
    if kernel_dropout and rate > 0:  # before any step is traced
        check_kernel_dropout(impl, platform, dtype_of(model_cfg.dtype))
    if impl != "xla" and rate > 0 and not kernel_dropout:
        log.warning(
            f"model.attention_impl={impl} is not used in training: model.attention_dropout={rate:g}"
            " > 0 and no fused kernel has attention dropout, so training attention runs on the "
            f"explicit xla path (evaluation uses {impl}); set model.attention_dropout=0 to train "
            "with it, or on a GPU model.dropout_impl=kernel (cuDNN's own dropout masks)"
        )
    model = task.build_model(model_cfg)
    rules = sharding.rules_from_config(config.mesh.get("rules"))
    phases = task.phases()
    for phase in phases:
        check_batch_size("train.global_batch_size", phase.global_batch_size, mesh, rules)
    total_steps = phases[-1].until_step
    tx, schedule = create_optimizer(config, total_steps, task.warmup_steps(total_steps))
    init_batch = task.init_batch(phases[0], 1)

    def init_boxed(rng):
        params_rng, train_rng = jax.random.split(jax.random.wrap_key_data(rng))
        params = task.fresh_params(model, params_rng, init_batch)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(trained_params(param_partition(task, model, params), params)),
            rng=jax.random.key_data(train_rng),
        )

    rng0 = jax.random.key_data(jax.random.key(config.train.seed))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract_boxed = jax.eval_shape(init_boxed, rng0)
    abstract = nn.meta.unbox(abstract_boxed)
    partition = param_partition(task, model, abstract.params)
    if partition is not None:
        frozen = sum(
            int(np.prod(v.shape))
            for k, v in traverse_util.flatten_dict(abstract.params).items()
            if k in partition.frozen
        )
        log.info(
            "task %s: %s of the parameters frozen (%d tensors: no gradient, no optimizer state)",
            task.name,
            f"{frozen:,}",
            len(partition.frozen),
        )
    state_shardings = sharding.logical_shardings(abstract_boxed, mesh, rules)

    def init_state(rng):
        # The init checkpoint's tensors (numpy) where the task has one, abstract leaves elsewhere:
        # only those are initialised at random. The program computes just them (XLA drops the
        # rest), so a fine-tuning run neither compiles nor holds a random encoder it would replace.
        started = task.start_params(model, abstract.params)
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            if started is abstract.params:  # no init checkpoint
                return jax.jit(
                    lambda r: nn.meta.unbox(init_boxed(r)), out_shardings=state_shardings
                )(rng)
            given = traverse_util.flatten_dict(started)
            fresh = [k for k, v in given.items() if isinstance(v, jax.ShapeDtypeStruct)]
            shardings = traverse_util.flatten_dict(state_shardings.params)

            def fresh_part(r):
                state = nn.meta.unbox(init_boxed(r))
                params = traverse_util.flatten_dict(state.params)
                return [params[k] for k in fresh], state.step, state.rng

            out_shardings = (
                [shardings[k] for k in fresh],
                state_shardings.step,
                state_shardings.rng,
            )
            values, step, train_rng = jax.jit(fresh_part, out_shardings=out_shardings)(rng)
            params = traverse_util.unflatten_dict({**given, **dict(zip(fresh, values))})
            params = jax.device_put(params, state_shardings.params)
            opt_state = jax.jit(tx.init, out_shardings=state_shardings.opt_state)(
                trained_params(partition, params)
            )
        return TrainState(step=step, params=params, opt_state=opt_state, rng=train_rng)

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
        partition,
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
            return jax.eval_shape(lambda: setup.task.fresh_params(m, jax.random.key(0), init_batch))

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


def check_batch_size(key: str, value, mesh=None, rules=None) -> None:
    """One-line ValueError naming ``key`` for a batch that is not a positive integer or that the
    devices sharding the batch do not divide."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"config key {key}={value!r} must be a positive integer")
    if mesh is not None and value % (devices := sharding.batch_devices(mesh, rules)):
        raise ValueError(
            f"config key {key}={value} is not divisible by the {devices} devices that shard the "
            f"batch (mesh {dict(mesh.shape)}); use a multiple of {devices}"
        )


def check_micro_batching(task: Task, accum_steps: int) -> None:
    """One-line ValueError for a task whose ``micro_batching`` is unknown, or whose loss cannot be
    split while ``train.grad_accum_steps`` asks for micro-batches."""
    mode = task.micro_batching
    if mode not in MICRO_BATCHING:
        raise ValueError(
            f"task {task.name}: micro_batching={mode!r} is not one of {', '.join(MICRO_BATCHING)}"
        )
    if mode == "whole_batch" and accum_steps > 1:
        raise ValueError(
            f"config key train.grad_accum_steps={accum_steps}: task {task.name} computes its loss "
            "on the whole batch (micro_batching='whole_batch'), which cannot be split into "
            "micro-batches; set train.grad_accum_steps=1"
        )


def make_train_step(setup: Setup, accum_steps: int, unroll: bool = False) -> Callable:
    """The pure ``train_step(state, batch) -> (state, metrics)`` of a setup (not yet jitted).

    ``accum_steps`` micro-batches per step, as the task's ``micro_batching`` says (summed, or the
    two-pass cached step). ``unroll``: the micro-batch loop unrolled (same result), for XLA's TPU
    cost model, which counts a loop's body once."""
    task, model, tx, partition = setup.task, setup.model, setup.tx, setup.partition
    check_micro_batching(task, accum_steps)
    batch_axes = dict(setup.rules).get("batch", ("data", "fsdp"))

    def constrain(x):  # [accum, b / accum, ...]: every device keeps its rows of each micro-batch
        spec = PartitionSpec(None, batch_axes, *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(setup.mesh, spec))

    def split(x):  # [b, ...] -> [accum, b / accum, ...]
        return constrain(microbatch.split_rows(x, accum_steps))

    def with_frozen(trained, frozen):  # the model's params from the trained and frozen ones
        return trained if partition is None else partition.merge(trained, frozen)

    def cached_gradients(params, frozen, batch, step_rng):  # the task's embed + whole-batch loss
        def embed(p, micro, rng):
            return task.embed(model, with_frozen(p, frozen), micro, rng)

        def batch_loss(embeddings):
            return task.batch_loss(embeddings, batch)

        if accum_steps == 1:
            whole = jax.value_and_grad(
                lambda p: batch_loss(embed(p, batch, step_rng)), has_aux=True
            )
            (loss, metrics), grads = whole(params)
            return loss, metrics, grads
        micro = jax.tree.map(split, batch)
        return microbatch.cached_value_and_grad(
            embed, batch_loss, params, micro, step_rng, accum_steps, constrain, unroll
        )

    def additive_gradients(params, frozen, batch, step_rng):  # micro-batches' gradients summed
        norms = task.normalizers(batch)

        def loss_fn(p, micro, rng):
            return task.loss(model, with_frozen(p, frozen), micro, rng, norms, deterministic=False)

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if accum_steps == 1:
            (loss, metrics), grads = grad_fn(params, batch, step_rng)
            return loss, metrics, grads
        micro = jax.tree.map(split, batch)
        return microbatch.accumulate(grad_fn, params, micro, step_rng, accum_steps, unroll)

    gradients = cached_gradients if task.micro_batching == "cached" else additive_gradients

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        step_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        # Frozen params (setup.partition) are neither differentiated nor updated: only the
        # trained ones have gradients and optimizer state.
        trained, frozen = (state.params, {}) if partition is None else partition.split(state.params)
        loss, metrics, grads = gradients(trained, frozen, batch, step_rng)
        updates, opt_state = tx.update(grads, state.opt_state, trained)
        params = with_frozen(optax.apply_updates(trained, updates), frozen)
        metrics = dict(metrics)
        metrics.update(
            loss=loss,
            learning_rate=setup.schedule(state.step),
            grad_norm=global_norm(grads),
            # The parameters the step starts from: the updated ones' norm fuses with the update on
            # a GPU, and every parameter is then copied into its donated buffer (233 copies).
            param_norm=global_norm(state.params),
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

"""What a task plugs into the one trainer: a model head, a loss, an input pipeline, an evaluation.

Pretraining and every fine-tuning task implement ``Task``; the trainer (``bertjax.train``) knows
nothing else about them. Tasks are chosen by name from ``REGISTRY`` (``register`` adds one; ``bertjax.tasks.registry.get_task``
instantiates one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import flax.linen as nn
import jax
import ml_collections
import numpy as np

from bertjax import progress
from bertjax.model_source import ModelSource

Batch = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Phase:
    """A stretch of training with fixed shapes: it runs until ``until_step`` (exclusive)."""

    until_step: int
    global_batch_size: int
    options: dict = dataclasses.field(default_factory=dict)  # task-specific (e.g. max_seq_length)


class DataIterator(Protocol):
    """Host-side batches with a resumable position (see bertjax.data.pipeline)."""

    def __next__(self) -> dict[str, np.ndarray]: ...

    def state(self) -> dict: ...

    def restore(self, state: dict) -> None: ...


MICRO_BATCHING = ("additive", "cached", "whole_batch")


class Task:
    """Base class of a task; subclasses override what differs.

    The loss contract. With ``train.grad_accum_steps = k > 1`` the trainer splits each batch into
    ``k`` micro-batches (micro-batch ``i`` holds rows ``i, i + k, ...``) and needs to know how the
    loss behaves under that split; ``micro_batching`` says it:

    * ``"additive"`` (the default; pretraining and the fine-tuning tasks): ``loss`` divides every
      term by the GLOBAL normalisers of ``normalizers(batch)`` (computed on the whole batch), so the
      micro-batches' losses, metrics and gradients add up to the whole batch's. The trainer sums them.
    * ``"cached"``: the loss couples the rows of a batch (in-batch negatives, as in a contrastive
      InfoNCE loss), so it does not add up. The task provides ``embed`` (a micro-batch's
      per-row embeddings) and ``batch_loss`` (the whole batch's loss from every row's embedding);
      the trainer runs the two-pass GradCache step (``bertjax.microbatch``): it embeds every
      micro-batch without keeping activations, takes ``batch_loss`` and its gradient with respect to
      the embeddings, then embeds each micro-batch again with the same dropout key and adds up the
      vector-Jacobian products. The gradient is the whole batch's, at one micro-batch's memory.
      The trainer calls neither ``normalizers`` nor ``loss`` of such a task in training (with
      ``k = 1`` it differentiates ``batch_loss(embed(...))`` directly); ``eval_outputs`` is the
      task's own.
    * ``"whole_batch"``: the loss cannot be split; ``train.grad_accum_steps > 1`` is an error.
    """

    name = "task"
    # How the loss behaves under micro-batching: one of MICRO_BATCHING (see the class docstring).
    micro_batching: str = "additive"
    # Which normaliser each metric is divided by (see ``normalizers``); used to average over batches.
    metric_normalizers: dict[str, str] = {}

    # Where the model comes from (init checkpoint or preset): set by tasks that train an encoder.
    source: ModelSource | None = None

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        self.config = config
        self.workdir = workdir

    @classmethod
    def for_compiling(cls, config: ml_collections.ConfigDict, workdir: str) -> Task | None:
        """The task built from its config alone, to compile its step without its data (None:
        the task's shapes come from its data, so compiling prepares it as training does)."""
        return None

    # ---- set-up --------------------------------------------------------------------------------
    def check(self) -> None:
        """Checks everything that needs only the config (and the init checkpoint) before any
        data work, so that a bad key costs seconds, not a data preparation."""

    def prepare(self) -> None:
        """Builds what the task needs on disk (runs on process 0 before the others read it)."""

    def after_prepare(self) -> None:
        """Loads what ``prepare`` built (runs on every process after a barrier)."""

    def model_config(self):
        raise NotImplementedError

    def build_model(self, model_config) -> nn.Module:
        raise NotImplementedError

    def phases(self) -> list[Phase]:
        cfg = self.config.train
        return [Phase(until_step=cfg.steps, global_batch_size=cfg.global_batch_size)]

    def phase_model(self, model: nn.Module, phase: Phase) -> nn.Module:
        """The model a phase trains (default: the run's); it must keep the run's parameters."""
        return model

    def init_batch(self, phase: Phase, batch_size: int) -> Batch:
        """A NumPy batch with the phase's shapes (used to initialise and compile)."""
        raise NotImplementedError

    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        """The model's call arguments taken from a batch."""
        raise NotImplementedError

    def fresh_params(self, model: nn.Module, rng: jax.Array, batch: Batch) -> Any:
        """Freshly initialised (boxed, logically partitioned) params."""
        return model.init({"params": rng}, **self.model_inputs(batch), deterministic=True)["params"]

    def step_shape(self, phase: Phase) -> tuple[int, int]:
        """(sequence length, predicted positions per sequence) of a phase, for throughput figures."""
        return 0, 0

    def tokens_per_step(self, phase: Phase) -> int:
        """Token positions one training step encodes, for tokens/s: the global batch of sequences
        of ``step_shape``'s length (a task that encodes several texts per example counts each)."""
        return phase.global_batch_size * self.step_shape(phase)[0]

    def flops_per_step(self, model_config, phase: Phase) -> float:
        """Model FLOPs of one training step (0 when not counted)."""
        return 0.0

    def warmup_steps(self, total_steps: int) -> int:
        """Learning-rate warmup steps of a run of ``total_steps`` (default optimizer.warmup_steps)."""
        return int(self.config.optimizer.warmup_steps)

    def frozen_mask(self, model: nn.Module, params: Any) -> Any | None:
        """A tree of bools like ``params``: True where a parameter is frozen (the trainer neither
        differentiates it nor keeps optimizer state for it; it stays bitwise as it started).
        None (the default): every parameter trains."""
        return None

    def start_params(self, model: nn.Module, fresh: Any) -> Any:
        """The params training starts from: ``fresh`` (unboxed :meth:`fresh_params`) with the
        init checkpoint's tensors where the task has one (``bertjax.model_source``)."""
        return fresh if self.source is None else self.source.load_into(model, fresh)

    # ---- training ------------------------------------------------------------------------------
    def normalizers(self, batch: Batch) -> dict[str, jax.Array]:
        """Global denominators of the loss terms, computed on the whole batch before splitting."""
        raise NotImplementedError

    def loss(
        self,
        model: nn.Module,
        params: Any,
        batch: Batch,
        rng: jax.Array,
        normalizers: dict[str, jax.Array],
        deterministic: bool,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(loss, metrics), every term divided by the GLOBAL normalisers (so micro-batches add up)."""
        raise NotImplementedError

    def embed(self, model: nn.Module, params: Any, batch: Batch, rng: jax.Array) -> Any:
        """(``micro_batching = "cached"`` tasks) The embeddings of one micro-batch in training mode:
        a pytree of arrays whose leading axis is the micro-batch's rows (e.g. ``{"query": [rows,
        d], "document": [rows, d]}``). ``rng`` is the micro-batch's dropout key; the trainer calls
        ``embed`` twice per micro-batch with the same key, so both passes drop the same units."""
        raise NotImplementedError(f"task {self.name}: micro_batching='cached' needs embed()")

    def batch_loss(self, embeddings: Any, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(``micro_batching = "cached"`` tasks) (loss, metrics) of the WHOLE batch from the
        embeddings of all its rows (``embed``'s pytree, micro-batches joined back into the batch's
        row order, so row ``r`` of every leaf is row ``r`` of ``batch``). It must not use the
        params: the trainer differentiates it with respect to the embeddings only."""
        raise NotImplementedError(f"task {self.name}: micro_batching='cached' needs batch_loss()")

    def train_data(self, phase: Phase, process_index: int, process_count: int) -> DataIterator:
        raise NotImplementedError

    # ---- evaluation ----------------------------------------------------------------------------
    def eval_outputs(self, model: nn.Module, params: Any, batch: Batch) -> dict[str, jax.Array]:
        """Device-side outputs of one eval batch (default: the loss metrics as sums)."""
        norms = self.normalizers(batch)
        ones = {k: jax.numpy.ones_like(v) for k, v in norms.items()}
        _, metrics = self.loss(model, params, batch, jax.random.key(0), ones, deterministic=True)
        return {**metrics, **{f"norm/{k}": v for k, v in norms.items()}}

    def eval_batches(self, phase: Phase, process_index: int, process_count: int) -> Iterable[Batch]:
        """A finite, deterministic sequence of host batches (empty: no evaluation)."""
        return ()

    def evaluate(self, run: Callable[[Batch], dict[str, np.ndarray]], phase: Phase) -> dict:
        """Runs evaluation with ``run`` (jitted eval_outputs -> host NumPy) and returns metrics."""
        totals: dict[str, float] = {}
        for batch in self.eval_batches(phase, jax.process_index(), jax.process_count()):
            for key, value in run(batch).items():
                totals[key] = totals.get(key, 0.0) + float(np.sum(value))
            progress.advance(1)
        if not totals:
            return {}
        return {
            name: totals[name] / max(totals[f"norm/{norm}"], 1e-9)
            for name, norm in self.metric_normalizers.items()
            if name in totals
        }

    # Evaluate before the first step too (the start of the pretraining curve; fine-tuning skips it).
    eval_at_start = False

    def eval_every(self) -> int:
        """Steps between evaluations (fine-tuning tasks: once per epoch)."""
        return self.config.train.eval_every

    def best_metric(self) -> tuple[str, str] | None:
        """(eval metric name, "max"|"min") whose best value's params are kept in WORKDIR/best."""
        return None

    def finalize(
        self, run: Callable[[Batch], dict[str, np.ndarray]], params: Any, workdir: str
    ) -> dict:
        """After training, with the best (or last) params: final metrics / prediction files."""
        return {}

    def checkpoint_record(self) -> dict[str, Any]:
        """What the checkpoint config records besides the run's config, so that the saved
        params load as the model trained (e.g. ``embedding``: the pooling a retriever used)."""
        return {}

    def describe(self) -> str:
        return self.name


REGISTRY: dict[str, Callable[..., Task]] = {}


def register(name: str):
    """Class decorator adding a task to the registry under ``name`` (e.g. ``glue/sst2``)."""

    def wrap(cls):
        REGISTRY[name] = cls
        return cls

    return wrap

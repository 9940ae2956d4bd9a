"""Orbax checkpoints of the whole training run: train state, data position and config.

Each checkpoint step directory holds three items: ``state`` (params, optimizer state, step, RNG;
sharded arrays written cooperatively by every process), ``data`` (the input iterators' positions, JSON)
and ``config`` (the experiment config, JSON). Orbax writes to a temporary directory and renames it
when complete, so an interrupted save never looks like a checkpoint; restoring picks the newest
complete step. Restoring onto another mesh reshards (the target shardings come from the new mesh).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

log = logging.getLogger(__name__)


class Checkpointer:
    """A thin wrapper over ``ocp.CheckpointManager`` with bertjax's three items."""

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        self.directory = epath.Path(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "data", "config")
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict, config_json: str, force=False) -> bool:
        """Starts an (async) save; returns whether a save was started."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(json.loads(config_json)),
        )
        return self.manager.save(step, args=args, force=force)

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, dict, int]:
        """Restores (state, data_state, config_dict, step) onto the shardings of ``abstract_state``."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                config=ocp.args.JsonRestore(),
            ),
        )
        return restored["state"], dict(restored["data"] or {}), dict(restored["config"] or {}), step

    def read_data(self, step: int | None = None) -> dict:
        """The ``data`` item (JSON) of a step (default: the newest)."""
        step = self.latest_step() if step is None else step
        restored = self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))
        return dict(restored["data"] or {})

    def restore_params(self, abstract_params: Any, step: int | None = None) -> Any:
        """Only ``state.params`` of a step saved as ``{"params": ...}``, onto the shardings of
        ``abstract_params`` (ShapeDtypeStructs, see :func:`abstract_like`)."""
        step = self.latest_step() if step is None else step
        target = {"params": abstract_params}
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target))
        return self.manager.restore(step, args=args)["state"]["params"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying the target shardings (what restore needs)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def restore_params(directory: str, abstract_params: Any | None = None, step: int | None = None):
    """Loads only the ``params`` of a bertjax checkpoint directory (a run's WORKDIR/checkpoints or
    a directory written by ``bertjax convert --to=bertjax``). Returns (params, config_dict, step)."""
    ckpt = Checkpointer(directory, async_save=False)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete bertjax checkpoint in {directory}")
        metadata = ckpt.manager.item_metadata(step)
        state_meta = metadata["state"]
        if abstract_params is None:
            target = jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=_single_device()),
                state_meta,
            )
        else:
            target = dict(state_meta)
            target = jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=_single_device()), target
            )
            target["params"] = abstract_params
        restored = ckpt.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target),
                config=ocp.args.JsonRestore(),
            ),
        )
        return restored["state"]["params"], dict(restored["config"] or {}), step
    finally:
        ckpt.close()


def _single_device():
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

"""Device mesh, logical-axis rules and the helpers that turn them into shardings.

The mesh has three axes: ``data`` (pure data parallel), ``fsdp`` (data parallel whose parameters and
optimizer state are also sharded) and ``tensor`` (attention heads, MLP and vocabulary split across
devices). Parameter sharding and compute sharding are kept apart: parameters use the logical axes
``embed``/``vocab``/``heads``/``mlp``; activations use ``batch``/``act_*``. One rules table maps both.

Axis types: the mesh is built with ``AxisType.Auto`` deliberately (``jax.make_mesh`` defaults to
Explicit in current JAX): the model states shardings through logical constraints and lets XLA's
partitioner propagate the rest, which is the Linen ``with_logical_constraint`` model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# The one rules table: logical axis name -> mesh axes.
RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),  # activations and inputs: split the batch over all data axes
    ("embed", "fsdp"),  # parameters: FSDP shards the hidden dimension of every kernel
    ("vocab", "tensor"),  # word embeddings / MLM decoder rows
    ("heads", "tensor"),  # attention kernels
    ("mlp", "tensor"),  # feed-forward kernels
    ("act_heads", "tensor"),  # attention activations follow their kernels
    ("act_mlp", "tensor"),
    ("layers", None),  # the stacked axis of scanned layers stays whole
)


def mesh_shape(data: int, fsdp: int, tensor: int, num_devices: int) -> tuple[int, int, int]:
    """Resolves the mesh sizes; at most one of them may be -1 (fills the remaining devices)."""
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh: at most one of data/fsdp/tensor may be -1, got {sizes}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(
            f"mesh: sizes must be positive or -1, got data={data} fsdp={fsdp} tensor={tensor}"
        )
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"mesh: {num_devices} devices are not divisible by {known} ({sizes})")
        sizes[sizes.index(-1)] = num_devices // known
    if int(np.prod(sizes)) != num_devices:
        raise ValueError(
            f"mesh: data*fsdp*tensor = {int(np.prod(sizes))} but there are {num_devices} devices "
            f"(mesh.data={data}, mesh.fsdp={fsdp}, mesh.tensor={tensor}); use -1 to fill"
        )
    return tuple(sizes)  # type: ignore[return-value]


def create_mesh(
    data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence | None = None
) -> Mesh:
    """A (data, fsdp, tensor) mesh over ``devices`` (default: all global devices)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(data, fsdp, tensor, len(devices))
    if devices == list(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def rules_from_config(rules: Sequence[Sequence[Any]] | None) -> tuple[tuple[str, Any], ...]:
    """Normalises a rules table from a config (lists become tuples)."""
    if rules is None:
        return RULES
    out = []
    for rule in rules:
        if len(rule) != 2:
            raise ValueError(f"sharding rule {rule!r} is not a (logical_name, mesh_axes) pair")
        name, axes = rule
        if isinstance(axes, list):
            axes = tuple(axes)
        for axis in axes if isinstance(axes, tuple) else (axes,):
            if axis is not None and axis not in MESH_AXES:
                raise ValueError(f"sharding rule {rule!r}: unknown mesh axis {axis!r}")
        out.append((name, axes))
    return tuple(out)


def fit_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Drops mesh axes from dimensions they do not divide (e.g. an odd vocabulary), keeping the rest."""
    fitted = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if axes is None:
            fitted.append(None)
            continue
        axes_tuple = axes if isinstance(axes, tuple) else (axes,)
        kept = []
        size = 1
        for axis in axes_tuple:
            if dim % (size * mesh.shape[axis]) == 0:
                kept.append(axis)
                size *= mesh.shape[axis]
        fitted.append(tuple(kept) if len(kept) > 1 else (kept[0] if kept else None))
    return PartitionSpec(*fitted)


def logical_shardings(abstract_tree: Any, mesh: Mesh, rules) -> Any:
    """NamedShardings for a tree of (boxed) abstract values carrying logical axis names."""
    specs = nn.get_partition_spec(abstract_tree)
    mesh_specs = nn.logical_to_mesh(specs, rules)
    shapes = jax.tree.map(lambda x: x.shape, nn.meta.unbox(abstract_tree))

    def to_sharding(spec, shape):
        if spec is None:
            spec = PartitionSpec()
        return NamedSharding(mesh, fit_spec(spec, shape, mesh))

    return jax.tree.map(
        to_sharding, mesh_specs, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None
    )


def batch_sharding(mesh: Mesh, rules=RULES) -> NamedSharding:
    """Sharding of an input batch: leading dimension over the mesh axes of the ``batch`` rule."""
    axes = dict(rules).get("batch", ("data", "fsdp"))
    return NamedSharding(mesh, PartitionSpec(axes))


def batch_devices(mesh: Mesh, rules=RULES) -> int:
    """How many devices split the batch dimension (the product of the ``batch`` rule's axes)."""
    axes = dict(rules).get("batch", ("data", "fsdp"))
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def global_batch(local: dict[str, np.ndarray], mesh: Mesh, rules=RULES) -> dict[str, jax.Array]:
    """Per-host NumPy batch -> global jax.Arrays sharded over the batch axes (multi-host safe)."""
    sharding = batch_sharding(mesh, rules)
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local.items()
    }


def per_device_bytes(tree: Any) -> int:
    """Bytes held on the first addressable device by a tree of sharded jax.Arrays."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            shard = leaf.addressable_shards[0]
            total += shard.data.size * shard.data.dtype.itemsize
    return total

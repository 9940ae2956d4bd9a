"""TPU slices by name, simulated on any machine: the devices of ``v5p-8`` or ``v5e:4x4`` for
ahead-of-time compilation (``bertjax compile --topology``, ``bertjax plan``).

``jax.experimental.topologies.get_topology_desc`` asks ``libtpu`` (the ``aot`` extra: the wheel
``jax[tpu]`` pins) for compile-only devices of a slice; XLA's TPU compiler then lowers the real
train step for them and reports its memory use and its cost model's step time, on a CPU-only box.

Names: Cloud TPU's accelerator types (``v4-32``, ``v5p-1024``: TensorCores, two per chip;
``v5e-256``, ``v6e-64``: chips) or an explicit chip grid (``v5p:4x4x8``, ``v5e:16x16``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import math
import os
import re
from collections.abc import Iterator
from typing import Any

from bertjax import gpu_topology

GIB = 1024**3
HOST_BOUNDS = (2, 2, 1)  # chips per TPU VM host


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation: its name, chip grid rank, cores per chip, HBM and megacore."""

    name: str  # libtpu's name: v4, v5p, v5e, v6e
    dims: int  # 3: a 3-D torus (v4, v5p); 2: a 2-D grid (v5e, v6e)
    cores_per_chip: int  # TensorCores counted by the accelerator type (v4-8 is 4 chips)
    hbm_bytes: int  # HBM per chip (peak FLOP/s: bertjax.flops.PEAK_TFLOPS)
    megacore: bool  # both TensorCores of a chip act as one JAX device


GENERATIONS = {
    g.name: g
    for g in (
        Generation("v4", 3, 2, 32 * GIB, True),
        Generation("v5p", 3, 2, 95 * GIB, True),
        Generation("v5e", 2, 1, 16 * GIB, False),
        Generation("v6e", 2, 1, 32 * GIB, False),
    )
}
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "trillium": "v6e"}


@dataclasses.dataclass(frozen=True)
class Slice:
    """A named TPU slice: its generation, chip grid and slice count."""

    name: str  # as the user wrote it
    generation: Generation
    grid: tuple[int, ...]  # chips per torus dimension, e.g. (2, 2, 1)
    num_slices: int = 1

    @property
    def chips(self) -> int:
        return math.prod(self.grid) * self.num_slices

    @property
    def accelerator_type(self) -> str:
        """Cloud TPU's name of one slice, e.g. ``v5p-8``."""
        return f"{self.generation.name}-{math.prod(self.grid) * self.generation.cores_per_chip}"

    @property
    def libtpu_name(self) -> str:
        return f"{self.generation.name}:{'x'.join(map(str, self.grid))}"

    def describe(self) -> str:
        slices = f" x {self.num_slices} slices" if self.num_slices > 1 else ""
        return f"{self.name} ({self.libtpu_name}{slices}, {self.chips} chips)"


def chip_grid(chips: int, dims: int) -> tuple[int, ...]:
    """Cloud TPU's grid for ``chips`` chips: 4 chips are 2x2(x1); each doubling doubles the smallest
    dimension, the last of equals (v5p-16 2x2x2, v5p-32 2x2x4, v5p-64 2x4x4, v5e-32 4x8)."""
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"{chips} chips is not a power of two")
    if chips < 4:
        return (1,) * (dims - 1) + (chips,) if dims == 3 else (1, chips)
    grid = [2, 2] + [1] * (dims - 2)
    while math.prod(grid) < chips:
        smallest = min(grid)
        index = max(i for i, g in enumerate(grid) if g == smallest)
        grid[index] *= 2
    return tuple(grid)


def parse(name: str, num_slices: int = 1) -> Slice | gpu_topology.GpuSystem:
    """``v5p-8`` / ``v4-32`` / ``v5e-256`` / ``v5p:2x2x1`` -> a :class:`Slice`, an NVIDIA system
    (``h100``, ``h100-8``, ``h100-8x4``) -> a :class:`bertjax.gpu_topology.GpuSystem`; else a
    ValueError whose line starts ``--topology=NAME:``."""
    if gpu_topology.is_gpu_name(name):
        return gpu_topology.parse(name, num_slices)
    if num_slices < 1:
        raise ValueError(f"--num_slices={num_slices} must be at least 1")
    flag = f"--topology={name}"
    text = name.strip().lower()
    grid_match = re.fullmatch(r"([a-z0-9]+)[:=_]((?:\d+x)*\d+)", text)
    type_match = re.fullmatch(r"([a-z0-9]+)-(\d+)", text)
    if not (grid_match or type_match):
        raise ValueError(
            f"{flag}: expected an accelerator type like v5p-8, v4-32, v5e-256, a chip "
            f"grid like v5p:2x2x1, v5e:4x4, or a GPU system like h100, h100-8, h100-8x4"
        )
    gen_name = (grid_match or type_match)[1]
    gen_name = ALIASES.get(gen_name, gen_name)
    if gen_name not in GENERATIONS:
        raise ValueError(f"{flag}: unknown TPU generation; known: {sorted(GENERATIONS)}")
    gen = GENERATIONS[gen_name]
    if grid_match:
        grid = tuple(int(g) for g in grid_match[2].split("x"))
        if len(grid) != gen.dims or min(grid) < 1:
            raise ValueError(f"{flag}: {gen.name} grids have {gen.dims} dimensions")
    else:
        count = int(type_match[2])
        if count % gen.cores_per_chip:
            raise ValueError(
                f"{flag}: {gen.name}-N counts TensorCores, {gen.cores_per_chip} per chip"
            )
        chips = count // gen.cores_per_chip
        try:
            grid = chip_grid(chips, gen.dims)
        except ValueError:
            cores = f"{count} TensorCores are " if gen.cores_per_chip > 1 else ""
            raise ValueError(f"{flag}: {cores}{chips} chips, not a power of two") from None
    return Slice(name, gen, grid, num_slices)


def _libtpu_kwargs(s: Slice) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"num_slices": s.num_slices}
    if s.generation.megacore:
        kwargs["chip_config_name"] = "megacore"
    grid3 = (*s.grid, 1)[:3]
    if any(g < b for g, b in zip(grid3, HOST_BOUNDS)):  # a slice smaller than one host's 2x2x1
        kwargs["chips_per_host_bounds"] = tuple(min(g, b) for g, b in zip(grid3, HOST_BOUNDS))
    return kwargs


def devices(s: Slice | gpu_topology.GpuSystem) -> list:
    """Compile-only devices of the slice, ordered by slice then device id (needs ``libtpu``; a
    GPU system's need JAX's CUDA plugin)."""
    if isinstance(s, gpu_topology.GpuSystem):
        return gpu_topology.devices(s)
    try:
        import libtpu  # noqa: F401  (the aot extra)
    except ImportError as err:
        raise ValueError(
            "--topology needs the libtpu wheel that jax[tpu] pins: pip install -e '.[aot]'"
        ) from err
    identity = {}
    if not has_tpu_chips():  # libtpu's start-up looks for a TPU VM's identity: give it one
        identity = {
            "TPU_SKIP_MDS_QUERY": "1",
            "TPU_ACCELERATOR_TYPE": s.accelerator_type,
            "TPU_WORKER_HOSTNAMES": "localhost",
            "TPU_WORKER_ID": "0",
            # Compile-only: several processes (plan's workers, parallel runs) may load libtpu.
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        }
    from jax.experimental import topologies

    with _environment_defaults(identity):  # for libtpu's start-up only: the caller's stays
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name=s.libtpu_name, **_libtpu_kwargs(s)
        )
    return sorted(topo.devices, key=lambda d: (getattr(d, "slice_index", 0) or 0, d.id))


@contextlib.contextmanager
def _environment_defaults(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` where the variable is unset, for the block only."""
    added = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def hbm_bytes(device) -> int:
    """HBM per device: the runtime's figure on a real TPU, else the generation's (or the GPU
    model's) table entry."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # compile-only devices have no runtime
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if getattr(device, "platform", "") == "gpu":
        return gpu_topology.memory_bytes(device)
    generation = generation_of_kind(getattr(device, "device_kind", ""))
    return generation.hbm_bytes if generation else 0


def generation_of_kind(kind: str) -> Generation | None:
    """The generation of a jax ``device_kind`` (``TPU v5`` is v5p, ``TPU v5 lite`` is v5e)."""
    kind = kind.lower().strip()
    table = {
        "tpu v4": "v4",
        "tpu v5": "v5p",
        "tpu v5p": "v5p",
        "tpu v5 lite": "v5e",
        "tpu v5e": "v5e",
        "tpu v6 lite": "v6e",
        "tpu v6e": "v6e",
    }
    return GENERATIONS.get(table.get(kind, ""))


GOOGLE_PCI_VENDOR = "0x1ae0"


def has_tpu_chips() -> bool:
    """Whether this machine has TPU chips on its PCI bus (read from sysfs; nothing initialised)."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False

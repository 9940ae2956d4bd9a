"""NVIDIA GPU systems by name, simulated on any machine: the compile-only devices of ``h100``,
``h100-8`` (one node of 8) or ``h100-8x4`` (4 nodes of 8) for ahead-of-time compilation
(``bertjax compile --topology``, ``bertjax plan``), as :mod:`bertjax.topology` does for TPU slices.

JAX's CUDA plugin (``jax-cuda12-plugin``, in the ``aot`` extra) builds compile-only GPU devices
from XLA's ``GpuTargetConfig`` text (``jax.experimental.topologies.get_topology_desc(platform=
"cuda", target_config=TEXT, topology="1xNODESxGPUS")``) without a driver or a GPU when
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``; XLA's GPU compiler then gives the optimized program of the
real train step, its memory use and every kernel (:mod:`bertjax.hlo_roofline` prices them).
The chips' figures are the vendors' data-sheet numbers (SXM parts).
"""

from __future__ import annotations

import dataclasses
import os
import re

from bertjax.hlo_roofline import Chip

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class GpuChip:
    """One GPU model: what XLA's compiler needs to know of it and its roofline."""

    name: str  # the topology name: h100, h200, a100
    description: str  # CUDA's device name (jax's device_kind)
    compute_capability: tuple[int, int]
    sm_count: int
    clock_ghz: float
    memory_bytes: int
    l2_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    roofline: Chip


CHIPS = {
    c.name: c
    for c in (
        GpuChip(
            "h100", "NVIDIA H100 80GB HBM3", (9, 0), 132, 1.98, 84_929_347_584, 50 * 2**20,
            233_472, 232_448,
            Chip("h100", 989e12, 494.5e12, 66.9e12, 3.35e12, 450e9, 50e9),
        ),
        GpuChip(
            "h200", "NVIDIA H200", (9, 0), 132, 1.98, 150_754_820_096, 50 * 2**20,
            233_472, 232_448,
            Chip("h200", 989e12, 494.5e12, 66.9e12, 4.8e12, 450e9, 50e9),
        ),
        GpuChip(
            "a100", "NVIDIA A100-SXM4-80GB", (8, 0), 108, 1.41, 85_899_345_920, 40 * 2**20,
            167_936, 166_912,
            Chip("a100", 312e12, 156e12, 19.5e12, 2.039e12, 300e9, 25e9),
        ),
    )
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GpuSystem:
    """Nodes of GPUs of one model: ``h100-8x4`` is 4 nodes of 8 H100s."""

    name: str  # as the user wrote it
    chip: GpuChip
    gpus_per_node: int
    nodes: int = 1
    num_slices: int = 1  # plan/compile pass it on; GPU systems have none

    @property
    def chips(self) -> int:
        return self.gpus_per_node * self.nodes

    def describe(self) -> str:
        nodes = f"{self.nodes} nodes x " if self.nodes > 1 else ""
        return f"{self.name} ({nodes}{self.gpus_per_node} x {self.chip.description})"


def is_gpu_name(name: str) -> bool:
    """Whether ``--topology=NAME`` names a GPU system (a letter and three digits: h100, b200),
    not a TPU slice (v4, v5p, v5e, v6e)."""
    return re.match(r"[a-z]\d{3}(?![0-9])", name.strip().lower()) is not None


def parse(name: str, num_slices: int = 1) -> GpuSystem:
    """``h100`` / ``h100-8`` / ``h200-8`` / ``a100-8`` / ``h100-8x4`` -> a :class:`GpuSystem`;
    else a ValueError whose line starts ``--topology=NAME:``."""
    flag = f"--topology={name}"
    m = re.fullmatch(r"([a-z]\d+)(?:-(\d+)(?:x(\d+))?)?", name.strip().lower())
    if not m or m[1] not in CHIPS:
        raise ValueError(
            f"{flag}: expected a GPU system like h100, h100-8, h200-8, a100-8 or h100-8x4 (4 nodes "
            f"of 8); known GPUs: {sorted(CHIPS)}"
        )
    if num_slices != 1:
        raise ValueError(
            f"--num_slices={num_slices}: GPU systems have nodes, not slices ({flag}x4)"
        )
    per_node, nodes = int(m[2] or 1), int(m[3] or 1)
    if not 1 <= per_node <= 8 or nodes < 1:
        raise ValueError(f"{flag}: 1 to 8 GPUs per node, at least one node")
    if nodes > 1 and per_node & (per_node - 1):
        raise ValueError(f"{flag}: GPUs per node must be a power of two across nodes")
    return GpuSystem(name, CHIPS[m[1]], per_node, nodes)


def target_config(chip: GpuChip) -> str:
    """XLA's ``GpuTargetConfig`` text proto for the chip (what the CUDA plugin compiles for)."""
    major, minor = chip.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {chip.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {chip.sm_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.roofline.hbm_bytes_per_s)}
  l2_cache_size: {chip.l2_bytes}
  clock_rate_ghz: {chip.clock_ghz}
  device_memory_size: {chip.memory_bytes}
  shared_memory_per_block_optin: {chip.shared_memory_per_block_optin}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 7
}}
runtime_version {{
  major: 12
  minor: 8
}}
device_description_str: "{chip.description}"
"""


def devices(system: GpuSystem) -> list:
    """Compile-only devices of the system, ordered by id (needs the CUDA plugin, not a GPU)."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401  (the aot extra)
    except ImportError as err:
        raise ValueError(
            f"--topology={system.name} needs JAX's CUDA plugin (jax-cuda12-plugin): "
            "pip install -e '.[aot]'"
        ) from err
    # The plugin registers without a driver only when told to skip its CUDA version checks.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="cuda",
        target_config=target_config(system.chip),
        topology=f"1x{system.nodes}x{system.gpus_per_node}",
    )
    return sorted(topo.devices, key=lambda d: d.id)


def chip_of_kind(kind: str) -> GpuChip | None:
    """The chip of a jax ``device_kind`` (``NVIDIA H100 80GB HBM3`` is h100)."""
    kind = kind.lower()
    for chip in CHIPS.values():
        if kind.startswith(chip.description.lower()) or re.search(rf"\b{chip.name}\b", kind):
            return chip
    return None


def memory_bytes(device) -> int:
    chip = chip_of_kind(getattr(device, "device_kind", ""))
    return chip.memory_bytes if chip else 0

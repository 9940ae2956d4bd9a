"""Which platform a layer is being traced for, where kernels and masks differ by platform."""

from __future__ import annotations

import jax


def current_platform() -> str:
    """The platform the code is being traced for: the devices of the mesh set by
    ``jax.set_mesh`` (compile-only GPU or TPU devices when compiling for a topology from another
    machine), else JAX's default backend."""
    mesh = jax.sharding.get_abstract_mesh()  # also inside jit, where get_mesh() raises
    device = getattr(mesh, "abstract_device", None) if not mesh.empty else None
    platform = getattr(device, "platform", None)
    return platform or jax.default_backend()

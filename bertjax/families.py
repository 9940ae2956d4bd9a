"""The families built on the core, by the module that adds each one to the core's registries.

A family (today one: retrieval) is a package above the core that plugs into it: its tasks
register with ``tasks.base.register``, its checkpoint formats with ``convert.register_format``, its
heads with the bertjax checkpoint reader (``convert.orbax_format.register_head_record``) and the
loader (``pretrained.register_default_head``). The core never imports a family: each of those
registries calls :func:`load` before it looks a name up, which imports the modules named here
(once; Python keeps them). So ``get_task("retrieval")``, ``load_pretrained(<a sentence-transformers
directory>)`` and ``bertjax convert --to=pylate`` work without the caller importing the family.

This is the one place that names the families (an entry-point table): a new family is one line.
"""

from __future__ import annotations

import importlib

# The module of each family that registers its tasks, formats and heads.
FAMILIES = ("bertjax.retrieval.registrations",)


def load() -> None:
    """Imports every family's registering module (a no-op after the first call)."""
    for name in FAMILIES:
        importlib.import_module(name)

"""Every task, registered by importing its module; ``get_task`` instantiates one by name.

The core's tasks are imported here; the families' (``bertjax.families``) are imported by the lookup,
so a family's task is found by name without its package being imported first.
"""

import ml_collections

from bertjax import families
from bertjax.tasks import glue, ner, pretraining, squad, swag  # noqa: F401  (each registers itself)
from bertjax.tasks.base import REGISTRY, Task


def task_class(name: str) -> type[Task]:
    """The task class registered under ``name``; unknown names list the known ones."""
    families.load()
    if name not in REGISTRY:
        raise ValueError(f"config key task={name!r} is not a known task; known: {sorted(REGISTRY)}")
    return REGISTRY[name]


def get_task(name: str, config: ml_collections.ConfigDict, workdir: str) -> Task:
    """Instantiates the task registered under ``name``; unknown names list the known ones."""
    return task_class(name)(config, workdir)

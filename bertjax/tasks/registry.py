"""Imports every task module so that each registers itself in ``bertjax.task.REGISTRY``."""

from bertjax.tasks import pretraining  # noqa: F401

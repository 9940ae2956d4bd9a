"""Imports every task module so that each registers itself in ``bertjax.task.REGISTRY``."""

import bertjax.tasks.choice  # noqa: F401
import bertjax.tasks.glue  # noqa: F401
import bertjax.tasks.squad  # noqa: F401
import bertjax.tasks.tagging  # noqa: F401
from bertjax.tasks import pretraining  # noqa: F401

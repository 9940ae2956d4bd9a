"""Orbax's handler of ``jax.Array`` with bertjax's retries on ``gs://`` (``bertjax.checkpointing``
writes its checkpoints' arrays with it).

TensorStore, which writes the arrays, retries a request to Cloud Storage by its own policy, the
``gcs_request_retries`` resource of the TensorStore context it is given: 32 retries, about a
quarter of an hour. No option of Orbax's managers or handlers names a context; the handler of
each array type is the caller's, and what Orbax hands it (``ParamInfo.ts_context``) is where this
one puts the policy of ``bertjax.gcs``."""

from __future__ import annotations

import orbax.checkpoint as ocp
import tensorstore as ts


class ArrayWriter(ocp.type_handlers.ArrayHandler):
    """Orbax's handler of ``jax.Array``; in a bucket (``gcs_retries``), its TensorStore requests
    retry by ``bertjax.gcs``'s policy, read from the environment at each save, instead of
    TensorStore's own (32 retries, about a quarter of an hour): a bucket that stays down fails
    the save within the policy's seconds, as a request of ``bertjax.fs`` does. Each of Orbax's
    contexts gets one child holding ``gcs_request_retries``, so the arrays of a save still share
    its caches. (Orbax's merge of the processes' OCDBT files after the arrays, and every restore,
    use contexts it makes itself, with TensorStore's policy.)"""

    def __init__(self, *, gcs_retries: bool, **kwargs):
        super().__init__(**kwargs)
        self._gcs_retries = gcs_retries

    async def serialize(self, values, infos, args=None):
        if self._gcs_retries:
            from bertjax import gcs  # gs:// checkpoints only (it imports gcsfs)

            retries = {
                "gcs_request_retries": gcs.RetryPolicy.from_environment().tensorstore_retries()
            }
            children = {}
            for info in infos:
                parent = info.ts_context
                if id(parent) not in children:
                    children[id(parent)] = ts.Context(retries, parent=parent)
                info.ts_context = children[id(parent)]
        return await super().serialize(values, infos, args)

"""What the retrieval family adds to the core's registries; ``bertjax.families`` imports this module
before a registry looks a name up, so no caller needs to import the family first.

* tasks: ``retrieval`` (bi-encoder), ``colbert`` and ``reranker`` (each module registers itself
  with ``tasks.base.register``).
"""

from bertjax.retrieval.bi_encoder import task as bi_encoder_task  # noqa: F401  (registers itself)
from bertjax.retrieval.colbert import task as colbert_task  # noqa: F401  (registers itself)
from bertjax.retrieval.reranker import task as reranker_task  # noqa: F401  (registers itself)

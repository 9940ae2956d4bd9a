"""Cross-encoder reranking, as sentence-transformers' ``CrossEncoder``: (query, passage) pairs
scored by a sequence classifier with one logit.

Modules: ``rerank`` (pairs, scoring, the CrossEncoder settings, reranking a run) and ``task``
(the ``reranker`` training task).
"""

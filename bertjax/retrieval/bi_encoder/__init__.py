"""Bi-encoders (sentence embeddings): one vector per text, as sentence-transformers computes it.

Modules: ``pooling`` (the head: pooling modes, Dense layers, L2 normalisation; no Flax),
``embedding`` (texts -> vectors with a loaded encoder), ``sentence_transformers`` (the
sentence-transformers directory format) and ``task`` (the ``retrieval`` training task).
"""

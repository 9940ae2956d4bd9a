"""Retrieval evaluation: exact search over embeddings and trec_eval's measures.

Modules (import the one you need; this package imports nothing on its own, and none of them
imports TensorFlow): `metrics` (nDCG@k, Recall@k, MRR@k, MAP@k exactly as trec_eval/pytrec_eval
compute them, pure Python), `trec_format` (TREC run files and qrels), `search` (exact top-k dense
search and ColBERT MaxSim in JAX, sharded over devices), `beir` (BEIR-format folders) and `evaluate`
(embed, search and score a BEIR set with any model that has ``embed``).
"""

"""The retrieval family: bi-encoders, ColBERT and cross-encoders, and what they share.

A family above the core: nothing in models/, layers/, convert/, tasks/ or the loader imports it; it
adds its tasks, checkpoint formats and heads to their registries (``registrations``), which
``bertjax.families`` loads when a registry is first asked. Importing this package imports nothing
else, and no module here imports TensorFlow. One line per module and sub-package:

* ``registrations``: what the family adds to the core's registries (tasks, formats, heads);
* ``beir``: BEIR folders (corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv);
* ``trec_format``: TREC run files and qrels, trec_eval's tie order;
* ``corpus_input``: ``bertjax embed``'s input (JSONL, Parquet, text; local, gs://): ids, texts;
* ``search``: exact top-k dense search and ColBERT MaxSim in JAX, the corpus sharded over devices;
* ``ranking_metrics``: nDCG@k, Recall@k, MRR@k, MAP@k as trec_eval / pytrec_eval, pure Python;
* ``contrastive_losses``: sentence-transformers' MultipleNegativesRankingLoss and Matryoshka,
  PyLate's ColBERT Contrastive and Distillation;
* ``mining``: hard negatives as sentence-transformers' ``mine_hard_negatives`` picks them;
* ``evaluate``: embed, search and score a BEIR set with any model that has ``embed``; score a run;
* ``embed_corpus``: a corpus -> embedding shards, resumable, over every device and host;
* ``embedding_store``: the shard files, their manifest, ``load_embeddings``;
* ``bi_encoder/``: one vector per text (pooling, the model and its settings, the
  sentence-transformers format, the ``retrieval`` task);
* ``colbert/``: one vector per token (the model and its settings, the PyLate format, the
  ``colbert`` task);
* ``reranker/``: cross-encoders (pairs, scoring, CrossEncoder settings, reranking a run, the
  ``reranker`` task).
"""

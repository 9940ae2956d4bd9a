"""Pretraining the mini preset on the real English corpus of 13 Project Gutenberg novels.

Reads the raw e-texts from ../shared/data (present on developer machines and in CI) with the original
BERT-Base uncased vocabulary; override `data.corpus` / `data.vocab` to point elsewhere.
"""

from configs import base

SHARED = "../shared/data"


def get_config():
    c = base.get_config()
    c.model.preset = "mini"
    c.model.max_position_embeddings = 128
    c.model.hidden_dropout = 0.0
    c.model.attention_dropout = 0.0
    c.data.corpus = f"{SHARED}/corpus/gutenberg/*_*__*.txt"  # the novels, not PG_LICENSE.txt
    c.data.corpus_format = "text"
    c.data.vocab = f"{SHARED}/vocab/bert-base-uncased/vocab.txt"
    c.data.max_seq_length = 128
    c.data.max_predictions_per_seq = 20
    c.data.dupe_factor = 1
    c.data.eval_fraction = 0.02
    c.data.num_shards = 8
    c.train.steps = 1000
    c.train.global_batch_size = 32
    c.train.log_every = 50
    c.train.eval_every = 200
    c.train.eval_steps = 20
    c.train.checkpoint_every = 200
    c.optimizer.learning_rate = 5e-4
    c.optimizer.warmup_steps = 100
    return c

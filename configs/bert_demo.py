"""The offline demo with the BERT recipe (`make pretrain CONFIG=configs/bert_demo.py`): a mini BERT,
MLM + NSP at 15% masking, AdamW with linear decay, on a real-English corpus built locally.
configs/demo.py (the default of `make pretrain`) runs the modern recipe on the same corpus.

The corpus is the docstrings of the running Python's standard library (bertjax.data.demo_corpus), the
vocabulary is trained from it, and the run takes a few minutes on 2 CPU cores with MLM accuracy rising.
"""

from configs import base


def get_config():
    c = base.get_config()
    c.model.preset = "mini"
    c.model.max_position_embeddings = 128
    c.model.hidden_dropout = 0.0
    c.model.attention_dropout = 0.0
    c.data.demo_corpus = True
    c.data.corpus_format = "bert"
    c.data.vocab_size = 8000
    c.data.max_seq_length = 64
    c.data.max_predictions_per_seq = 10
    c.data.dupe_factor = 2
    c.data.eval_fraction = 0.02
    c.data.num_shards = 4
    c.train.steps = 500
    c.train.global_batch_size = 32
    c.train.log_every = 25
    c.train.eval_every = 100
    c.train.eval_steps = 10
    c.train.checkpoint_every = 100
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 50
    return c

"""The offline default of `make pretrain`: a small ModernBERT with the modern recipe on a real-English
corpus built locally.

The corpus is the docstrings of the running Python's standard library (bertjax.data.demo_corpus), the
vocabulary is trained from it, and the run takes a few minutes on 2 CPU cores with MLM accuracy rising.
The recipe: `modernbert-mini` (6 x 256, GeGLU, RoPE, a 32-token window on 64-token rows), MLM only at
30% masking on packed rows, StableAdamW (weight decay 1e-5 decoupled from the lr, as ModernBERT's)
with warmup-stable-decay. It won the side-by-side against the BERT recipe (docs/performance.md);
configs/bert_demo.py is the same demo with the BERT recipe.
"""

from configs import bert_demo


def get_config():
    c = bert_demo.get_config()
    c.model.architecture = "modernbert"
    c.model.preset = "modernbert-mini"
    c.model.max_position_embeddings = None  # the preset's (RoPE has no position table)
    c.model.local_attention = 32  # a window shorter than the 64-token rows
    c.data.nsp = False
    c.data.packing = True
    c.data.masked_lm_prob = 0.3
    c.data.max_predictions_per_seq = 20
    c.optimizer.name = "stableadamw"
    c.optimizer.schedule = "wsd"
    c.optimizer.b2 = 0.98
    c.optimizer.weight_decay = 1e-5
    c.optimizer.decouple_lr = True  # as ModernBERT: (lr_t / peak) * 1e-5 per step
    c.optimizer.grad_clip_norm = 0.0
    return c

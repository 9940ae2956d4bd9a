"""The offline demo (configs/demo.py) with the modern encoder recipe: a small modernbert, MLM only
at 30% masking on packed rows, StableAdamW with warmup-stable-decay. A few minutes on 2 CPU cores."""

from configs import demo


def get_config():
    c = demo.get_config()
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
    c.optimizer.grad_clip_norm = 0.0
    return c

"""ModernBERT-base pretraining, the modern encoder recipe (Warner et al., 2024) as a delta on base:
the modernbert architecture (pre-LN, GeGLU, RoPE, alternating global / sliding-window attention),
MLM only at 30% masking with packed sequences of 1024 tokens then context extension to 8192
(global RoPE base 10k -> 160k), StableAdamW with a
warmup-stable-decay schedule (lr 8e-4, betas 0.9/0.98, weight decay 1e-5 decoupled from the lr as
optimi's `decouple_lr`, no gradient clipping).
Set `data.corpus` and `data.vocab` (a `tokenizer.json`, e.g. ModernBERT's, or a vocab.txt)."""

from configs import base


def get_config():
    c = base.get_config()
    c.model.architecture = "modernbert"
    c.model.preset = "modernbert-base"
    c.model.dtype = "bfloat16"
    c.data.corpus = "gs://YOUR_BUCKET/corpus/*.parquet"
    c.data.vocab = "gs://YOUR_BUCKET/tokenizer/modernbert/tokenizer.json"
    # ModernBERT's tokenizer.json has 50,368 tokens: the size used where data.vocab cannot be read
    # (compiling for a topology from a machine without the bucket's credentials).
    c.data.vocab_size = 50368
    c.data.nsp = False
    c.data.packing = True
    c.data.masked_lm_prob = 0.3
    c.data.num_shards = 1024
    # Sequence 1024 with the global RoPE base at 10k, then context extension to 8192 with the
    # base raised to 160k (the same parameters; only the rotary base and the shapes change).
    c.data.phases = (
        dict(
            until_step=360_000,
            max_seq_length=1024,
            max_predictions_per_seq=320,  # 30% of 1024 tokens, rounded up
            model=dict(global_rope_theta=10_000.0),
        ),
        dict(
            until_step=400_000,
            max_seq_length=8192,
            max_predictions_per_seq=2464,
            global_batch_size=512,
            model=dict(global_rope_theta=160_000.0),
        ),
    )
    c.train.steps = 400_000
    c.train.global_batch_size = 4096
    c.optimizer.name = "stableadamw"
    c.optimizer.schedule = "wsd"
    c.optimizer.decay_fraction = 0.1
    c.optimizer.decay_shape = "1-sqrt"
    c.optimizer.learning_rate = 8e-4
    c.optimizer.b2 = 0.98
    c.optimizer.weight_decay = 1e-5
    c.optimizer.decouple_lr = True  # ModernBERT's decoupled_stableadamw
    c.optimizer.grad_clip_norm = 0.0
    c.optimizer.warmup_steps = 3_000
    return c

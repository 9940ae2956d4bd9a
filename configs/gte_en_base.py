"""gte-en-mlm-base pretraining after its recipe (Zhang et al., 2024, "mGTE"), its first stage, as a
delta on base: the gte architecture (BERT's post-LN layout with RoPE, a gated GELU MLP, attention
biases, no token types) at gte-base-en-v1.5's shapes, MLM only at 30% masking on packed 512-token
rows with an unscaled RoPE base of 10k, batch 4096, lr 2e-4, 300k steps.

Sources: the stages, learning rates, batches, steps, masking and RoPE bases are those of the model
card of Alibaba-NLP/gte-en-mlm-base ("MLM-512: lr 2e-4, mlm_probability 0.3, batch_size 4096,
num_steps 300000, rope_base 10000"); the paper names AdamW with decoupled weight decay in bf16. The
warmup, the decay shape, the betas and the weight decay are not stated there: a linear decay after
3% warmup, betas 0.9/0.98 and weight decay 1e-5 are starting values, not the paper's.

The card's next stages (lr 5e-5, same masking) continue from this run: configs/gte_en_base_long.py.
Set ``data.corpus`` and ``data.vocab`` (bert-base-uncased's vocab.txt, padded to 30,528)."""

from configs import base


def get_config():
    c = base.get_config()
    c.model.architecture = "gte"
    c.model.preset = "gte-base-en-v1.5"
    c.model.rope_theta = 10_000.0
    c.model.rope_scaling = ""  # unscaled: the released checkpoint's NTK scaling came later
    c.model.dtype = "bfloat16"
    c.data.corpus = "gs://YOUR_BUCKET/corpus/*.parquet"
    c.data.vocab = "gs://YOUR_BUCKET/tokenizer/bert-base-uncased/vocab.txt"
    c.data.vocab_size = 30528
    c.data.nsp = False
    c.data.packing = True
    c.data.masked_lm_prob = 0.3
    c.data.max_seq_length = 512
    c.data.max_predictions_per_seq = 154  # 30% of 512 tokens, rounded up
    c.data.num_shards = 1024
    c.train.steps = 300_000
    c.train.global_batch_size = 4096
    c.optimizer.name = "adamw"
    c.optimizer.decouple_lr = True  # decoupled weight decay, as the paper names it
    c.optimizer.schedule = "linear"
    c.optimizer.learning_rate = 2e-4
    c.optimizer.b2 = 0.98
    c.optimizer.weight_decay = 1e-5
    c.optimizer.warmup_steps = 9_000
    return c

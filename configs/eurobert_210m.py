"""EuroBERT-210m pretraining after its recipe (Boizard et al., 2025) as a delta on base: the
eurobert architecture (Llama-style: pre-RMSNorm, grouped-query attention, RoPE, SiLU-gated MLP, no
biases, untied decoder), MLM only at 50% masking on packed rows of 2048 tokens with the RoPE base at
10k, then 8192-token rows with the base raised to 250k (the released checkpoints' value), AdamW
with Llama's betas and a warmup-stable-decay schedule.

The paper's per-size learning rate and batch are not restated here: 1e-4 and 2048 x 2048 tokens
are starting values to tune, not the paper's. Its annealing also lowers the masking ratio (to 10%):
continue from this run's checkpoint with ``--config.data.masked_lm_prob=0.1``. Set ``data.corpus``
and ``data.vocab`` (EuroBERT's ``tokenizer.json``, 128,256 tokens, or your own)."""

from configs import base


def get_config():
    c = base.get_config()
    c.model.architecture = "eurobert"
    c.model.preset = "eurobert-210m"
    c.model.dtype = "bfloat16"
    c.data.corpus = "gs://YOUR_BUCKET/corpus/*.parquet"
    c.data.vocab = "gs://YOUR_BUCKET/tokenizer/eurobert/tokenizer.json"
    c.data.vocab_size = 128256  # where data.vocab cannot be read (compiling for a topology)
    c.data.nsp = False
    c.data.packing = True
    c.data.masked_lm_prob = 0.5
    c.data.num_shards = 1024
    c.data.phases = (
        dict(
            until_step=180_000,
            max_seq_length=2048,
            max_predictions_per_seq=1024,  # 50% of 2048 tokens
            model=dict(rope_theta=10_000.0),
        ),
        dict(
            until_step=200_000,
            max_seq_length=8192,
            max_predictions_per_seq=4096,
            global_batch_size=512,
            model=dict(rope_theta=250_000.0),
        ),
    )
    c.train.steps = 200_000
    c.train.global_batch_size = 2048
    c.optimizer.name = "adamw"
    c.optimizer.schedule = "wsd"
    c.optimizer.decay_fraction = 0.1
    c.optimizer.learning_rate = 1e-4
    c.optimizer.b2 = 0.95
    c.optimizer.eps = 1e-5
    c.optimizer.weight_decay = 0.1
    c.optimizer.warmup_steps = 2_000
    return c

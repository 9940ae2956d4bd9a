"""gte-en-mlm-base's long-context stages after its recipe (Zhang et al., 2024, "mGTE"), continued
from configs/gte_en_base.py's run (``--config.init_checkpoint=THAT_WORKDIR``): MLM at 30% on packed
2048-token rows (RoPE base 10k, batch 4096, 30k steps), then 8192-token rows with the base raised to
160k (batch 1024, 30k steps), lr 5e-5 throughout.

Sources: the model card of Alibaba-NLP/gte-en-mlm-base ("MLM-2048: lr 5e-5, mlm_probability 0.3,
batch_size 4096, num_steps 30000, rope_base 10000"; "MLM-8192: lr 5e-5, mlm_probability 0.3,
batch_size 1024, num_steps 30000, rope_base 160000"). The warmup and decay are starting values, not
the paper's: a short warmup, then a linear decay over both stages."""

from configs import gte_en_base


def get_config():
    c = gte_en_base.get_config()
    c.init_checkpoint = "gs://YOUR_BUCKET/runs/gte_en_base"  # the first stage's workdir
    c.data.phases = (
        dict(
            until_step=30_000,
            max_seq_length=2048,
            max_predictions_per_seq=615,  # 30% of 2048 tokens
            model=dict(rope_theta=10_000.0),
        ),
        dict(
            until_step=60_000,
            max_seq_length=8192,
            max_predictions_per_seq=2458,
            global_batch_size=1024,
            model=dict(rope_theta=160_000.0),
        ),
    )
    c.train.steps = 60_000
    c.optimizer.learning_rate = 5e-5
    c.optimizer.warmup_steps = 1_000
    return c

"""nomic-bert-2048 pretraining after its recipe as a delta on base: the nomicbert architecture (BERT's
post-LN layout with RoPE at base 1000, a SwiGLU MLP and no biases), MLM only at 30% masking on packed
2048-token rows of BERT's uncased WordPiece vocabulary padded to 30,528 (a multiple of 64), AdamW
(lr 5e-4, betas 0.9/0.98, eps 1e-6, weight decay 1e-5), no gradient clipping, a linear decay after a
warmup of 6% of the steps, batch 4096.

Sources: the optimiser, masking, batch and schedule are those of nomic-ai/contrastors'
``configs/train/mlm.yaml`` (the training code of Nussbaum et al., 2024, "Nomic Embed"); the 2048-token
rows and the rotary base are the released checkpoint's (``n_positions`` 2048, ``rotary_emb_base``
1000). That file trains 5 epochs of its corpus rather than a number of steps: ``train.steps`` is 5
epochs of about 4.2B tokens (BooksCorpus and English Wikipedia) in 4096 x 2048-token batches; set it
from your corpus (5 x tokens / 8,388,608). Set ``data.corpus`` and ``data.vocab`` (bert-base-uncased's
vocab.txt)."""

from configs import base

BATCH, SEQ = 4096, 2048


def get_config():
    c = base.get_config()
    c.model.architecture = "nomicbert"
    c.model.preset = "nomic-bert-2048"
    c.model.dtype = "bfloat16"
    c.data.corpus = "gs://YOUR_BUCKET/corpus/*.parquet"
    c.data.vocab = "gs://YOUR_BUCKET/tokenizer/bert-base-uncased/vocab.txt"
    c.data.vocab_size = 30528  # 30,522 WordPiece tokens padded to a multiple of 64
    c.data.nsp = False
    c.data.packing = True
    c.data.masked_lm_prob = 0.3
    c.data.max_seq_length = SEQ
    c.data.max_predictions_per_seq = 615  # 30% of 2048 tokens, rounded up
    c.data.num_shards = 1024
    c.train.steps = 2_500
    c.train.global_batch_size = BATCH
    c.optimizer.name = "adamw"
    c.optimizer.schedule = "linear"
    c.optimizer.learning_rate = 5e-4
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.98
    c.optimizer.eps = 1e-6
    c.optimizer.weight_decay = 1e-5
    c.optimizer.grad_clip_norm = 0.0
    c.optimizer.warmup_steps = 150  # 6% of the steps
    return c

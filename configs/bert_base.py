"""BERT-Base pretraining, the paper's recipe: batch 256, lr 1e-4, 10k warmup, 1M steps, seq 128 for
90% of the steps then 512. Set `data.corpus` to your corpus (e.g. gs://bucket/wiki/*.txt)."""

from configs import base


def get_config():
    c = base.get_config()
    c.model.preset = "base"
    c.model.dtype = "bfloat16"
    c.data.corpus = "gs://YOUR_BUCKET/corpus/*.txt"
    c.data.vocab = "gs://YOUR_BUCKET/vocab/bert-base-uncased/vocab.txt"
    c.data.num_shards = 256
    c.data.phases = (
        dict(until_step=900_000, max_seq_length=128, max_predictions_per_seq=20),
        dict(until_step=1_000_000, max_seq_length=512, max_predictions_per_seq=80),
    )
    c.train.steps = 1_000_000
    c.train.global_batch_size = 256
    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_steps = 10_000
    # Parameters and AdamW state sharded over all chips (fsdp), the batch too: on a v5p-8, 21.5 ms
    # per step by XLA's TPU cost model vs 24.5 ms data parallel (`bertjax compile --topology`).
    c.mesh.data = 1
    c.mesh.fsdp = -1
    return c

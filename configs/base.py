"""Shared defaults for every bertjax experiment; each config file is a small delta on this one."""

import ml_collections

from bertjax import models
from bertjax.sharding import RULES


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.task = "pretrain"  # a name from the task registry (bertjax.tasks.registry)
    # A HF / Google / bertjax checkpoint to start from (continued pretraining, fine-tuning): it
    # defines the architecture; config.model may change only numerics (dtype, dropout, kernels).
    c.init_checkpoint = ""

    # Model: an architecture (bertjax.models), a named preset of it, and any field of its config
    # (every field of every architecture is defined here unset: None keeps the preset's value).
    c.model = ml_collections.ConfigDict()
    for key, kind in models.experiment_keys().items():
        c.model[key] = ml_collections.config_dict.placeholder(kind)
    c.model.architecture = ml_collections.config_dict.placeholder(
        str
    )  # None: bert / the checkpoint's
    c.model.preset = "base"
    c.model.dtype = "float32"  # compute dtype; "bfloat16" on TPU/GPU

    # Pretraining data: a corpus turned into TFRecords by `bertjax prepare` (run automatically).
    c.data = ml_collections.ConfigDict()
    c.data.corpus = ""  # glob(s), comma-separated, gs:// allowed, or tfds:NAME:SPLIT[:FEATURE]
    c.data.corpus_format = "text"  # text (raw documents) | bert (one per line) | jsonl | parquet
    c.data.text_column = "text"  # the JSON key / Parquet column of the jsonl and parquet formats
    c.data.demo_corpus = False  # build a corpus from the Python stdlib docstrings (offline)
    c.data.prepared_dir = ""  # default: WORKDIR/data
    c.data.vocab = ""  # vocab.txt / .model; empty: train one from the corpus
    c.data.vocab_kind = "wordpiece"  # when training a vocabulary: wordpiece | sentencepiece
    c.data.vocab_size = 30522  # when training a vocabulary
    # vocab.txt / .model casing; unset: the vocabulary's own (lower case when training one). A
    # tokenizer.json's normalizer decides its casing: this key is then ignored (with a warning).
    c.data.do_lower_case = ml_collections.config_dict.placeholder(bool)
    c.data.max_seq_length = 128
    c.data.max_predictions_per_seq = 20
    c.data.masked_lm_prob = 0.15
    c.data.short_seq_prob = 0.1
    c.data.dupe_factor = 5
    c.data.nsp = True
    # Pack several sequences per row (block-diagonal attention) to cut padding; needs nsp=False.
    c.data.packing = False
    c.data.masking = "static"  # static (in the records) | dynamic (fresh every epoch, in tf.data)
    c.data.whole_word_mask = False
    c.data.eval_fraction = 0.01
    c.data.num_shards = 8
    c.data.shuffle_buffer = 10_000
    # Fixed number of input streams: the global batch (its rows in order) is the same for any
    # process count dividing N, and resuming on another host count is exact. 0: one stream per
    # process (the batch then depends on the host count).
    c.data.streams = 8
    c.data.seed = 12345
    # Sequence-length phases (the paper: 128 for 90% of the steps, then 512). Empty: one phase.
    c.data.phases = ()

    c.train = ml_collections.ConfigDict()
    c.train.steps = 1_000_000
    c.train.seed = 0
    c.train.global_batch_size = 256
    c.train.grad_accum_steps = 1  # micro-batches per step (global batch larger than memory)
    c.train.log_every = 100
    c.train.eval_every = 10_000
    c.train.eval_steps = 50
    c.train.checkpoint_every = 10_000
    c.train.keep_checkpoints = 3
    c.train.stop_at_step = (
        0  # >0: checkpoint and exit at this step (time-sliced jobs); 0: run to the end
    )
    c.train.async_checkpoints = True
    c.train.transfer_guard = True  # jax_transfer_guard=disallow inside the loop
    # MLM loss: logits (the [predictions, vocab] logits, then the loss) | chunked (decoder and
    # cross-entropy fused, a vocabulary chunk at a time: less memory, the logits computed twice)
    # | auto (chunked above 4 GiB of fp32 logits per device, as with a 256k vocabulary)
    c.train.mlm_loss = "auto"
    c.train.peak_tflops = 0.0  # per-device peak for MFU on unknown devices (e.g. CPU)
    c.tensorboard = True  # event files in WORKDIR/tensorboard (metrics.jsonl is written always)

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.name = "adamw"  # adamw | lamb | stableadamw (AdamW with update clipping)
    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_steps = 10_000
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.999
    c.optimizer.eps = 1e-6
    c.optimizer.weight_decay = 0.01
    # adamw / stableadamw: decay by (lr_t / learning_rate) * weight_decay instead of
    # lr_t * weight_decay (optimi's decouple_lr; ModernBERT: True with weight_decay 1e-5).
    c.optimizer.decouple_lr = False
    c.optimizer.grad_clip_norm = 1.0
    c.optimizer.end_lr_factor = 0.0
    c.optimizer.schedule = (
        "linear"  # linear (BERT: warmup, linear decay) | wsd (warmup-stable-decay)
    )
    c.optimizer.decay_fraction = 0.1  # wsd: the last fraction of the steps decays
    c.optimizer.decay_shape = "linear"  # wsd: linear | 1-sqrt

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    c.mesh.num_devices = 0  # 0: every device; N: the first N (tests, debugging)
    c.mesh.rules = [list(rule) for rule in RULES]
    return c

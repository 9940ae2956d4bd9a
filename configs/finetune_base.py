"""Shared fine-tuning defaults (BERT paper, Appendix A.3): a delta on configs/base.py.

Batch 32, AdamW lr in {5e-5, 3e-5, 2e-5} (2e-5 here), 3 epochs, linear warmup over 10% of the steps,
dropout 0.1. Each task's config (glue.py, squad.py, ner.py, swag.py) is a small delta on this one.
``init_checkpoint`` names a HF / Google / bertjax checkpoint directory whose encoder starts training;
``seeds`` with several entries runs one fine-tuning per seed and reports the median and best dev run.

The feature-based approach (BERT paper, Section 5.3): ``train.freeze_encoder=True`` trains the task
head alone on a frozen encoder (no gradient, no optimizer state and no dropout for the encoder;
the pooler, which only the sentence and multiple-choice heads read, trains with them), and
``head.features`` chooses which combination of the encoder's layers the head reads: ``last`` (the
fine-tuning head), ``sum_last4``, ``concat_last4`` or ``scalar_mix`` (ELMo's learned weighted sum of
every layer; GLUE, reranker and NER tasks), read at [CLS] or (``head.pooling=mean``, sentence tasks)
as the mean over each example's tokens. ``head.bilstm=True`` puts the paper's two-layer BiLSTM
under the NER classifier.
"""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
    c = base.get_config()
    c.task = "glue/sst2"
    c.init_checkpoint = ""  # HF / Google / bertjax checkpoint dir; empty: random init (tests)
    c.data_dir = ""  # folder in the official layout; empty: TFDS by name (GLUE)
    c.seeds = ()  # empty: train.seed; several (--config.seeds="(1,2,3)"): one run per seed

    # The pretraining data keys of base do not apply; fine-tuning data options replace them.
    c.data = ml_collections.ConfigDict()
    c.data.vocab = ""  # vocab.txt / .model / tokenizer.json; empty: the init checkpoint's
    c.data.do_lower_case = ml_collections.config_dict.placeholder(bool)  # unset: the checkpoint's
    c.data.max_seq_length = 128
    c.data.max_train_examples = 0  # > 0: a seeded random subset of the training split
    c.data.max_eval_examples = 0  # > 0: the first N dev examples (quick checks only)
    c.data.eval_batch_size = 64
    # Pack several examples per row (GLUE, NER; not SQuAD/SWAG): train.global_batch_size and
    # data.eval_batch_size then count rows of at most max_examples_per_row examples each.
    c.data.packing = False
    c.data.max_examples_per_row = 8
    # Evaluation and prediction pack rows by default where the task allows (GLUE, NER): outputs
    # per example equal the unpacked ones (to float rounding), 2-5x fewer rows on GLUE dev sets.
    c.data.eval_packing = True
    # Each training batch of global_batch_size examples packed alone into fewer rows (the same
    # examples and loss per step as unpacked: bertjax.data.batch_packing); off when data.packing.
    c.data.batch_packing = True

    c.model.hidden_dropout = 0.1
    c.model.attention_dropout = 0.1

    # Fine-tuning evaluates whole dev sets: base's eval_steps would be read by nothing, so it is
    # not a key here (setting it is then an error naming it, not a silence).
    del c.train["eval_steps"]
    c.train.epochs = 3.0
    c.train.steps = 0  # > 0 overrides epochs
    c.train.global_batch_size = 32
    c.train.log_every = 50
    c.train.eval_every = 0  # 0: once per epoch
    c.train.checkpoint_every = 1000
    c.train.keep_checkpoints = 1
    c.train.freeze_encoder = False  # True: the head trains alone on the frozen encoder

    # The task head: which layers it reads (the feature-based approach; see the docstring).
    c.head = ml_collections.ConfigDict()
    c.head.features = "last"  # last | sum_last4 | concat_last4 | scalar_mix
    c.head.pooling = "cls"  # GLUE / reranker, features other than last: cls | mean (of the tokens)
    c.head.bilstm = False  # NER: a two-layer BiLSTM between the features and the classifier

    c.optimizer.learning_rate = 2e-5
    c.optimizer.warmup_proportion = 0.1  # resolves optimizer.warmup_steps; 0 keeps warmup_steps
    c.optimizer.warmup_steps = 0
    c.optimizer.weight_decay = 0.01
    return c

"""SQuAD fine-tuning (BERT paper): `--config.task=squad/v1.1|squad/v2.0`, 384 tokens, stride 128.

v1.1: lr 5e-5, batch 32, 2 epochs (the paper: 3e-5 / 2 epochs for Base-sized runs also reported);
v2.0: the paper uses lr 5e-5, batch 48, 2 epochs (set --config.train.global_batch_size=48).
"""

from configs import finetune_base


def get_config():
    c = finetune_base.get_config()
    c.task = "squad/v1.1"
    c.data.max_seq_length = 384
    c.data.doc_stride = 128
    c.data.max_query_length = 64
    c.data.n_best_size = 20
    c.data.max_answer_length = 30
    c.data.null_score_diff_threshold = 0.0  # v2.0: predict "" when null odds exceed this
    c.data.eval_batch_size = 32
    c.train.epochs = 2.0
    c.optimizer.learning_rate = 5e-5
    return c

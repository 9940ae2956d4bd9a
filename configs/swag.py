"""SWAG fine-tuning (BERT paper): 4 choices of 128 tokens, lr 2e-5, batch 16, 3 epochs."""

from configs import finetune_base


def get_config():
    c = finetune_base.get_config()
    c.task = "swag"
    c.data.max_seq_length = 128
    c.data.eval_batch_size = 32
    c.train.global_batch_size = 16
    c.train.epochs = 3.0
    c.optimizer.learning_rate = 2e-5
    return c

"""ModernBERT-large pretraining: modernbert_base.py with the large preset (28 x 1024) and the
paper's lower peak learning rate (5e-4)."""

from configs import modernbert_base


def get_config():
    c = modernbert_base.get_config()
    c.model.preset = "modernbert-large"
    c.optimizer.learning_rate = 5e-4
    return c

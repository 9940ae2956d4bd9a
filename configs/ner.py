"""CoNLL-2003 NER fine-tuning: `--config.data_dir` holds train.txt / valid.txt / test.txt."""

from configs import finetune_base


def get_config():
    c = finetune_base.get_config()
    c.task = "ner/conll2003"
    # Casing follows the init checkpoint's tokenizer (the paper fine-tunes the cased model).
    c.data.max_seq_length = 128
    c.train.epochs = 3.0
    c.optimizer.learning_rate = 5e-5
    return c

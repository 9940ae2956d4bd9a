"""CoNLL-2003 NER fine-tuning: `--config.data_dir` holds train.txt / valid.txt / test.txt."""

from configs import finetune_base


def get_config():
    c = finetune_base.get_config()
    c.task = "ner/conll2003"
    c.do_lower_case = False  # the paper uses the cased model for NER
    c.data.max_seq_length = 128
    c.train.epochs = 3.0
    c.optimizer.learning_rate = 5e-5
    return c

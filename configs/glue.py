"""GLUE fine-tuning (BERT paper): `--config.task=glue/<name>`, sequences of 128, batch 32, 3 epochs."""

from configs import finetune_base


def get_config():
    c = finetune_base.get_config()
    c.task = "glue/sst2"  # glue/{cola,sst2,mrpc,stsb,qqp,mnli,qnli,rte,wnli,ax}
    c.data.max_seq_length = 128
    c.optimizer.learning_rate = 2e-5
    return c

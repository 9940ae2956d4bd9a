"""BERT-Large pretraining (L24/H1024/A16) with the paper's recipe; see bert_base.py."""

from configs import bert_base


def get_config():
    c = bert_base.get_config()
    c.model.preset = "large"
    c.model.remat = "dots"
    c.mesh.fsdp = -1
    c.mesh.data = 1
    return c

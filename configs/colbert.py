"""Late-interaction retrieval (ColBERT, as PyLate trains it): a delta on configs/retrieval.py.
Per-token vectors (`colbert.dim`) scored by MaxSim; PyLate's Contrastive loss over the whole batch
(in-batch and hard negatives) or, with `colbert.loss=distillation`, its KL Distillation loss on
teacher scores given in the JSON lines (`"scores": [...]`, aligned with positive + negatives).
Evaluation: nDCG@10 of exact MaxSim search over the BEIR folder's `data.eval_split` every epoch;
the best params are written as a PyLate directory WORKDIR/pylate."""

import string

import ml_collections

from configs import retrieval


def get_config():
    c = retrieval.get_config()
    c.task = "colbert"
    c.train.global_batch_size = 32
    c.optimizer.learning_rate = 3e-6  # PyLate's fine-tuning examples
    c.colbert = ml_collections.ConfigDict()
    c.colbert.dim = 128  # the projection of every token (no bias)
    c.colbert.query_length = 32  # queries: cut or padded with [MASK] to this many tokens
    c.colbert.document_length = 180  # documents: cut to this many tokens
    c.colbert.query_prefix = "auto"  # "[Q] " / "[unused0]", the first the tokenizer has ("" none)
    c.colbert.document_prefix = "auto"  # "[D] " / "[unused1]"
    c.colbert.do_query_expansion = True  # pad queries with [MASK] (query augmentation)
    c.colbert.attend_to_expansion_tokens = False  # PyLate's default: the [MASK]s are not attended
    c.colbert.skiplist_words = tuple(string.punctuation)  # document tokens left out of MaxSim
    c.colbert.loss = "contrastive"  # contrastive | distillation
    c.colbert.temperature = 1.0  # contrastive: scores / temperature
    c.colbert.normalize_scores = True  # distillation: min-max normalise the student's scores
    c.colbert.export = True  # write the best params as a PyLate directory WORKDIR/pylate
    return c

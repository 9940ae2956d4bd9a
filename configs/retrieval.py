"""Dense retrieval (a bi-encoder, as DPR / sentence-transformers' MultipleNegativesRankingLoss):
a delta on finetune_base. Train on a BEIR folder (`--config.data_dir=...`, its qrels/train.tsv) or
JSON lines (`--config.data.train_file=...`: query, positive, negatives); evaluate nDCG@10 on the
folder's `data.eval_split` every epoch. Big contrastive batches: raise train.global_batch_size and
train.grad_accum_steps together (the cached two-pass step keeps the whole batch's negatives)."""

import ml_collections

from configs import finetune_base


def get_config():
    c = finetune_base.get_config()
    c.task = "retrieval"
    c.data.max_seq_length = 256  # documents
    c.data.max_query_length = 64
    c.data.train_file = ""  # JSON lines; empty: data_dir's qrels/<train_split>.tsv
    c.data.train_split = "train"
    c.data.eval_split = "test"  # "" or a missing qrels file: no evaluation
    c.data.num_negatives = 0  # hard negatives per row (from train_file's "negatives")
    c.data.no_duplicates = True  # no text twice in a batch (it would be its own negative)
    c.data.batch_packing = False
    c.data.eval_packing = False
    c.train.global_batch_size = 64
    c.optimizer.learning_rate = 2e-5
    c.retrieval = ml_collections.ConfigDict()
    # cls | mean | max | lasttoken | weightedmean (joined with +); empty: the init checkpoint's
    # (a sentence-transformers model's pooling, Dense layers and Normalize), else mean
    c.retrieval.pooling = ""
    c.retrieval.normalize = False  # also L2-normalise the embeddings the model outputs
    c.retrieval.similarity = "cosine"  # cosine | dot
    c.retrieval.scale = 20.0  # 1 / temperature
    c.retrieval.directions = ("query_to_doc",)  # + "doc_to_query": the symmetric loss
    c.retrieval.matryoshka_dims = ()  # e.g. (384, 256, 128, 64): a loss per prefix
    c.retrieval.eval = True
    return c

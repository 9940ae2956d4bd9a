"""Cross-encoder reranking (sentence-transformers' CrossEncoder with BinaryCrossEntropyLoss): a delta
on glue.py. Train on (query, passage, label) pairs (`--config.data.train_file=...`: JSON lines, TSV,
or the bi-encoder's query/positive/negatives rows) or on a BEIR folder's qrels plus mined negatives
(`--config.data_dir=... --config.data.negatives_file=RUN.trec`); evaluate every epoch by reranking a
first-stage run (`--config.data.eval_run=RUN.trec`, nDCG@10 keeps the best) or on dev pairs."""

from configs import glue


def get_config():
    c = glue.get_config()
    c.task = "reranker"
    c.data.max_seq_length = 256  # query + passage, truncated longest-first
    c.data.train_file = ""  # JSONL / TSV pairs; empty: data_dir's qrels/<train_split>.tsv
    c.data.train_split = "train"
    c.data.negatives_file = ""  # TREC run whose top non-relevant documents are label-0 pairs
    c.data.num_negatives = 4  # negatives per query (rows' "negatives" or negatives_file); 0: all
    c.data.eval_run = ""  # TREC first-stage run reranked on data_dir's eval_split every epoch
    c.data.eval_split = "test"
    c.data.rerank_top_k = 100  # documents per query reranked
    c.data.dev_file = ""  # without eval_run: pairs scored by binary cross-entropy and accuracy
    c.train.global_batch_size = 32
    c.train.epochs = 1.0
    c.optimizer.learning_rate = 2e-5
    return c

"""A tiny GLUE fine-tuning config for CLI tests: `--config=tests/tiny_finetune_config.py:TMPDIR`.

SST-2 in the official TSV layout (24 training and 10 dev sentences, 7 test ones) and a vocabulary
are written to TMPDIR on first use; a 1-layer H32 model with dropout trains 2 epochs (6 steps of 8)
per seed, for seeds 0 and 1, evaluating every epoch and checkpointing every 2 steps.
"""

import pathlib

import numpy as np

from configs import glue

WORDS = "the a movie film was is good bad great awful fun dull plot actors it not very and".split()


def write_sst2(root: pathlib.Path) -> pathlib.Path:
    """root/vocab.txt and root/glue/SST-2/{train,dev,test}.tsv (deterministic)."""
    folder = root / "glue" / "SST-2"
    if (folder / "test.tsv").exists():
        return root
    folder.mkdir(parents=True, exist_ok=True)
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","]
    (root / "vocab.txt").write_text("\n".join([*special, *WORDS]) + "\n")
    rng = np.random.default_rng(0)

    def sentence():
        return " ".join(rng.choice(WORDS, 6))

    for split, n in (("train", 24), ("dev", 10)):
        rows = [f"{sentence()}\t{i % 2}" for i in range(n)]
        (folder / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    rows = [f"{i}\t{sentence()}" for i in range(7)]
    (folder / "test.tsv").write_text("index\tsentence\n" + "\n".join(rows) + "\n")
    return root


def get_config(tmpdir: str):
    root = write_sst2(pathlib.Path(tmpdir))
    c = glue.get_config()
    c.task = "glue/sst2"
    c.data.vocab = str(root / "vocab.txt")
    c.data.do_lower_case = True
    c.data_dir = str(root / "glue")
    c.seeds = (0, 1)
    c.model.preset = "tiny"
    c.model.num_layers = 1
    c.model.hidden_size = 32
    c.model.num_heads = 2
    c.model.intermediate_size = 64
    c.model.max_position_embeddings = 32
    c.data.max_seq_length = 16
    c.data.eval_batch_size = 8
    c.train.epochs = 2.0
    c.train.global_batch_size = 8
    c.train.log_every = 1
    c.train.checkpoint_every = 2
    c.train.keep_checkpoints = 2
    c.optimizer.learning_rate = 1e-3
    c.mesh.num_devices = 1
    c.tensorboard = False
    return c

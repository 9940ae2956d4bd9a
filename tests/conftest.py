"""Shared pytest fixtures: paths to ../shared/data (skipped when absent) and CPU device setup."""

import logging
import os
import pathlib
import tempfile

# Eight simulated CPU devices for every test process; a test that wants one device uses a sub-mesh.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402,F401  (before the cache settings below: this process does not read them)
import pytest  # noqa: E402

# One persistent XLA cache for the `bertjax` subprocesses of a test session (both xdist workers'):
# a killed run and its rerun, or two tests running the same tiny config, compile each program once.
# The executables, hence every number, are those a fresh compile gives. Only subprocesses read it
# (jax above has read its settings already): in-process tests compile as a user's code does.
# The first process to read this (pytest's own, under xdist) names the folder; its workers inherit it.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"bertjax-test-xla-cache-pid{os.getpid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")

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


# The heaviest files first (about the order of their times on the 2-core machine): `--dist
# loadfile` hands each worker the next file in collection order, so a heavy file collected last
# would run alone at the end while the other worker sits idle.
HEAVY_FIRST = (
    "test_train.py",
    "test_readme_commands.py",
    "test_multihost_train.py",
    "test_round_trips.py",
    "test_finetune.py",
    "test_training_parity.py",
    "test_topology.py",
    "test_bench.py",
    "test_crash_recovery.py",
    "test_continued_pretraining_bert.py",
    "test_gpu_program.py",
    "test_accelerator.py",
    "test_modernbert_interop.py",
    "test_finetune_heads.py",
    "test_packing.py",
    "test_packing_finetune.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole

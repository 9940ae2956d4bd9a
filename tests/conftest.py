"""Shared pytest fixtures: paths to ../shared/data (skipped when absent) and CPU device setup."""

import os
import pathlib

# Eight simulated CPU devices for every test process; a test that wants one device uses a sub-mesh.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

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

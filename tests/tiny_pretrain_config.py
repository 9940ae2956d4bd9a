"""A tiny pretraining config for CLI tests: `--config=tests/tiny_pretrain_config.py:TMPDIR`."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from train_fixtures import tiny_config  # noqa: E402


def get_config(tmpdir: str):
    return tiny_config(pathlib.Path(tmpdir), steps=10)

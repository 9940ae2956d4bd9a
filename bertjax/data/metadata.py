"""`metadata.json` of a prepared data directory (written by `bertjax prepare`, read by training);
TensorFlow-free for local directories."""

from __future__ import annotations

import json

import bertjax.fs as fs

METADATA_FILE = "metadata.json"
REQUIRED_METADATA = ("max_seq_length", "max_predictions_per_seq", "masking", "nsp")


def read_metadata(data_dir: str, missing_ok: bool = False) -> dict | None:
    """Reads `{data_dir}/metadata.json` (from prepare.py); one-line ValueError if missing or bad
    (None when it is missing and ``missing_ok``)."""
    path = f"{str(data_dir).rstrip('/')}/{METADATA_FILE}"
    if not fs.exists(path):
        if missing_ok:
            return None
        raise ValueError(f"{path}: metadata file not found (is {data_dir} a prepared data dir?)")
    with fs.open_file(path, "r") as f:
        text = f.read()
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as err:
        raise fs.json_error(path, err) from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    missing = [k for k in REQUIRED_METADATA if k not in meta]
    if missing:
        raise ValueError(f"{path}: missing key(s) {missing}")
    if meta["masking"] not in ("static", "dynamic"):
        raise ValueError(
            f"{path}: key 'masking' must be 'static' or 'dynamic', got {meta['masking']!r}"
        )
    return meta

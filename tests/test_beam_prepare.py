"""`bertjax prepare --runner=DirectRunner`: the Beam pipeline writes the local path's shards byte for byte.

Skipped without Apache Beam (the optional extra `bertjax[beam]`).
"""

import hashlib
import os
import sys

import pytest

pytest.importorskip("apache_beam")

from bertjax.data import prepare  # noqa: E402
from bertjax.text import load_tokenizer  # noqa: E402

WORDS = "the a of and to in it was he she said that his her on at with for as had".split()
TIMING = ("seconds", "docs_per_second", "mb_per_second")


def _corpus(folder, files=4):
    paths = []
    for f in range(files):
        docs = []
        for d in range(9 + f):
            sentences = [
                " ".join(
                    WORDS[(f * 5 + d * 3 + s + w) % len(WORDS)] for w in range(3 + (d + s) % 8)
                )
                + "."
                for s in range(2 + (d + f) % 6)
            ]
            docs.append("\n".join(s.capitalize() for s in sentences))
        paths.append(str(folder / f"part-{f}.txt"))
        (folder / f"part-{f}.txt").write_text("\n\n".join(docs) + "\n")
    return paths


def _digest(out):
    h = hashlib.sha256()
    for name in sorted(os.listdir(out)):
        h.update(name.encode())
        if name.endswith(".tfrecord"):
            h.update((out / name).read_bytes())
    return h.hexdigest()


@pytest.fixture()
def tok(tmp_path):
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","] + WORDS
    tokens += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"] + list("bcdfgjkmnpqruvxyz")
    (tmp_path / "vocab.txt").write_text("\n".join(tokens) + "\n")
    return load_tokenizer(str(tmp_path / "vocab.txt"), do_lower_case=True)


@pytest.mark.parametrize("options", [{}, {"whole_word_mask": True, "eval_fraction": 0.2}])
def test_direct_runner_multi_process_equals_the_local_path(tmp_path, tok, options):
    paths = _corpus(tmp_path)
    kw = dict(max_seq_length=32, max_predictions_per_seq=5, dupe_factor=2, num_shards=3, **options)
    local = prepare.prepare(paths, str(tmp_path / "local"), tok, show_progress=False, **kw)
    beam_args = ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))  # the workers import bertjax
    old = os.environ.copy()
    os.environ.update(env)
    try:
        beam = prepare.prepare(
            paths,
            str(tmp_path / "beam"),
            tok,
            show_progress=False,
            runner="DirectRunner",
            beam_args=beam_args,
            **kw,
        )
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert {k: v for k, v in beam.items() if k not in TIMING} == {
        k: v for k, v in local.items() if k not in TIMING
    }
    assert _digest(tmp_path / "beam") == _digest(tmp_path / "local")


def test_cli_passes_unknown_flags_to_beam_only_with_a_runner(tmp_path, tok):
    args = ["--input", "x", "--output_dir", str(tmp_path), "--vocab", tok.vocab_file]
    with pytest.raises(SystemExit):  # argparse: unrecognized arguments
        prepare.main([*args, "--direct_num_workers=2"])


def test_direct_runner_reads_and_writes_a_bucket(tmp_path, tok, gcs_bucket):
    """A corpus in a bucket (the local GCS emulator, tests/gcs_emulator.py) prepared by the Beam
    pipeline into the bucket: the local path's shards, byte for byte."""
    from bertjax import fs

    paths = _corpus(tmp_path)
    for path in paths:
        name = os.path.basename(path)
        fs.write_bytes(f"{gcs_bucket}/corpus/{name}", (tmp_path / name).read_bytes())
    kw = dict(max_seq_length=32, max_predictions_per_seq=5, dupe_factor=2, num_shards=3)
    local = prepare.prepare(paths, str(tmp_path / "local"), tok, show_progress=False, **kw)
    out = f"{gcs_bucket}/beam"
    beam = prepare.prepare(
        f"{gcs_bucket}/corpus/*", out, tok, show_progress=False, runner="DirectRunner", **kw
    )
    ignored = (*TIMING, "input", "sources")
    assert {k: v for k, v in beam.items() if k not in ignored} == {
        k: v for k, v in local.items() if k not in ignored
    }
    names = sorted(os.listdir(tmp_path / "local"))
    assert fs.list_files(out) == names  # no .beam-parts left
    for name in names:
        if name.endswith(".tfrecord"):
            assert fs.read_bytes(f"{out}/{name}") == (tmp_path / "local" / name).read_bytes()

"""``bertjax extract-features``: per-token vectors of chosen layers (as BERT's extract_features.py).

Each input line is one sentence or a pair written ``A ||| B``. Layers index the model's hidden
states: 0 is the embedding output and i the output of layer i, so negative indices (the default
``-1,-2,-3,-4``: the last four layers) mean the same as in the original script. Output:

* ``.jsonl``: one JSON object per line in the original format, ``{"linex_index": i, "features":
  [{"token": "[CLS]", "layers": [{"index": -1, "values": [...]}, ...]}, ...]}`` (values rounded
  to 6 decimals);
* ``.npz``: ``features`` [lines, max_seq_length, layers, hidden] float32 (zero past each line's
  ``lengths``), ``tokens`` [lines, max_seq_length] str, ``input_ids``, ``segment_ids``,
  ``lengths``, ``layers``.

The output is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bertjax import atomic, fs, progress
from bertjax.pretrained import Pretrained, encode_batch, load_pretrained

log = logging.getLogger("bertjax")
_PAIR = re.compile(r"^(.*) \|\|\| (.*)$")


def read_examples(path: str) -> list[str | tuple[str, str]]:
    """One example per line: a sentence, or ``(A, B)`` for a line ``A ||| B``."""
    try:
        lines = fs.read_bytes(path).decode("utf-8").splitlines()  # local or gs://
    except UnicodeDecodeError as err:
        raise fs.utf8_error(path, err) from None
    examples: list[str | tuple[str, str]] = []
    for line in lines:
        match = _PAIR.match(line.strip())
        examples.append((match.group(1), match.group(2)) if match else line.strip())
    return examples


def parse_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """ "-1,-2" -> (-1, -2), checked against the L + 1 hidden states (embeddings + L layers)."""
    try:
        layers = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--layers={spec!r} must be comma-separated integers") from None
    bad = [i for i in layers if not -(num_layers + 1) <= i <= num_layers]
    if not layers or bad:
        raise ValueError(
            f"--layers={spec!r}: the model has {num_layers} layers, so indices must lie in "
            f"[{-(num_layers + 1)}, {num_layers}] (0 = embeddings)"
        )
    return layers


def extract_features(
    model: Pretrained,
    examples: Sequence[str | tuple[str, str]],
    layers: Sequence[int],
    max_seq_length: int = 128,
    batch_size: int = 8,
) -> Iterator[tuple[int, list[str], dict[str, np.ndarray], np.ndarray]]:
    """Yields (line index, tokens, encoded row, features [tokens, len(layers), hidden]) per example.

    Batches are padded to ``batch_size`` x ``max_seq_length`` so the jitted step compiles once.
    """
    if model.tokenizer is None:
        raise ValueError(f"{model.source}: no vocabulary file found beside the checkpoint")
    model.check_length(max_seq_length)
    layers = tuple(layers)

    @jax.jit
    def step(params, input_ids, segment_ids, input_mask):
        out = model.module.apply(
            {"params": params},
            input_ids,
            segment_ids,
            input_mask,
            output_hidden_states=True,
        )
        hidden = out["hidden_states"]
        return jnp.stack([hidden[i] for i in layers], axis=2)  # [batch, seq, layers, hidden]

    for start in range(0, len(examples), batch_size):
        chunk = list(examples[start : start + batch_size])
        batch = encode_batch(model.tokenizer, chunk, max_seq_length, pad_to_max_length=True)
        padded = {k: np.zeros((batch_size, max_seq_length), np.int32) for k in batch}
        for key, value in batch.items():
            padded[key][: len(chunk)] = value
        features = np.asarray(
            step(
                model.params,
                padded["input_ids"],
                padded["segment_ids"],
                padded["input_mask"],
            )
        )
        for row in range(len(chunk)):
            length = int(batch["input_mask"][row].sum())
            ids = batch["input_ids"][row, :length]
            tokens = model.tokenizer.convert_ids_to_tokens(ids)
            encoded = {k: v[row] for k, v in batch.items()}
            yield start + row, tokens, encoded, features[row, :length]


def json_record(index: int, tokens: list[str], layers, features: np.ndarray) -> str:
    """One line of the original output format (values rounded to 6 decimals)."""
    values = np.round(features.astype(np.float64), 6)
    return json.dumps(
        {
            "linex_index": index,
            "features": [
                {
                    "token": token,
                    "layers": [
                        {"index": layer, "values": values[t, j].tolist()}
                        for j, layer in enumerate(layers)
                    ],
                }
                for t, token in enumerate(tokens)
            ],
        }
    )


def _counted(records):
    """``records``, each counted in the running progress phase as it is produced."""
    for record in records:
        progress.advance(1)
        yield record


def write_features(path: str, records, layers: Sequence[int], max_seq_length: int) -> int:
    """Writes .jsonl or .npz atomically (temp name, then rename); returns the number of lines."""
    if not path.endswith((".jsonl", ".npz")):
        raise ValueError(f"--output={path}: must end in .jsonl or .npz")
    count = 0
    with atomic.atomic_open(path, "w" if path.endswith(".jsonl") else "wb") as f:
        if path.endswith(".jsonl"):
            for index, tokens, _, features in records:
                f.write(json_record(index, tokens, layers, features) + "\n")
                count += 1
        else:
            rows = list(records)
            count = len(rows)
            hidden = rows[0][3].shape[-1] if rows else 0
            feats = np.zeros((count, max_seq_length, len(layers), hidden), np.float32)
            tokens = np.full((count, max_seq_length), "", dtype=object)
            for i, (_, toks, _, features) in enumerate(rows):
                feats[i, : len(toks)] = features
                tokens[i, : len(toks)] = toks
            buffer = io.BytesIO()  # zip needs a seekable file; GFile (gs://) is not
            np.savez(
                buffer,
                features=feats,
                tokens=tokens.astype(str),
                input_ids=np.stack([r[2]["input_ids"] for r in rows]).astype(np.int32),
                segment_ids=np.stack([r[2]["segment_ids"] for r in rows]),
                lengths=np.array([len(r[1]) for r in rows], np.int32),
                layers=np.array(layers, np.int32),
            )
            f.write(buffer.getvalue())
    return count


def main(argv: list[str]) -> None:
    """``bertjax extract-features --checkpoint=DIR --input=FILE --output=OUT.jsonl|.npz``."""
    parser = argparse.ArgumentParser(
        prog="bertjax extract-features", description="Per-token vectors of chosen BERT layers."
    )
    parser.add_argument(
        "--checkpoint",
        "--init_checkpoint",
        required=True,
        help="HF, original Google or bertjax checkpoint directory",
    )
    parser.add_argument(
        "--input",
        "--input_file",
        required=True,
        help="text file: one sentence or 'A ||| B' per line",
    )
    parser.add_argument("--output", "--output_file", required=True, help=".jsonl or .npz")
    parser.add_argument("--layers", default="-1,-2,-3,-4")
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--vocab", help="vocabulary file (default: the one beside the checkpoint)")
    parser.add_argument("--dtype", default="float32", help="compute dtype")
    args = parser.parse_args(argv)
    if not args.output.endswith((".jsonl", ".npz")):
        parser.error(f"--output={args.output}: must end in .jsonl or .npz")
    if args.batch_size < 1:
        parser.error(f"--batch_size={args.batch_size} must be positive")
    examples = read_examples(args.input)
    model = load_pretrained(args.checkpoint, vocab=args.vocab, dtype=args.dtype)
    layers = parse_layers(args.layers, model.config.num_layers)
    model.check_length(args.max_seq_length)
    records = extract_features(model, examples, layers, args.max_seq_length, args.batch_size)
    with progress.phase("extracting features", len(examples), "lines"):
        count = write_features(args.output, _counted(records), layers, args.max_seq_length)
    log.info("wrote features of %d lines (layers %s) to %s", count, list(layers), args.output)

"""`bertjax prepare`: the original BERT `create_pretraining_data.py`, streaming and parallel.

Instances follow the original algorithm (google-research/bert): per document, a target length of
max_seq_length - 3 (with prob short_seq_prob a random one in [2, max_seq_length - 3], drawn once per
document as in the original); sentences are accumulated up to the target and split at a random point
into A and B; with prob 0.5 (always when the chunk has one sentence) B is taken from a random other
document from a random start and the unused sentences are put back; `truncate_seq_pair` trims the
longer side from the front or back at random; the record is `[CLS] A [SEP] B [SEP]` with segment ids
0/1. With nsp=False an instance is one segment of consecutive sentences filling max_seq_length - 2:
`[CLS] A [SEP]`. `dupe_factor` passes over the corpus give different instances and masks.
With packing (nsp=False only) the instances of a unit, pass and split go through a first-fit packer
(`bertjax.data.packing`) so that short ones (document ends, short_seq_prob) share rows; a row is
masked as a whole (max_predictions_per_seq per row, positions row-global).

Scalable variant (documented departure from the original, which shuffles the whole corpus in memory):
every input file (or TFDS slice) is an independent work unit with its own generators seeded by
(seed, unit index, pass, split), and random next segments come from a sliding window of
`random_document_buffer` documents before and after the current one in the same unit. So memory is
flat in corpus size, and the output is byte-identical for any num_workers. Instance k of a unit goes
to shard (k + unit index) % num_shards; a shard is the concatenation of its per-unit parts in unit
order (TFRecord files concatenate), so shards mix all units; readers shuffle further.

Held-out eval split: each document goes to "eval" with probability eval_fraction, decided by a
generator seeded by (seed, unit index) (deterministic); eval documents pair only with eval documents.

Output in output_dir:
  {split}-{i:05d}-of-{n:05d}.tfrecord, split in (train, eval): tf.train.Example records with
    input_ids, input_mask, segment_ids: int64 [max_seq_length] (0-padded);
    next_sentence_labels: int64 [1] (1 = random next, 0 = real next; always 0 when nsp is false);
    static masking only: masked_lm_positions, masked_lm_ids: int64 [max_predictions_per_seq],
    masked_lm_weights: float [max_predictions_per_seq] (1.0 real, 0.0 padding);
    packing only: pack_ids, position_ids: int64 [max_seq_length] (see bertjax.data.packing).
  metadata.json, written last (atomically), keys:
    format_version, max_seq_length, max_predictions_per_seq, masked_lm_prob, masking ("static" |
    "dynamic"), whole_word_mask, nsp, packing, short_seq_prob, dupe_factor, seed,
    random_document_buffer, eval_fraction, corpus_format, input (list of corpus spec entries),
    sources (work unit names), vocab_file, vocab_size, vocab_sha256 (of the vocabulary file's bytes;
    training refuses data prepared with another vocabulary), tokenizer_kind, do_lower_case, special_ids ({pad, unk, cls, sep, mask}),
    shards ({file name: example count} over both splits), shard_files ({split: [file names]}),
    examples ({split: count}), documents ({split: count}), sentences, tokens, input_bytes, seconds,
    docs_per_second, mb_per_second.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import pickle
import shutil
import time
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
import tqdm

from bertjax import atomic
from bertjax.data import corpus, lifetime
from bertjax.data.instances import (  # noqa: F401  (re-exported)
    DocumentWindow,
    PrepareConfig,
    create_instances_from_document,
    instance_to_example,
    packed_to_example,
    truncate_seq_pair,
)
from bertjax.data.packing import Packer
from bertjax.data.pipeline import METADATA_FILE, read_metadata
from bertjax.text import load_tokenizer

FORMAT_VERSION = 1
SPLITS = ("train", "eval")
_EVAL_STREAM = 0x5EED_E7A1  # generator stream tag for the eval-split draws
_SETTINGS = (
    "format_version max_seq_length max_predictions_per_seq masked_lm_prob masking whole_word_mask nsp "
    "short_seq_prob dupe_factor seed random_document_buffer eval_fraction corpus_format input sources "
    "vocab_file vocab_size tokenizer_kind do_lower_case special_ids num_shards packing text_column"
).split()
# settings added later: their value in older metadata
_SETTING_DEFAULTS = {"packing": False, "text_column": "text"}
log = logging.getLogger(__name__)


# Per-process state of a worker: the tokenizer (loaded once) and the shared progress counters.
_WORKER: dict = {}


def _init_worker(counters, parent_pid: int | None = None) -> None:
    _WORKER["counters"] = counters
    if parent_pid is not None:  # a pool worker: ends when prepare is killed
        lifetime.die_with_parent(parent_pid)


def _tokenizer_for(spec):
    if not isinstance(spec, tuple):
        return spec  # an in-process tokenizer object
    if _WORKER.get("tokenizer_spec") != spec:
        _WORKER["tokenizer"], _WORKER["tokenizer_spec"] = load_tokenizer(*spec), spec
    return _WORKER["tokenizer"]


class _Progress:
    """Batches progress into the shared counters (docs, bytes) every ~1 MB."""

    def __init__(self):
        self.docs = self.bytes = 0

    def add(self, docs: int = 0, nbytes: int = 0) -> None:
        self.docs += docs
        self.bytes += nbytes
        if self.bytes >= 1 << 20 or self.docs >= 1000:
            self.flush()

    def flush(self) -> None:
        lifetime.exit_if_orphaned()
        counters = _WORKER.get("counters")
        if counters is not None:
            for counter, value in zip(counters, (self.docs, self.bytes)):
                with counter.get_lock():
                    counter.value += value
        self.docs = self.bytes = 0


def _tokenized_documents(source, index, cfg, tok, progress):
    """(split, document) pairs of one unit; a document is a list of non-empty id lists."""
    eval_rng = np.random.default_rng([cfg.seed, index, _EVAL_STREAM])
    for doc in corpus.iter_source_documents(
        source, cfg.corpus_format, lambda n: progress.add(0, n), cfg.text_column
    ):
        progress.add(1)
        ids = [s for s in (tok.encode(sentence) for sentence in doc) if s]
        if not ids:
            continue
        split = "eval" if cfg.eval_fraction and eval_rng.random() < cfg.eval_fraction else "train"
        yield split, ids


def _doc_stream(source, index: int, cfg: PrepareConfig, tok, cache_path: str, pass_index: int):
    """(split, document) pairs: tokenized from the corpus in pass 0 (and cached), then from the cache."""
    if pass_index > 0:
        with open(cache_path, "rb") as cache:
            while True:
                try:
                    yield pickle.load(cache)
                except EOFError:
                    return
    progress = _Progress()
    with open(cache_path, "wb") as cache:
        for item in _tokenized_documents(source, index, cfg, tok, progress):
            if cfg.dupe_factor > 1:
                pickle.dump(item, cache, protocol=pickle.HIGHEST_PROTOCOL)
            yield item
    progress.flush()


def _process_source(task) -> dict:
    """Worker: all passes over one unit, writing per-shard part files; returns counts."""
    index, source, cfg, tok_spec, tmp_dir = task
    tok = _tokenizer_for(tok_spec)
    consts = dict(
        vocab_size=tok.vocab_size, mask_id=tok.mask_id, cls_id=tok.cls_id, sep_id=tok.sep_id,
        pad_id=tok.pad_id, special_ids=(tok.cls_id, tok.sep_id, tok.pad_id),
        word_start=tok.word_start_table() if cfg.whole_word_mask else None,
    )  # fmt: skip
    num_shards, writers = cfg.shard_counts(), {}
    examples = {split: collections.Counter() for split in SPLITS}
    written = collections.Counter()
    stats = {"documents": dict.fromkeys(SPLITS, 0), "sentences": 0, "tokens": 0, "real_next": 0}
    cache_path = os.path.join(tmp_dir, f"cache-{index:06d}.pkl")

    def make_instances(split: str, rng: np.random.Generator, pool, i: int) -> None:
        kw = dict(max_seq_length=cfg.max_seq_length, short_seq_prob=cfg.short_seq_prob, nsp=cfg.nsp)
        for a, b, is_random in create_instances_from_document(pool, i, rng=rng, **kw):
            stats["real_next"] += not is_random
            if not cfg.packing:
                write(split, instance_to_example(a, b, is_random, cfg=cfg, consts=consts, rng=rng))
                continue
            for row in packers[split].add(a, len(a) + 2):  # [CLS] a [SEP]
                write(split, packed_to_example(row, cfg=cfg, consts=consts, rng=rng))

    def write(split: str, record: bytes) -> None:
        shard = (written[split] + index) % num_shards[split]  # round robin, offset per unit
        written[split] += 1
        if (split, shard) not in writers:
            part = os.path.join(tmp_dir, _part_name(split, shard, index))
            writers[split, shard] = tf.io.TFRecordWriter(part)
        writers[split, shard].write(record)
        examples[split][shard] += 1

    for pass_index in range(cfg.dupe_factor):
        rngs = {
            split: np.random.default_rng([cfg.seed, index, pass_index, split_id])
            for split_id, split in enumerate(SPLITS)
        }
        packers = {split: Packer(cfg.max_seq_length, min_length=3) for split in SPLITS}
        windows = {
            split: DocumentWindow(
                cfg.random_document_buffer, functools.partial(make_instances, split, rngs[split])
            )
            for split in SPLITS
        }
        for split, doc in _doc_stream(source, index, cfg, tok, cache_path, pass_index):
            if pass_index == 0:
                stats["documents"][split] += 1
                stats["sentences"] += len(doc)
                stats["tokens"] += sum(map(len, doc))
            windows[split].push(doc)
        for split, window in windows.items():
            window.finish()
            for row in packers[split].flush():
                write(split, packed_to_example(row, cfg=cfg, consts=consts, rng=rngs[split]))
    for writer in writers.values():
        writer.close()
    os.remove(cache_path)
    return {"index": index, "examples": {s: dict(c) for s, c in examples.items()}, **stats}


def _part_name(split: str, shard: int, index: int) -> str:
    return f"{split}-{shard:05d}.part-{index:06d}"


def _shard_name(split: str, shard: int, count: int) -> str:
    return f"{split}-{shard:05d}-of-{count:05d}.tfrecord"


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}"


def _run_units(tasks: list, num_workers: int, total_bytes: int | None, show_progress: bool) -> list:
    """Runs _process_source over the units (in-process or on a spawn pool) with a tqdm bar."""
    ctx = multiprocessing.get_context("spawn")
    counters = (ctx.Value("q", 0), ctx.Value("q", 0))  # documents read, bytes read
    bar = tqdm.tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        disable=not show_progress,
        desc="prepare",
        smoothing=0.1,
    )
    start = time.time()

    def update():
        bar.n = counters[1].value
        rate = counters[0].value / max(time.time() - start, 1e-9)
        bar.set_postfix_str(f"{counters[0].value} docs, {rate:.0f} docs/s", refresh=True)

    try:
        if num_workers <= 1:
            _init_worker(counters)
            results = []
            for task in tasks:
                results.append(_process_source(task))
                update()
            _WORKER.pop("counters", None)
            return results
        with ctx.Pool(
            num_workers, initializer=_init_worker, initargs=(counters, os.getpid())
        ) as pool:
            pending = pool.map_async(_process_source, tasks, chunksize=1)
            while not pending.ready():
                pending.wait(0.5)
                update()
            results = pending.get()
            update()
            return results
    finally:
        bar.close()


def vocab_sha256(path: str) -> str:
    """SHA-256 of a vocabulary file's bytes (vocab.txt, *.model or tokenizer.json; gs:// too)."""
    digest = hashlib.sha256()
    with tf.io.gfile.GFile(str(path), "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _settings(cfg: PrepareConfig, entries: list[str], sources: list, tok) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
        "input": entries,
        "sources": [s.name for s in sources],
        "vocab_file": str(tok.vocab_file),
        "vocab_size": int(tok.vocab_size),
        "vocab_sha256": vocab_sha256(tok.vocab_file),
        "tokenizer_kind": tok.kind,
        "do_lower_case": bool(tok.do_lower_case),
        "special_ids": {
            k: int(getattr(tok, f"{k}_id")) for k in ("pad", "unk", "cls", "sep", "mask")
        },
    }


def prepare(
    input_spec: str | Sequence[str],
    output_dir: str,
    tokenizer,
    *,
    corpus_format: str = "bert",
    max_seq_length: int = 128,
    max_predictions_per_seq: int = 20,
    masked_lm_prob: float = 0.15,
    short_seq_prob: float = 0.1,
    dupe_factor: int = 5,
    nsp: bool = True,
    masking: str = "static",
    whole_word_mask: bool = False,
    seed: int = 12345,
    num_shards: int = 16,
    eval_fraction: float = 0.0,
    random_document_buffer: int = 1000,
    num_workers: int | None = None,
    tfds_data_dir: str | None = None,
    show_progress: bool = True,
    packing: bool = False,
    text_column: str = "text",
) -> dict:
    """Turns a corpus into pretraining TFRecord shards + metadata.json; returns the metadata.

    `tokenizer` is a `bertjax.text.tokenization` tokenizer (workers reload it from its vocab_file). When
    output_dir already holds a metadata.json for the same settings the work is skipped; for other
    settings it is an error. Options are described in the module docstring.
    """
    cfg = PrepareConfig(
        max_seq_length, max_predictions_per_seq, masked_lm_prob, short_seq_prob, dupe_factor, nsp,
        masking, whole_word_mask, seed, num_shards, eval_fraction, random_document_buffer,
        corpus_format, packing, text_column,
    )  # fmt: skip
    cfg.validate()
    entries = (
        [e.strip() for e in input_spec.split(",")]
        if isinstance(input_spec, str)
        else [str(e) for e in input_spec]
    )
    sources = corpus.list_sources(entries, tfds_data_dir=tfds_data_dir)
    settings = _settings(cfg, entries, sources, tokenizer)
    output_dir = str(output_dir)
    existing = read_metadata(output_dir, missing_ok=True)
    if existing is not None:
        differ = [k for k in _SETTINGS if existing.get(k, _SETTING_DEFAULTS.get(k)) != settings[k]]
        if existing.get("vocab_sha256", settings["vocab_sha256"]) != settings["vocab_sha256"]:
            differ.append("vocab_sha256 (the vocabulary file's contents)")  # older: no hash
        if differ:
            raise ValueError(
                f"{_join(output_dir, METADATA_FILE)} was written for other settings (differs in "
                f"{', '.join(differ)}); use a new --output_dir or delete that one"
            )
        missing = [n for n in existing["shards"] if not tf.io.gfile.exists(_join(output_dir, n))]
        if not missing:
            log.info("%s is already prepared with these settings; skipping", output_dir)
            return existing
        tf.io.gfile.remove(_join(output_dir, METADATA_FILE))  # incomplete: prepare again
    tf.io.gfile.makedirs(output_dir)
    for split in SPLITS:  # stale shards of an interrupted run
        for path in tf.io.gfile.glob(_join(output_dir, f"{split}-*-of-*.tfrecord")):
            tf.io.gfile.remove(path)
    remote = "://" in output_dir
    tmp_dir = lifetime.make_tmp_dir(".prepare-tmp-", None if remote else output_dir)
    tok_spec = tokenizer
    num_workers = min(num_workers or os.cpu_count() or 1, len(sources))
    if num_workers > 1:
        tok_spec = (str(tokenizer.vocab_file), bool(tokenizer.do_lower_case))
    tasks = [(i, source, cfg, tok_spec, tmp_dir) for i, source in enumerate(sources)]
    sizes = [tf.io.gfile.stat(s.path).length if s.kind == "file" else None for s in sources]
    total_bytes = None if None in sizes else sum(sizes)
    start = time.time()
    try:
        results = _run_units(tasks, num_workers, total_bytes, show_progress)
        seconds = time.time() - start
        documents = {s: sum(r["documents"][s] for r in results) for s in SPLITS}
        _check_documents(cfg, sources, results, documents)
        shards, shard_files, examples = _merge_parts(
            cfg, output_dir, tmp_dir, len(sources), results
        )
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    metadata = {
        **settings,
        "shards": shards,
        "shard_files": shard_files,
        "examples": examples,
        "documents": documents,
        "sentences": sum(r["sentences"] for r in results),
        "tokens": sum(r["tokens"] for r in results),
        "input_bytes": total_bytes,
        "seconds": round(seconds, 3),
        "docs_per_second": round(sum(documents.values()) / max(seconds, 1e-9), 1),
        "mb_per_second": round((total_bytes or 0) / 1e6 / max(seconds, 1e-9), 3),
    }
    atomic.write_text(_join(output_dir, METADATA_FILE), json.dumps(metadata, indent=1))
    return metadata


def _check_documents(cfg: PrepareConfig, sources: list, results: list, documents: dict) -> None:
    """One-line errors for a corpus that cannot make pretraining instances."""
    names = [s.name for s in sources]
    shown = names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} more)"
    if documents["train"] == 0:
        raise ValueError(f"corpus {shown}: no non-empty document (format {cfg.corpus_format!r})")
    if cfg.nsp and documents["train"] < 2:
        raise ValueError(
            f"corpus {shown}: only 1 document; next-sentence prediction needs at least 2 "
            "(add documents or pass nsp=False / --nsp=false)"
        )
    instances = sum(sum(c.values()) for r in results for c in r["examples"].values())
    if cfg.nsp and instances and not sum(r["real_next"] for r in results):
        log.warning(
            "nsp: none of the %d instances has a real next segment (every document has one "
            "sentence?): every next_sentence_label is 1 (random), so NSP learns nothing; split "
            "documents into sentences (one per line) or pass nsp=False",
            instances,
        )
    if cfg.eval_fraction and documents["eval"] == 0:
        log.warning(
            "eval_fraction=%s chose no document: the eval shards are empty", cfg.eval_fraction
        )
    for r in results:
        if sum(r["documents"].values()) == 0:
            log.warning("corpus %s: no documents", sources[r["index"]].name)
        elif cfg.nsp and r["documents"]["train"] == 1:
            log.warning(
                "corpus %s: a single document; its random next segments come from itself",
                sources[r["index"]].name,
            )


def _merge_parts(cfg: PrepareConfig, output_dir: str, tmp_dir: str, num_units: int, results: list):
    """Concatenates per-unit parts (in unit order) into shards, each via a temp name + rename."""
    shards, shard_files, examples = {}, {}, {}
    for split, count in cfg.shard_counts().items():
        shard_files[split] = []
        for shard in range(count):
            name = _shard_name(split, shard, count)
            final = _join(output_dir, name)
            with tf.io.gfile.GFile(f"{final}.tmp", "wb") as out:
                out.write(b"")  # GFile creates the file on the first write: an empty shard too
                for index in range(num_units):
                    part = os.path.join(tmp_dir, _part_name(split, shard, index))
                    if os.path.exists(part):
                        with open(part, "rb") as f:
                            shutil.copyfileobj(f, out, 1 << 22)
                        os.remove(part)
            tf.io.gfile.rename(f"{final}.tmp", final, overwrite=True)
            shards[name] = sum(r["examples"][split].get(shard, 0) for r in results)
            shard_files[split].append(name)
        examples[split] = sum(shards[n] for n in shard_files[split])
    return shards, shard_files, examples


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """`bertjax prepare`: command-line front end of `prepare`."""
    d = PrepareConfig()
    p = argparse.ArgumentParser(prog="bertjax prepare", description=__doc__.split("\n")[0])
    p.add_argument(
        "--input", required=True, help="comma-separated files/globs/gs:// or tfds:NAME:SPLIT"
    )
    p.add_argument("--output_dir", required=True)
    p.add_argument(
        "--vocab", required=True, help="vocab.txt (WordPiece) or *.model (SentencePiece)"
    )
    p.add_argument("--do_lower_case", type=_bool, default=None, help="default: inferred from vocab")
    p.add_argument("--format", default=d.corpus_format, choices=corpus.FORMATS)
    p.add_argument(
        "--text_column", default=d.text_column, help="JSON key / Parquet column (jsonl, parquet)"
    )
    p.add_argument("--tfds_data_dir", default=None)
    for name in (
        "max_seq_length",
        "max_predictions_per_seq",
        "dupe_factor",
        "seed",
        "num_shards",
        "random_document_buffer",
    ):
        p.add_argument(f"--{name}", type=int, default=getattr(d, name))
    for name in ("masked_lm_prob", "short_seq_prob", "eval_fraction"):
        p.add_argument(f"--{name}", type=float, default=getattr(d, name))
    p.add_argument("--nsp", type=_bool, default=d.nsp)
    p.add_argument("--whole_word_mask", type=_bool, default=d.whole_word_mask)
    p.add_argument("--packing", type=_bool, default=d.packing, help="pack rows (needs --nsp=false)")
    p.add_argument("--masking", default=d.masking, choices=("static", "dynamic"))
    p.add_argument("--num_workers", type=int, default=None, help="default: all cores")
    p.add_argument("--no_progress", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    meta = prepare(
        args.input, args.output_dir, load_tokenizer(args.vocab, args.do_lower_case),
        corpus_format=args.format, max_seq_length=args.max_seq_length,
        max_predictions_per_seq=args.max_predictions_per_seq, masked_lm_prob=args.masked_lm_prob,
        short_seq_prob=args.short_seq_prob, dupe_factor=args.dupe_factor, nsp=args.nsp,
        masking=args.masking, whole_word_mask=args.whole_word_mask, seed=args.seed,
        num_shards=args.num_shards, eval_fraction=args.eval_fraction,
        random_document_buffer=args.random_document_buffer, num_workers=args.num_workers,
        tfds_data_dir=args.tfds_data_dir, show_progress=not args.no_progress, packing=args.packing,
        text_column=args.text_column,
    )  # fmt: skip
    print(
        f"{args.output_dir}: {meta['examples']} examples from {meta['documents']} documents, "
        f"{meta['docs_per_second']} docs/s, {meta['mb_per_second']} MB/s"
    )
    return 0

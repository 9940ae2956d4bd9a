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

Implementation (per unit, no per-token Python): text is tokenized a block of lines at a time
(`bertjax.text.bulk_wordpiece`, id for id `encode`), documents are token arrays and instances spans
of them (`spans`), and rows are masked and serialized a batch at a time (`example_batch`,
`example_codec`). The random draws are taken in bulk, so they differ from those of the list-based
reference functions in `instances` (the original script's order of calls), not their distributions.

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
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence

import bertjax.fs as fs
from bertjax import atomic
from bertjax.data import corpus, lifetime, units
from bertjax.data.instances import (  # noqa: F401  (re-exported)
    DocumentWindow,
    PrepareConfig,
    create_instances_from_document,
    instance_to_example,
    packed_to_example,
    truncate_seq_pair,
)
from bertjax.data.metadata import METADATA_FILE, read_metadata
from bertjax.data.units import SPLITS
from bertjax.text import load_tokenizer

FORMAT_VERSION = 1
_TMP_PREFIX = ".prepare-tmp-"
_SETTINGS = (
    "format_version max_seq_length max_predictions_per_seq masked_lm_prob masking whole_word_mask nsp "
    "short_seq_prob dupe_factor seed random_document_buffer eval_fraction corpus_format input sources "
    "vocab_file vocab_size tokenizer_kind do_lower_case special_ids num_shards packing text_column"
).split()
# settings added later: their value in older metadata
_SETTING_DEFAULTS = {"packing": False, "text_column": "text"}
log = logging.getLogger(__name__)


def _shard_name(split: str, shard: int, count: int) -> str:
    return f"{split}-{shard:05d}-of-{count:05d}.tfrecord"


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}"


def vocab_sha256(path: str) -> str:
    """SHA-256 of a vocabulary file's bytes (vocab.txt, *.model or tokenizer.json; gs:// too)."""
    digest = hashlib.sha256()
    with fs.open_file(str(path), "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _settings(cfg: PrepareConfig, entries: list[str], sources: list, tok) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.compare},
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
    text_column_setting: str = "text_column",
    runner: str | None = None,
    beam_args: Sequence[str] = (),
) -> dict:
    """Turns a corpus into pretraining TFRecord shards + metadata.json; returns the metadata.

    `tokenizer` is a `bertjax.text.tokenization` tokenizer (workers reload it from its vocab_file). When
    output_dir already holds a metadata.json for the same settings the work is skipped; for other
    settings it is an error. Options are described in the module docstring; `text_column_setting`
    is what errors call the option that chose `text_column` (`--text_column`, `data.text_column`).
    """
    cfg = PrepareConfig(
        max_seq_length,
        max_predictions_per_seq,
        masked_lm_prob,
        short_seq_prob,
        dupe_factor,
        nsp,
        masking,
        whole_word_mask,
        seed,
        num_shards,
        eval_fraction,
        random_document_buffer,
        corpus_format,
        packing,
        text_column,
        text_column_setting,
    )
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
        missing = [n for n in existing["shards"] if not fs.exists(_join(output_dir, n))]
        if not missing:
            log.info("%s is already prepared with these settings; skipping", output_dir)
            return existing
        fs.remove(_join(output_dir, METADATA_FILE))  # incomplete: prepare again
    fs.makedirs(output_dir)
    sizes = [fs.size(s.path) if s.kind == "file" else None for s in sources]
    total_bytes = None if None in sizes else sum(sizes)
    if runner:  # Apache Beam (bertjax.data.beam_prepare): the same units and shards
        return _prepare_beam(
            cfg, settings, sources, tokenizer, output_dir, total_bytes, runner, beam_args
        )
    tmp_dir = _work_dir(output_dir, _resume_key(settings, sources, sizes))
    _remove_stale_shards(cfg, output_dir, tmp_dir)
    done = units.done_units(tmp_dir, len(sources))
    if done:
        log.info(
            "resuming: %d of %d corpus units were done by an interrupted run",
            len(done),
            len(sources),
        )
    tok_spec = tokenizer
    todo = [i for i in range(len(sources)) if i not in done]
    num_workers = max(1, min(num_workers or os.cpu_count() or 1, len(todo)))
    if num_workers > 1:
        tok_spec = (str(tokenizer.vocab_file), bool(tokenizer.do_lower_case))
        units.preload_tokenizer(
            tok_spec, tokenizer, cfg.whole_word_mask
        )  # forked workers inherit its tables
    tasks = [(i, sources[i], cfg, tok_spec, tmp_dir) for i in todo]
    start = time.time()
    try:
        results = units.run_units(tasks, num_workers, total_bytes, show_progress)
        results = sorted([*done.values(), *results], key=lambda r: r["index"])
        seconds = time.time() - start
        documents = {s: sum(r["documents"][s] for r in results) for s in SPLITS}
        _check_documents(cfg, sources, results, documents)
        shards, shard_files, examples = _merge_parts(
            cfg, output_dir, tmp_dir, len(sources), results
        )
    except Exception:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # an error: nothing worth resuming
        raise
    # Killed or interrupted (KeyboardInterrupt): tmp_dir stays, and the next run resumes from it.
    shutil.rmtree(tmp_dir, ignore_errors=True)
    return _publish(
        output_dir,
        settings,
        results,
        (shards, shard_files, examples),
        documents,
        total_bytes,
        seconds,
    )


def _prepare_beam(cfg, settings, sources, tokenizer, output_dir, total_bytes, runner, beam_args):
    from bertjax.data import beam_prepare

    spec = (str(tokenizer.vocab_file), bool(tokenizer.do_lower_case))
    tasks = [(i, source, cfg, spec) for i, source in enumerate(sources)]
    for split in SPLITS:  # shards of an earlier, unfinished run
        for path in fs.glob(_join(output_dir, f"{split}-*-of-*.tfrecord")):
            fs.remove(path)
    start = time.time()
    results = beam_prepare.run(tasks, output_dir, cfg.shard_counts(), runner, beam_args)
    seconds = time.time() - start
    documents = {s: sum(r["documents"][s] for r in results) for s in SPLITS}
    _check_documents(cfg, sources, results, documents)
    table = _shard_table(cfg, results)
    return _publish(output_dir, settings, results, table, documents, total_bytes, seconds)


def _shard_table(cfg: PrepareConfig, results: list):
    """({shard file: examples}, {split: [shard files]}, {split: examples}) from the units' counts."""
    shards, shard_files, examples = {}, {}, {}
    for split, count in cfg.shard_counts().items():
        shard_files[split] = [_shard_name(split, shard, count) for shard in range(count)]
        for shard, name in enumerate(shard_files[split]):
            shards[name] = sum(r["examples"][split].get(shard, 0) for r in results)
        examples[split] = sum(shards[n] for n in shard_files[split])
    return shards, shard_files, examples


def _publish(output_dir, settings, results, table, documents, total_bytes, seconds) -> dict:
    """Writes metadata.json (last: it publishes the shard set) and returns it."""
    shards, shard_files, examples = table
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


def _resume_key(settings: dict, sources: list, sizes: list) -> str:
    """Hash of everything that changes the output, input files' sizes and times included."""
    stamps = [
        (size, os.path.getmtime(s.path) if s.kind == "file" and not fs.is_remote(s.path) else None)
        for s, size in zip(sources, sizes)
    ]
    text = json.dumps([settings, stamps], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _work_dir(output_dir: str, key: str) -> str:
    """This run's temporary folder (in output_dir, or the system's for a remote output_dir), holding
    what an interrupted run with the same settings finished (`units.adopt_interrupted`)."""
    folder = None if fs.is_remote(output_dir) else output_dir
    resume = units.adopt_interrupted(folder or tempfile.gettempdir(), _TMP_PREFIX, key)
    tmp_dir = lifetime.make_tmp_dir(_TMP_PREFIX, folder)
    with open(os.path.join(tmp_dir, units.KEY_FILE), "w") as f:
        f.write(key)
    if resume is not None:
        units.move_contents(resume, tmp_dir)
    return tmp_dir


def _remove_stale_shards(cfg: PrepareConfig, output_dir: str, tmp_dir: str) -> None:
    """Removes shards of an interrupted run, except those it completed for these settings."""
    keep = {
        _shard_name(split, shard, count)
        for split, count in cfg.shard_counts().items()
        for shard in range(count)
        if units.is_merged(tmp_dir, split, shard)
    }
    for split in SPLITS:
        for path in fs.glob(_join(output_dir, f"{split}-*-of-*.tfrecord")):
            if path.rsplit("/", 1)[-1] not in keep:
                fs.remove(path)


def _merge_parts(cfg: PrepareConfig, output_dir: str, tmp_dir: str, num_units: int, results: list):
    """Concatenates per-unit parts (in unit order) into shards, each via a temp name + rename;
    a merged shard is marked (`units.mark_merged`) before its parts are removed."""
    for split, count in cfg.shard_counts().items():
        for shard in range(count):
            name = _shard_name(split, shard, count)
            final = _join(output_dir, name)
            parts = [
                os.path.join(tmp_dir, units.part_name(split, shard, i)) for i in range(num_units)
            ]
            if not (units.is_merged(tmp_dir, split, shard) and fs.exists(final)):
                with fs.open_file(f"{final}.tmp", "wb") as out:
                    out.write(b"")  # GFile creates the file on the first write: an empty shard too
                    for part in parts:
                        if os.path.exists(part):
                            with open(part, "rb") as f:
                                shutil.copyfileobj(f, out, 1 << 22)
                fs.rename(f"{final}.tmp", final)
                units.mark_merged(tmp_dir, split, shard)
            for part in parts:
                if os.path.exists(part):
                    os.remove(part)
    return _shard_table(cfg, results)


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
    p.add_argument(
        "--runner",
        default=None,
        help="run as an Apache Beam pipeline (DirectRunner, DataflowRunner, ...); other --flags "
        "go to Beam's pipeline options",
    )
    args, beam_args = p.parse_known_args(argv)
    if beam_args and not args.runner:
        p.error(f"unrecognized arguments: {' '.join(beam_args)}")
    meta = prepare(
        args.input,
        args.output_dir,
        load_tokenizer(args.vocab, args.do_lower_case),
        corpus_format=args.format,
        max_seq_length=args.max_seq_length,
        max_predictions_per_seq=args.max_predictions_per_seq,
        masked_lm_prob=args.masked_lm_prob,
        short_seq_prob=args.short_seq_prob,
        dupe_factor=args.dupe_factor,
        nsp=args.nsp,
        masking=args.masking,
        whole_word_mask=args.whole_word_mask,
        seed=args.seed,
        num_shards=args.num_shards,
        eval_fraction=args.eval_fraction,
        random_document_buffer=args.random_document_buffer,
        num_workers=args.num_workers,
        tfds_data_dir=args.tfds_data_dir,
        show_progress=not args.no_progress,
        packing=args.packing,
        text_column=args.text_column,
        text_column_setting="--text_column",
        runner=args.runner,
        beam_args=beam_args,
    )
    print(
        f"{args.output_dir}: {meta['examples']} examples from {meta['documents']} documents, "
        f"{meta['docs_per_second']} docs/s, {meta['mb_per_second']} MB/s"
    )
    return 0

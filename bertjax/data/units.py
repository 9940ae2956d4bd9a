"""The work units of `bertjax prepare`: a worker turns one corpus unit (file or TFDS slice) into
per-shard part files in the run's temporary folder, and marks the unit complete.

Resuming: the temporary folder holds `settings.key` (a hash of everything that changes the output)
and, per finished unit, `unit-{index:06d}.json` (its counts, written last and atomically). A run
that was killed leaves its folder behind; the next run with the same settings adopts it
(`adopt_interrupted`) and processes only the units without a marker. Shards merged into the output
before the kill are marked `merged-{split}-{shard:05d}` and kept.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import multiprocessing
import os
import pickle
import re
import shutil
import socket
import sys
import time

import numpy as np

from bertjax import progress
from bertjax.data import lifetime, token_docs
from bertjax.data.example_batch import ExampleBatch
from bertjax.data.example_codec import frame_records
from bertjax.data.instances import DocumentWindow, PrepareConfig
from bertjax.data.packing import Packer, row_layout
from bertjax.data.records import HAS_CRC32C, RecordWriter
from bertjax.data.spans import document_spans
from bertjax.text import load_tokenizer

SPLITS = ("train", "eval")
KEY_FILE = "settings.key"
_EVAL_STREAM = 0x5EED_E7A1  # generator stream tag for the eval-split draws
_RESUME_PREFIX = ".prepare-resume-"

# Per-process state of a worker: the tokenizer (loaded once) and the shared progress counters.
_WORKER: dict = {}


def _init_worker(counters, parent_pid: int | None = None) -> None:
    _WORKER["counters"] = counters
    if parent_pid is not None:  # a pool worker: ends when prepare is killed
        lifetime.die_with_parent(parent_pid)


def preload_tokenizer(spec, tokenizer, whole_word: bool = False) -> None:
    """Makes `tokenizer` (with its bulk encoder's tables) the one for `spec` in this process, so
    that workers forked from it start with them instead of loading their own."""
    if hasattr(tokenizer, "bulk_encoder"):
        tokenizer.bulk_encoder()
    if whole_word:
        tokenizer.word_start_table()
    _WORKER["tokenizer"], _WORKER["tokenizer_spec"] = tokenizer, spec


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
    """(split, document) pairs of one unit (`token_docs.tokenized_documents`)."""
    eval_rng = np.random.default_rng([cfg.seed, index, _EVAL_STREAM])
    on_bytes = lambda n: progress.add(0, n)  # noqa: E731
    for doc in token_docs.tokenized_documents(
        source, cfg.corpus_format, tok, on_bytes, cfg.text_column, cfg.text_column_setting
    ):
        progress.add(1)
        split = "eval" if cfg.eval_fraction and eval_rng.random() < cfg.eval_fraction else "train"
        yield split, doc


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


class _Shards:
    """The unit's part files: record k of a split goes to shard (k + unit index) % shards."""

    def __init__(self, cfg: PrepareConfig, index: int, tmp_dir: str):
        self.counts, self.index, self.tmp_dir = cfg.shard_counts(), index, tmp_dir
        self.writers: dict = {}
        self.written = collections.Counter()
        self.examples = {split: collections.Counter() for split in SPLITS}

    def emit(self, split: str, blob: bytes, lengths: list[int]) -> None:
        """Records laid one after another in blob (`ExampleBatch`'s emit)."""
        if not HAS_CRC32C:  # pragma: no cover - TensorFlow's writer frames each record
            framed = []
            for end, n in zip(itertools.accumulate(lengths), lengths):
                framed += (b"", blob[end - n : end], b"")
        else:
            framed = frame_records(blob, lengths)
        count, first = self.counts[split], self.written[split] + self.index
        for k in range(min(count, len(lengths))):
            shard = (first + k) % count
            rows = range(k, len(lengths), count)
            if (split, shard) not in self.writers:
                part = os.path.join(self.tmp_dir, part_name(split, shard, self.index))
                self.writers[split, shard] = RecordWriter(part)
            writer = self.writers[split, shard]
            if HAS_CRC32C:
                writer.write_framed(b"".join([p for r in rows for p in framed[3 * r : 3 * r + 3]]))
            else:  # pragma: no cover
                for r in rows:
                    writer.write(framed[3 * r + 1])
            self.examples[split][shard] += len(rows)
        self.written[split] += len(lengths)

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()


def process_unit(task) -> dict:
    """Worker: all passes over one unit, writing per-shard part files; returns counts."""
    index, source, cfg, tok_spec, tmp_dir = task
    tok = _tokenizer_for(tok_spec)
    consts = dict(
        vocab_size=tok.vocab_size,
        mask_id=tok.mask_id,
        cls_id=tok.cls_id,
        sep_id=tok.sep_id,
        pad_id=tok.pad_id,
        special_ids=(tok.cls_id, tok.sep_id, tok.pad_id),
        word_start=tok.word_start_table() if cfg.whole_word_mask else None,
    )
    shards = _Shards(cfg, index, tmp_dir)
    stats = {"documents": dict.fromkeys(SPLITS, 0), "sentences": 0, "tokens": 0, "real_next": 0}
    cache_path = os.path.join(tmp_dir, f"cache-{index:06d}.pkl")
    cls_sep = np.array([tok.cls_id], np.int32), np.array([tok.sep_id], np.int32)
    kw = dict(max_seq_length=cfg.max_seq_length, short_seq_prob=cfg.short_seq_prob, nsp=cfg.nsp)

    def make_instances(split: str, rng: np.random.Generator, pool, i: int) -> None:
        spans = document_spans(pool, i, rng=rng, **kw)
        stats["real_next"] += sum(not span.is_random_next for span in spans)
        if not cfg.packing:
            batches[split].add_spans(spans)
            return
        for span in spans:
            a = span.a[span.a_start : span.a_stop]
            for row in packers[split].add(a, len(a) + 2):  # [CLS] a [SEP]
                add_packed(split, row)

    def add_packed(split: str, segments: list[np.ndarray]) -> None:
        ids = np.concatenate([p for tokens in segments for p in (cls_sep[0], tokens, cls_sep[1])])
        pack_ids, position_ids, _ = row_layout([len(t) + 2 for t in segments], len(ids))
        extra = {"pack_ids": pack_ids, "position_ids": position_ids}
        batches[split].add_row(ids, len(ids), 0, extra)

    for pass_index in range(cfg.dupe_factor):
        rngs = {
            split: np.random.default_rng([cfg.seed, index, pass_index, split_id])
            for split_id, split in enumerate(SPLITS)
        }
        packers = {split: Packer(cfg.max_seq_length, min_length=3) for split in SPLITS}
        batches = {
            split: ExampleBatch(cfg, consts, functools.partial(shards.emit, split), rngs[split])
            for split in SPLITS
        }
        windows = {
            split: DocumentWindow(
                cfg.random_document_buffer, functools.partial(make_instances, split, rngs[split])
            )
            for split in SPLITS
        }
        for split, doc in _doc_stream(source, index, cfg, tok, cache_path, pass_index):
            if pass_index == 0:
                stats["documents"][split] += 1
                stats["sentences"] += len(doc.bounds) - 1
                stats["tokens"] += len(doc.ids)
            windows[split].push(doc)
        for split, window in windows.items():
            window.finish()
            for row in packers[split].flush():
                add_packed(split, row)
            batches[split].flush()
    shards.close()
    os.remove(cache_path)
    examples = {s: dict(c) for s, c in shards.examples.items()}
    result = {"index": index, "examples": examples, **stats}
    _write_json(os.path.join(tmp_dir, _marker_name(index)), result)  # the unit is complete
    return result


def part_name(split: str, shard: int, index: int) -> str:
    return f"{split}-{shard:05d}.part-{index:06d}"


class _NoBar:
    """What run_units uses of a tqdm bar, doing nothing (tqdm is not even imported)."""

    n = 0

    def set_postfix_str(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


class _ByteLines:
    """What run_units uses of a tqdm bar, as a line every ``BERTJAX_PROGRESS_SECONDS`` where
    stderr is not a terminal (a log file; see :mod:`bertjax.progress`)."""

    def __init__(self, total_bytes: int):
        self.shown = progress.Display(
            "prepare", total_bytes, "bytes", sys.stderr, progress.interval()
        )
        self._n = 0

    @property
    def n(self) -> int:
        return self._n

    @n.setter
    def n(self, value: int) -> None:
        self.shown.update(value - self._n)
        self._n = value

    def set_postfix_str(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        self.shown.close()


def _progress_bar(total_bytes: int | None, show: bool):
    if not show:
        return _NoBar()
    if not progress.is_terminal(sys.stderr) and total_bytes:
        return _ByteLines(total_bytes)
    import tqdm  # only for a visible bar: its import costs more than a small unit's work

    return tqdm.tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", smoothing=0.1)


def run_units(tasks: list, num_workers: int, total_bytes: int | None, show_progress: bool) -> list:
    """Runs process_unit over the units (in-process or on a process pool) with a tqdm bar."""
    # fork starts workers at no cost (nothing to import again) and is safe while neither TensorFlow
    # nor JAX, whose threads do not survive a fork, is loaded: `bertjax prepare` on local files.
    fork = sys.platform == "linux" and not {"tensorflow", "jax"} & set(sys.modules)
    ctx = multiprocessing.get_context("fork" if fork else "spawn")
    counters = (ctx.Value("q", 0), ctx.Value("q", 0))  # documents read, bytes read
    bar = _progress_bar(total_bytes, show_progress)
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
                results.append(process_unit(task))
                update()
            _WORKER.pop("counters", None)
            return results
        with ctx.Pool(
            num_workers, initializer=_init_worker, initargs=(counters, os.getpid())
        ) as pool:
            pending = pool.map_async(process_unit, tasks, chunksize=1)
            while not pending.ready():
                pending.wait(0.5)
                update()
            results = pending.get()
            update()
            return results
    finally:
        bar.close()


def _marker_name(index: int) -> str:
    return f"unit-{index:06d}.json"


def _write_json(path: str, value) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def done_units(tmp_dir: str, num_units: int) -> dict[int, dict]:
    """{unit index: result} of the units marked complete in tmp_dir."""
    done = {}
    for index in range(num_units):
        path = os.path.join(tmp_dir, _marker_name(index))
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
            for split, counts in result["examples"].items():  # JSON keys are strings
                result["examples"][split] = {int(k): v for k, v in counts.items()}
            done[index] = result
    return done


def mark_merged(tmp_dir: str, split: str, shard: int) -> None:
    """Records that a shard is complete in the output folder (its parts may go)."""
    open(os.path.join(tmp_dir, f"merged-{split}-{shard:05d}"), "w").close()


def is_merged(tmp_dir: str, split: str, shard: int) -> bool:
    return os.path.exists(os.path.join(tmp_dir, f"merged-{split}-{shard:05d}"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def adopt_interrupted(folder: str, prefix: str, key: str) -> str | None:
    """A dead run's temporary folder in `folder` with the same settings `key`, renamed out of
    the way of the stale-folder cleanup (`{folder}/.prepare-resume-{key}`), or None.

    Only folders of this host whose pid is gone and that hold at least one finished unit qualify.
    """
    resume = os.path.join(folder, f"{_RESUME_PREFIX}{key}")
    if os.path.isdir(resume):  # a run that died between adopting and moving
        return resume
    pattern = re.compile(rf"^{re.escape(prefix)}(?P<host>.+)-(?P<pid>\d+)-[^-]+$")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        path = os.path.join(folder, name)
        m = pattern.match(name)
        if not m or m["host"] != socket.gethostname() or _pid_alive(int(m["pid"])):
            continue
        try:
            with open(os.path.join(path, KEY_FILE)) as f:
                if f.read().strip() != key:
                    continue
        except OSError:
            continue
        if any(n.startswith("unit-") and n.endswith(".json") for n in os.listdir(path)):
            os.rename(path, resume)
            return resume
    return None


def move_contents(source: str, target: str) -> None:
    """Moves every file of source into target, then removes source."""
    for name in os.listdir(source):
        if name != KEY_FILE:
            os.replace(os.path.join(source, name), os.path.join(target, name))
    shutil.rmtree(source, ignore_errors=True)

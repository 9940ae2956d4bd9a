"""A corpus -> embedding shards on disk, resumable, over every local device and every host: what
``bertjax embed`` runs.

The texts are cut into shards of ``shard_size`` in input order (shard ``k``: texts ``k *
shard_size`` to ``(k + 1) * shard_size``); process ``p`` of ``P`` embeds shards ``p, p + P, ...``.
Within a shard the texts are tokenized as ``Pretrained.embed`` tokenizes them (prompt, [CLS] text
[SEP] cut to ``max_length``), sorted by token count (longest first: an out-of-memory shows at
once) and run in batches of ``batch_size`` rows (rounded up to a multiple of the local devices),
each batch padded to a bucketed length: a power of two up to 128 tokens, then a multiple of 64
(at most ``max_length``). A length that only 1-2 batches of the shard would use is not compiled:
those batches take the longer length before them. The batch is split over the local devices (a
``jax.sharding.Mesh`` of them, the parameters replicated); the next batch is dispatched before
the last one's vectors are fetched. The vectors go back to input order and the shard is written
in one go (``embedding_store``).

Sorting only within a shard keeps each shard a function of its own texts: a shard is computed the
same way whether the run was interrupted or not, so a resumed run (same command, same output
folder) skips the finished shards and writes the others byte for byte as an uninterrupted run
would (on the same kind and number of devices). ``run.json`` records the model (a SHA-256 of its
parameters and embedding head), the input (a SHA-256 of the ids and texts) and the settings that
change the vectors or the files; an output folder of another model, input or settings is a
one-line error, never a mix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import bertjax.fs as fs
import bertjax.models as models
from bertjax import atomic, distributed, progress
from bertjax.convert import unflatten_params
from bertjax.retrieval import embedding_store as store
from bertjax.retrieval.bi_encoder.embedding import (
    EmbeddingSettings,
    SentenceEmbedder,
    embed_rows,
    jitted_apply,
    max_length_of,
    token_rows,
)
from bertjax.retrieval.corpus_input import Corpus
from bertjax.text import features

_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class EmbedOptions:
    format: str = "npy"  # npy | parquet
    dtype: str = "float32"  # float16 | float32: what is stored (computed in float32)
    batch_size: int = 32  # rows per batch over all local devices
    shard_size: int = 50_000  # texts per shard
    max_length: int | None = None  # tokens per text with [CLS] and [SEP]; None: the model's
    prompt: str | None = None
    prompt_name: str | None = None

    def check(self) -> None:
        if self.format not in store.FORMATS:
            raise ValueError(f"--format={self.format} is not one of {', '.join(store.FORMATS)}")
        if self.dtype not in store.DTYPES:
            raise ValueError(f"--dtype={self.dtype} is not one of {', '.join(store.DTYPES)}")
        for name in ("batch_size", "shard_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}={getattr(self, name)} must be at least 1")


@dataclasses.dataclass(frozen=True)
class ShardDone:
    """What the progress callback is told after each shard this process handles."""

    index: int
    count: int  # shards in all
    texts: int  # texts of this shard
    seconds: float  # 0 for a shard found finished
    skipped: bool  # found finished on disk: not computed


@dataclasses.dataclass(frozen=True)
class Summary:
    output: str
    texts: int  # texts of the whole corpus
    dim: int
    shards: int
    shards_embedded: int  # by this process in this call
    shards_skipped: int  # found finished by this process
    texts_embedded: int  # by this process in this call
    seconds: float  # this process, reading the model and input excluded
    cpu_seconds: float  # this process's CPU time (all threads) in those seconds
    manifest: bool  # whether this process wrote the manifest (process 0, at the end)


class _Encoder:
    """The model's embedding head over a mesh of local devices, one batch at a time."""

    def __init__(self, model, settings: EmbeddingSettings, max_length: int, prompt: str, devices):
        self.tokenizer = model.tokenizer
        self.settings = settings
        self.max_length = max_length
        self.prompt = prompt
        self.module = SentenceEmbedder(model.config, settings.head)
        self.dim = settings.head.dimension(model.config.hidden_size)
        self.mesh = Mesh(np.asarray(devices), (_AXIS,))
        self.rows = NamedSharding(self.mesh, P(_AXIS))
        name = models.architecture(model.config).encoder_name
        params = {name: model.encoder_params, **unflatten_params(settings.tensors)}
        self.params = jax.device_put(params, NamedSharding(self.mesh, P()))
        self.apply = jitted_apply(self.module)

    def token_rows(self, texts: list[str]) -> tuple[list[features.Row], int]:
        """Token ids per text and the prompt's length, as ``bi_encoder.embedding.embed_texts``."""
        lower = self.settings.do_lower_case and not getattr(self.tokenizer, "do_lower_case", False)
        return token_rows(self.tokenizer, texts, self.max_length, prompt=self.prompt, lower=lower)

    def embed(self, texts: list[str], batch_size: int) -> np.ndarray:
        """Float32 vectors [len(texts), dim] in the order of ``texts``."""
        rows, skip = self.token_rows(texts)
        height = -(-batch_size // self.mesh.size) * self.mesh.size

        def run(*arrays):  # each batch split over the mesh's devices
            return self.apply({"params": self.params}, *jax.device_put(arrays, self.rows))

        return embed_rows(self.tokenizer, rows, skip, height, self.max_length, self.dim, run)


def model_fingerprint(model, settings: EmbeddingSettings) -> str:
    """SHA-256 of the parameters the vectors depend on and of the embedding head."""
    digest = hashlib.sha256(repr(settings.head).encode())
    flat = {**dict(_flatten(model.encoder_params)), **settings.tensors}
    for path in sorted(flat):
        value = np.ascontiguousarray(np.asarray(flat[path]))
        digest.update(f"{path}:{value.dtype}:{value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def _flatten(tree: Any, prefix: str = ""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}/{key}" if prefix else str(key))
    else:
        yield prefix, tree


def _run_record(model, settings, corpus: Corpus, options: EmbedOptions, max_length, prompt):
    return {
        "model": {"sha256": model_fingerprint(model, settings), "source": str(model.source)},
        "input": {"sha256": corpus.fingerprint, "texts": len(corpus.ids), "files": corpus.files},
        "settings": {
            "format": options.format,
            "dtype": options.dtype,
            "batch_size": options.batch_size,
            "shard_size": options.shard_size,
            "max_length": max_length,
            "prompt": prompt,
            "do_lower_case": settings.do_lower_case,
        },
    }


def _check_same_run(output: str, record: dict, existing: dict) -> None:
    """A one-line ValueError when ``output`` holds the output of another run."""
    where = os.path.join(output, store.RUN)
    hint = "use another --output or remove the folder"
    for part in ("model", "input"):
        old = existing.get(part, {}).get("sha256")
        if old != record[part]["sha256"]:
            was = existing.get(part, {}).get("source") or existing.get(part, {}).get("files")
            raise ValueError(
                f"{where}: this folder holds the embeddings of another {part} ({was}); {hint}"
            )
    old_settings = existing.get("settings", {})
    for key, value in record["settings"].items():
        if old_settings.get(key) != value:
            raise ValueError(
                f"{where}: this folder was written with {key}={old_settings.get(key)!r}, not "
                f"{value!r}; {hint}"
            )


def embed_corpus(
    model,
    corpus: Corpus,
    output: str,
    options: EmbedOptions = EmbedOptions(),
    *,
    devices=None,
    process_index: int | None = None,
    process_count: int | None = None,
    on_shard: Callable[[ShardDone], None] | None = None,
) -> Summary:
    """Embeds ``corpus`` with ``model`` (a :class:`~bertjax.pretrained.Pretrained`) into the
    folder ``output`` (see the module docstring); ``devices``: this process's (default: its
    local devices); ``process_index`` / ``process_count`` default to JAX's."""
    options.check()
    if model.late_interaction:  # its settings are PyLate's, not an EmbeddingSettings
        raise ValueError(
            f"{model.source}: a late-interaction (ColBERT) model gives a vector per token, not one "
            "per text: embed its documents with load_pretrained(...).embed_documents"
        )
    if model.tokenizer is None:
        raise ValueError(f"{model.source}: no vocabulary file found beside the checkpoint")
    settings = model.embedding or EmbeddingSettings()
    table = model.config.max_position_embeddings
    max_length = max_length_of(
        dataclasses.replace(settings, max_seq_length=options.max_length or settings.max_seq_length),
        table,
    )
    prompt = settings.resolve_prompt(options.prompt, options.prompt_name, model.source)
    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    encoder = _Encoder(model, settings, max_length, prompt, devices or jax.local_devices())
    output = os.fspath(output)
    record = _run_record(model, settings, corpus, options, max_length, prompt)
    existing = store.read_json(os.path.join(output, store.RUN))
    if existing is not None:
        _check_same_run(output, record, existing)
    elif index == 0:
        atomic.write_json(os.path.join(output, store.RUN), record)
    fs.makedirs(output)
    n = len(corpus.ids)
    num_shards = math.ceil(n / options.shard_size)
    start_time, start_cpu = time.perf_counter(), time.process_time()
    embedded = skipped = texts_embedded = 0
    mine = range(index, num_shards, count)
    done = {s for s in mine if store.shard_done(output, options.format, s, num_shards)}
    bounds = {s: (s * options.shard_size, min((s + 1) * options.shard_size, n)) for s in mine}
    left = sum(hi - lo for s, (lo, hi) in bounds.items() if s not in done)
    with progress.phase("embedding", left, "texts"):
        for shard in mine:
            lo, hi = bounds[shard]
            if shard in done:
                skipped += 1
                if on_shard:
                    on_shard(ShardDone(shard, num_shards, hi - lo, 0.0, True))
                continue
            began = time.perf_counter()
            vectors = encoder.embed(corpus.texts[lo:hi], options.batch_size)
            matrix = vectors.astype(options.dtype)
            store.write_shard(output, options.format, shard, num_shards, corpus.ids[lo:hi], matrix)
            embedded += 1
            texts_embedded += hi - lo
            if on_shard:
                seconds = time.perf_counter() - began
                on_shard(ShardDone(shard, num_shards, hi - lo, seconds, False))
    distributed.sync("bertjax embed: shards written")
    wrote_manifest = False
    if index == 0:
        _write_manifest(output, record, options, encoder.dim, num_shards, n)
        wrote_manifest = True
    return Summary(
        output=output,
        texts=n,
        dim=encoder.dim,
        shards=num_shards,
        shards_embedded=embedded,
        shards_skipped=skipped,
        texts_embedded=texts_embedded,
        seconds=time.perf_counter() - start_time,
        cpu_seconds=time.process_time() - start_cpu,
        manifest=wrote_manifest,
    )


def _write_manifest(output, record, options: EmbedOptions, dim, num_shards, n) -> None:
    shards = []
    for shard in range(num_shards):
        if not store.shard_done(output, options.format, shard, num_shards):
            raise ValueError(f"{output}: shard {shard} of {num_shards} is missing after the run")
        lo, hi = shard * options.shard_size, min((shard + 1) * options.shard_size, n)
        files = list(store.shard_files(options.format, shard, num_shards))
        shards.append({"files": files, "count": hi - lo, "first": lo})
    manifest = {
        "format": options.format,
        "dtype": options.dtype,
        "dim": dim,
        "count": n,
        "model": record["model"],
        "input": record["input"],
        "settings": record["settings"],
        "shards": shards,
    }
    atomic.write_json(os.path.join(output, store.MANIFEST), manifest)

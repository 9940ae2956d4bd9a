"""`bertjax prepare --runner=...`: the same algorithm as an Apache Beam pipeline, for many machines.

The work units and their code are those of the local path (`units.process_unit`: one corpus file or
TFDS slice per unit, generators seeded by (seed, unit, pass, split)), so the shards are byte for byte
the local ones for the same seed and inputs:

  Create(units) -> Reshuffle -> ProcessUnit: runs `units.process_unit` in a worker-local temporary
      folder, copies its per-shard part files to `{output_dir}/.beam-parts/` (any tf.io.gfile
      scheme) and emits ((split, shard), (unit, part path)) plus the unit's counts;
  + one empty entry per (split, shard), so that every shard exists -> GroupByKey -> MergeShard:
      concatenates a shard's parts in unit order into `{split}-{i}-of-{n}.tfrecord` (temp name +
      rename), then removes the parts.

The launcher (`prepare`) then checks the counts and writes metadata.json, last, as the local path
does. Beam is an optional extra (`pip install bertjax[beam]`); runner options (--project, --region,
--temp_location, --direct_num_workers, ...) are passed through to Beam's PipelineOptions.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import bertjax.fs as fs
from bertjax.data import units

PARTS_DIR = ".beam-parts"


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}"


def _process(task, output_dir: str):
    """Beam: one unit; yields ("part", (split, shard), (index, path)) and ("result", dict)."""
    index = task[0]
    local = tempfile.mkdtemp(prefix="bertjax-beam-unit-")
    try:
        result = units.process_unit((*task[:4], local))
        parts_dir = _join(output_dir, PARTS_DIR)
        for split, counts in result["examples"].items():
            for shard in counts:
                name = units.part_name(split, shard, index)
                target = _join(parts_dir, name)
                with (
                    open(os.path.join(local, name), "rb") as src,
                    fs.open_file(target, "wb") as out,
                ):
                    shutil.copyfileobj(src, out, 1 << 22)
                yield "part", ((split, int(shard)), (index, target))
    finally:
        shutil.rmtree(local, ignore_errors=True)
    yield "result", json.loads(json.dumps(result))  # plain JSON types across workers


def _merge(item, output_dir: str, counts: dict[str, int]) -> str:
    """Beam: writes one shard from its parts (unit order); returns its file name."""
    (split, shard), entries = item
    parts = sorted(e for e in entries if e is not None)
    name = f"{split}-{shard:05d}-of-{counts[split]:05d}.tfrecord"
    final = _join(output_dir, name)
    with fs.open_file(f"{final}.tmp", "wb") as out:
        out.write(b"")
        for _, path in parts:
            with fs.open_file(path, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    fs.rename(f"{final}.tmp", final)
    for _, path in parts:
        fs.remove(path)
    return name


def run(tasks: list, output_dir: str, shard_counts: dict[str, int], runner: str, beam_args) -> list:
    """Runs the pipeline over `tasks` ((index, source, cfg, tokenizer spec) tuples); returns the
    units' counts (as `units.process_unit` returns them), sorted by unit index."""
    try:
        import apache_beam as beam
        from apache_beam.options.pipeline_options import PipelineOptions
    except ImportError:
        raise ValueError(
            f"--runner={runner} needs Apache Beam: pip install 'bertjax[beam]'"
        ) from None
    fs.makedirs(_join(output_dir, PARTS_DIR))
    results_dir = _join(output_dir, f"{PARTS_DIR}/results")
    fs.makedirs(results_dir)
    keys = [(s, i) for s, n in shard_counts.items() for i in range(n)]
    options = PipelineOptions(list(beam_args or []), runner=runner)
    with beam.Pipeline(options=options) as p:
        out = (
            p
            | "Units" >> beam.Create(tasks)
            | "Spread" >> beam.Reshuffle()
            | "ProcessUnit" >> beam.FlatMap(lambda t: _process(t, output_dir))
        )
        parts = (
            out | "Parts" >> beam.Filter(lambda kv: kv[0] == "part") | beam.Map(lambda kv: kv[1])
        )
        every = p | "EveryShard" >> beam.Create([(k, None) for k in keys])
        _ = (
            (parts, every)
            | beam.Flatten()
            | beam.GroupByKey()
            | "MergeShard" >> beam.Map(_merge, output_dir, shard_counts)
        )
        _ = (
            out
            | "Results" >> beam.Filter(lambda kv: kv[0] == "result")
            | beam.Map(lambda kv: _write_result(kv[1], results_dir))
        )
    results = []
    for path in sorted(fs.glob(_join(results_dir, "unit-*.json"))):
        with fs.open_file(path, "r") as f:
            result = json.load(f)
        for split, counts in result["examples"].items():
            result["examples"][split] = {int(k): v for k, v in counts.items()}
        results.append(result)
    fs.rmtree(_join(output_dir, PARTS_DIR))
    return sorted(results, key=lambda r: r["index"])


def _write_result(result: dict, results_dir: str) -> None:
    with fs.open_file(_join(results_dir, f"unit-{result['index']:06d}.json"), "w") as f:
        f.write(json.dumps(result))

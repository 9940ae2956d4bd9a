"""``bertjax bench``: step time, tokens/s, TFLOP/s, MFU, compile time, memory and input speed.

One run on the current devices measures:

* the real pretraining ``train_step`` (``bertjax.train.jit_train_step`` of a ``PretrainingTask`` whose
  data is a synthetic batch, so no corpus is needed): compile time, the median step time after
  warm-up (each step synchronised) and the mean of a pipelined run (one sync at the end);
* achieved TFLOP/s from the analytic count of ``bertjax.flops`` (attention included, MLM head only at
  the masked positions), XLA's own count (``compiled.cost_analysis()``) beside it, and MFU against the
  table peak of known TPU/GPU kinds or, on CPU, a jitted fp32 matmul peak measured in the same run;
* peak memory: ``device.memory_stats()`` where the backend has it, else the process's peak RSS;
* ``bertjax prepare`` on a real corpus (docs/s, MB/s, cores used, peak RSS of the process tree), at
  the corpus sizes of ``--prepare_scales``, and the tf.data ``PretrainingData`` examples/s over the
  records it wrote, with the ratio to the model's sequences/s;
* with ``--peers``: transformers' ``FlaxBertForPreTraining`` and PyTorch ``BertForPreTraining`` on the
  same shapes (``bertjax/bench_peers.py`` in the ``.venv-peers`` virtualenv), and the speed-up ratios.

``--json`` prints ONE JSON object; ``--output_dir`` writes ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from bertjax import flops, models, sharding, train
from bertjax.sharding import RULES
from bertjax.tasks.pretraining import PretrainingTask
from bertjax.tools import bench_finetune, bench_peers
from bertjax.tools.bench_data import (  # noqa: F401
    cached_records,
    compare_with_original,
    measure_input,
    measure_prepare,
)

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SHARED = os.environ.get(
    "BERTJAX_SHARED_DATA", os.path.join(os.path.dirname(_REPO), "shared", "data")
)
DEFAULT_CORPUS = os.path.join(_SHARED, "corpus", "gutenberg", "*.txt")
DEFAULT_VOCAB = os.path.join(_SHARED, "vocab", "bert-base-uncased", "vocab.txt")
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "bertjax", "bench")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bertjax bench", description=__doc__.split("\n")[0])
    p.add_argument(
        "--preset", default="small", help="model preset (tiny/mini/small/base/L4_H512...)"
    )
    p.add_argument(
        "--architecture",
        default=models.DEFAULT,
        choices=sorted(models.ARCHITECTURES),
        help="the encoder family (its pretraining heads: MLM, and NSP where it has them)",
    )
    p.add_argument("--vocab_size", type=int, default=30522)
    p.add_argument("--batch", type=int, default=32, help="global batch size")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--masked", type=int, default=0, help="MLM predictions/seq (0: 15%% of seq)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--attention_impl",
        default="xla",
        choices=("auto", "xla", "dot_product", "cudnn", "splash"),
    )
    p.add_argument("--remat", default="none", choices=("none", "dots", "full"))
    p.add_argument("--dropout_impl", default="auto", choices=("auto", "bits16", "flax", "kernel"))
    p.add_argument("--scan_layers", action="store_true")
    p.add_argument(
        "--grad_accum_steps",
        type=int,
        default=1,
        help="micro-batches per step (the same global batch; fewer activations live at once)",
    )
    p.add_argument("--dropout", type=float, default=0.1, help="hidden (and attention) dropout")
    p.add_argument("--attention_dropout", type=float, default=None, help="default: --dropout")
    p.add_argument("--devices", type=int, default=0, help="use the first N devices (0: all)")
    p.add_argument("--peak_tflops", type=float, default=0.0, help="override the per-device peak")
    p.add_argument("--matmul_size", type=int, default=2048, help="n of the CPU n*n matmul peak")
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    p.add_argument("--output_dir", default="", help="write results.json and results.md here")
    p.add_argument("--skip_input", action="store_true", help="skip the tf.data input benchmark")
    p.add_argument("--skip_prepare", action="store_true", help="skip the prepare benchmark")
    p.add_argument("--corpus", default=DEFAULT_CORPUS, help="real text for prepare (glob)")
    p.add_argument("--corpus_format", default="text", choices=("text", "bert"))
    p.add_argument("--vocab", default=DEFAULT_VOCAB, help="WordPiece vocab.txt for prepare")
    p.add_argument("--prepare_scales", default="1,4", help="corpus copies per prepare run")
    p.add_argument("--whole_word_mask", action="store_true", help="prepare with whole-word masking")
    p.add_argument(
        "--original_script",
        default="",
        help="google-research/bert's create_pretraining_data.py: also time it on the same corpus",
    )
    p.add_argument("--dupe_factor", type=int, default=1, help="prepare's passes over the corpus")
    p.add_argument("--prepare_workers", type=int, default=0, help="0: all cores")
    p.add_argument("--input_batches", type=int, default=100, help="timed tf.data batches")
    p.add_argument("--cache_dir", default=DEFAULT_CACHE, help="prepared records for --skip_prepare")
    p.add_argument("--peers", action="store_true", help="also time transformers Flax + PyTorch")
    p.add_argument("--peers_python", default="", help="python of the peer venv")
    p.add_argument("--peer_steps", type=int, default=5)
    p.add_argument("--profile_dir", default="", help="write a jax.profiler trace of 3 steps")
    p.add_argument("--finetune", default="", help="e.g. glue/sst2: time fine-tuning instead")
    p.add_argument("--finetune_config", default=os.path.join(_REPO, "configs", "glue.py"))
    p.add_argument("--glue_dir", default=os.path.join(_SHARED, "glue", "SST-2"))
    p.add_argument("--eval_batch", type=int, default=64, help="the peer's dev batch (--finetune)")
    args = p.parse_args(argv)
    args.masked = args.masked or max(1, round(0.15 * args.seq + 0.3))  # 128 -> 20, 512 -> 77
    return args


# ---- the model step ------------------------------------------------------------------------------
def bench_config(args: argparse.Namespace):
    """The experiment the benchmark runs: one pretraining phase with the paper's AdamW settings."""
    switches = {
        k: getattr(args, k)
        for k in ("dtype", "attention_impl", "remat", "scan_layers", "dropout_impl")
    }
    arch = models.architecture(args.architecture)
    model = dict(architecture=args.architecture, preset=args.preset, **switches)
    positions = arch.get_preset(args.preset).max_position_embeddings
    model["max_position_embeddings"] = max(positions, args.seq)
    attention_dropout = args.dropout if args.attention_dropout is None else args.attention_dropout
    model.update(hidden_dropout=args.dropout, attention_dropout=attention_dropout)
    data = dict(
        max_seq_length=args.seq, max_predictions_per_seq=args.masked, nsp=arch.nsp, phases=()
    )
    optimizer = dict(name="adamw", learning_rate=1e-4, warmup_steps=10_000, grad_clip_norm=1.0)
    optimizer.update(b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01, end_lr_factor=0.0)
    mesh = dict(data=-1, fsdp=1, tensor=1, num_devices=args.devices)
    mesh["rules"] = [list(rule) for rule in RULES]
    train = dict(
        steps=1_000_000,
        seed=0,
        global_batch_size=args.batch,
        grad_accum_steps=args.grad_accum_steps,
    )
    c = dict(task="pretrain", model=model, data=dict(data, prepared_dir=""), train=train)
    return ml_collections.ConfigDict(dict(c, optimizer=optimizer, mesh=mesh))


def synthetic_batch(task, phase, vocab_size: int) -> dict:
    """A pretraining task's init_batch shapes filled like real data (what the peers get too)."""
    seq, pred = task.step_shape(phase)
    hf = bench_peers.synthetic_batch(phase.global_batch_size, seq, pred, vocab_size)
    positions = (hf["labels"] >= 0).nonzero()[1].reshape(phase.global_batch_size, pred)
    batch = task.init_batch(phase, phase.global_batch_size)  # the dtypes of real batches
    values = dict(
        input_ids=hf["input_ids"],
        segment_ids=hf["token_type_ids"],
        masked_lm_positions=positions,
        next_sentence_labels=hf["next_sentence_label"],
        masked_lm_ids=hf["labels"][hf["labels"] >= 0].reshape(positions.shape),
        masked_lm_weights=np.ones(positions.shape),
    )
    return {k: values.get(k, v).astype(v.dtype) for k, v in batch.items()}


def matmul_peak_tflops(n: int, reps: int = 7) -> tuple[float, float]:
    """A jitted fp32 [n, n] x [n, n] matmul on the first device: median TFLOP/s of wall time, and
    TFLOP per CPU-second of this process (all threads; robust to other processes' load)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    f(a, b).block_until_ready()
    times, cpu_times = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    flop = 2.0 * n**3 / 1e12
    return flop / statistics.median(times), flop / statistics.median(cpu_times)


def peak_memory(device) -> dict[str, Any]:
    """Peak bytes in use on ``device`` when its backend reports it, else this process's peak RSS."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("peak_bytes_in_use"):
        return {"peak_bytes": int(stats["peak_bytes_in_use"]), "source": "device.memory_stats"}
    return {
        "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "source": "peak RSS of the process",
    }


def summarize_trace(profile_dir: str, top: int = 12) -> dict[str, Any]:
    """Device time per XLA op kind (``fusion.3`` and ``fusion.7`` add up) from the perfetto trace.

    Host-side events (Python frames ``$...``, runtime ``A::B`` calls, ``end: ...`` markers) are
    left out; what remains are the compiled program's ops (on CPU: thunks such as ``ynn_fusion``
    for matmuls, ``loop_fusion``/``input_fusion`` for elementwise and reductions).
    """
    paths = sorted(
        glob.glob(os.path.join(profile_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    )
    if not paths:
        return {}
    with gzip.open(paths[-1]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    totals: dict[str, float] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or re.search(r"^(\$|end: |Pjit)|::|\s", name):
            continue
        kind = re.sub(r"[.:]\d+$", "", name)
        totals[kind] = totals.get(kind, 0.0) + e.get("dur", 0.0) / 1e6
    total = sum(totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {
        "trace": paths[-1],
        "op_seconds": total,
        "top_ops": [{"op": k, "seconds": v, "share": v / total} for k, v in ranked],
    }


def _xla_flops(compiled) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None


def measure_step(args: argparse.Namespace) -> dict[str, Any]:
    """Compiles and times the real jitted pretraining step on a synthetic batch."""
    config = bench_config(args)
    with tempfile.TemporaryDirectory(prefix="bertjax-bench-") as workdir:
        task = PretrainingTask(config, workdir, vocab_size=args.vocab_size)
        setup = train.build(config, workdir, task)
    phase = setup.phases[0]
    model_cfg = setup.model.config
    devices = list(setup.mesh.devices.flat)
    with jax.set_mesh(setup.mesh), nn.logical_axis_rules(setup.rules):
        state = setup.init_state(jax.random.key_data(jax.random.key(0)))
        batch = synthetic_batch(task, phase, args.vocab_size)
        batch = sharding.global_batch(batch, setup.mesh, setup.rules)
        step = train.jit_train_step(setup, accum_steps=args.grad_accum_steps)
        t0 = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
        with jax.transfer_guard("disallow"):
            for _ in range(args.warmup):
                state, metrics = compiled(state, batch)
            jax.block_until_ready((state, metrics))
            times, cpu_times = [], []
            for _ in range(args.steps):  # each step synchronised: a per-step median
                t0, c0 = time.perf_counter(), time.process_time()
                state, metrics = compiled(state, batch)
                jax.block_until_ready((state, metrics))
                times.append(time.perf_counter() - t0)
                cpu_times.append(time.process_time() - c0)
            t0 = time.perf_counter()
            for _ in range(args.steps):  # pipelined: no host sync inside the loop
                state, metrics = compiled(state, batch)
            jax.block_until_ready((state, metrics))
            pipelined = (time.perf_counter() - t0) / args.steps
        if args.profile_dir:
            trace = jax.profiler.trace(args.profile_dir, create_perfetto_trace=True)
            with trace, jax.transfer_guard("disallow"):
                for _ in range(3):
                    state, metrics = compiled(state, batch)
                jax.block_until_ready((state, metrics))
    profile = summarize_trace(args.profile_dir) if args.profile_dir else None
    loss = float(jax.device_get(metrics["loss"]))
    memory = peak_memory(devices[0])
    analysis = compiled.memory_analysis()
    if analysis is not None:
        for key in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
            memory[key.replace("_size_in", "")] = int(getattr(analysis, key, 0) or 0)
    step_s = statistics.median(times)
    step_flops = flops.train_flops_per_step(model_cfg, args.batch, args.seq, args.masked)
    tflops = step_flops / step_s / len(devices) / 1e12
    peak = flops.device_peak_tflops(devices[0], args.peak_tflops)
    source = "override" if args.peak_tflops > 0 else "table"
    matmul = matmul_cpu = mfu_cpu = None
    if devices[0].platform == "cpu":
        matmul, matmul_cpu = matmul_peak_tflops(args.matmul_size)
        mfu_cpu = step_flops / statistics.median(cpu_times) / 1e12 / matmul_cpu
        if not args.peak_tflops:
            peak, source = matmul, f"measured fp32 {args.matmul_size}^3 matmul"
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "num_devices": len(devices),
        "num_params": int(model_cfg.num_params()),
        "model": {
            k: getattr(model_cfg, k)
            for k in ("num_layers", "hidden_size", "num_heads", "intermediate_size", "vocab_size")
        },
        "model_config": model_cfg.to_dict(),
        "compile_s": compile_s,
        "step_time_s": step_s,
        "step_time_s_min": min(times),
        "step_times_s": times,
        "step_time_s_pipelined": pipelined,
        "step_cpu_s": statistics.median(cpu_times),  # CPU seconds of all threads: robust to load
        "sequences_per_sec": args.batch / step_s,
        "tokens_per_sec": args.batch * args.seq / step_s,
        "train_flops_per_step": step_flops,
        "xla_flops_per_step": _xla_flops(compiled),
        "tflops_per_sec_per_device": tflops,
        "peak_tflops": peak or None,
        "peak_source": source if peak else "unknown device kind",
        "matmul_peak_tflops": matmul,
        "matmul_tflop_per_cpu_s": matmul_cpu,
        "mfu_cpu_time": mfu_cpu,  # FLOP per CPU-second of the step / of the matmul
        "mfu": tflops / peak if peak else None,
        "memory": memory,
        "final_loss": loss,
        "profile": profile,
        **roofline_beside(compiled, step_flops, args.batch * args.seq, devices, step_s),
    }


def roofline_beside(compiled, step_flops, tokens, devices, step_s) -> dict[str, Any]:
    """On a GPU, the roofline estimate of the same compiled step (``bertjax compile
    --topology=h100`` prices the program this way) and measured / estimated: the calibration of
    the estimate. Empty elsewhere."""
    if devices[0].platform != "gpu":
        return {}
    from bertjax.compile import gpu_report

    est = gpu_report(compiled, step_flops, tokens, devices)
    if "est_step_seconds" not in est:
        return {"roofline_unavailable": est.get("est_unavailable")}
    return {
        "est_step_seconds": est["est_step_seconds"],
        "est_mfu": est["est_mfu"],
        "measured_over_estimate": step_s / est["est_step_seconds"],
        "kernels": est["kernels"],
    }


# ---- data: prepare and the tf.data pipeline ------------------------------------------------------
def measure_peers(args, result: dict) -> dict[str, Any]:
    """Runs the peers of the architecture on the model's shapes; adds bertjax's speed-up."""
    python = args.peers_python or bench_peers.default_peer_python()
    if not os.path.exists(python):
        return {"skipped": f"no peer virtualenv python at {python}"}
    shape = bench_peers.peer_shape(
        result["model"],
        batch=args.batch,
        seq=args.seq,
        masked=args.masked,
        steps=args.peer_steps,
        warmup=2,
        dropout=args.dropout,
    )
    c = result["model_config"]
    if "local_attention" in c:  # sliding-window layers: the peer takes their window and pattern
        shape.update(window=c["local_attention"], global_every=c["global_attn_every_n_layers"])
        shape.update(accum=args.grad_accum_steps)  # like for like: the same micro-batches
        if args.dtype == "bfloat16":
            shape.update(dtype="bfloat16")  # PyTorch's autocast: bf16 matmuls, fp32 weights
    if "num_kv_heads" in c:  # grouped-query attention: the peer takes its key-value heads
        shape.update(kv_heads=c["num_kv_heads"], accum=args.grad_accum_steps)
        if args.dtype == "bfloat16":
            shape.update(dtype="bfloat16")
    on_gpu = result["platform"] == "gpu"
    if on_gpu:  # the GPU peer as its users run it: bf16 autocast, SDPA, torch.compile
        shape.update(device="cuda", compile=1, dtype=args.dtype)
    reference = models.architecture(args.architecture).hf_reference
    if reference not in bench_peers.PEERS:
        return {"skipped": f"no peer benchmark of {reference} (bench_peers.PEERS)"}
    peers = {}
    for framework in bench_peers.PEERS[reference]:
        if on_gpu and framework == "flax":
            peers[framework] = {"skipped": "transformers' Flax BERT is CPU-only here (gone in v5)"}
            continue
        try:
            peer = bench_peers.run_peer(python, framework, shape)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
            peers[framework] = {"error": str(err)[-1500:]}  # the rest of the bench stands
            continue
        peer["bertjax_speedup"] = result["tokens_per_sec"] / peer["tokens_per_sec"]
        peer["bertjax_speedup_cpu_time"] = peer["step_cpu_s"] / result["step_cpu_s"]
        peers[framework] = peer
    return peers


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def to_markdown(r: dict) -> str:
    """A results table (plus data and peer tables when measured) in GitHub markdown."""
    c, mem = r["config"], r.get("memory", {})
    rows = [
        (
            "model",
            f"{c['preset']} ({_num(r['num_params'])} params), {c['dtype']}, "
            f"attention {c['attention_impl']}, remat {c['remat']}, scan {c['scan_layers']}, "
            f"dropout {c['dropout']} ({c.get('dropout_impl', 'flax')})",
        ),
        (
            "shape",
            f"batch {c['batch']} x seq {c['seq']}, {c['masked']} MLM predictions/seq"
            + (
                f", {c['grad_accum_steps']} micro-batches"
                if c.get("grad_accum_steps", 1) > 1
                else ""
            ),
        ),
        ("devices", f"{r['num_devices']} x {r['device_kind']} ({r['platform']})"),
        ("compile time (s)", _num(r["compile_s"])),
        ("step time, median (s)", _num(r["step_time_s"])),
        ("step time, pipelined mean (s)", _num(r["step_time_s_pipelined"])),
        ("sequences/s", _num(r["sequences_per_sec"])),
        ("tokens/s", _num(r["tokens_per_sec"])),
        ("analytic TFLOP per step", _num(r["train_flops_per_step"] / 1e12)),
        ("XLA-counted TFLOP per step", _num((r["xla_flops_per_step"] or 0) / 1e12)),
        ("achieved TFLOP/s per device", _num(r["tflops_per_sec_per_device"])),
        ("peak TFLOP/s per device", f"{_num(r['peak_tflops'])} ({r['peak_source']})"),
        ("MFU", "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"),
        ("CPU-seconds per step (all threads)", _num(r["step_cpu_s"])),
        (
            "MFU in CPU time (CPU only)",
            "-" if r["mfu_cpu_time"] is None else f"{100 * r['mfu_cpu_time']:.1f}%",
        ),
        ("peak memory (MB)", f"{mem.get('peak_bytes', 0) / 1e6:,.0f} ({mem.get('source')})"),
    ]
    out = ["| metric | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]
    if r.get("prepare"):
        out += [
            "",
            "| prepare: corpus | MB | docs | wall s | CPU s | MB/s/core | instances/CPU-s | cores "
            "| peak RSS MB |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| x{p['scale']} | {_num(p['input_mb'])} | {p['documents']:,} | {_num(p['wall_s'])}"
            f" | {_num(p['cpu_s'])} | {_num(p['mb_per_cpu_s'])} | {_num(p['examples_per_cpu_s'])}"
            f" | {_num(p['cores_used'])} | {p['peak_rss_bytes'] / 1e6:,.0f} |"
            for p in r["prepare"]
        ]
    if r.get("prepare_vs_original"):
        c = r["prepare_vs_original"]
        out += [
            "",
            "| same corpus (bert format) | instances | CPU s | instances/CPU-s | peak RSS MB |",
        ]
        out += ["|---|---|---|---|---|"]
        out += [
            f"| {name} | {m['examples']:,} | {_num(m['cpu_s'])} | {_num(m['examples_per_cpu_s'])}"
            f" | {m['peak_rss_bytes'] / 1e6:,.0f} |"
            for name, m in (
                ("bertjax prepare", c["bertjax"]),
                ("create_pretraining_data.py", c["original"]),
            )
        ]
        out += ["", f"bertjax prepare / original, instances per CPU-second: {_num(c['ratio'])}x"]
    if r.get("input"):
        i = r["input"]
        out += [
            "",
            f"tf.data input: {_num(i['examples_per_sec'])} examples/s = "
            f"{_num(i['ratio_to_model'])}x the model's {_num(r['sequences_per_sec'])} seq/s",
        ]
    if r.get("profile"):
        out += ["", "| XLA op kind (3 profiled steps) | seconds | share |", "|---|---|---|"]
        out += [
            f"| {o['op']} | {_num(o['seconds'])} | {100 * o['share']:.1f}% |"
            for o in r["profile"]["top_ops"]
        ]
    peers = {k: v for k, v in (r.get("peers") or {}).items() if "framework" in v}
    if peers:
        out += [
            "",
            "| implementation | step s (median) | CPU s/step | tokens/s | speed-up (wall, CPU) |",
            "|---|---|---|---|---|",
            f"| bertjax | {_num(r['step_time_s'])} | {_num(r['step_cpu_s'])} | "
            f"{_num(r['tokens_per_sec'])} | 1.00x, 1.00x |",
        ]
        out += [
            f"| {p['framework']} | {_num(p['step_time_s'])} | {_num(p['step_cpu_s'])} | "
            f"{_num(p['tokens_per_sec'])} | {p['bertjax_speedup']:.2f}x, "
            f"{p['bertjax_speedup_cpu_time']:.2f}x |"
            for p in peers.values()
        ]
    return "\n".join(out) + "\n"


def report(result: dict) -> str:
    """The Markdown report of a run (pretraining step, or fine-tuning with ``--finetune``)."""
    if "finetune" in result:
        return bench_finetune.to_markdown(result["finetune"])
    return to_markdown(result)


def write_outputs(result: dict, output_dir: str) -> None:
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
    with open(os.path.join(output_dir, "results.md"), "w") as f:
        f.write(report(result))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement the flags ask for, as one JSON-able dict."""
    keys = "preset batch seq masked steps warmup dtype attention_impl remat scan_layers dropout"
    keys += " attention_dropout dropout_impl grad_accum_steps"
    result: dict[str, Any] = {"config": {k: getattr(args, k) for k in keys.split()}}
    result["host"] = {"cpu_count": os.cpu_count(), "loadavg_before": os.getloadavg()}
    if args.finetune:
        result["finetune"] = bench_finetune.measure_finetune(args)
        result["host"]["loadavg_after"] = os.getloadavg()
        return result
    result.update(measure_step(args))
    if not args.skip_prepare:
        result["prepare"] = [
            measure_prepare(args, int(s), os.path.join(args.cache_dir, f"prepared-x{s}"))
            for s in args.prepare_scales.split(",")
        ]
        if args.original_script:
            result["prepare_vs_original"] = compare_with_original(args)
    if not args.skip_input:
        data_dir = (
            result["prepare"][0]["data_dir"] if result.get("prepare") else cached_records(args)
        )
        result["input"] = measure_input(data_dir, args.batch, args.input_batches)
        result["input"]["ratio_to_model"] = (
            result["input"]["examples_per_sec"] / result["sequences_per_sec"]
        )
    if args.peers:
        result["peers"] = measure_peers(args, result)
    result["host"]["loadavg_after"] = os.getloadavg()
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    result = run(args)
    if args.output_dir:
        write_outputs(result, args.output_dir)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(report(result), end="")


if __name__ == "__main__":
    main()

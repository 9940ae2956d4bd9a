"""``bertjax bench --finetune``: the real fine-tuning step and evaluation, beside PyTorch.

On a GLUE sentence(-pair) task read from a local folder (default: SST-2 of the shared data), with a
random-init model of the chosen preset (the step's cost does not depend on the weights):

* the jitted fine-tuning ``train_step`` of the task, unpacked, (dropout on, AdamW, clipping) at
  ``--batch`` x ``--seq``, each step synchronised: median wall and CPU seconds, steps/s, examples/s;
* the same with ``data.batch_packing`` (the default: each batch's examples in fewer rows) and with
  ``data.packing`` (rows of the packed training set: more examples per step): rows and examples per
  step, examples/s;
* ``task.evaluate`` over the whole dev set (the loop fine-tuning runs: batching, the jitted forward,
  gathering, the metric), unpacked and packed (``data.eval_packing``), wall and CPU s, examples/s;
* with ``--peers``: transformers' PyTorch ``BertForSequenceClassification`` at the same shapes (eager,
  its own loss, ``clip_grad_norm_``, AdamW) and its dev-set forward passes under ``no_grad``, with
  bertjax's speed-up at equal shapes and the end-to-end speed-up of the batch-packed default.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
from typing import Any

import flax.linen as nn
import jax

from bertjax import sharding, train
from bertjax.tools import bench_peers


def load_config_file(path: str):
    """``get_config()`` of an experiment config file (its ``configs.*`` imports resolved)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if root not in sys.path:
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location("bertjax_bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


MODES = {  # name: (data.packing, data.batch_packing)
    "unpacked": (False, False),
    "batch_packed": (False, True),  # the default: the unpacked run's batches in fewer rows
    "packed": (True, False),  # rows of the packed training set: more examples per step
}


def finetune_config(args: argparse.Namespace, mode: str):
    """The fine-tuning experiment the benchmark runs (``--finetune_config`` with bench's shapes)."""
    c = load_config_file(args.finetune_config)
    c.task = args.finetune
    c.data_dir = args.glue_dir
    c.data.vocab = args.vocab
    c.model.preset = args.preset
    c.model.dtype = args.dtype
    c.model.dropout_impl = args.dropout_impl
    c.model.hidden_dropout = c.model.attention_dropout = args.dropout
    c.data.max_seq_length = args.seq
    c.data.packing, c.data.batch_packing = MODES[mode]
    c.data.eval_packing = mode != "unpacked"
    c.train.global_batch_size = args.batch
    c.train.steps = 1_000_000
    c.mesh.num_devices = args.devices
    return c


def measure(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """Times the task's jitted train step and its whole-dev-set evaluation."""
    config = finetune_config(args, mode)
    with tempfile.TemporaryDirectory(prefix="bertjax-bench-ft-") as workdir:
        task = train.prepared_task(config, workdir)
        setup = train.build(config, workdir, task)
        phase = setup.phases[0]
        setup = train.phase_setup(setup, phase)
        data = task.train_data(phase, 0, 1)
        step = train.jit_train_step(setup, 1)
        with jax.set_mesh(setup.mesh), nn.logical_axis_rules(setup.rules):
            state = setup.init_state(jax.random.key_data(jax.random.key(0)))
            host = [next(data) for _ in range(args.steps)]
            batches = [sharding.global_batch(b, setup.mesh, setup.rules) for b in host]
            holder, used = {"state": state}, []  # used: the batch index of every call

            def one_step():  # batch-packed batches differ in rows: one compile per row count
                used.append(len(used) % len(batches))
                holder["state"], metrics = step(holder["state"], batches[used[-1]])
                jax.block_until_ready(metrics)

            # The first call compiles; every row count is compiled before the timed steps.
            times, cpu, compile_s = bench_peers.time_steps(
                one_step, args.steps, warmup=len(batches) + args.warmup
            )

        def run(batch):  # what fine-tuning's evaluation calls per batch
            gb = sharding.global_batch(batch, setup.mesh, setup.rules)
            with jax.set_mesh(setup.mesh), nn.logical_axis_rules(setup.rules):
                return jax.device_get(setup.eval_fn(holder["state"].params, gb))

        eval_times, eval_cpu, _ = bench_peers.time_steps(  # the untimed call compiles
            lambda: task.evaluate(run, phase), max(2, args.steps // 3), warmup=1
        )
    timed = used[-args.steps :]
    examples = [_examples(host[i]) for i in timed]
    rows = [len(host[i]["input_ids"]) for i in timed]
    step_s = statistics.median(times)
    dev = sum(e.size for e in task.eval_sets)
    return {
        "mode": mode,
        "first_step_s": compile_s,
        "step_time_s": step_s,
        "step_time_s_min": min(times),
        "step_cpu_s": statistics.median(cpu),
        "steps_per_sec": 1.0 / step_s,
        "examples_per_step": statistics.mean(examples),
        "examples_per_sec": sum(examples) / sum(times),
        "rows_per_step": statistics.mean(rows),
        "eval_examples": dev,
        "eval_s": statistics.median(eval_times),
        "eval_cpu_s": statistics.median(eval_cpu),
        "eval_examples_per_sec": dev / statistics.median(eval_times),
        "train_rows": int(len(task.train_features["input_ids"])),
        "model": setup.model.config.to_dict(),
    }


def _examples(batch: dict) -> float:
    """Real examples in a host batch (packed rows: the weighted slots of real rows)."""
    if "example_weights" in batch:
        return float((batch["example_weights"] * batch["mask"][:, None]).sum())
    return float(batch["mask"].sum())


def measure_finetune(args: argparse.Namespace) -> dict[str, Any]:
    """Unpacked and packed fine-tuning, and the PyTorch peer when ``--peers``."""
    result: dict[str, Any] = {"task": args.finetune, "glue_dir": args.glue_dir}
    for mode in MODES:
        result[mode] = measure(args, mode)
    if args.peers:
        result["peer"] = measure_peer(args, result)
    return result


def measure_peer(args: argparse.Namespace, result: dict) -> dict[str, Any]:
    """PyTorch BertForSequenceClassification on the same shapes; bertjax's speed-ups."""
    python = args.peers_python or bench_peers.default_peer_python()
    if not os.path.exists(python):
        return {"skipped": f"no peer virtualenv python at {python}"}
    unpacked, default = result["unpacked"], result["batch_packed"]
    shape = bench_peers.peer_shape(
        unpacked["model"],
        batch=args.batch,
        seq=args.seq,
        masked=0,
        steps=args.peer_steps,
        warmup=2,
        dropout=args.dropout,
        eval_examples=unpacked["eval_examples"],
        eval_batch=args.eval_batch,
    )
    peer = bench_peers.run_peer(python, "torch-cls", shape)
    peer["bertjax_speedup_step"] = peer["step_time_s"] / unpacked["step_time_s"]
    peer["bertjax_speedup_step_cpu_time"] = peer["step_cpu_s"] / unpacked["step_cpu_s"]
    peer["bertjax_speedup_eval"] = peer["eval_s"] / unpacked["eval_s"]
    peer_examples = args.batch / peer["step_time_s"]
    peer["bertjax_default_speedup_examples"] = default["examples_per_sec"] / peer_examples
    peer["bertjax_default_speedup_eval"] = peer["eval_s"] / default["eval_s"]
    return peer


def to_markdown(r: dict) -> str:
    """The fine-tuning section of bench's report."""
    out = [f"## Fine-tuning: {r['task']} ({r['glue_dir']})", ""]
    out.append(
        "| | rows/step | step s (median) | step CPU s | steps/s | examples/step | examples/s "
        "| dev eval s |"
    )
    out.append("|---|---|---|---|---|---|---|---|")
    for name in MODES:
        x = r[name]
        out.append(
            f"| bertjax {name} | {x['rows_per_step']:.1f} | {x['step_time_s']:.3f} | "
            f"{x['step_cpu_s']:.3f} | {x['steps_per_sec']:.2f} | {x['examples_per_step']:.1f} | "
            f"{x['examples_per_sec']:.1f} | {x['eval_s']:.2f} |"
        )
    peer = r.get("peer")
    if peer and "skipped" not in peer:
        out.append(
            f"| PyTorch (transformers) | {peer['batch']} | {peer['step_time_s']:.3f} | "
            f"{peer['step_cpu_s']:.3f} | "
            f"{1 / peer['step_time_s']:.2f} | {peer['batch']} | "
            f"{peer['batch'] / peer['step_time_s']:.1f} | {peer['eval_s']:.2f} |"
        )
        out += [
            "",
            f"bertjax / PyTorch at equal shapes: step {peer['bertjax_speedup_step']:.2f}x "
            f"(CPU time {peer['bertjax_speedup_step_cpu_time']:.2f}x), dev eval "
            f"{peer['bertjax_speedup_eval']:.2f}x; batch-packed (the default, same batches): "
            f"{peer['bertjax_default_speedup_examples']:.2f}x training examples/s, dev eval "
            f"{peer['bertjax_default_speedup_eval']:.2f}x",
        ]
    elif peer:
        out += ["", f"peer: {peer['skipped']}"]
    return "\n".join(out) + "\n"

"""Peer baselines for ``bertjax bench --peers``: the same pretraining step in Hugging Face transformers.

Two peers, each written the way their users write it:

* ``flax``: transformers 4.x ``FlaxBertForPreTraining`` (full-sequence MLM logits, as HF computes
  them), masked cross-entropy + NSP cross-entropy, ``optax.chain(clip_by_global_norm(1.0),
  adamw(...))``, one ``jax.jit`` with the train state donated;
* ``torch``: transformers ``BertForPreTraining`` in eager PyTorch (its own MLM + NSP loss from
  ``labels``/``next_sentence_label``), ``clip_grad_norm_(1.0)`` and ``torch.optim.AdamW``.

Both train with dropout 0.1 on the same synthetic batch shapes as ``bertjax bench``: every token
real, ``num_masked`` distinct masked positions per sequence, random NSP labels.

This file runs as a SCRIPT under a second virtualenv (``.venv-peers``: transformers 4.57 with the
jax/flax it supports and torch 2.13 CPU), never inside bertjax: the library never imports torch or
transformers. Only the standard library is imported at module level, so ``bertjax.tools.bench`` imports
``run_peer`` from here to launch the script and read the one JSON line it prints.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PEER_FRAMEWORKS = (
    "flax",
    "torch",
    "torch-modernbert",
    "torch-eurobert",
    "torch-nomicbert",
    "torch-gte",
    "torch-cls",
)
# The peers of each architecture, by its transformers reference class (``Architecture.hf_reference``).
PEERS = {
    "BertForPreTraining": ("flax", "torch"),
    "ModernBertForMaskedLM": ("torch-modernbert",),
    "EuroBertForMaskedLM": ("torch-eurobert",),
    "NomicBertForMaskedLM": ("torch-nomicbert",),
    "GteForMaskedLM": ("torch-gte",),
}


def default_peer_python() -> str:
    """``<repo>/.venv-peers/bin/python`` (the folder above the bertjax package), or $BERTJAX_PEERS_PYTHON."""
    env = os.environ.get("BERTJAX_PEERS_PYTHON")
    if env:
        return env
    here = os.path.abspath(__file__)  # <repo>/bertjax/tools/bench_peers.py
    root = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    return os.path.join(root, ".venv-peers", "bin", "python")


def run_peer(python: str, framework: str, shape: dict, timeout: float = 1800.0) -> dict:
    """Runs this file under ``python`` for one framework; returns its JSON result.

    ``shape`` holds layers, hidden, heads, intermediate, vocab, batch, seq, masked, steps, warmup.
    """
    argv = [python, os.path.abspath(__file__), f"--framework={framework}"]
    argv += [f"--{key}={value}" for key, value in shape.items()]
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.pop("XLA_FLAGS", None)  # one host device, as bertjax bench uses
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout)[-2000:]
        raise RuntimeError(f"peer {framework} failed (exit {done.returncode}):\n{tail}")
    return json.loads(lines[-1])


def peer_shape(model: dict, **sizes) -> dict:
    """``run_peer``'s shape for a bertjax model config dict (layers, hidden, heads, intermediate,
    vocab) plus ``sizes`` (batch, seq, masked, steps, warmup, dropout, ...)."""
    keys = ("num_layers", "hidden_size", "num_heads", "intermediate_size", "vocab_size")
    names = ("layers", "hidden", "heads", "intermediate", "vocab")
    return {**{name: model[key] for name, key in zip(names, keys)}, **sizes}


def synthetic_batch(batch: int, seq: int, masked: int, vocab: int, seed: int = 0) -> dict:
    """NumPy batch: ids [batch, seq], masked positions/labels [batch, masked], nsp [batch]."""
    import numpy as np

    rng = np.random.default_rng(seed)
    positions = np.sort(
        np.stack([rng.choice(np.arange(1, seq - 1), masked, replace=False) for _ in range(batch)]),
        axis=1,
    )
    mask_id = min(103, vocab - 1)  # [MASK] in the BERT vocabularies
    ids = rng.integers(vocab // 30, vocab, (batch, seq))  # mostly ordinary word pieces
    labels_full = np.full((batch, seq), -100, np.int64)  # HF convention: -100 = not predicted
    np.put_along_axis(labels_full, positions, np.take_along_axis(ids, positions, 1), axis=1)
    np.put_along_axis(ids, positions, mask_id, axis=1)
    segments = (np.arange(seq)[None, :] >= seq // 2).astype(np.int64).repeat(batch, 0)
    return {
        "input_ids": ids,
        "attention_mask": np.ones((batch, seq), np.int64),
        "token_type_ids": segments,
        "labels": labels_full,
        "next_sentence_label": rng.integers(0, 2, (batch,)),
    }


def _hf_config(a):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        intermediate_size=a.intermediate,
        hidden_act="gelu",
        hidden_dropout_prob=a.dropout,
        attention_probs_dropout_prob=a.dropout,
        max_position_embeddings=max(512, a.seq),
    )


def time_steps(run_step, steps: int, warmup: int) -> tuple[list[float], list[float], float]:
    """Calls ``run_step()`` (which must block until done) ``warmup`` times untimed, then ``steps``
    times timed: (per-step wall s, per-step CPU s, the first call's wall s)."""
    t0 = time.perf_counter()
    run_step()
    first = time.perf_counter() - t0
    for _ in range(max(warmup - 1, 0)):
        run_step()
    times, cpu_times = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        run_step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    return times, cpu_times, first


def bench_flax(a) -> dict:
    """FlaxBertForPreTraining + optax AdamW, full-sequence MLM logits, one jitted donated step."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import traverse_util
    from transformers import FlaxBertForPreTraining

    model = FlaxBertForPreTraining(_hf_config(a), seed=0, dtype=jnp.float32)

    def decay_mask(params):
        flat = traverse_util.flatten_dict(params)
        keep = {p: p[-1] != "bias" and "LayerNorm" not in "/".join(p) for p in flat}
        return traverse_util.unflatten_dict(keep)

    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(1e-4, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01, mask=decay_mask),
    )
    state = (model.params, tx.init(model.params), jax.random.PRNGKey(0))
    batch = {
        k: jnp.asarray(v, jnp.int32)
        for k, v in synthetic_batch(a.batch, a.seq, a.masked, a.vocab).items()
    }

    def loss_fn(params, batch, rng):
        out = model(
            batch["input_ids"],
            batch["attention_mask"],
            batch["token_type_ids"],
            params=params,
            dropout_rng=rng,
            train=True,
        )
        logits = out.prediction_logits  # [batch, seq, vocab]: every position, as HF does
        labels = batch["labels"]
        weight = (labels >= 0).astype(jnp.float32)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
        mlm = (nll * weight).sum() / weight.sum()
        nsp = optax.softmax_cross_entropy_with_integer_labels(
            out.seq_relationship_logits, batch["next_sentence_label"]
        ).mean()
        return mlm + nsp

    def train_step(state, batch):
        params, opt_state, rng = state
        rng, dropout_rng = jax.random.split(rng)
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, dropout_rng)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, rng), loss

    step = jax.jit(train_step, donate_argnums=(0,))
    holder = {"state": state}

    def run():
        holder["state"], loss = step(holder["state"], batch)
        loss.block_until_ready()

    times, cpu_times, first = time_steps(run, a.steps, a.warmup)
    return {
        "framework": "transformers-flax",
        "times": times,
        "cpu_times": cpu_times,
        "first_step_s": first,
        "versions": {
            "jax": jax.__version__,
            "flax": _version("flax"),
            "transformers": _version("transformers"),
        },
    }


def bench_torch(a) -> dict:
    """Eager PyTorch BertForPreTraining with its built-in loss, clip_grad_norm_ and AdamW."""
    import torch
    from transformers import BertForPreTraining

    torch.manual_seed(0)
    model = BertForPreTraining(_hf_config(a))
    batch = synthetic_batch(a.batch, a.seq, a.masked, a.vocab)
    return _bench_torch_model(model, batch, a, "transformers-torch", no_decay=("bias", "LayerNorm"))


def bench_torch_modernbert(a) -> dict:
    """Eager PyTorch ModernBertForMaskedLM (its defaults: full-sequence logits, its own MLM loss
    from ``labels``), clip_grad_norm_ and AdamW."""
    import torch
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    torch.manual_seed(0)
    config = ModernBertConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        intermediate_size=a.intermediate,
        max_position_embeddings=max(8192, a.seq),
        local_attention=a.window,
        global_attn_every_n_layers=a.global_every,
        embedding_dropout=a.dropout,
        mlp_dropout=a.dropout,
        attention_dropout=a.dropout,
        pad_token_id=0,
    )
    model = ModernBertForMaskedLM(config)
    hf = synthetic_batch(a.batch, a.seq, a.masked, a.vocab)
    batch = {k: hf[k] for k in ("input_ids", "attention_mask", "labels")}
    return _bench_torch_model(model, batch, a, "transformers-torch-modernbert", ("bias", "norm"))


def bench_torch_eurobert(a) -> dict:
    """Eager PyTorch EuroBertForMaskedLM (full-sequence logits, its own MLM loss from
    ``labels``, SDPA attention), clip_grad_norm_ and AdamW."""
    import torch
    from transformers import EuroBertConfig, EuroBertForMaskedLM

    torch.manual_seed(0)
    config = EuroBertConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads or a.heads,
        intermediate_size=a.intermediate,
        max_position_embeddings=max(8192, a.seq),
        attention_dropout=a.dropout,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        mask_token_id=3,
    )
    model = EuroBertForMaskedLM(config)
    hf = synthetic_batch(a.batch, a.seq, a.masked, a.vocab)
    batch = {k: hf[k] for k in ("input_ids", "attention_mask", "labels")}
    return _bench_torch_model(model, batch, a, "transformers-torch-eurobert", ("norm",))


def _bench_torch_post_norm(a, family: str, positions: int, name: str, no_decay) -> dict:
    """Eager PyTorch ``{family}ForMaskedLM`` of a post-LN rotary family (NomicBERT, GTE):
    full-sequence logits, its own MLM loss from ``labels``, SDPA attention, clip_grad_norm_ and
    AdamW."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        intermediate_size=a.intermediate,
        max_position_embeddings=max(positions, a.seq),
        hidden_dropout_prob=a.dropout,
        attention_probs_dropout_prob=a.dropout,
        pad_token_id=0,
    )
    model = getattr(transformers, f"{family}ForMaskedLM")(config)
    hf = synthetic_batch(a.batch, a.seq, a.masked, a.vocab)
    batch = {k: hf[k] for k in ("input_ids", "attention_mask", "labels")}
    return _bench_torch_model(model, batch, a, name, no_decay)


def bench_torch_nomicbert(a) -> dict:
    """Eager PyTorch NomicBertForMaskedLM (:func:`_bench_torch_post_norm`)."""
    name = "transformers-torch-nomicbert"
    return _bench_torch_post_norm(a, "NomicBert", 2048, name, ("bias", "norm"))


def bench_torch_gte(a) -> dict:
    """Eager PyTorch GteForMaskedLM (:func:`_bench_torch_post_norm`)."""
    return _bench_torch_post_norm(
        a, "Gte", 8192, "transformers-torch-gte", ("bias", "norm", "Norm")
    )


def bench_torch_cls(a) -> dict:
    """Fine-tuning in eager PyTorch: BertForSequenceClassification (2 labels, its own loss) trained
    as ``_bench_torch_model`` does, then the dev set's forward passes (``eval_examples`` rows in
    batches of ``eval_batch``, ``model.eval()`` under ``torch.no_grad``) timed as one evaluation."""
    import numpy as np
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    config = _hf_config(a)
    config.num_labels = 2
    model = BertForSequenceClassification(config)
    rng = np.random.default_rng(0)
    hf = synthetic_batch(a.batch, a.seq, 0, a.vocab)
    batch = {k: hf[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    batch["labels"] = rng.integers(0, 2, (a.batch,))
    result = _bench_torch_model(model, batch, a, "transformers-torch-cls", ("bias", "LayerNorm"))
    dev = synthetic_batch(a.eval_examples, a.seq, 0, a.vocab, seed=1)
    dev = {k: torch.as_tensor(dev[k]) for k in ("input_ids", "attention_mask", "token_type_ids")}

    def evaluate():
        model.eval()
        with torch.no_grad():
            predictions = [
                model(**{k: v[i : i + a.eval_batch] for k, v in dev.items()}).logits.argmax(-1)
                for i in range(0, a.eval_examples, a.eval_batch)
            ]
        model.train()
        return torch.cat(predictions)

    times, cpu_times, _ = time_steps(evaluate, max(2, a.steps // 3), 1)
    result.update(eval_s=statistics.median(times), eval_cpu_s=statistics.median(cpu_times))
    result["batch"] = a.batch
    return result


def _bench_torch_model(model, batch: dict, a, name: str, no_decay: tuple[str, ...]) -> dict:
    """Times eager PyTorch training steps of ``model`` on ``batch`` (its own loss from the labels):
    backward, clip_grad_norm_(1.0), AdamW (weight decay 0.01 except parameters named ``no_decay``)."""
    import torch

    device = getattr(a, "device", "cpu")  # cuda: the GPU peer (bf16 autocast, SDPA attention)
    model.to(device)
    model.train()
    params = list(model.named_parameters())
    decay = [p for n, p in params if not any(k in n for k in no_decay)]
    rest = [p for n, p in params if any(k in n for k in no_decay)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-4,
        eps=1e-6,
    )
    batch = {k: torch.as_tensor(v).to(device) for k, v in batch.items()}
    forward = torch.compile(model) if getattr(a, "compile", 0) else model

    accum = getattr(a, "accum", 1)  # micro-batches: gradients summed over equal slices of rows
    chunks = [{k: v.chunk(accum)[i] for k, v in batch.items()} for i in range(accum)]
    dtype = getattr(a, "dtype", "float32")  # bfloat16: mixed precision, fp32 weights (autocast)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bfloat16")

    def run():
        for chunk in chunks:
            with autocast:
                loss = forward(**chunk).loss / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()  # time_steps needs the step done

    times, cpu_times, first = time_steps(run, a.steps, a.warmup)
    return {
        "framework": name,
        "times": times,
        "cpu_times": cpu_times,
        "first_step_s": first,
        "attn_implementation": model.config._attn_implementation,
        "dtype": dtype,
        "device": device,
        "torch_compile": bool(getattr(a, "compile", 0)),
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": _version("transformers")},
    }


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=PEER_FRAMEWORKS, required=True)
    for name, default in (
        ("layers", 4),
        ("hidden", 512),
        ("heads", 8),
        ("intermediate", 2048),
        ("vocab", 30522),
        ("batch", 32),
        ("seq", 128),
        ("masked", 20),
        ("steps", 10),
        ("warmup", 2),
        ("window", 128),
        ("global_every", 3),
        ("kv_heads", 0),
        ("eval_examples", 872),
        ("eval_batch", 64),
    ):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step (PyTorch peers)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="PyTorch peers")
    p.add_argument("--compile", type=int, default=0, help="1: torch.compile the PyTorch model")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="PyTorch peers: bfloat16 = torch.autocast mixed precision (fp32 weights, bf16 matmuls)",
    )
    a = p.parse_args(argv)
    runners = {
        "flax": bench_flax,
        "torch": bench_torch,
        "torch-modernbert": bench_torch_modernbert,
        "torch-eurobert": bench_torch_eurobert,
        "torch-nomicbert": bench_torch_nomicbert,
        "torch-gte": bench_torch_gte,
        "torch-cls": bench_torch_cls,
    }
    result = runners[a.framework](a)
    result["step_time_s"] = statistics.median(result["times"])
    result["step_cpu_s"] = statistics.median(result["cpu_times"])
    result["tokens_per_sec"] = a.batch * a.seq / result["step_time_s"]
    result["sequences_per_sec"] = a.batch / result["step_time_s"]
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])

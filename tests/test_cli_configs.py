"""Every config file parses into a valid model; the CLI dispatcher; `bertjax plot`."""

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import pytest

from bertjax import models
from bertjax.commands import plot
from bertjax.models import model_config_from

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = sorted(p for p in (REPO / "configs").glob("*.py") if p.name != "__init__.py")


def _load(path):
    sys.path.insert(0, str(REPO))
    spec = importlib.util.spec_from_file_location(f"cfg_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_parses_and_builds_a_model_config(path):
    config = _load(path)
    assert config.task
    for key in (
        "steps",
        "seed",
        "global_batch_size",
        "log_every",
        "eval_every",
        "checkpoint_every",
    ):
        assert key in config.train, key
    for key in ("data", "fsdp", "tensor"):
        assert key in config.mesh, key
    model = model_config_from(config.model, vocab_size=30522)
    arch = config.model.architecture or "bert"
    assert model.architecture == arch
    assert model.num_layers == models.get_preset(config.model.preset, arch).num_layers


def test_paper_recipe_in_bert_base_config():
    config = _load(REPO / "configs" / "bert_base.py")
    assert config.train.global_batch_size == 256 and config.train.steps == 1_000_000
    assert config.optimizer.learning_rate == 1e-4 and config.optimizer.warmup_steps == 10_000
    phases = [dict(p) for p in config.data.phases]
    assert [(p["until_step"], p["max_seq_length"]) for p in phases] == [
        (900_000, 128),
        (1_000_000, 512),
    ]


def test_cli_lists_commands_and_rejects_unknown_ones():
    ok = subprocess.run(
        [sys.executable, "-m", "bertjax.cli", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert ok.returncode == 0
    for command in ("pretrain", "finetune", "prepare", "vocab", "convert", "bench", "plot"):
        assert command in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "bertjax.cli", "pretrian"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert bad.returncode == 2 and "unknown command 'pretrian'" in bad.stderr


def test_plot_writes_a_png(tmp_path):
    records = [
        {
            "step": s,
            "split": "train",
            "loss": 5.0 - s / 10,
            "mlm_accuracy": s / 100,
            "learning_rate": 1e-4,
            "tokens_per_sec": 1000.0,
        }
        for s in range(1, 11)
    ]
    records.append({"step": 10, "split": "eval", "loss": 4.2, "mlm_accuracy": 0.11})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = plot.plot(str(tmp_path))
    assert pathlib.Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: invalid JSON"):
        plot.plot(str(tmp_path))


def test_keys_a_run_ignores_are_refused_and_keys_it_reads_are_settable(tmp_path):
    """Fine-tuning evaluates whole dev sets, so train.eval_steps is no key of its configs (setting
    it is an error naming it); ``tensorboard``, which every run reads, can be set from the CLI."""
    from configs import base, finetune_base, glue

    assert "eval_steps" in base.get_config().train
    for config in (finetune_base.get_config(), glue.get_config()):
        assert "eval_steps" not in config.train and config.tensorboard is True

    def finetune(*overrides):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "bertjax.cli",
                "finetune",
                "--config=configs/glue.py",
                *overrides,
                f"--workdir={tmp_path}",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
        )

    bad = finetune("--config.train.eval_steps=5")
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1] == (
        "bertjax finetune: error: unknown config key train.eval_steps"
    )
    renamed = finetune("--config.vocab=vocab.txt")  # bertjax 0.2's name of data.vocab
    assert renamed.returncode != 0 and renamed.stderr.strip().splitlines()[-1] == (
        "bertjax finetune: error: config key vocab was renamed data.vocab in bertjax 0.3: set data.vocab"
    )


def test_plot_marks_series_of_few_points():
    records = [
        {"step": 1, "split": "train", "loss": 5.0, "learning_rate": 1e-4, "tokens_per_sec": 9.0},
        {"step": 1, "split": "eval", "loss": 4.0},
    ]
    fig = plot.draw(records)
    lines = [line for ax in fig.axes for line in ax.lines]
    assert len(lines) == 4 and all(line.get_marker() not in ("None", "", None) for line in lines)
    many = [{"step": s, "split": "train", "loss": 1.0 / s} for s in range(1, 200)]
    (line,) = plot.draw(many).axes[0].lines
    assert line.get_marker() in ("None", "", None)  # a long curve: a plain line


def test_plot_draws_a_tasks_own_eval_metrics():
    """A retrieval run's ndcg@10 (any eval number no panel names) is drawn with the accuracies;
    losses stay in the loss panel."""
    records = [
        {"step": 1, "split": "train", "loss": 2.0, "learning_rate": 1e-4, "tokens_per_sec": 9.0},
        {"step": 1, "split": "eval", "ndcg@10": 0.61, "recall@100": 0.9, "rerank_loss": 1.0},
        {"step": 2, "split": "eval", "ndcg@10": 0.64, "recall@100": 0.92},
    ]
    fig = plot.draw(records)
    labels = {line.get_label() for line in fig.axes[plot.METRICS_PANEL].lines}
    assert labels == {"eval ndcg@10", "eval recall@100"}
    assert plot.eval_metric_keys(records) == ("ndcg@10", "recall@100")


def test_recipes_of_nomicbert_and_gte_as_their_sources_state_them():
    """configs/nomicbert_2048.py: nomic-ai/contrastors' configs/train/mlm.yaml at the checkpoint's
    2048 tokens; configs/gte_en_base.py and gte_en_base_long.py: gte-en-mlm-base's model card."""
    nomic = _load(REPO / "configs" / "nomicbert_2048.py")
    opt = nomic.optimizer
    assert (opt.name, opt.schedule, opt.learning_rate, opt.b1, opt.b2) == (
        "adamw", "linear", 5e-4, 0.9, 0.98
    )  # fmt: skip
    assert (opt.eps, opt.weight_decay, opt.grad_clip_norm) == (1e-6, 1e-5, 0.0)
    assert opt.warmup_steps == round(0.06 * nomic.train.steps)
    assert (nomic.train.global_batch_size, nomic.data.max_seq_length) == (4096, 2048)
    assert nomic.data.masked_lm_prob == 0.3 and not nomic.data.nsp
    assert nomic.data.max_predictions_per_seq == math.ceil(0.3 * 2048)
    stages = []
    for name in ("gte_en_base", "gte_en_base_long"):
        c = _load(REPO / "configs" / f"{name}.py")
        assert c.model.architecture == "gte" and c.data.masked_lm_prob == 0.3
        phases = [dict(p) for p in c.data.phases] or [
            dict(until_step=c.train.steps, max_seq_length=c.data.max_seq_length)
        ]
        start = 0
        for p in phases:
            rope = p.get("model", {}).get("rope_theta", c.model.rope_theta)
            batch = p.get("global_batch_size", c.train.global_batch_size)
            length = p["max_seq_length"]
            stages.append((length, c.optimizer.learning_rate, batch, p["until_step"] - start, rope))
            assert p.get("max_predictions_per_seq", c.data.max_predictions_per_seq) >= 0.3 * length
            start = p["until_step"]
    assert stages == [  # (tokens, lr, batch, steps, RoPE base) of MLM-512, MLM-2048, MLM-8192
        (512, 2e-4, 4096, 300_000, 10_000.0),
        (2048, 5e-5, 4096, 30_000, 10_000.0),
        (8192, 5e-5, 1024, 30_000, 160_000.0),
    ]

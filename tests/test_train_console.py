"""The training console: short per-step lines, an ETA from steady-state steps only, a readable last
line, and a warmup longer than the run refused."""

import ml_collections
import pytest

from bertjax import metrics_logging, optim
from bertjax.metrics_logging import Eta, console_line, summary

# Every metric a pretraining step logs (what metrics.jsonl keeps).
TRAIN = {
    "loss": 2.34567,
    "mlm_loss": 1.9,
    "nsp_loss": 0.44,
    "mlm_accuracy": 0.45123,
    "nsp_accuracy": 0.5,
    "learning_rate": 1e-4,
    "grad_norm": 0.8123,
    "param_norm": 123.4,
    "update_norm": 0.01,
    "steps_per_sec": 5.2,
    "seq_per_sec": 1331.2,
    "tokens_per_sec": 170393.6,
    "tflops_per_device": 12.5,
    "mfu": 0.412,
}


def test_a_train_line_is_short_and_keeps_the_key_metrics():
    line = console_line("train", 100, TRAIN, total_steps=1000, eta=83.0)
    assert line == (
        "[train] step 100/1000 loss=2.3457 mlm_accuracy=0.4512 nsp_accuracy=0.5000 lr=1.000e-04 "
        "grad_norm=0.8123 5.2 steps/s 170.4k tok/s mfu 41.2% eta 1m23s"
    )
    assert len(line) < 160  # the old line held every metric: ~400 characters
    no_tokens = console_line("train", 1, {**TRAIN, "tokens_per_sec": 0.0, "mfu": 0.0})
    assert no_tokens.endswith("5.2 steps/s 1.3k seq/s") and "eta" not in no_tokens


def test_an_eval_line_shows_every_metric():
    line = console_line("eval", 4, {"mlm_accuracy": 0.5, "mlm_loss": 2.0})
    assert line == "[eval] step 4 mlm_accuracy=0.5000 mlm_loss=2.0000"


def test_the_eta_leaves_out_compilation(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(metrics_logging.time, "perf_counter", lambda: now[0])
    eta = Eta(total_steps=103, min_steps=3)
    assert eta.seconds_left(1) is None  # the first step (compilation) is not timed
    now[0] = 60.0  # the first step compiled for a minute
    eta.start(1)
    now[0] = 62.0  # then 1 s a step
    assert eta.seconds_left(3) is None  # too few steps timed
    now[0] = 63.0
    assert eta.seconds_left(4) == pytest.approx(99.0)  # 3 s for 3 steps, 99 steps to go


def test_the_last_line_is_a_readable_summary():
    result = {
        "step": 1000,
        "train": TRAIN,
        "eval": {"accuracy": 0.87123, "loss": 0.4},
        "final": {"params": "best", "best_metric": "accuracy", "best_value": 0.9, "f1": 0.91},
    }
    assert summary(result) == (
        "done: step 1000 | train loss=2.3457 mlm_accuracy=0.4512 nsp_accuracy=0.5000 | "
        "eval accuracy=0.8712 loss=0.4000 | final (best params) f1=0.9100"
    )
    finetuned = {
        "params": "best",
        "best_value": 0.9,
        "task": "glue/sst2",
        "train_steps": 30,
        "dev": {"accuracy": 0.9, "loss": 0.3},
    }
    assert summary({"step": 30, "final": finetuned}) == (
        "done: step 30 | final (best params) accuracy=0.9000 loss=0.3000"
    )
    seeds = {"main_metric": "accuracy", "median": {"accuracy": 0.85}, "best_seed": 2, "seeds": {}}
    assert summary({"step": None, "eval": {"accuracy": 0.9}, "final": seeds}) == (
        "done: | eval accuracy=0.9000 | final median_accuracy=0.8500 best_seed=2"
    )
    assert "{" not in summary({"step": 1, "train": TRAIN, "final": finetuned})


def _optimizer(warmup):
    return ml_collections.ConfigDict(
        dict(
            optimizer=dict(
                name="adamw",
                learning_rate=1e-3,
                warmup_steps=warmup,
                b1=0.9,
                b2=0.999,
                eps=1e-6,
                weight_decay=0.01,
                grad_clip_norm=1.0,
            )
        )
    )


def test_a_warmup_longer_than_the_run_is_an_error_naming_the_key():
    optim.create_optimizer(_optimizer(10), total_steps=10)  # as long as the run: fine
    with pytest.raises(ValueError, match=r"optimizer.warmup_steps=50 is longer than the run \(10"):
        optim.create_optimizer(_optimizer(50), total_steps=10)
    with pytest.raises(ValueError, match="optimizer.warmup_steps=11"):  # a task-resolved warmup
        optim.create_optimizer(_optimizer(0), total_steps=10, warmup_steps=11)


def test_the_start_up_line_says_the_global_batch_and_its_packed_rows():
    from bertjax import train

    assert train.batch_shape_text(32, 8, 128) == "batch 32 examples in 8 packed rows x seq 128"
    assert train.batch_shape_text(8, 8, 16) == "batch 8 x seq 16"


def test_tokens_per_second_counts_the_tokens_a_step_encodes():
    meter = metrics_logging.Throughput()
    meter.t0 -= 2.0  # two steps in two seconds
    meter.tick()
    meter.tick()
    rates = meter.rates(32, 32 * 8 + 32 * 3 * 16)
    assert rates["seq_per_sec"] == pytest.approx(32, rel=1e-3)
    assert rates["tokens_per_sec"] == pytest.approx(32 * 8 + 32 * 3 * 16, rel=1e-3)

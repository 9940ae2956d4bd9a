"""``bertjax finetune``: one fine-tuning run, or one per seed with the median and the best dev run.

Fine-tuning on small data is unstable (BERT paper, Sec. 4.1: for BERT-Large on small GLUE tasks
"we ran several random restarts and selected the best model on the Dev set"). With several
``config.seeds`` every seed trains in ``WORKDIR/seed_{s}`` (each resumable on its own) and
``WORKDIR/eval_results.json`` lists each seed's final dev metrics, their median and the best dev run
(by the task's main metric) — the paper's selection. One seed is a plain run in WORKDIR.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from typing import Any

import jax
import ml_collections

from bertjax import atomic, train

log = logging.getLogger("bertjax")

SELECTION = "best dev run (BERT paper, Sec. 4.1: random restarts, best model on the Dev set)"


def _with_seed(config: ml_collections.ConfigDict, seed: int) -> ml_collections.ConfigDict:
    config = config.copy_and_resolve_references()
    config.train.seed = int(seed)
    return config


def _median(values: list[float]) -> float:
    """The median, NaN when a value is NaN (as numpy.median; statistics.median would sort NaN
    arbitrarily)."""
    return float("nan") if any(math.isnan(v) for v in values) else statistics.median(values)


def summarize(per_seed: dict[int, dict], main_metric: str) -> dict[str, Any]:
    """Median of every dev metric over seeds and the best seed's run by ``main_metric`` (max).

    A seed whose main metric is NaN (a diverged run) is never the best unless every seed is NaN;
    such seeds are listed under ``nan_seeds``."""
    devs = {s: r.get("dev", {}) for s, r in per_seed.items()}
    missing = [s for s, d in devs.items() if main_metric not in d]
    if missing:
        raise ValueError(f"seed(s) {missing} report no dev metric {main_metric!r}")
    keys = sorted(set.intersection(*(set(d) for d in devs.values())))
    median = {
        k: _median([float(d[k]) for d in devs.values()])
        for k in keys
        if all(isinstance(d[k], int | float) for d in devs.values())
    }
    nan_seeds = sorted(s for s, d in devs.items() if math.isnan(float(d[main_metric])))
    if nan_seeds:
        log.warning("seed(s) %s: dev %s is NaN (diverged); not selected", nan_seeds, main_metric)

    def rank(s: int) -> tuple[bool, float, int]:
        value = float(devs[s][main_metric])
        return (not math.isnan(value), -math.inf if math.isnan(value) else value, -s)

    best_seed = max(devs, key=rank)
    return {
        "main_metric": main_metric,
        "seeds": {str(s): per_seed[s] for s in per_seed},
        "median": median,
        "best_seed": best_seed,
        "best": devs[best_seed],
        "nan_seeds": nan_seeds,
        "selection": SELECTION,
    }


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Fine-tunes ``config.task`` once per seed in ``config.seeds``; returns the run's results.

    One seed: ``train.train_and_evaluate`` in WORKDIR (its eval_results.json is the task's final
    metrics). Several: one run per seed in WORKDIR/seed_{s}; WORKDIR/eval_results.json holds every
    seed's final metrics, the median and the best dev run; the returned dict has them under
    ``final`` and the best run's dev metrics under ``eval``.
    """
    seeds = [int(s) for s in (config.get("seeds") or [config.train.seed])]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"config key seeds={seeds} repeats a seed")
    if len(seeds) == 1:
        return train.train_and_evaluate(_with_seed(config, seeds[0]), workdir)
    per_seed: dict[int, dict] = {}
    main_metric = None
    for seed in seeds:
        log.info(
            "fine-tuning %s with seed %d (%d of %d)",
            config.task,
            seed,
            len(per_seed) + 1,
            len(seeds),
        )
        result = train.train_and_evaluate(
            _with_seed(config, seed), os.path.join(workdir, f"seed_{seed}")
        )
        final = result.get("final") or {}
        if not final:
            raise ValueError(f"task {config.task} returned no final metrics for seed {seed}")
        per_seed[seed] = final
        main_metric = final.get("main_metric") or final.get("best_metric")
    summary = summarize(per_seed, main_metric)
    summary["task"] = config.task
    if jax.process_index() == 0:
        atomic.write_json(os.path.join(workdir, "eval_results.json"), summary)
    log.info(
        "%s over seeds %s: median %s=%.4f, best (seed %d) %.4f",
        config.task,
        seeds,
        main_metric,
        summary["median"][main_metric],
        summary["best_seed"],
        summary["best"][main_metric],
    )
    return {"final": summary, "eval": summary["best"], "step": None}

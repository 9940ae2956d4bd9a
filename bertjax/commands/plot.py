"""``bertjax plot WORKDIR``: a PNG of a run's curves from WORKDIR/metrics.jsonl (local or gs://)."""

from __future__ import annotations

import argparse
import json
import os

from bertjax import atomic, fs

PANELS = (
    ("loss", ("loss", "mlm_loss", "nsp_loss")),
    ("accuracy and eval metrics", ("mlm_accuracy", "nsp_accuracy", "accuracy")),
    ("learning rate", ("learning_rate",)),
    ("throughput (tokens/s)", ("tokens_per_sec",)),
)
METRICS_PANEL = 1  # also every other number an evaluation logged (ndcg@10, f1, exact_match, ...)
_NOT_METRICS = {"step", "split", "epoch", "time", "seconds", "eval_seconds"}


def eval_metric_keys(records: list[dict]) -> tuple[str, ...]:
    """The numbers of the eval records that no panel names: a task's own metrics (a retrieval
    run's ndcg@10 and recall@100, SQuAD's f1), drawn with the accuracies."""
    named = {key for _, keys in PANELS for key in keys} | _NOT_METRICS
    found = {
        key
        for r in records
        if r.get("split") == "eval"
        for key, value in r.items()
        if key not in named and isinstance(value, int | float) and not isinstance(value, bool)
    }
    return tuple(sorted(k for k in found if "loss" not in k))


def read_records(workdir: str) -> list[dict]:
    """The records of ``WORKDIR/metrics.jsonl``; a bad line is an error naming file and line."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not fs.exists(path):
        raise FileNotFoundError(f"{path}: no metrics file (is {workdir} a bertjax run directory?)")
    records = []
    with fs.open_file(path, "r") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise fs.json_error(path, err, number) from None
    return records


FEW_POINTS = 20  # a train series with at most this many points is drawn with markers too


def draw(records: list[dict]):
    """The 2x2 figure of ``records`` (train lines, eval markers). A train series of few points
    also gets markers, so a single point (a short run's learning rate or throughput) is visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    extra = eval_metric_keys(records)
    for index, (ax, (title, keys)) in enumerate(zip(axes.flat, PANELS)):
        keys = keys + extra if index == METRICS_PANEL else keys
        for split in ("train", "eval"):
            for key in keys:
                points = [
                    (r["step"], r[key]) for r in records if r.get("split") == split and key in r
                ]
                if not points:
                    continue
                xs, ys = zip(*points)
                style = "o--" if split == "eval" else ("o-" if len(xs) <= FEW_POINTS else "-")
                ax.plot(xs, ys, style, label=f"{split} {key}", markersize=4)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(workdir: str, output: str | None = None) -> str:
    """Writes the curves of ``workdir`` (see :func:`draw`) to ``output`` (default
    WORKDIR/curves.png)."""
    import matplotlib.pyplot as plt

    records = read_records(workdir)
    output = output or os.path.join(workdir, "curves.png")
    fig = draw(records)
    fig.suptitle(
        os.path.basename(workdir.rstrip("/") if fs.is_remote(workdir) else os.path.abspath(workdir))
    )
    fig.tight_layout()
    with atomic.atomic_open(output, "wb") as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    return output


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bertjax plot", description=__doc__)
    parser.add_argument("workdir")
    parser.add_argument("--output", default=None, help="PNG path (default WORKDIR/curves.png)")
    args = parser.parse_args(argv)
    print(plot(args.workdir, args.output))

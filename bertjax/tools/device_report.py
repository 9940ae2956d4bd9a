"""The device check's report: ``device_report.json`` (its schema) and ``device_report.md``, rewritten
after every part of ``bertjax.tools.device_check`` so that a kill leaves the parts done."""

from __future__ import annotations

import json
import os
import time
from typing import Any

REPORT_KEYS = ("platform", "device_kind", "tests", "benchmarks", "skipped")


class Report:
    """The report, rewritten (JSON + Markdown) after every part."""

    def __init__(self, out: str, budget_s: float, started: float, dry: bool):
        self.out = out
        self.deadline = started + budget_s
        self.data: dict[str, Any] = {
            "platform": "?",
            "device_kind": "?",
            "dry_run": dry,
            "budget_s": budget_s,
            "environment": {},
            "tests": {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "cases": []},
            "benchmarks": [],
            "skipped": [],
            "plan": [],
        }
        os.makedirs(out, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.time()

    def skip(self, what: str, why: str) -> None:
        self.data["skipped"].append({"what": what, "why": why})
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.time() - (self.deadline - self.data["budget_s"]), 1)
        path = os.path.join(self.out, "device_report.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1, sort_keys=True, default=str)
        os.replace(path + ".tmp", path)
        with open(os.path.join(self.out, "device_report.md.tmp"), "w") as f:
            f.write(to_markdown(self.data))
        os.replace(
            os.path.join(self.out, "device_report.md.tmp"),
            os.path.join(self.out, "device_report.md"),
        )


def check_schema(data: dict) -> list[str]:
    """What is wrong with a report (empty when it has every key with the right type)."""
    problems = [f"missing key {k!r}" for k in REPORT_KEYS if k not in data]
    if not isinstance(data.get("tests"), dict) or "cases" not in data.get("tests", {}):
        problems.append("'tests' must be a dict with 'cases'")
    if not isinstance(data.get("benchmarks"), list):
        problems.append("'benchmarks' must be a list")
    if not isinstance(data.get("skipped"), list):
        problems.append("'skipped' must be a list")
    for bench in data.get("benchmarks", []):
        for key in ("name", "args"):
            if key not in bench:
                problems.append(f"benchmark without {key!r}: {bench}")
    return problems


def _num(value: Any, fmt: str = "{:.3g}") -> str:
    return "-" if value is None else fmt.format(value)


def to_markdown(d: dict) -> str:
    env = d.get("environment", {})
    lines = [
        "# bertjax device check",
        "",
        f"- platform: **{d['platform']}**, device: **{d['device_kind']}**"
        + (" (dry run: nothing was executed)" if d.get("dry_run") else ""),
        f"- jax {env.get('jax', '?')}, jaxlib {env.get('jaxlib', '?')}, flax {env.get('flax', '?')},"
        f" TensorFlow {env.get('tensorflow', '?')}; {env.get('nvidia_smi', '')}",
        f"- budget {d['budget_s']:.0f} s, used {d.get('elapsed_s', 0):.0f} s",
    ]
    cache = d.get("compile_cache")
    if cache:
        lines.append(
            f"- JAX compilation cache `{cache['dir']}`: {cache.get('entries_before', 0)} programs"
            f" before, {cache.get('entries_after', '?')} after (a program found there is loaded,"
            " not compiled: see compile s)"
        )
    lines += [
        "",
        "## Tests (`-m accelerator`)",
        "",
    ]
    t = d["tests"]
    if d.get("dry_run"):  # nothing ran: what would, not "0 passed, 0 failed"
        selected = t.get("selected", [])
        lines += [f"Dry run, not run: {len(selected)} tests selected", ""]
        lines += [f"- `{name}`" for name in selected]
    else:
        lines.append(
            f"{t.get('passed', 0)} passed, {t.get('failed', 0)} failed, {t.get('errors', 0)} "
            f"errors, {t.get('skipped', 0)} skipped"
            + (f" in {t['seconds']} s" if "seconds" in t else "")
        )
    lines.append("")
    for case in t.get("cases", []):
        if case["outcome"] != "passed":
            lines.append(f"- {case['outcome']}: `{case['test']}`: {case.get('message', '')[:300]}")
    lines += ["", "## Benchmarks (bf16, attention auto, real train_step, synthetic batch)", ""]
    lines.append(
        "| name | batch x seq | step ms | tokens/s | seq/s | TFLOP/s | MFU | peak GB | compile s |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for b in d["benchmarks"]:
        if b.get("planned"):
            shape = f"{b.get('batch', '?')} x {b.get('seq', '?')}"
            lines.append(f"| {b['name']} | {shape} | planned, not run | | | | | | |")
            continue
        if "error" in b:
            lines.append(f"| {b['name']} | error: {b['error'][-200:]!r} | | | | | | | |")
            continue
        c = b.get("config", {})
        peak = (b.get("memory") or {}).get("peak_bytes")
        lines.append(
            f"| {b['name']} | {c.get('batch')} x {c.get('seq')} | "
            f"{_num(b['step_time_s'] and b['step_time_s'] * 1e3, '{:.1f}')} | "
            f"{_num(b['tokens_per_sec'], '{:.0f}')} | {_num(b['sequences_per_sec'], '{:.0f}')} | "
            f"{_num(b['tflops_per_sec_per_device'], '{:.0f}')} | {_num(b['mfu'], '{:.1%}')} | "
            f"{_num(peak and peak / 1e9, '{:.1f}')} | {_num(b['compile_s'], '{:.0f}')} |"
        )
    anchors = [f"- {b['name']}: {b['anchor']}" for b in d["benchmarks"] if b.get("anchor")]
    if anchors:
        lines += ["", "Published anchors (other software, other settings: context, not a race):"]
        lines += anchors
    if d["skipped"]:
        lines += ["", "## Skipped", ""]
        lines += [f"- {s['what']}: {s['why']}" for s in d["skipped"]]
    return "\n".join(lines) + "\n"

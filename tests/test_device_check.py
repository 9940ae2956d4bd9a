"""``make device-check`` (launch/device_check.sh + bertjax.tools.device_check): its dry mode and its
real path on CPU, both in a Python where TensorFlow cannot be imported (as on the GPU machine)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import xla_flags

from bertjax.tools import device_check, device_report

REPO = pathlib.Path(__file__).resolve().parent.parent
NO_TF = REPO / "tests" / "no_tensorflow"


def _env(**extra) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=f"{NO_TF}{os.pathsep}{REPO}", JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = xla_flags()
    return {**env, **extra}


def test_the_no_tensorflow_site_hides_tensorflow():
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('tensorflow') is None)"
    assert subprocess.run([sys.executable, "-c", code], env=_env()).returncode == 1


def test_dry_run_checks_selection_plan_and_schema_without_tensorflow(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "device_check.sh"), "--dry", "--out", str(out)],
        env=_env(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "device_report.json").read_text())
    assert not device_report.check_schema(report)
    assert report["dry_run"] and not report["dry_run_problems"]
    assert report["environment"]["tensorflow"] == "not installed"
    selected = report["tests"]["selected"]
    assert any("test_attention_impl_equals_xla" in t for t in selected)
    assert any("test_sharded_step_equals_one_device" in t for t in selected)
    assert any("cudnn" in t for t in selected)
    names = [b["name"] for b in report["benchmarks"]]
    assert names == [name for name, _, _ in device_check.PLAN]
    markdown = (out / "device_report.md").read_text()
    assert f"Dry run, not run: {len(selected)} tests selected" in markdown
    assert all(f"- `{test}`" in markdown for test in selected) and "0 passed" not in markdown
    assert f"| {names[0]} |" in markdown and "planned, not run" in markdown


def test_without_an_accelerator_the_script_says_use_dry(tmp_path):
    if subprocess.run(["sh", "-c", "command -v nvidia-smi"], capture_output=True).returncode == 0:
        pytest.skip("this machine has nvidia-smi")
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "device_check.sh"), "--out", str(tmp_path)],
        env=_env(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "device_check.sh: no NVIDIA GPU or TPU on this machine; use --dry"


def test_a_spent_budget_skips_every_benchmark_with_its_reason(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bertjax.tools.device_check",
            "--allow_cpu",
            "--skip_tests",
            "--budget_s",
            "1",
            "--out",
            str(tmp_path),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "device_report.json").read_text())
    skipped = {s["what"]: s["why"] for s in report["skipped"]}
    assert report["benchmarks"] == []
    for name, _, _ in device_check.PLAN:
        assert "left, it needs about" in skipped[f"benchmark {name}"]


@pytest.mark.slow
def test_the_real_path_on_cpu_with_tiny_models_without_tensorflow(tmp_path):
    """Tests selected and run through JUnit XML, benchmarks through ``bertjax bench``, both in
    subprocesses that cannot import TensorFlow; the report has their figures. The budget is far
    beyond what they need, so that a busy machine does not turn them into skips."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bertjax.tools.device_check",
            "--allow_cpu",
            "--plan=tiny",
            "--tests_k=checkpoint or pretrain",
            "--budget_s=3600",
            "--tests_s=3000",
            f"--compile_cache={tmp_path / 'xla-cache'}",
            "--out",
            str(tmp_path),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "device_report.json").read_text())
    assert not device_report.check_schema(report)
    tests = report["tests"]
    assert tests["passed"] == 1 and tests["failed"] == 0 and tests["skipped"] == 1
    skipped = [c for c in tests["cases"] if c["outcome"] == "skipped"]
    assert "TensorFlow is not installed" in skipped[0]["message"]
    benches = {b["name"]: b for b in report["benchmarks"]}
    assert set(benches) == {name for name, _, _ in device_check.TINY_PLAN}
    for b in benches.values():
        assert "error" not in b, b.get("error")
        assert b["step_time_s"] > 0 and b["tokens_per_sec"] > 0 and b["final_loss"] > 0
        assert b["resolved"]["attention_impl"] == "xla"  # auto on CPU
    assert "| modernbert-tiny-128 |" in (tmp_path / "device_report.md").read_text()
    # Every test and benchmark process kept its programs in the one persistent cache.
    cache = report["compile_cache"]
    assert cache["dir"] == str(tmp_path / "xla-cache") and cache["entries_before"] == 0
    assert cache["entries_after"] == len(os.listdir(cache["dir"])) > 0


def test_parse_junit_and_schema(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="a" name="ok" time="1.5"/>'
        '<testcase classname="a" name="bad"><failure message="boom"/></testcase>'
        '<testcase classname="a" name="skip"><skipped message="why"/></testcase>'
        "</testsuite></testsuites>"
    )
    result = device_check.parse_junit(str(xml))
    assert (result["passed"], result["failed"], result["skipped"]) == (1, 1, 1)
    assert result["cases"][1] == {
        "test": "a::bad",
        "outcome": "failed",
        "seconds": 0.0,
        "message": "boom",
    }
    assert device_report.check_schema({"platform": "gpu"}) == [
        "missing key 'device_kind'",
        "missing key 'tests'",
        "missing key 'benchmarks'",
        "missing key 'skipped'",
        "'tests' must be a dict with 'cases'",
        "'benchmarks' must be a list",
        "'skipped' must be a list",
    ]


def test_a_dry_report_lists_what_it_selected_not_zero_passed(tmp_path):
    report = device_report.Report(str(tmp_path), 60.0, 0.0, dry=True)
    report.data["tests"]["selected"] = ["tests/test_a.py::test_one", "tests/test_b.py::test_two"]
    report.data["benchmarks"].append(
        {"name": "bert-base-128", "args": [], "planned": True, "batch": 32, "seq": 128}
    )
    text = device_report.to_markdown(report.data)
    assert "passed" not in text and "failed" not in text, text
    assert "Dry run, not run: 2 tests selected\n\n- `tests/test_a.py::test_one`\n" in text
    assert "- `tests/test_b.py::test_two`" in text
    assert "| bert-base-128 | 32 x 128 | planned, not run |" in text

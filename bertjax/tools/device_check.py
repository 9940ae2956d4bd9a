"""``make device-check``: the accelerator path checked in one command, with a report.

On a GPU or TPU it runs, within a time budget (install included, counted by the caller):

1. the tests marked ``accelerator`` (``tests/test_accelerator.py`` and the cuDNN window test):
   every attention path equal to ``xla`` on padded and packed batches, bf16 losses against fp32,
   a sharded train step against one device, a checkpoint round trip, ``make pretrain`` end to end
   (skipped without TensorFlow);
2. benchmarks of the real pretraining step (``bertjax bench``) in bf16 with the platform's
   attention (``auto``): step time, tokens/s, peak memory, MFU against the chip's peak, beside
   published anchors.

Every test and benchmark process shares JAX's persistent compilation cache (``--compile_cache``,
default ``$BERTJAX_COMPILE_CACHE``, JAX's ``$JAX_COMPILATION_CACHE_DIR`` or
``bertjax-compile-cache`` in the temporary folder): a second
call on the same machine (a rerun after a budget ran out, or ``--only`` one benchmark again) loads
the programs the first compiled instead of compiling them again, which on a GPU is most of a
benchmark's wall time; the report's ``compile_cache`` says where and how many entries it held
before and after, and each benchmark's ``compile_s`` shows what was loaded.

It writes ``device_report.json`` (keys ``platform``, ``device_kind``, ``tests``, ``benchmarks``,
``skipped`` and more) and ``device_report.md`` to ``--out``, rewriting both after every part so
that a kill leaves the parts done. Whatever does not fit in the time left is listed in
``skipped`` with the reason. ``--dry`` (any machine, CI) checks the test selection, the benchmark
plan and the report's schema without running them. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as platform_lib
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Any

from bertjax.tools.device_report import Report, check_schema, to_markdown

# The checkout (its tests/ and configs/): launch/device_check.sh says where; else this file's.
REPO = os.environ.get("BERTJAX_REPO") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
TEST_FILES = ("tests/test_accelerator.py", "tests/test_modernbert.py")
TEST_MARKER = "accelerator"

# The benchmarks, most informative first: (name, bench arguments, seconds it needs at least).
# Batch sizes fill an 80 GB H100 comfortably in bf16 without rematerialisation.
PLAN: list[tuple[str, list[str], int]] = [
    ("bert-base-128", ["--preset=base", "--seq=128", "--batch=256"], 60),
    (
        "modernbert-base-1024",
        [
            "--architecture=modernbert",
            "--preset=modernbert-base",
            "--seq=1024",
            "--batch=32",
            "--vocab_size=50368",
            "--dropout=0",
        ],
        90,
    ),
    ("bert-large-128", ["--preset=large", "--seq=128", "--batch=128"], 80),
    ("bert-base-128-no-dropout", ["--preset=base", "--seq=128", "--batch=256", "--dropout=0"], 60),
    ("bert-base-512", ["--preset=base", "--seq=512", "--batch=64"], 60),
    ("bert-large-512", ["--preset=large", "--seq=512", "--batch=32"], 80),
    # the attention kernels side by side (BERT's attention dropout 0: no explicit fallback)
    (
        "bert-base-512-xla-attn",
        [
            "--preset=base",
            "--seq=512",
            "--batch=64",
            "--attention_dropout=0",
            "--attention_impl=xla",
        ],
        60,
    ),
    (
        "bert-base-512-auto-attn",
        ["--preset=base", "--seq=512", "--batch=64", "--attention_dropout=0"],
        60,
    ),
    (
        "modernbert-base-1024-xla-attn",
        [
            "--architecture=modernbert",
            "--preset=modernbert-base",
            "--seq=1024",
            "--batch=32",
            "--vocab_size=50368",
            "--dropout=0",
            "--attention_impl=xla",
        ],
        90,
    ),
    # BERT's attention dropout inside cuDNN's kernel (dropout_impl=kernel) against the default
    (
        "bert-base-128-kernel-dropout",
        ["--preset=base", "--seq=128", "--batch=256", "--dropout_impl=kernel"],
        60,
    ),
    (
        "bert-large-128-kernel-dropout",
        ["--preset=large", "--seq=128", "--batch=128", "--dropout_impl=kernel"],
        80,
    ),
    (
        "bert-base-128-xla-attn",
        ["--preset=base", "--seq=128", "--batch=256", "--attention_impl=xla"],
        60,
    ),
    (
        "modernbert-base-8192",
        [
            "--architecture=modernbert",
            "--preset=modernbert-base",
            "--seq=8192",
            "--batch=4",
            "--vocab_size=50368",
            "--dropout=0",
        ],
        120,
    ),
    # the same steps in transformers + PyTorch on the same GPU (bf16 autocast, SDPA,
    # torch.compile): the peer's tokens/s beside bertjax's (needs torch and transformers there)
    (
        "bert-base-128-vs-pytorch",
        [
            "--preset=base",
            "--seq=128",
            "--batch=256",
            "--dropout_impl=kernel",
            "--peers",
            "--peer_steps=5",
        ],
        180,
    ),
    (
        "modernbert-base-1024-vs-pytorch",
        [
            "--architecture=modernbert",
            "--preset=modernbert-base",
            "--seq=1024",
            "--batch=32",
            "--vocab_size=50368",
            "--dropout=0",
            "--peers",
            "--peer_steps=5",
        ],
        200,
    ),
]
# A plan of tiny models with the same code path (``--plan=tiny``: CPU self-tests of this tool).
TINY_PLAN: list[tuple[str, list[str], int]] = [
    (
        "modernbert-tiny-128",
        [
            "--architecture=modernbert",
            "--preset=modernbert-tiny",
            "--seq=128",
            "--batch=4",
            "--vocab_size=512",
        ],
        5,
    ),
]
COMMON = ["--dtype=bfloat16", "--attention_impl=auto", "--skip_input", "--skip_prepare", "--json"]
ANCHORS = {
    "bert-large-128": "MLPerf Training BERT-large on H100: about 970 samples/s per GPU (seq 512, "
    "packed, NVIDIA's tuned PyTorch); NVIDIA's PyTorch BERT-large pretraining on A100: 580 "
    "sequences/s at seq 128",
    "bert-large-512": "MLPerf Training BERT-large on H100: about 970 samples/s per GPU",
}


def detect_platform() -> str:
    """gpu | tpu | cpu, from JAX when it imports, else from the machine's devices."""
    try:
        import jax

        return jax.default_backend()
    except Exception:  # noqa: BLE001 - no JAX, or no backend: say what the machine has
        if os.path.exists("/dev/accel0") or os.path.isdir("/dev/vfio"):
            return "tpu"
        return "cpu"


def environment() -> dict[str, Any]:
    """Versions and devices (what a reader needs to compare the figures)."""
    info: dict[str, Any] = {"python": platform_lib.python_version(), "host": platform_lib.node()}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "numpy", "transformers"):
        try:
            module = __import__(name, fromlist=["__version__"])
            info[name] = getattr(module, "__version__", "?")
        except Exception as err:  # noqa: BLE001
            info[name] = f"missing ({type(err).__name__})"
    import importlib.util

    found = importlib.util.find_spec("tensorflow") is not None
    info["tensorflow"] = "installed" if found else "not installed"
    try:
        import jax

        devices = jax.devices()
        info["devices"] = [d.device_kind for d in devices]
        info["device_kind"] = devices[0].device_kind
        info["platform"] = devices[0].platform
    except Exception as err:  # noqa: BLE001
        info["device_error"] = f"{type(err).__name__}: {err}"
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if smi.returncode == 0:
            info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def test_command(junit: str, collect_only: bool = False, keyword: str = "") -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", TEST_MARKER]
    cmd += ["-k", keyword] if keyword else []
    cmd += ["--collect-only"] if collect_only else [f"--junitxml={junit}", "-rs"]
    return cmd + [os.path.join(REPO, f) for f in TEST_FILES]


def default_compile_cache() -> str:
    """``$BERTJAX_COMPILE_CACHE``, else JAX's own ``$JAX_COMPILATION_CACHE_DIR``, else a folder in
    the temporary folder (kept while the machine is)."""
    env = os.environ
    return (
        env.get("BERTJAX_COMPILE_CACHE")
        or env.get("JAX_COMPILATION_CACHE_DIR")
        or os.path.join(tempfile.gettempdir(), "bertjax-compile-cache")
    )


def cache_entries(path: str) -> int:
    return len(os.listdir(path)) if path and os.path.isdir(path) else 0


def test_env(platform: str, compile_cache: str = "") -> dict[str, str]:
    """The tests' environment: the platform's devices (conftest defaults to 8 simulated CPUs) and,
    with ``compile_cache``, JAX's persistent compilation cache there (every program kept)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if compile_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = compile_cache
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PLATFORMS"] = {"gpu": "cuda", "tpu": "tpu"}.get(platform, "cpu")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    if platform != "cpu":  # the accelerator's own compiler settings, not the CPU suite's defaults
        env.setdefault("XLA_FLAGS", "")
    return env


def parse_junit(path: str) -> dict[str, Any]:
    """Counts and one entry per test case from pytest's JUnit XML."""
    result: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "cases": []}
    if not os.path.exists(path):
        return result
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag, label in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome = label
                message = (node.get("message") or node.text or "")[:600]
                break
        result[outcome] += 1
        entry = {"test": name, "outcome": outcome, "seconds": float(case.get("time", 0) or 0)}
        if message:
            entry["message"] = message
        result["cases"].append(entry)
    return result


def run_tests(
    report: Report, platform: str, reserve_s: float, keyword: str = "", compile_cache: str = ""
) -> None:
    """The accelerator tests in one pytest process, killed if it would eat the benchmarks' time."""
    junit = os.path.join(report.out, "tests.xml")
    limit = report.left() - reserve_s
    if limit < 30:
        report.skip("accelerator tests", f"only {limit:.0f} s left for them")
        return
    t0 = time.time()
    try:
        proc = subprocess.run(
            test_command(junit, keyword=keyword),
            cwd=REPO,
            env=test_env(platform, compile_cache),
            capture_output=True,
            text=True,
            timeout=limit,
        )
        tail = (proc.stdout + proc.stderr)[-4000:]
        timed_out = False
    except subprocess.TimeoutExpired as err:
        tail = (
            (err.stdout or b"").decode(errors="replace")
            if isinstance(err.stdout, bytes)
            else (err.stdout or "")
        )[-4000:]
        timed_out = True
    tests = parse_junit(junit)
    tests["seconds"] = round(time.time() - t0, 1)
    tests["output_tail"] = tail
    if timed_out:
        tests["timed_out_after_s"] = round(limit)
        report.skip("the rest of the accelerator tests", f"pytest passed its {limit:.0f} s")
    report.data["tests"] = tests
    report.write()


def bench_command(args: list[str], steps: int, warmup: int, profile_dir: str = "") -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "bertjax.tools.bench",
        *COMMON,
        *args,
        f"--steps={steps}",
        f"--warmup={warmup}",
    ]
    cmd += [f"--profile_dir={profile_dir}"] if profile_dir else []
    # The peers run under this python (on the accelerator image: its torch and transformers).
    return cmd + ([f"--peers_python={sys.executable}"] if "--peers" in args else [])


def _bench_summary(name: str, result: dict) -> dict[str, Any]:
    keep = (
        "platform",
        "device_kind",
        "num_params",
        "compile_s",
        "step_time_s",
        "step_time_s_min",
        "step_time_s_pipelined",
        "sequences_per_sec",
        "tokens_per_sec",
        "train_flops_per_step",
        "xla_flops_per_step",
        "tflops_per_sec_per_device",
        "peak_tflops",
        "peak_source",
        "mfu",
        "memory",
        "final_loss",
    )
    out = {k: result.get(k) for k in keep}
    out["config"] = {
        k: result.get("config", {}).get(k)
        for k in ("preset", "batch", "seq", "dtype", "attention_impl", "dropout", "remat")
    }
    if result.get("profile"):
        out["profile_top_ops"] = result["profile"].get("top_ops")
    model = result.get("model_config") or {}
    out["resolved"] = {k: model.get(k) for k in ("attention_impl", "dropout_impl")}
    for key in ("est_step_seconds", "est_mfu", "measured_over_estimate"):  # the roofline's
        if key in result:
            out[key] = result[key]
    if result.get("peers"):
        out["peers"] = {
            name: {
                k: peer.get(k)
                for k in (
                    "tokens_per_sec",
                    "step_time_s",
                    "bertjax_speedup",
                    "torch_compile",
                    "error",
                    "skipped",
                )
                if k in peer
            }
            for name, peer in result["peers"].items()
        }
    if name in ANCHORS:
        out["anchor"] = ANCHORS[name]
    return out


def run_benchmarks(
    report: Report,
    platform: str,
    plan: list,
    steps: int,
    warmup: int,
    only: list[str],
    profiled: tuple[str, ...] = (),
    compile_cache: str = "",
) -> None:
    for name, args, needs_s in plan:
        if only and name not in only:
            continue
        left = report.left()
        if left < needs_s:
            report.skip(f"benchmark {name}", f"{left:.0f} s left, it needs about {needs_s} s")
            continue
        profile = os.path.join(tempfile.gettempdir(), "bertjax-profile", name)
        profile = profile if name in profiled else ""
        cmd = bench_command(args, steps, warmup, profile)
        entry: dict[str, Any] = {"name": name, "args": args + COMMON[:2]}
        t0 = time.time()
        try:
            proc = subprocess.run(
                cmd,
                cwd=REPO,
                env=test_env(platform, compile_cache),
                capture_output=True,
                text=True,
                timeout=left - 5,
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode == 0 and lines:
                entry.update(_bench_summary(name, json.loads(lines[-1])))
            else:
                entry["error"] = (proc.stderr or proc.stdout)[-3000:]
        except subprocess.TimeoutExpired:
            entry["error"] = f"killed after {left - 5:.0f} s (the budget)"
        entry["wall_s"] = round(time.time() - t0, 1)
        report.data["benchmarks"].append(entry)
        report.write()


def dry_run(report: Report) -> int:
    """What can be checked without an accelerator: the selection, the plan, the schema."""
    proc = subprocess.run(
        test_command("", collect_only=True),
        cwd=REPO,
        env=test_env("cpu"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    selected = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    report.data["tests"]["selected"] = selected
    problems = []
    if proc.returncode != 0 or not selected:
        problems.append(f"the test selection failed: {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    from bertjax.tools import bench

    for name, args, _ in PLAN:
        parsed = bench.parse_args([*COMMON, *args])
        config = bench.bench_config(parsed)
        report.data["benchmarks"].append(
            {
                "name": name,
                "args": args + COMMON[:2],
                "planned": True,
                "model": dict(config.model),
                "batch": parsed.batch,
                "seq": parsed.seq,
            }
        )
    report.skip("running the tests and benchmarks", "dry run (no accelerator needed)")
    problems += check_schema(
        json.loads(open(os.path.join(report.out, "device_report.json")).read())
    )
    report.data["dry_run_problems"] = problems
    report.write()
    for problem in problems:
        print(f"device-check: {problem}", file=sys.stderr)
    print(
        f"device-check (dry): {len(selected)} tests selected, {len(PLAN)} benchmarks planned, "
        f"report in {report.out}" + (" - PROBLEMS" if problems else "")
    )
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bertjax device-check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="device_report", help="directory for the report")
    p.add_argument("--budget_s", type=float, default=480.0, help="seconds for everything")
    p.add_argument("--started", type=float, default=0.0, help="epoch seconds the budget began")
    p.add_argument("--dry", action="store_true", help="check the plan only (CPU, CI)")
    p.add_argument("--tests_s", type=float, default=150.0, help="at most this long for tests")
    p.add_argument("--steps", type=int, default=5, help="timed steps per benchmark")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated benchmark names")
    p.add_argument("--skip_tests", action="store_true")
    p.add_argument("--tests_k", default="", help="pytest -k expression within the selection")
    p.add_argument("--plan", default="full", choices=("full", "tiny"), help="tiny: self-test")
    p.add_argument("--allow_cpu", action="store_true", help="run (not dry) on CPU: self-test")
    p.add_argument("--profile", default="", help="benchmarks to trace (top device ops reported)")
    p.add_argument(
        "--compile_cache",
        default=default_compile_cache(),
        help="JAX's persistent compilation cache for every test and benchmark ('' = none)",
    )
    args = p.parse_args(argv)
    if args.dry:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    plan = PLAN if args.plan == "full" else TINY_PLAN
    started = args.started or time.time()
    report = Report(args.out, args.budget_s, started, args.dry)
    platform = "cpu" if args.dry else detect_platform()
    report.data["plan"] = [name for name, _, _ in plan]
    report.data["environment"] = environment()
    report.data["platform"] = report.data["environment"].get("platform", platform)
    report.data["device_kind"] = report.data["environment"].get("device_kind", "?")
    report.write()
    if args.dry:
        return dry_run(report)
    if platform == "cpu" and not args.allow_cpu:
        report.skip("everything", "no GPU or TPU here: run with --dry, or on an accelerator")
        print("device-check: no accelerator (JAX backend is cpu); use --dry", file=sys.stderr)
        return 2
    cache = args.compile_cache
    if cache:
        os.makedirs(cache, exist_ok=True)
        report.data["compile_cache"] = {"dir": cache, "entries_before": cache_entries(cache)}
    if args.skip_tests:
        report.skip("accelerator tests", "--skip_tests")
    else:
        # the tests get what is left beyond the first two benchmarks, and at most --tests_s
        reserve = max(report.left() - args.tests_s, sum(n for _, _, n in plan[:2]))
        run_tests(report, platform, reserve, args.tests_k, cache)
    only = [s for s in args.only.split(",") if s]
    profiled = tuple(s for s in args.profile.split(",") if s)
    run_benchmarks(report, platform, plan, args.steps, args.warmup, only, profiled, cache)
    if cache:
        report.data["compile_cache"]["entries_after"] = cache_entries(cache)
        report.write()
    failed = report.data["tests"].get("failed", 0) + report.data["tests"].get("errors", 0)
    errors = [b["name"] for b in report.data["benchmarks"] if "error" in b]
    print(to_markdown(report.data))
    print(f"device-check: report in {args.out}; {failed} test failures; benchmark errors: {errors}")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())

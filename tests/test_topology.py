"""TPU slices by name (bertjax.topology), and the train step compiled for a simulated slice
(`bertjax compile --topology`, `bertjax plan`). The compiling tests need libtpu (the test extra)."""

import json
import re
import subprocess
import sys

import pytest
from helpers import HBM_REFUSAL, TINY, compile_report, needs_libtpu

from bertjax import topology

REPO = __import__("pathlib").Path(__file__).resolve().parent.parent
# The tiny step at 1 x 32 tokens per chip on a 4-chip slice: a TPU compile is mostly a fixed cost,
# but fewer tokens take less of it (what is checked of these steps does not depend on their size).
TINY_32 = {**TINY, "train.global_batch_size": 4, "data.max_seq_length": 32}


@pytest.mark.parametrize(
    "name,libtpu_name,chips",
    [
        ("v5p-8", "v5p:2x2x1", 4),
        ("v5p-16", "v5p:2x2x2", 8),
        ("v5p-64", "v5p:2x4x4", 32),
        ("v5p-1024", "v5p:8x8x8", 512),
        ("v4-32", "v4:2x2x4", 16),
        ("v4-128", "v4:4x4x4", 64),
        ("v5e-16", "v5e:4x4", 16),
        ("v5e-32", "v5e:4x8", 32),
        ("v5e-256", "v5e:16x16", 256),
        ("v6e-64", "v6e:8x8", 64),
        ("v5p:4x4x8", "v5p:4x4x8", 128),
        ("v5litepod:2x2", "v5e:2x2", 4),
    ],
)
def test_slice_names_follow_cloud_tpu(name, libtpu_name, chips):
    s = topology.parse(name)
    assert (s.libtpu_name, s.chips) == (libtpu_name, chips)
    assert topology.parse(name, num_slices=2).chips == 2 * chips


@pytest.mark.parametrize(
    "name,match",
    [
        ("v5p", "expected an accelerator type"),
        ("v9-8", "unknown TPU generation"),
        ("v5p:2x2", "3 dimensions"),
        ("v5p-7", "counts TensorCores, 2 per chip"),
        ("v5e-12", "12 chips, not a power of two"),
        ("v5p-6", "6 TensorCores are 3 chips, not a power of two"),
    ],
)
def test_bad_slice_names_are_one_line_naming_the_flag(name, match):
    with pytest.raises(ValueError, match=f"^--topology={re.escape(name)}: .*{match}") as err:
        topology.parse(name)
    assert "\n" not in str(err.value)


def test_device_kinds_map_to_generations():
    assert topology.generation_of_kind("TPU v5").name == "v5p"
    assert topology.generation_of_kind("TPU v5 lite").name == "v5e"
    assert topology.generation_of_kind("TPU v6 lite").hbm_bytes == 32 * topology.GIB
    assert topology.generation_of_kind("cpu") is None


@needs_libtpu
@pytest.mark.slow
def test_compile_for_a_simulated_slice_reports_consistent_estimates(tmp_path):
    report = compile_report(tmp_path, "configs/bert_base.py", TINY_32)
    assert report["devices"] == 4 and report["device_kind"] == "TPU v5"
    assert report["hbm_capacity_bytes"] == 95 * topology.GIB
    assert report["fits"] is True and 0 < report["hbm_bytes_per_device"] < 2 * topology.GIB
    est, mfu = report["est_step_seconds"], report["est_mfu"]
    assert est > 0 and 0 < mfu < 1
    peak = 459e12
    assert mfu == pytest.approx(report["analytic_flops_per_step"] / (est * 4 * peak), rel=1e-9)
    assert report["est_tokens_per_sec_per_chip"] == pytest.approx(4 * 32 / est / 4, rel=1e-9)
    assert "estimates" in report["note"]
    assert report["largest_arrays"][0]["path"].endswith("word_embeddings/embedding")
    assert not (tmp_path / "data").exists()  # no corpus, nothing prepared


REFUSED_COMPILE = """
import json, os, sys
import jax
from bertjax import compile as aot, topology
from configs import bert_base

def refusing(message):
    def refuse(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(message)
    return refuse

config = aot.with_overrides(bert_base.get_config(), json.loads(sys.argv[1]))
environment = dict(os.environ)
devices = topology.devices(topology.parse("v5e:2x2"))
assert dict(os.environ) == environment, "topology.devices changed the environment"
aot.compile_step = refusing(sys.argv[2])
report = aot.compile_train_step(config, None, devices=devices)  # compiling for a slice: no workdir
print(json.dumps(report))
print(aot.format_report(report).splitlines()[1])
aot.compile_step = refusing("INTERNAL: something else")
try:
    aot.compile_train_step(config, sys.argv[3], devices=devices)
except jax.errors.JaxRuntimeError as err:
    print(f"raised {type(err).__name__}: {err}")
"""


@needs_libtpu
def test_a_step_larger_than_hbm_is_a_report_that_it_does_not_fit(tmp_path):
    # The TPU compiler refuses a program larger than HBM with an error; compile (and plan) report
    # it as not fitting, with the compiler's sentence and the bytes it asked for, not a traceback.
    # Any other compiler error raises (with a workdir). Both in one process: one start of libtpu.
    out = subprocess.run(
        [sys.executable, "-c", REFUSED_COMPILE, json.dumps(TINY), HBM_REFUSAL, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report_line, human, other = out.stdout.strip().splitlines()[-3:]
    report = json.loads(report_line)
    assert report["fits"] is False and report["hbm_bytes_per_device"] is None
    assert report["compile_error"] == HBM_REFUSAL
    assert report["temp_size_in_bytes"] == int(108.21 * 2**30)
    assert report["hbm_bytes_at_least"] > report["temp_size_in_bytes"]
    assert report["hbm_capacity_bytes"] == 16 * topology.GIB and report["devices"] == 4
    assert human.startswith("memory      DOES NOT FIT: RESOURCE_EXHAUSTED")
    assert other.startswith("raised JaxRuntimeError: ") and "something else" in other


@needs_libtpu
@pytest.mark.slow
def test_a_v5e_step_gets_a_time_without_sliced_prefetches(tmp_path):
    # One BERT-small layer (hidden 512, FFN 2048) in bf16 on a v5e-4: the compiler slices operands
    # into VMEM, and the cost model gives those ConcatBitcast calls no cost (-1 s each); the
    # report's time comes from the same step compiled without them, and says so. 1 x 32 tokens per
    # chip still slice (about 35 CPU-s, BERT-base at 2 x 64 took 100); at hidden 256, or an FFN of
    # 512, nothing is sliced and the first compile gets a time.
    overrides = {**TINY_32, "model.preset": "small"}
    report = compile_report(
        tmp_path,
        "configs/bert_base.py",
        {**overrides, "model.dtype": "bfloat16"},
        slice_name="v5e:2x2",
    )
    assert report["device_kind"] == "TPU v5 lite" and "est_unavailable" not in report
    assert 0 < report["est_step_seconds"] < 0.1 and 0 < report["est_mfu"] < 1
    assert "no sliced prefetches" in report["est_from"]


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("jobs", [1, 2])  # 2: candidates compiled in worker processes
def test_plan_ranks_the_candidates_that_fit(tmp_path, jobs):
    from bertjax import plan
    from configs import bert_base

    config = plan.with_overrides(bert_base.get_config(), TINY_32)
    base = dict(zip(plan.SEARCH_KEYS, (4, 1, 1, "none", 1, False, "xla")))
    fsdp = {**base, "mesh.data": 1, "mesh.fsdp": 4}
    slower = {**base, "train.grad_accum_steps": 4, "model.remat": "full"}
    # Two candidates to rank in worker processes; in process, one (each compile is about 9 CPU-s).
    fitting = [base, fsdp] if jobs == 2 else [base]
    result = plan.run(
        config, str(tmp_path), topology.parse("v5p:2x2x1"), search=[*fitting, slower], jobs=jobs
    )
    # `slower` is never compiled: the same mesh fit with less recomputation and no micro-batches.
    assert (result["searched"], result["of"], len(result["ranked"])) == (
        len(fitting),
        len(fitting) + 1,
        len(fitting),
    )
    times = [r["est_step_seconds"] for r in result["ranked"]]
    assert times == sorted(times) and all(t > 0 for t in times)
    assert {plan.overrides_flags(r["overrides"]) for r in result["ranked"]} == {
        plan.overrides_flags(c) for c in fitting
    }
    assert result["best_overrides"] == plan.overrides_flags(result["ranked"][0]["overrides"])
    assert "best: --config.mesh.data=" in plan.format_table(result)


def test_plan_skips_what_an_outcome_decides():
    from bertjax import plan

    base = dict(zip(plan.SEARCH_KEYS, (4, 1, 1, "none", 1, False, "xla")))
    more_remat = {**base, "model.remat": "dots"}
    more_accum = {**base, "train.grad_accum_steps": 2}
    fsdp = {**base, "mesh.data": 1, "mesh.fsdp": 4}
    assert plan.dominated(base, {"fits": True}, more_remat)
    assert plan.dominated(base, {"fits": True}, more_accum)
    assert not plan.dominated(base, {"fits": True}, fsdp)
    # Out of memory with fsdp over 4: plain data parallelism (less sharding) cannot fit either,
    # but more recomputation or more micro-batches might.
    assert plan.dominated(fsdp, {"fits": False}, base)
    assert not plan.dominated(fsdp, {"fits": False}, {**fsdp, "model.remat": "dots"})
    assert not plan.dominated(fsdp, {"error": "RESOURCE_EXHAUSTED: hbm"}, more_accum)
    assert not plan.dominated(fsdp, {"error": "some other failure"}, base)


def test_plan_candidates_skip_layouts_that_cannot_fit():
    from bertjax import plan
    from configs import bert_large

    config = plan.with_overrides(bert_large.get_config(), {"data.vocab": "", "data.phases": ()})
    roomy = plan.candidates(config, 16, 95 * topology.GIB)
    tight = plan.candidates(config, 16, 2 * topology.GIB)
    assert len(tight) < len(roomy)
    # 340M parameters x 16 bytes do not fit 2 GiB unsharded: every survivor shards the state.
    assert all(c["mesh.fsdp"] * c["mesh.tensor"] >= 4 for c in tight)
    first = roomy[0]
    assert (first["mesh.data"], first["model.remat"], first["train.grad_accum_steps"]) == (
        16,
        "none",
        1,
    )


def test_plan_table_ranks_in_search_order_where_the_chip_has_no_estimate():
    from bertjax import plan

    base = dict(zip(plan.SEARCH_KEYS, (1, 16, 1, "none", 1, False, "xla")))
    row = {"overrides": base, "fits": True, "hbm_bytes_per_device": 12 * topology.GIB}
    row["est_unavailable"] = "XLA's cost model gave no step time for TPU v5 lite"
    result = {"topology": "v5e-16", "phase": 1, "searched": 1, "of": 9, "seconds": 60.0}
    refused = {"overrides": {**base, "model.remat": "dots"}, "fits": False}  # compile's OOM report
    refused.update(hbm_bytes_per_device=None, hbm_bytes_at_least=20 * topology.GIB)
    refused.update(hbm_capacity_bytes=16 * topology.GIB, compile_error=HBM_REFUSAL)
    result.update(ranked=[row], rejected=[refused], best_overrides=plan.overrides_flags(base))
    table = plan.format_table(result)
    assert "no step time for this chip" in table and "12.00" in table
    assert "needs at least 20.00 GiB per device, 16.00 GiB available (the TPU compiler" in table
    assert table.splitlines()[-1] == "best: " + plan.overrides_flags(base)


def test_plan_offers_splash_only_where_training_would_use_it():
    """With attention dropout the trainer's attention is the explicit path whatever
    attention_impl says: plan must not offer splash as if it differed."""
    from bertjax import plan
    from configs import bert_large

    base = {"data.vocab": "", "data.phases": (), "data.max_seq_length": 512}
    with_dropout = plan.with_overrides(bert_large.get_config(), base)  # the preset's 0.1
    assert {c["model.attention_impl"] for c in plan.candidates(with_dropout, 16)} == {"xla"}
    without = plan.with_overrides(with_dropout, {"model.attention_dropout": 0.0})
    assert {c["model.attention_impl"] for c in plan.candidates(without, 16)} == {"xla", "splash"}

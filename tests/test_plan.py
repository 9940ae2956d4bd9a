"""What `bertjax plan` tells its user: a line per compiled candidate while it searches, each
rejected candidate's memory against the chip's, and why nothing fits (an error, so the command exits
non-zero). The slice and its compiles are scripted here (no libtpu, no compile): what the search
does with their outcomes is the subject; tests/test_topology.py compiles for real."""

import json

import pytest
from helpers import HBM_REFUSAL, TINY

from bertjax import compile as aot
from bertjax import plan, topology

GIB = topology.GIB
BASE = dict(zip(plan.SEARCH_KEYS, (4, 1, 1, "none", 1, False, "xla")))
REMAT = {**BASE, "model.remat": "full"}  # not decided by BASE running out of memory
FSDP = {**BASE, "mesh.data": 1, "mesh.fsdp": 4}


class _Device:
    """A compile-only v5e device as plan sees it (no runtime memory stats)."""

    platform = "tpu"
    device_kind = "TPU v5 lite"

    def memory_stats(self):
        return None


def _report(config) -> dict:
    """compile_train_step's report for a candidate: remat=none runs out of memory the way the TPU
    compiler refuses it (a lower bound of 650 GiB); any other candidate fits in 3 GiB."""
    if config.model.remat == "none":
        return {
            "fits": False,
            "hbm_bytes_per_device": None,
            "hbm_bytes_at_least": 650 * GIB,
            "hbm_capacity_bytes": 16 * GIB,
            "compile_error": HBM_REFUSAL,
        }
    return {
        "fits": True,
        "hbm_bytes_per_device": 3 * GIB,
        "hbm_capacity_bytes": 16 * GIB,
        "est_step_seconds": 0.012,
        "est_mfu": 0.4,
        "est_tokens_per_sec_per_chip": 1e5,
    }


@pytest.fixture
def scripted(monkeypatch):
    """plan.run's compiles answered by ``_report``; the workdirs they were given are recorded."""
    workdirs = []

    def compile_train_step(config, workdir, task=None, *, devices, phase_index):
        workdirs.append(workdir)
        return _report(config)

    monkeypatch.setattr(topology, "devices", lambda s: [_Device()] * s.chips)
    monkeypatch.setattr(aot, "compile_train_step", compile_train_step)
    return workdirs


@pytest.fixture(scope="module")
def config():
    from configs import bert_base

    return plan.with_overrides(bert_base.get_config(), TINY)


def search(config, candidates, **kwargs):
    lines = []
    kwargs.setdefault("progress", lines.append)
    result = plan.run(config, None, topology.parse("v5e:2x2"), search=candidates, **kwargs)
    return result, lines


def test_plan_says_what_each_candidate_gave_while_it_searches(config, scripted, capsys):
    result, lines = search(config, [BASE, REMAT])
    assert scripted == [None, None]  # no workdir: compiling for a slice needs none
    assert lines[0].startswith("plan: compiling up to 2 of 2 candidates for v5e:2x2")
    refused, fits = lines[1:]
    assert refused.startswith(f"plan: candidate 1/2 {plan.layout(BASE)}: does not fit: needs at")
    assert "650.00 GiB per device, 16.00 GiB available" in refused
    assert fits.startswith(f"plan: candidate 2/2 {plan.layout(REMAT)}: fits, 3.00 GiB per device")
    assert "of 16.00, est. 12.0 ms a step [0 s of 1800 s]" in fits
    # by default the lines go to stderr: `plan --json` prints one JSON object on stdout
    plan.run(config, None, topology.parse("v5e:2x2"), search=[REMAT])
    out, err = capsys.readouterr()
    assert out == "" and "plan: candidate 1/1" in err


def test_a_rejected_candidate_shows_needed_against_available_memory(config, scripted):
    result, _ = search(config, [BASE, REMAT])
    (rejected,) = json.loads(json.dumps(result))["rejected"]
    assert (rejected["hbm_bytes_at_least"], rejected["hbm_capacity_bytes"]) == (650 * GIB, 16 * GIB)
    assert rejected["compile_error"] == HBM_REFUSAL
    assert rejected["reason"] == (
        "needs at least 650.00 GiB per device, 16.00 GiB available (the TPU compiler refused it)"
    )
    assert f"{plan.overrides_flags(BASE)}: {rejected['reason']}" in plan.format_table(result)
    plan.require_fit(result)  # REMAT fits: no error


@pytest.mark.parametrize(
    "flag,value",
    [("budget_seconds", 0), ("budget_seconds", -5.0), ("max_candidates", 0), ("jobs", 0)],
)
def test_a_limit_that_allows_no_compile_is_an_error_naming_its_flag(config, scripted, flag, value):
    with pytest.raises(ValueError, match=f"^--{flag}={value}: must be positive$"):
        search(config, [BASE], **{flag: value})
    assert scripted == []


def test_a_budget_spent_before_the_first_compile_says_so(config, scripted):
    result, lines = search(config, [BASE, REMAT], budget_seconds=1e-9)
    assert (result["searched"], result["not_tried"]) == (0, 2)
    assert result["stopped_by"] == "budget_seconds"
    said = "no candidate compiled: the --budget_seconds=1e-09 s budget ran out before the first one"
    assert plan.format_table(result).splitlines()[-1] == said
    assert lines[-1] == "plan: stopped at --budget_seconds: 2 candidate(s) not tried"
    with pytest.raises(plan.NothingFits, match=f"^plan for v5e:2x2 .*: {said}$"):
        plan.require_fit(result)


def test_nothing_fitting_is_an_error_that_says_why(config, scripted):
    # NothingFits is a ValueError: the CLI prints it as one line and exits 1
    result, _ = search(config, [FSDP, REMAT], max_candidates=1)
    assert (result["searched"], result["not_tried"], result["best_overrides"]) == (1, 1, None)
    with pytest.raises(ValueError, match="--max_candidates=1 stopped the search with 1 not tried"):
        plan.require_fit(result)
    # FSDP's refusal decides BASE (less sharding, same remat): all compiled or decided, no limit
    result, _ = search(config, [FSDP, BASE])
    assert (result["searched"], result["stopped_by"]) == (1, None)
    with pytest.raises(plan.NothingFits, match=r"no candidate fits \(all 1 compiled\): a larger"):
        plan.require_fit(result)
    empty, _ = search(config, [])  # every layout's lower bound exceeds HBM
    assert "no candidate can fit" in plan.format_table(empty)


def test_compile_without_a_slice_or_workdir_is_an_error(config):
    with pytest.raises(ValueError, match="^compile without --topology needs --workdir"):
        aot.compile_train_step(config, None)


def test_the_compile_report_says_where_its_estimate_and_memory_come_from():
    report = {
        "devices": 4,
        "device_kind": "TPU v5 lite",
        "mesh": {"data": 4},
        "phase": 0,
        "global_batch_size": 16,
        "hbm_bytes_per_device": 22967296,
        "argument_size_in_bytes": 1543168,
        "temp_size_in_bytes": 11225088,
        "generated_code_size_in_bytes": 10193920,
        "hbm_capacity_bytes": 16 * GIB,
        "fits": True,
        "hbm_headroom_bytes": 16 * GIB - 22967296,
        "est_step_seconds": 0.001,
        "est_tokens_per_sec_per_chip": 5e5,
        "est_mfu": 0.1,
        "compile_seconds": 25.9,
        "est_from": "the same step with no sliced prefetches (the cost model gives them no "
        "cost on this chip)",
        "largest_arrays": [],
    }
    lines = aot.format_report(report).splitlines()
    assert (
        "            (arguments 1.5 MiB, temporaries 10.7 MiB, code 9.7 MiB: as the compiler lays "
        "the step out for TPU v5 lite; another chip's differs)"
    ) in lines
    assert (
        f"            (est. from {report['est_from']}; the memory is the step's as it runs)"
        in lines
    )


def test_the_plan_command_fails_when_nothing_fits_and_needs_no_workdir(
    config, scripted, monkeypatch, capsys
):
    """`bertjax plan` (its command function, without --workdir): the table on stdout, then
    NothingFits, a ValueError, which the CLI prints as one line with exit status 1."""
    import types

    from bertjax import cli

    monkeypatch.setattr(aot, "compile_train_step", lambda *a, **k: _report_refused())
    flags = types.SimpleNamespace(
        topology="v5e-4",
        num_slices=1,
        phase=0,
        budget_seconds=60.0,
        max_candidates=2,
        jobs=1,
        json=False,
    )
    with pytest.raises(plan.NothingFits):
        cli._aot_command("plan", config, None, flags)
    assert "raise --max_candidates to try them" in capsys.readouterr().out  # the table's verdict


def _report_refused() -> dict:
    return {
        "fits": False,
        "hbm_bytes_per_device": None,
        "hbm_bytes_at_least": 650 * GIB,
        "hbm_capacity_bytes": 16 * GIB,
        "compile_error": HBM_REFUSAL,
    }

"""`bertjax pretrain|finetune|compile|plan --help`: what the command does, its own flags with their
help, how to set config keys; not absl's or JAX's flags (those are `--helpfull`'s)."""

import pytest
from absl import flags

from bertjax import cli

OWN = {
    "pretrain": ["config", "workdir", "dry_run", "verbose"],
    "finetune": ["config", "workdir", "dry_run", "verbose"],
    "compile": ["config", "workdir", "verbose", "topology", "num_slices", "phase", "json"],
    "plan": [
        *("config", "workdir", "verbose", "topology", "num_slices", "phase", "json"),
        *("budget_seconds", "max_candidates", "jobs"),
    ],
}
PLAN_ONLY = ("budget_seconds", "max_candidates", "jobs")


@pytest.mark.parametrize("command", sorted(OWN))
@pytest.mark.parametrize("asked", ["--help", "-h"])
def test_help_lists_the_commands_own_flags(command, asked, capsys):
    defined_before = set(flags.FLAGS)
    with pytest.raises(SystemExit) as exited:
        cli.main(["bertjax", command, "--config=configs/demo.py", asked])
    out = capsys.readouterr().out
    assert exited.value.code == 0, out
    workdir = "--workdir=DIR" if command in ("pretrain", "finetune") else "[--workdir=DIR]"
    assert out.startswith(f"usage: bertjax {command} --config=FILE {workdir}"), out
    about = cli.COMMANDS[command][1]
    assert f"\n{about[0].upper()}{about[1:]}.\n" in out  # the one-line description
    assert "--config.KEY=VALUE" in out and "--config.train.steps=" in out
    lines = {line.split()[0].split("=")[0]: line for line in out.splitlines() if line[:4] == "  --"}
    for name in OWN[command]:  # each flag, with its help text on its line
        usage = f"--[no]{name}" if name in ("dry_run", "verbose", "json") else f"--{name}"
        assert usage in lines and len(lines[usage].split()) >= 3, (usage, out)
    assert "--distributed.coordinator=" in out  # multi-process runs
    for name in {n for names in OWN.values() for n in names} - set(OWN[command]):
        assert f"--{name}" not in out and f"--[no]{name}" not in out, name
    for internal in ("--verbosity", "--logtostderr", "--jax_", "--flagfile", "Try --helpfull"):
        assert internal not in out, internal
    new_flags = set(flags.FLAGS) - defined_before  # help defines none of its flags in the process
    assert not new_flags & {"config", "workdir", "verbose"}, new_flags


def test_compile_refuses_the_flags_only_plan_reads():
    fv = flags.FlagValues()
    cli.define_command_flags("compile", fv)
    assert not set(PLAN_ONLY) & set(fv) and "dry_run" not in fv
    plan = flags.FlagValues()
    cli.define_command_flags("plan", plan)
    assert set(PLAN_ONLY) <= set(plan)


@pytest.mark.parametrize(
    "module,argv,expected",
    [
        (
            "score",
            ["retrieval", "--chekpoint=x", "--data=y"],
            'unknown --chekpoint (did you mean "--checkpoint"?)',
        ),
        (
            "embed",
            ["--ouput=x", "--input=y", "--checkpoint=z"],
            'unknown --ouput (did you mean "--output"?)',
        ),
        (
            "score",
            ["glue", "--taks=x", "--labels=y", "--predictions=z"],
            'unknown --taks (did you mean "--task"?)',
        ),
        ("mine", ["--corpus_fil=x"], 'did you mean "--corpus'),
    ],
)
def test_tool_commands_name_the_option_meant(module, argv, expected, capsys):
    """embed, evaluate and mine-negatives: a misspelt option is one line with the closest known
    option, whether argparse reports it unrecognized or a required option missing first."""
    import importlib

    main = importlib.import_module(f"bertjax.commands.{module}").main
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and expected in err[-1], err


@pytest.mark.parametrize(
    "command,argv,expected",
    [
        ("plot", ["{tmp}/none"], "{tmp}/none/metrics.jsonl: no metrics file"),
        ("evaluate-mlm", ["--checkpoint={tmp}/none", "--data={tmp}/none"], "{tmp}/none"),
        ("vocab", ["--input={tmp}/none.txt", "--output={tmp}/v.txt"], "{tmp}/none.txt"),
    ],
)
def test_every_command_prefixes_its_errors_as_argparse_does(command, argv, expected, tmp_path):
    """`bertjax COMMAND: error: ...` for a command's bad input (as argparse's usage errors and
    embed's and evaluate's input errors are), never `bertjax: error:`."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["bertjax", command, *(a.format(tmp=tmp_path) for a in argv)])
    message = str(exited.value.code)
    assert message.startswith(f"bertjax {command}: error: "), message
    assert expected.format(tmp=tmp_path) in message and "\n" not in message


def test_argparse_usage_errors_have_the_same_prefix(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["bertjax", "plot", "--nonsense"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("bertjax plot: error: ")

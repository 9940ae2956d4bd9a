"""Issue 15, item 9: the commands the README and the launch scripts' help texts show run as written.

Every ``--config.KEY=`` they mention exists; the README's ``launch/tpu_vm.sh`` block runs (with
``--dry-run``, its ``export`` line as the environment); the README's multi-process example runs
end to end on CPU (slow: the demo's corpus, vocabulary and data, then 2 steps) with its logs under
the run's workdir.
"""

import importlib
import os
import pathlib
import re
import shlex
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = [
    REPO / "README.md",
    REPO / "launch" / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "launch").glob("*.sh")),
    REPO / "launch" / "slurm_gpu.sbatch",
]


def _config_keys() -> set[str]:
    """Every key path of every config file's get_config()."""
    keys: set[str] = set()

    def walk(node, prefix):
        for key, value in node.items():
            keys.add(prefix + key)
            if hasattr(value, "items"):
                walk(value, f"{prefix}{key}.")

    for path in sorted((REPO / "configs").glob("*.py")):
        if path.stem != "__init__":
            walk(importlib.import_module(f"configs.{path.stem}").get_config(), "")
    return keys


def test_every_config_key_in_the_docs_and_help_texts_exists():
    known = _config_keys()
    unknown = [
        f"{path.relative_to(REPO)}: --config.{key}"
        for path in DOCS
        for key in re.findall(r"--config\.([A-Za-z_][\w.]*?)=", path.read_text())
        if key not in known
    ]
    assert not unknown, unknown


def _readme_block(first_line: str) -> list[str]:
    """The lines of the README code block that contains ``first_line``, comments removed."""
    text = (REPO / "README.md").read_text()
    start = text.index(first_line)
    block = text[start : text.index("```", start)]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_tpu_vm_block_runs_as_written_in_dry_run(tmp_path):
    export, *commands = _readme_block("export TPU_NAME=")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    env.update(word.split("=", 1) for word in shlex.split(export)[1:])
    assert commands and all(c.startswith("launch/tpu_vm.sh ") for c in commands)
    for command in commands:
        proc = subprocess.run(
            ["bash", *shlex.split(command), "--dry-run"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, f"{command}: {proc.stderr}"
        if " run " in f"{command} ":
            assert "CONFIG=configs/bert_base.py" in proc.stdout
            assert "WORKDIR=gs://my-bucket/runs/base" in proc.stdout


def test_tpu_vm_refuses_an_unknown_key_value_argument():
    env = {"PATH": os.environ["PATH"], "TPU_NAME": "t", "ZONE": "z"}
    proc = subprocess.run(
        ["bash", "launch/tpu_vm.sh", "run", "CONFG=configs/bert_base.py", "--dry-run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "unexpected argument 'CONFG=" in proc.stderr


@pytest.mark.slow
def test_readme_local_sh_example_runs_with_logs_under_the_workdir(tmp_path):
    (line,) = [
        x.strip(" `.")
        for x in (REPO / "README.md").read_text().splitlines()
        if x.strip().startswith("`launch/local.sh")
    ]
    workdir = tmp_path / "mh"
    words = [w.replace("/tmp/mh", str(workdir)) for w in shlex.split(line)]
    env = {k: v for k, v in os.environ.items() if k not in ("LOG_DIR", "XLA_FLAGS")}
    proc = subprocess.run(
        ["bash", *words, "--config.train.steps=2"],  # the example, 2 steps
        cwd=tmp_path,  # no ./workdir/logs here afterwards
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (tmp_path / "workdir").exists()
    for k in range(2):
        log = (workdir / "logs" / f"process_{k}.log").read_text()
        assert "Traceback" not in log, log[-3000:]
    assert "[train] step 2" in (workdir / "logs" / "process_0.log").read_text()

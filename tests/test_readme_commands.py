"""The commands the README and the launch scripts' help texts show run as written.

Every ``--config.KEY=`` they mention exists; the README's ``launch/tpu_vm.sh`` block runs (with
``--dry-run``, its ``export`` line as the environment); the README's multi-process example runs
end to end on CPU (slow: the demo's corpus, vocabulary and data, then 2 steps) with its logs under
the run's workdir. Every `make ...` / `.venv/bin/bertjax ...` command of the README runs as written
offline on CPU (tiny overrides where it would take long; slow), or is listed with why it cannot.
"""

import importlib
import json
import math
import os
import pathlib
import re
import shlex
import shutil
import subprocess

import pytest
from helpers import xla_flags

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
def test_readme_local_sh_example_runs_with_logs_under_the_workdir(tmp_path, readme_run):
    (line,) = [
        x.strip(" `.")
        for x in (REPO / "README.md").read_text().splitlines()
        if x.strip().startswith("`launch/local.sh")
    ]
    workdir = tmp_path / "mh"
    # The demo's vocabulary as `make pretrain` trained it (the same corpus, so the same file; 8
    # CPU-s saved): process 0 still builds the corpus and the records while process 1 waits.
    (workdir / "data").mkdir(parents=True)
    shutil.copy(readme_run / "workdirs" / "demo" / "data" / "vocab.txt", workdir / "data")
    words = [w.replace("/tmp/mh", str(workdir)) for w in shlex.split(line)]
    # Run from an empty folder (to see that nothing lands in ./workdir): the repo's paths made absolute.
    words = [str(REPO / w) if w.startswith("launch/") else w for w in words]
    words = [w.replace("--config=configs/", f"--config={REPO}/configs/") for w in words]
    env = {k: v for k, v in os.environ.items() if k != "LOG_DIR"}
    env["XLA_FLAGS"] = xla_flags()  # no device count: local.sh sets it
    proc = subprocess.run(
        # 2 steps, 1 eval batch, 1 layer (nothing reads this run's hidden states)
        ["bash", *words, *TINY_STEPS.split(), "--config.model.num_layers=1"],
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
    log = (workdir / "logs" / "process_0.log").read_text()
    assert "[train] step 2" in log and "preparing pretraining data" in log
    assert "training a wordpiece vocabulary" not in log


# ---- the README's `make ...` and `.venv/bin/bertjax ...` commands ----------------------------------
# Each one is run as written (placeholders such as path/to/bert made real, /tmp/ moved under the
# test's folder) or skipped here with the reason. `make` gets `-o .venv/bin/.installed`: the venv is
# installed already and the offline test machine cannot run `pip install`.
SKIPPED = {  # a command is skipped when it is, or starts with, a key (then a space)
    "make test": "the test suite itself (checked with make -n)",
    "make install": "pip install needs the network (checked with make -n)",
    "make test-beam": "installs Beam (the network); make test runs it after the suite",
    "make bench": "a benchmark of minutes on real sizes; tests/test_bench.py runs it small",
    "make device-check": "needs a GPU or TPU (DRY=1: tests/test_device_check.py runs the dry mode "
    "and a CPU self-test of the real path)",
    "make device-wheels": "pip download needs the network",
    "make pretrain CONFIG=configs/bert_base.py WORKDIR=gs://my-bucket/runs/base": "gs://",
    "make pretrain CONFIG=configs/bert_base.py": "BERT-base on a Wikipedia corpus: hours",
    "make pretrain CONFIG=configs/bert_demo.py": "the demo again with the BERT recipe: minutes",
    ".venv/bin/bertjax convert --from=tf": "needs Google's original TF checkpoint (a download)",
    ".venv/bin/bertjax compile --config=... --workdir=...": "placeholders only; see --dry_run run",
    "python -m venv beam-env": "pip install of the beam extra needs the network",
    "beam-env/bin/python -m bertjax.cli prepare --runner=DirectRunner": "needs that beam-env",
    "beam-env/bin/python -m bertjax.cli prepare --runner=DataflowRunner": "Google Cloud Dataflow",
}
# Commands that fail today, each with the error it gives (the test fails once one is fixed, so that
# it moves to the commands that must pass).
KNOWN_BROKEN: dict[str, str] = {}
# configs/demo.py's ModernBERT with 3 of its 6 layers: layer 0 global, layers 1-2 local (a window),
# the two kinds it has, and the 4 hidden states extract-features reads by default (embeddings and
# 3 layers); the compiles of every command on its checkpoint shrink with it.
TINY_LAYERS = "--config.model.num_layers=3"
TINY_STEPS = "--config.train.steps=2 --config.optimizer.warmup_steps=1 --config.train.eval_steps=1"
TINY_PRETRAIN = f"{TINY_STEPS} {TINY_LAYERS}"
TINY_FT = (
    "--config.train.steps=2 --config.train.global_batch_size=8 --config.data.max_seq_length=32"
    " --config.data.eval_batch_size=8"
)


def _readme_commands() -> list[str]:
    """Every `make ...` / `.venv/bin/bertjax ...` command of the README: code-block lines (with
    their continuations, without comments) and inline code."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(re.split(r"\s#\s", line)[0].split())
            if line.startswith(("make ", ".venv/bin/bertjax ", "python -m venv ", "beam-env/")):
                commands.append(line)
    for inline in re.findall(r"`((?:make|\.venv/bin/bertjax|bertjax) [^`]*)`", text):
        if not inline.startswith("bertjax ") or "--config=" in inline:
            commands.append(" ".join(inline.split()))
    return list(dict.fromkeys(commands))


def _skip_reason(command: str) -> str | None:
    command = command.replace("bertjax compile", ".venv/bin/bertjax compile")
    for prefix, reason in SKIPPED.items():
        if command == prefix or command.startswith(prefix + " "):
            return reason
    return None


def test_every_readme_command_is_run_or_skipped_with_a_reason():
    run = [c for c in _readme_commands() if _skip_reason(c) is None]
    assert set(run) == set(_RUNS), sorted(set(run) ^ set(_RUNS))
    env = {**os.environ, "MAKEFLAGS": ""}
    for target, expect in (("test", "pytest -q"), ("install JAX_EXTRA=cpu", '-e ".[cpu]"')):
        out = subprocess.run(
            ["make", "-n", "-B", *target.split()],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert expect in out, out


_RUNS = [  # in order: later commands use what earlier ones wrote
    "make pretrain",
    ".venv/bin/bertjax plot workdirs/demo",
    ".venv/bin/bertjax pretrain --config=configs/demo.py --workdir=/tmp/demo "
    "--config.train.steps=2000 --config.train.global_batch_size=64 --config.mesh.data=1 "
    "--config.mesh.fsdp=-1",
    ".venv/bin/bertjax vocab --input='corpus/*.txt' --output=vocab.txt --vocab_size=30522 "
    "--kind=wordpiece",
    ".venv/bin/bertjax prepare --input='corpus/*.txt' --format=text --vocab=vocab.txt "
    "--output_dir=data/seq128 --max_seq_length=128 --max_predictions_per_seq=20 --dupe_factor=5",
    'make finetune TASK=glue/sst2 INIT=path/to/bert ARGS="--config.data_dir=../shared/data/glue"',
    ".venv/bin/bertjax finetune --config=configs/glue.py --config.task=glue/mrpc "
    "--config.init_checkpoint=path/to/bert --config.data_dir=path/to/glue --workdir=/tmp/mrpc "
    '--config.seeds="(1,2,3)"',
    ".venv/bin/bertjax finetune --config=configs/squad.py --config.task=squad/v2.0 "
    "--config.init_checkpoint=path/to/bert --config.data_dir=path/to/squad --workdir=/tmp/squad2",
    ".venv/bin/bertjax evaluate squad --dataset=dev-v1.1.json "
    "--predictions=/tmp/squad/squad/predictions.json",
    ".venv/bin/bertjax convert --from=bertjax workdirs/demo --to=hf /tmp/demo-hf",
    ".venv/bin/bertjax convert workdirs/demo --to=sentence-transformers --pooling=cls /tmp/demo-st",
    ".venv/bin/bertjax convert --from=hf path/to/hf-bert --to=bertjax /tmp/bert-bertjax",
    ".venv/bin/bertjax extract-features --checkpoint=/tmp/bert-hf --input=sentences.txt "
    "--output=feats.jsonl",
    ".venv/bin/bertjax evaluate-mlm --checkpoint=workdirs/demo --data=workdirs/demo/data",
]


def _as_run(command: str, here: pathlib.Path) -> str:
    """The command with its placeholders made real and tiny overrides where it would be long."""
    command = command.replace("/tmp/", f"{here}/tmp/").replace("path/to/bert", "workdirs/demo")
    command = command.replace("path/to/glue", "glue").replace("path/to/squad", "squad")
    command = command.replace("path/to/hf-bert", f"{here}/tmp/demo-hf")
    command = command.replace(f"{here}/tmp/bert-hf", f"{here}/tmp/demo-hf")  # made just before
    if command.startswith("make "):
        command = "make -o .venv/bin/.installed " + command[5:]
    if command.endswith("make -o .venv/bin/.installed pretrain"):  # 2 steps, 1 eval batch
        command += f' ARGS="{TINY_PRETRAIN}"'
    if " finetune " in command:  # 2 steps of batch 8 on tiny files
        command = command.replace('ARGS="', f'ARGS="{TINY_FT} ')
        command += "" if "ARGS=" in command else f" {TINY_FT}"
        if "squad.py" in command:
            command += " --config.data.max_query_length=16 --config.data.doc_stride=16"
    if "--workdir=" in command and "demo.py" in command:  # compile only, on the demo's data
        command = command.replace(f"{here}/tmp/demo", "workdirs/demo")
        command += f" {TINY_LAYERS} --dry_run"
    if " prepare " in command:
        command += " --num_shards=2"  # small: one shard per core
    if " evaluate-mlm " in command:
        command += " --max_batches=2"
    return command


def _write_task_data(here: pathlib.Path) -> None:
    """Tiny SST-2, MRPC and SQuAD v2.0 files in the official layouts, a corpus, sentences, and a
    SQuAD v1.1 dev set with predictions for `evaluate squad`."""
    words = "the film was good bad and a plot it is not very fun dull".split()
    rng = __import__("random").Random(0)

    def sentence(n=6):
        return " ".join(rng.choice(words) for _ in range(n))

    for folder in (here.parent / "shared" / "data" / "glue", here / "glue"):
        (folder / "SST-2").mkdir(parents=True, exist_ok=True)
        for split, n in (("train", 16), ("dev", 8)):
            rows = "".join(f"{sentence()}\t{i % 2}\n" for i in range(n))
            (folder / "SST-2" / f"{split}.tsv").write_text("sentence\tlabel\n" + rows)
        (folder / "SST-2" / "test.tsv").write_text("index\tsentence\n0\tgood film\n")
    (here / "glue" / "MRPC").mkdir()
    head = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    for split, n in (("train", 16), ("dev", 8)):
        rows = "".join(f"{i % 2}\t{i}\t{i}\t{sentence()}\t{sentence()}\n" for i in range(n))
        (here / "glue" / "MRPC" / f"{split}.tsv").write_text("\ufeff" + head + rows)
    test_head = "index\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    (here / "glue" / "MRPC" / "test.tsv").write_text(test_head + "0\t1\t2\tgood\tbad film\n")
    context = "the film was good and the plot was not dull ."
    qas = [
        {
            "id": f"q{i}",
            "question": "was the film good ?",
            "is_impossible": False,
            "answers": [{"text": "good", "answer_start": context.index("good")}],
        }
        for i in range(4)
    ]
    squad = {
        "version": "v2.0",
        "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}],
    }
    (here / "squad").mkdir()
    for name in ("train-v2.0.json", "dev-v2.0.json"):
        (here / "squad" / name).write_text(json.dumps(squad))
    for qa in qas:
        del qa["is_impossible"]
    (here / "dev-v1.1.json").write_text(json.dumps({**squad, "version": "1.1"}))
    (here / "tmp" / "squad" / "squad").mkdir(parents=True)
    predictions = {qa["id"]: "good" for qa in qas}
    (here / "tmp" / "squad" / "squad" / "predictions.json").write_text(json.dumps(predictions))
    (here / "corpus").mkdir()
    for k in range(2):
        docs = ["\n".join(sentence(8) + " ." for _ in range(5)) for _ in range(40)]
        (here / "corpus" / f"c{k}.txt").write_text("\n\n".join(docs) + "\n")
    (here / "sentences.txt").write_text("the film was good .\nit is not dull .\n")


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory) -> pathlib.Path:
    """The folder every `make ...` / `.venv/bin/bertjax ...` command of the README ran in, in
    order (later commands use what earlier ones wrote); each must succeed."""
    here = tmp_path_factory.mktemp("readme") / "work"
    here.mkdir()
    for name in (".venv", "configs", "Makefile"):
        (here / name).symlink_to(REPO / name)
    _write_task_data(here)
    env = {k: v for k, v in os.environ.items() if k != "MAKEFLAGS"}
    env["XLA_FLAGS"] = xla_flags()  # the host's one device, as a user's machine has
    for command in _RUNS:
        run = _as_run(command, here)
        proc = subprocess.run(
            ["bash", "-c", run], cwd=here, env=env, capture_output=True, text=True, timeout=900
        )
        if command in KNOWN_BROKEN:
            assert proc.returncode != 0 and KNOWN_BROKEN[command] in proc.stderr, (run, proc.stderr)
            continue
        assert proc.returncode == 0, f"{run}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return here


@pytest.mark.slow
def test_readme_make_and_bertjax_commands_run_as_written(readme_run):
    here = readme_run
    # `make pretrain` end to end: stdlib corpus -> WordPiece vocab -> TFRecords -> steps -> eval.
    demo = here / "workdirs" / "demo"
    assert (demo / "curves.png").exists() and (demo / "data" / "metadata.json").exists()
    assert len((demo / "data" / "vocab.txt").read_text().splitlines()) == 8000
    rows = [json.loads(line) for line in (demo / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"][-1] == 2
    last_eval = [r for r in rows if r["split"] == "eval"][-1]
    assert last_eval["step"] == 2 and math.isfinite(last_eval["mlm_loss"]), last_eval
    assert json.loads((here / "tmp" / "mrpc" / "eval_results.json").read_text())["best_seed"]
    assert (here / "workdirs" / "finetune" / "glue_sst2" / "eval_results.json").exists()
    assert (here / "tmp" / "squad2" / "eval_results.json").exists()
    assert (here / "vocab.txt").exists() and (here / "data/seq128/metadata.json").exists()
    assert (here / "tmp" / "demo-hf" / "config.json").exists()
    assert (here / "tmp" / "demo-st" / "modules.json").exists()
    assert len((here / "feats.jsonl").read_text().splitlines()) == 2

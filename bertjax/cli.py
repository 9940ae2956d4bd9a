"""The ``bertjax`` command: a thin dispatcher to library functions.

``bertjax pretrain --config=configs/demo.py --workdir=DIR [--config.key=value ...]`` and
``bertjax finetune ...`` parse absl flags with ml_collections config files (locked: an unknown
``--config.`` key is an error); the other subcommands own their argparse flags. ``main`` is the
only place that configures the process (console, logging, ``process_hooks``): the library does not.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import sys
import textwrap

from bertjax import console, fs, host_memory, process_hooks

COMMANDS = {
    "pretrain": (
        "bertjax.cli:train_command",
        "pretrain an encoder (masked LM, plus NSP where the config asks) from a config",
    ),
    "finetune": (
        "bertjax.cli:train_command",
        "fine-tune from a config: GLUE/SQuAD/NER/SWAG, retrievers, ColBERT, rerankers",
    ),
    "compile": (
        "bertjax.cli:train_command",
        "compile the train step (--topology: for a TPU slice or GPUs); memory, est. step time, MFU",
    ),
    "plan": (
        "bertjax.cli:train_command",
        "search mesh, remat, batch and kernels for a TPU slice; rank what fits",
    ),
    "prepare": ("bertjax.data.prepare:main", "turn a corpus into pretraining TFRecords"),
    "vocab": ("bertjax.data.vocab:main", "train a WordPiece or SentencePiece vocabulary"),
    "plot": ("bertjax.commands.plot:main", "write a PNG of a run's metric curves"),
    "evaluate": (
        "bertjax.commands.score:main",
        "official SQuAD / GLUE metrics; retrieval metrics of a run or a model (--rerank)",
    ),
    "evaluate-mlm": (
        "bertjax.commands.mlm_eval:main",
        "held-out MLM loss of any checkpoint on records",
    ),
    "convert": (
        "bertjax.convert:main",
        "convert checkpoints: HF, TF, bertjax, sentence-transformers, PyLate",
    ),
    "extract-features": (
        "bertjax.commands.extract_features:main",
        "per-token vectors of chosen layers",
    ),
    "embed": ("bertjax.commands.embed:main", "embed a corpus into resumable shards of vectors"),
    "mine-negatives": (
        "bertjax.commands.mine:main",
        "a model's top-ranked non-positive documents as retrieval training rows",
    ),
    "bench": ("bertjax.tools.bench:main", "measure step time, tokens/s, MFU, memory, input speed"),
}


def _usage() -> str:
    lines = ["usage: bertjax COMMAND [flags]", "", "commands:"]
    lines += [f"  {name:<17} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`bertjax COMMAND --help` lists a command's flags."]
    return "\n".join(lines)


# Commands that run the model forward over many batches and nothing else: XLA's freed host
# memory kept for the next batch (bertjax.host_memory) by default. embed: a third less CPU per
# batch; evaluate retrieval on Cranfield: 109 s -> 63 s (system time 43 s -> 0.9 s).
RETAIN_MEMORY_BY_DEFAULT = ("embed", "evaluate", "mine-negatives")


def setup_logging(stream=None) -> None:
    """Human-readable progress lines on stdout (or ``stream``) from the ``bertjax`` logger
    (process 0 only)."""
    logger = logging.getLogger("bertjax")
    if logger.handlers:
        return
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _tf_errors() -> tuple[type[Exception], ...]:
    """TensorFlow's errors, one line each like bertjax's own, where the command imported it (the
    input of a pretraining run, a TFDS download, a TF checkpoint); () where it did not."""
    tf = sys.modules.get("tensorflow")
    return (tf.errors.OpError,) if tf is not None and hasattr(tf, "errors") else ()


def _config_file(argv: list[str]) -> str | None:
    """The file of ``--config=FILE[:ARG]`` (None without the flag)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1].split(":")[0]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1].split(":")[0]
    return None


def _add_config_root_to_path(argv: list[str]) -> None:
    """Config files import their base as ``configs.base``: put the folder above configs/ on sys.path."""
    path = _config_file(argv)
    if path:
        root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        if root not in sys.path:
            sys.path.insert(0, root)


def _config_file_error(err: BaseException, path: str | None) -> str | None:
    """One line for a config file that does not load (None for other errors): a syntax error at
    its line, no ``get_config``, or the error ``get_config`` raised at the file's line
    (ml_collections hands that on as a whole traceback in the text)."""
    if isinstance(err, SyntaxError):
        return f"{err.filename}:{err.lineno}: invalid config file: {err.msg}"
    text = str(err)
    if isinstance(err, AttributeError) and "'get_config'" in text:
        return f"{path}: the config file defines no get_config()"
    if "Error whilst parsing config file" not in text or not path:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    where = f'File "{os.path.abspath(path)}", line '
    at = [line[len(where) :].split(",")[0] for line in lines if line.startswith(where)]
    return f"{path}{':' + at[-1] if at else ''}: get_config() failed: {lines[-1]}"


def _one_line(err: BaseException) -> str:
    """An exception as one line (whitespace and newlines collapsed)."""
    return " ".join(str(err).split()) or type(err).__name__


def error_prefix(command: str) -> str:
    """How every command's errors begin, as argparse's own do: ``bertjax COMMAND: error: ``."""
    return f"bertjax {command}: error: "


def _fail(err: BaseException, verbose: bool, command: str) -> None:
    """Exits with ``bertjax COMMAND: error: <one line>``; with --verbose re-raises (full
    traceback)."""
    if verbose:
        raise err
    sys.exit(error_prefix(command) + _one_line(err))


def _config_override_error(err: BaseException, args: list[str]) -> str:
    """ml_collections' error for a bad ``--config.`` key (a KeyError/AttributeError holding only
    the last name and a hint) as one line naming the whole key."""
    text = " ".join(str(err.args[0] if err.args else err).split())
    missing = re.search(r"[A-Za-z_]\w*", text)  # the first name in the message is the bad one
    keys = [a[2:].split("=", 1)[0] for a in args if a.startswith("--config.")]
    culprit = next((k for k in keys if missing and missing[0] in k.split(".")[1:]), None)
    if culprit is None:
        return f"bad --config override: {text}"
    from bertjax.tasks.finetuning import RENAMED_KEYS

    key = culprit.removeprefix("config.")
    if key in RENAMED_KEYS:
        return f"config key {key} was renamed {RENAMED_KEYS[key]} in bertjax 0.3: set {RENAMED_KEYS[key]}"
    hint = re.search(r'Did you mean "([^"]+)"', text)
    suggestion = f' (did you mean "{hint[1]}"?)' if hint else ""
    return f"unknown config key {culprit.removeprefix('config.')}{suggestion}"


# The flags of the config-driven commands: (name, kind, default, help, commands); kind "bool" is
# --[no]NAME. --config (a config file) comes first, defined by ml_collections.
_TRAIN, _AOT = ("pretrain", "finetune"), ("compile", "plan")
_ALL = _TRAIN + _AOT
_FLAGS = (
    ("workdir", "string", None, "run directory: checkpoints, metrics, data", _ALL),
    ("dry_run", "bool", False, "only compile the train step and print its memory", _TRAIN),
    ("verbose", "bool", False, "full tracebacks for errors (otherwise one line)", _ALL),
    (
        "topology",
        "string",
        None,
        "TPU slice or NVIDIA GPUs to compile for from any machine: v5p-8, v5e:4x4, h100, h100-8, "
        "h100-8x4 (4 nodes of 8)",
        _AOT,
    ),
    ("num_slices", "integer", 1, "slices of --topology (multi-slice)", _AOT),
    ("phase", "integer", 0, "which phase of data.phases to compile (0 = the first)", _AOT),
    ("json", "bool", False, "print one JSON object instead of a table", _AOT),
    ("budget_seconds", "float", 1800.0, "stop compiling candidates after this", ("plan",)),
    ("max_candidates", "integer", 24, "compile at most this many candidates", ("plan",)),
    ("jobs", "integer", 1, "candidates compiled at once (processes)", ("plan",)),
)
_VALUE_NAMES = {"config": "FILE[:ARG]", "workdir": "DIR", "topology": "SLICE"}
_EXAMPLES = {
    "pretrain": "bertjax pretrain --config=configs/demo.py --workdir=workdirs/demo "
    "--config.train.steps=1000",
    "finetune": "bertjax finetune --config=configs/glue.py --config.task=glue/mrpc \\\n"
    "    --config.init_checkpoint=path/to/model --config.data_dir=path/to/glue --workdir=/tmp/mrpc",
    "compile": "bertjax compile --config=configs/bert_base.py --topology=v5p-8",
    "plan": "bertjax plan --config=configs/bert_large.py --topology=v5e-16",
}


def define_command_flags(command: str, flag_values):
    """Defines the flags of ``command`` (pretrain, finetune, compile, plan) in the absl
    ``flag_values``; returns the ``--config`` flag holder."""
    from absl import flags
    from ml_collections import config_flags

    from bertjax import distributed

    config_flag = config_flags.DEFINE_config_file(
        "config",
        None,
        "experiment config file (configs/*.py)",
        flag_values=flag_values,
        lock_config=True,
    )
    define = {
        "string": flags.DEFINE_string,
        "bool": flags.DEFINE_bool,
        "integer": flags.DEFINE_integer,
        "float": flags.DEFINE_float,
    }
    for name, kind, default, help_, commands in _FLAGS:
        if command in commands:
            define[kind](name, default, help_, flag_values=flag_values)
    distributed.define_flags(flag_values)
    return config_flag


def _wants_help(argv: list[str]) -> bool:
    """Whether the command's own help is asked for (``--helpfull``: absl's list of every flag)."""
    return any(arg in ("-h", "--help", "-?", "--helpshort") for arg in argv)


def command_help(command: str) -> str:
    """``bertjax COMMAND --help``: what the command does, its flags and how to set config keys."""
    from absl import flags

    flag_values = flags.FlagValues()
    define_command_flags(command, flag_values)
    # compile and plan need no workdir for a --topology (compile without one: its error says so)
    required = {"config", *(("workdir",) if command in _TRAIN else ())}
    required |= {"topology"} if command == "plan" else set()
    workdir = "--workdir=DIR" if command in _TRAIN else "[--workdir=DIR]"
    lines = [
        f"usage: bertjax {command} --config=FILE {workdir} [--config.KEY=VALUE ...] [flags]",
        "",
        COMMANDS[command][1][0].upper() + COMMANDS[command][1][1:] + ".",
        "",
        "flags:",
    ]
    headed = set()
    for name in flag_values:
        flag = flag_values[name]
        if name.startswith("distributed.") and "distributed" not in headed:
            headed.add("distributed")
            lines += ["", "multi-process runs (unset: from the BERTJAX_* environment variables):"]
        value = _VALUE_NAMES.get(name) or {"int": "N", "float": "X"}.get(flag.flag_type(), "VALUE")
        usage = f"--[no]{name}" if flag.boolean else f"--{name}={value}"
        if name in required:
            help_ = f"{flag.help} (required)"
        elif flag.default is not None and flag.default is not False:
            help_ = f"{flag.help} (default: {str(flag.default).lower()})"
        else:
            help_ = flag.help
        text = textwrap.wrap(help_, 99 - 30)
        if len(usage) > 26:
            lines += [f"  {usage}", *(" " * 30 + t for t in text)]
        else:
            lines += [f"  {usage:<27} {text[0]}", *(" " * 30 + t for t in text[1:])]
    lines += [
        "",
        "config keys:",
        "  --config.KEY=VALUE sets one key of the config file's get_config(), e.g.",
        "  --config.train.steps=1000 --config.optimizer.learning_rate=2e-4; a key the config",
        "  does not have is an error (configs/base.py lists every key with its default).",
        "",
        "example:",
        f"  {_EXAMPLES[command]}",
        "",
        "`--helpfull` also lists absl's and JAX's own flags.",
    ]
    return "\n".join(lines)


def _aot_command(command: str, config, workdir: str | None, FLAGS) -> None:
    """compile / plan / pretrain --dry_run: reports of the ahead-of-time compiled train step."""
    from bertjax import compile as aot
    from bertjax import topology

    topo = getattr(FLAGS, "topology", None)
    slice_ = topology.parse(topo, FLAGS.num_slices) if topo else None
    if command == "plan":
        from bertjax import plan

        if slice_ is None:
            raise ValueError("plan needs --topology (e.g. --topology=v5e-16)")
        result = plan.run(
            config,
            workdir,
            slice_,
            phase_index=FLAGS.phase,
            budget_seconds=FLAGS.budget_seconds,
            max_candidates=FLAGS.max_candidates,
            jobs=FLAGS.jobs,
        )
        print(json.dumps(result, indent=2) if FLAGS.json else plan.format_table(result))
        plan.require_fit(result)  # nothing fits: NothingFits (a ValueError), one line, exit 1
        return
    devices = topology.devices(slice_) if slice_ else None
    report = aot.compile_train_step(
        config, workdir, devices=devices, phase_index=getattr(FLAGS, "phase", 0)
    )
    if slice_:
        report["topology"] = slice_.describe()
    as_json = getattr(FLAGS, "json", False) or command != "compile"
    print(json.dumps(report, indent=2) if as_json else aot.format_report(report))


def train_command(argv: list[str], command: str) -> None:
    """pretrain / finetune / compile / plan: absl flags, a locked config file, then the library
    call."""
    # Imported here, not at the top: `bertjax --help` and the light commands stay instant.
    from absl import app, flags

    from bertjax import distributed

    _add_config_root_to_path(argv)
    config_flag = define_command_flags(command, flags.FLAGS)
    verbose = "--verbose" in argv or "--verbose=true" in argv
    config_file = _config_file(argv)
    if config_file and not os.path.isfile(config_file):
        _fail(FileNotFoundError(f"--config={config_file}: no such config file"), verbose, command)

    def parse(args: list[str]) -> list[str]:
        try:
            return flags.FLAGS(args)
        except (flags.Error, SyntaxError, AttributeError, KeyError, TypeError, ValueError) as err:
            if verbose:
                raise
            message = _config_file_error(err, config_file)
            if message is None and isinstance(err, flags.Error):
                message = _one_line(err)
            sys.exit(error_prefix(command) + (message or _config_override_error(err, args)))

    flags.mark_flags_as_required(["config"] if command in _AOT else ["config", "workdir"])

    def run(_):
        from bertjax.preemption import CtrlCSaves

        with CtrlCSaves() as ctrl_c:  # Ctrl-C saves a checkpoint like SIGTERM; twice: exit now
            try:
                body(ctrl_c)
            except KeyboardInterrupt:
                if flags.FLAGS.verbose:
                    raise
                print(
                    f"bertjax {command}: interrupted (Ctrl-C): exited without saving",
                    file=sys.stderr,
                )
                sys.exit(130)

    def body(ctrl_c):
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every step at INFO
        # --json (and plan, whose output is JSON or a table): stdout holds the report alone.
        reports = command == "plan" or getattr(flags.FLAGS, "json", False)
        setup_logging(sys.stderr if command in _AOT and reports else None)
        try:
            distributed.initialize_from_flags()
        except distributed.DistributedStartupError as err:
            sys.exit(error_prefix(command) + str(err))
        from bertjax import metrics_logging, train
        from bertjax.preemption import PreemptionRequested
        from bertjax.workdir_lock import WorkdirLockedError

        config, workdir = config_flag.value, flags.FLAGS.workdir
        try:
            if command == "finetune" and config.task == "pretrain":
                raise ValueError("finetune needs --config.task=<a fine-tuning task>")
            if command in ("compile", "plan") or flags.FLAGS.dry_run:
                _aot_command(command, config, workdir, flags.FLAGS)
                return
            if command == "finetune":  # every seed of config.train.seeds, then their summary
                from bertjax import multiseed

                result = multiseed.run(config, workdir)
            else:
                result = train.train_and_evaluate(config, workdir)
        except PreemptionRequested as stopped:
            if ctrl_c.pressed:  # one line; rerunning the same command resumes
                print(
                    f"bertjax {command}: interrupted (Ctrl-C): {stopped}; the same command resumes",
                    file=sys.stderr,
                )
                sys.exit(130)
            logging.getLogger("bertjax").warning("%s", stopped)
            sys.exit(0)
        except (
            ValueError,
            OSError,
            FloatingPointError,
            WorkdirLockedError,
            *_tf_errors(),
        ) as err:
            _fail(err, flags.FLAGS.verbose, command)
        logging.getLogger("bertjax").info("%s", metrics_logging.summary(result))

    app.run(run, argv=[f"bertjax {command}", *argv], flags_parser=parse)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up chatter
    # gs:// by one convention: Orbax's paths through gcsfs as bertjax.fs's (with its retries),
    # and with STORAGE_EMULATOR_HOST every client pointed at that emulator (a variable set wins).
    os.environ.update(fs.cloud_environment(os.environ))
    fs.register_gcs()
    if argv is None:  # the `bertjax` command (not a caller's in-process call)
        console.quiet_native_logs()  # CPU-only machine: TF/CUDA/TPU start-up noise off stderr
        if sys.argv[1:2] and sys.argv[1] in RETAIN_MEMORY_BY_DEFAULT:
            host_memory.apply_from_environment(default="1")
        elif os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
            host_memory.apply_from_environment()  # opt-in: XLA's per-step blocks kept for reuse
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(_usage())
        sys.exit(0 if len(argv) >= 2 else 2)
    command, rest = argv[1], argv[2:]
    if command not in COMMANDS:
        print(f"bertjax: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        sys.exit(2)
    target = COMMANDS[command][0]
    if target == "bertjax.cli:train_command" and _wants_help(rest):
        print(command_help(command))
        sys.exit(0)
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    # The command's process, not a library caller's: one-line errors stay one line (see
    # process_hooks). Installed for good; the interpreter's exit may still run abandoned work.
    process_hooks.install()
    # TensorFlow, once some work imports it (pretraining's tf.data; fine-tuning reads none and
    # starts about 7 CPU-seconds sooner without it), sees no GPU or TPU: their memory is JAX's. Its
    # import leaves out Keras, which bertjax does not use (2.3 of TF's 5.9 CPU-seconds).
    process_hooks.after_import(
        "tensorflow", process_hooks.tensorflow_on_the_cpu, process_hooks.keras_left_out
    )
    if target == "bertjax.cli:train_command":
        train_command(rest, command)
    else:
        setup_logging()
        verbose = "--verbose" in rest
        try:
            func([a for a in rest if a != "--verbose"])
        except (ValueError, OSError) as err:
            _fail(err, verbose, command)


if __name__ == "__main__":
    main()

"""Every gs:// code path in bertjax/ is named by a test against the GCS emulator, and stays so.

A function of bertjax/ holds a gs:// code path when its own body (not a nested function's) calls
``is_remote``, ``is_gcs`` or ``bucket`` (bertjax.fs's, or bertjax.data.formats's ``is_remote``),
compares a path with a ``"gs://"`` literal (``==``, ``in``, ``startswith``), or reaches
``bertjax.gcs`` (imports it or looks it up by name). Each such function is in ``RUN_BY`` under a
test that takes the emulator (the ``gcs_bucket`` or ``gcs_emulator`` fixture) and runs that path;
coverage measured which (README, "Buckets (gs://)"). A new one without a test fails here in one
line naming it, and so does a name left in the table once its function has no such path. Nothing
is imported: bertjax/ and the test files are parsed."""

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent / "bertjax"
EMULATOR_FIXTURES = {"gcs_bucket", "gcs_emulator"}

# A test against the emulator: the functions (module.qualified_name, bertjax. left off) whose
# gs:// path it runs.
RUN_BY = {
    "test_gcs.py::test_fs_round_trip_in_bucket": """atomic.atomic_open fs._gcs fs.open_file
        fs.exists fs.isdir fs.isfile fs.write_bytes fs.glob fs.remove fs.makedirs fs.size
        fs.rename fs.rmtree fs.list_files fs.download fs.upload fs.not_found_errors""",
    "test_gcs_faults.py::test_a_workdir_this_account_may_not_write_is_one_line_before_any_work": (
        "fs.bucket fs.io_errors fs.write_refusal fs.missing_folders"
    ),
    "test_gcs.py::test_a_workdir_in_a_bucket_that_does_not_exist_is_one_line_before_any_work": (
        "workdir_lock.WorkdirLock._create"
    ),
    "test_gcs_faults.py::test_a_bucket_that_stays_down_is_one_line_naming_the_object": (
        "fs.register_gcs checkpointing.Checkpointer.__init__ checkpointing.Checkpointer._save_failed"
    ),
    "test_gcs_faults.py::test_tensorstore_retries_a_checkpoints_arrays_by_the_same_policy": (
        "checkpointing._handler_registry gcs_arrays.ArrayWriter.serialize"
    ),
    "test_gcs.py::test_a_run_in_a_bucket_resumes_to_the_local_runs_losses": """
        checkpointing.Checkpointer._remove_retired data.pipeline.pretraining_dataset
        metrics_logging.MetricsWriter.__init__""",
    "test_gcs.py::test_records_in_a_bucket_are_read_in_blocks_not_per_record": (
        "data.records.read_records"
    ),
    "test_gcs.py::test_convert_and_load_pretrained_from_and_to_a_bucket": """
        convert.load_checkpoint convert.save_checkpoint convert.orbax_format._has_steps
        convert.orbax_format._steps_dir""",
    "test_gcs_commands.py::test_a_tokenizer_json_in_a_bucket_reads_as_the_local_one": (
        "convert.remote.stage_vocab"
    ),
    "test_gcs.py::test_a_corpus_glob_in_a_bucket_reads_as_the_local_files": (
        "data.corpus._expand_files data.formats.open_raw"
    ),
    "test_gcs_commands.py::test_vocab_from_a_bucket_into_the_bucket_and_its_tokenizers_read_there": (
        "data.formats.parquet_texts"
    ),
    "test_gcs_commands.py::test_prepare_reads_and_writes_a_bucket_as_local_files": (
        "data.prepare._resume_key data.prepare._work_dir"
    ),
    "test_gcs_commands.py::test_plot_of_a_run_in_a_bucket": "commands.plot.plot",
    "test_gcs_commands.py::test_embed_reads_a_parquet_corpus_in_a_bucket_as_the_local_files": (
        "retrieval.corpus_input._read_parquet"
    ),
    "test_gcs.py::test_compiling_with_a_vocabulary_in_a_bucket_asks_the_bucket_nothing": (
        "tasks.pretraining.PretrainingTask.for_compiling"
    ),
}

PREDICATES = {"is_remote", "is_gcs", "bucket"}


def _own_nodes(function: ast.AST):
    """The nodes of a function's body, not those of the functions and classes defined in it."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _gs_literal(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Constant) and isinstance(n.value, str) and "gs://" in n.value
        for n in ast.walk(node)
    )


def _is_gs_path(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        called = getattr(node.func, "attr", getattr(node.func, "id", None))
        if called in PREDICATES:
            return True
        if called in ("startswith", "endswith", "removeprefix") and _gs_literal(node):
            return True
        return any(a.value == "bertjax.gcs" for a in node.args if isinstance(a, ast.Constant))
    if isinstance(node, ast.Compare):
        return _gs_literal(node)
    if isinstance(node, ast.ImportFrom):
        return node.module == "bertjax" and any(a.name == "gcs" for a in node.names)
    return isinstance(node, ast.Import) and any(a.name == "bertjax.gcs" for a in node.names)


def _gs_functions() -> set[str]:
    found = set()

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and any(map(_is_gs_path, _own_nodes(child))):
                    found.add(name)
                visit(child, f"{name}.")

    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if module != "gcs":  # bertjax.gcs is all gs://: its functions are the client itself
            visit(ast.parse(path.read_text(encoding="utf-8")), f"{module}.")
    return found


def _emulator_tests() -> dict[str, set[str]]:
    """{"file.py::test_name": its fixtures} of the test functions that take the emulator."""
    tests = {}
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                tests[f"{path.name}::{node.name}"] = {a.arg for a in node.args.args}
    return {name: args for name, args in tests.items() if args & EMULATOR_FIXTURES}


def test_every_gs_code_path_is_named_by_an_emulator_test():
    named = {function: test for test, names in RUN_BY.items() for function in names.split()}
    assert sum(len(names.split()) for names in RUN_BY.values()) == len(named), "a name twice"
    emulator_tests = _emulator_tests()
    found = _gs_functions()
    problems = [
        f"bertjax.{f}: a gs:// code path that no test names (add its emulator test to RUN_BY in "
        "tests/test_gcs_paths.py)"
        for f in sorted(found - named.keys())
    ]
    problems += [
        f"bertjax.{f}: named in RUN_BY but has no gs:// code path (remove it)"
        for f in sorted(named.keys() - found)
    ]
    problems += [
        f"{test}: named in RUN_BY but no test of that name takes gcs_bucket or gcs_emulator"
        for test in sorted(RUN_BY.keys() - emulator_tests.keys())
    ]
    assert not problems, "\n".join(problems)

"""The package's shape: no import cycle, no reaching into another module's private names, files of a
readable size, and every registered architecture exporting the registry's contract."""

import ast
import pathlib
import re

import pytest

from bertjax import models

ROOT = pathlib.Path(__file__).resolve().parent.parent / "bertjax"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: pathlib.Path, modules) -> set[str]:
    """Modules of bertjax that ``path`` imports anywhere (function-local imports too): ``from a
    import b`` counts as importing the package ``a`` (its ``__init__`` runs) and ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found & set(modules)


def test_the_import_graph_has_no_cycle():
    modules = _modules()
    edges = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                pytest.fail(f"import cycle: {' -> '.join(stack[stack.index(n) :] + [n])}")
            if not state.get(n):
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(modules):
        if not state.get(m):
            visit(m, [m])


def test_no_module_reaches_into_another_modules_private_names():
    modules = _modules()
    short = {name.rsplit(".", 1)[-1] for name in modules}
    offenders = []
    for name, path in modules.items():
        text = path.read_text()
        for match in re.finditer(r"\b([a-z_]\w*)\.(_[a-zA-Z]\w*)\b", text):
            owner, attr = match.groups()
            if owner in short and owner != name.rsplit(".", 1)[-1] and not attr.startswith("__"):
                offenders.append(f"{path.name}: {owner}.{attr}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bertjax"):
                offenders += [f"{path.name}: {a.name}" for a in node.names if a.name[0] == "_"]
    assert not offenders, offenders


def test_files_stay_readable():
    sizes = {p.name: len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert max(sizes.values()) <= 520, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("name", sorted(models.ARCHITECTURES))
def test_every_architecture_exports_the_registry_contract(name):
    arch = models.ARCHITECTURES[name]
    for attr in (
        "Config", "Encoder", "MaskedLMHead", "ENCODER_NAME", "WORD_EMBEDDINGS",
        "POOLER_IN_PRETRAINING", "CHOICE_POOLS_FIRST_TOKEN", "get_preset", "preset_names",
        "forward_flops_per_sequence",
    ):  # fmt: skip
        assert hasattr(arch, attr), f"{name}.{attr}"
    assert arch.Config.architecture == name
    config = arch.get_preset(arch.preset_names()[0], vocab_size=100)
    assert models.config_from_dict(config.to_dict()) == config
    for key in ("hidden_size", "dropout_impl", "attention_impl", "max_position_embeddings"):
        assert key in models.experiment_keys(), key

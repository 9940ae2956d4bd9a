"""The package's shape: no import cycle, no reaching into another module's private names, every
registered architecture honouring the contract (``bertjax.models.contract``), and no code outside
``models/`` and ``convert/`` that compares an architecture's name."""

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


# The families built on the core (``bertjax.families`` names the module that registers each) and
# the modules above both, which may import them: the command line, its commands, the dev tools.
FAMILIES = ("bertjax.retrieval",)
ABOVE_THE_FAMILIES = ("bertjax.cli", "bertjax.commands", "bertjax.tools")
MODULE_NAME = re.compile(r"bertjax(\.\w+)+")


def _within(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_imports_point_down_from_the_commands_to_the_families_to_the_core():
    """No module of the core (models/, layers/, convert/, tasks/, pretrained.py, the trainer...)
    imports a family, not even inside a function, and none but ``bertjax/families.py`` (the one
    table of them) names a family's module to import it at run time: a family plugs into the
    core's registries instead. A family imports neither the commands nor the tools above it."""
    modules = _modules()
    offenders = []
    for name, path in sorted(modules.items()):
        if _within(name, ABOVE_THE_FAMILIES):
            continue
        above = _within(name, FAMILIES)
        for imported in sorted(_imports(path, modules)):
            if _within(imported, ABOVE_THE_FAMILIES if above else FAMILIES):
                offenders.append(f"{name} imports {imported}")
        if above or name == "bertjax.families":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            value = node.value if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and MODULE_NAME.fullmatch(value) and _within(value, FAMILIES):
                offenders.append(f"{name} names {value}")
    assert not offenders, offenders

    from bertjax import families

    assert families.FAMILIES and all(_within(m, FAMILIES) for m in families.FAMILIES)


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


@pytest.mark.parametrize("name", sorted(models.ARCHITECTURES))
def test_every_architecture_honours_the_contract(name):
    """The registry entry is an ``Architecture`` whose parts build and agree: a preset round-trips
    through its dict, its encoder runs under ``encoder_name`` with the word-embedding table where
    ``word_embeddings`` says, its MLM head maps hidden states to the vocabulary, its parameter
    count is the built model's, scanning builds exactly when ``can_scan``, and the keys every
    experiment may set exist."""
    import flax.linen as nn
    import jax
    import numpy as np
    from flax import traverse_util

    from bertjax.models.contract import Architecture
    from bertjax.models.heads import PreTrainingModel

    arch = models.ARCHITECTURES[name]
    assert isinstance(arch, Architecture) and arch.name == name
    assert models.architecture(name) is arch
    config = arch.get_preset(arch.preset_names()[0], vocab_size=100)
    assert config.architecture == name and isinstance(config, arch.config_class)
    assert models.config_from_dict(config.to_dict()) == config
    for key in ("hidden_size", "dropout_impl", "attention_impl", "max_position_embeddings"):
        assert key in models.experiment_keys(), key
    small = config.replace(num_layers=2, hidden_size=32, num_heads=2, intermediate_size=64)
    ids = np.ones((2, 8), np.int32)
    model = PreTrainingModel(small, nsp=arch.nsp)
    # Shapes and names are all the contract checks: traced (jax.eval_shape), not compiled or run.
    params = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.key(0), ids, ids, ids)))
    params = params["params"]
    assert arch.encoder_name in params and "predictions" in params
    table = params[arch.encoder_name]
    for key in arch.word_embeddings:
        table = table[key]
    assert table.shape == (100, 32)
    out = jax.eval_shape(lambda p: model.apply({"params": p}, ids, ids, ids), params)
    assert out["mlm_logits"].shape == (2, 8, 100)
    assert ("nsp_logits" in out) == arch.nsp

    def count(tree):
        return sum(np.size(v) for v in traverse_util.flatten_dict(tree).values())

    assert count(params) == small.num_params()  # the pretraining model
    assert count(params[arch.encoder_name]) == small.num_params(include_heads=False)
    assert arch.forward_flops_per_sequence(small, 8, 2) > 0
    if arch.token_head is not None:  # a per-token transform: [..., H] -> [..., H]
        x = np.ones((2, 8, 32), np.float32)
        head = arch.token_head(small)
        run = jax.eval_shape(lambda: head.apply(head.init(jax.random.key(0), x), x))
        assert run.shape == x.shape
    assert isinstance(arch.choice_pools_first_token, bool)
    assert isinstance(arch.pooler_in_pretraining, bool) and arch.hf_reference
    if arch.can_scan:
        scanned = PreTrainingModel(small.replace(scan_layers=True), nsp=arch.nsp)
        shapes = jax.eval_shape(lambda: scanned.init(jax.random.key(0), ids, ids, ids))
        flat = traverse_util.flatten_dict(nn.meta.unbox(shapes["params"]), sep="/")
        stacked = f"{arch.encoder_name}/{arch.scanned_layers[0]}/"
        assert any(p.startswith(stacked) for p in flat), stacked
    else:
        with pytest.raises(ValueError, match="scan_layers"):
            small.replace(scan_layers=True)


def test_no_architecture_name_outside_models_and_convert():
    """Only ``bertjax/models/`` and ``bertjax/convert/`` may compare an architecture's name: code
    elsewhere asks the contract (``bertjax.models.architecture(config)``)."""
    names = set(models.ARCHITECTURES)
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).parts[0] in ("models", "convert"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                texts = [ast.unparse(o) for o in operands]
                consts = [o.value for o in operands if isinstance(o, ast.Constant)]
                if any(c in names for c in consts) and any("arch" in t for t in texts):
                    offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Dict):
                keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
                if any(k in names for k in keys):
                    offenders.append(f"{path.name}:{node.lineno}: a table keyed by architecture")
    assert not offenders, offenders

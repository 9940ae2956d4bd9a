"""The architecture registry: ``model.architecture`` names one entry of ``ARCHITECTURES``.

Each architecture module (``bert``, ``modernbert``, ``eurobert``, ``nomicbert``, ``gte``) ends with
``ARCHITECTURE = Architecture(...)`` (``bertjax.models.contract``): its config and presets, encoder,
heads, parameter and FLOP counts, whether it scans, its pretraining heads. Adding an architecture is one
module here plus one line in ``ARCHITECTURES``; ``tests/test_layout.py`` checks the contract of every
entry. Task heads (``bertjax.models.heads``), the trainer, ``plan``, ``compile``, ``convert``,
``load_pretrained`` and the benchmarks reach an architecture only through :func:`architecture` /
:func:`config_from_dict`, and never compare its name.
"""

from __future__ import annotations

from typing import Any

from bertjax.models import bert, eurobert, gte, modernbert, nomicbert
from bertjax.models.contract import Architecture

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        bert.ARCHITECTURE,
        modernbert.ARCHITECTURE,
        eurobert.ARCHITECTURE,
        nomicbert.ARCHITECTURE,
        gte.ARCHITECTURE,
    )
}
DEFAULT = bert.ARCHITECTURE.name  # a config or checkpoint without ``architecture``


def architecture(name_or_config: Any) -> Architecture:
    """The architecture of a name or a model config; unknown names list the known ones."""
    name = getattr(name_or_config, "architecture", name_or_config) or DEFAULT
    if name not in ARCHITECTURES:
        raise ValueError(
            f"config key model.architecture={name!r} is not a known architecture; known: "
            f"{sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]


def get_preset(name: str, architecture_name: str = DEFAULT, **overrides: Any):
    """A preset of an architecture (BERT's ``base``, ``modernbert-base``, ...) with field overrides."""
    return architecture(architecture_name).get_preset(name, **overrides)


def preset_names(architecture_name: str = DEFAULT) -> list[str]:
    """The preset names of an architecture (default BERT's)."""
    return list(architecture(architecture_name).preset_names())


def config_from_dict(values: dict[str, Any]):
    """A model config from its ``to_dict()`` form (``architecture`` key; absent = BERT)."""
    return architecture(values.get("architecture", DEFAULT)).config_class.from_dict(values)


def config_fields(architecture_name: str) -> tuple[str, ...]:
    """Every field of an architecture's model config (what ``config.model`` may override)."""
    return architecture(architecture_name).config_fields()


def experiment_keys() -> dict[str, type]:
    """Every model field of every architecture with its type: the ``config.model`` keys an
    experiment config defines (as typed placeholders, so ``--config.model.X=`` works for all)."""
    keys: dict[str, type] = {}
    for arch in ARCHITECTURES.values():
        for name, kind in arch.field_types().items():
            keys.setdefault(name, kind)
    return keys


def model_overrides(model: Any, vocab_size: int) -> tuple[Architecture, dict[str, Any]]:
    """The architecture an experiment's ``config.model`` names (``architecture``, default bert)
    and the fields it sets (unset/None keys are left to the preset).

    ``vocab_size`` comes from the vocabulary; a ``model.vocab_size`` that disagrees is an error, and
    so is a field that the architecture does not have (one line naming the key).
    """
    arch = architecture(model.get("architecture") or DEFAULT)
    fields = set(arch.config_fields())
    overrides = {}
    for key, value in model.items():
        if key in ("architecture", "preset") or value is None:
            continue
        if key not in fields:
            raise ValueError(
                f"config key model.{key}={value!r} does not apply to architecture {arch.name!r}"
            )
        if key == "vocab_size":
            if value != vocab_size:
                raise ValueError(
                    f"config key model.vocab_size={value} disagrees with the vocabulary "
                    f"({vocab_size} tokens)"
                )
            continue
        overrides[key] = value
    return arch, overrides


def model_config_from(model: Any, vocab_size: int):
    """The model config an experiment's ``config.model`` describes: its architecture's ``preset``
    (default ``base``) with every field the experiment sets (see :func:`model_overrides`)."""
    arch, overrides = model_overrides(model, vocab_size)
    return arch.get_preset(model.get("preset") or "base", vocab_size=vocab_size, **overrides)


def forward_flops_per_sequence(config, seq_len: int, num_masked: int) -> float:
    """Forward FLOPs of one pretraining sequence of any architecture."""
    return architecture(config).forward_flops_per_sequence(config, seq_len, num_masked)

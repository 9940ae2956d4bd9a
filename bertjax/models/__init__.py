"""The architecture registry: ``model.architecture`` names one module of this package.

Each architecture module (``bert``, ...) holds everything the rest of bertjax needs to know about
its encoder, under the same names:

* ``Config`` - a frozen dataclass with ``architecture`` (class attribute), the fields every config
  shares (``vocab_size``, ``hidden_size``, ``num_layers``, ``num_heads``, ``intermediate_size``,
  ``hidden_act``, ``hidden_dropout``, ``attention_dropout``, ``dropout_impl``,
  ``max_position_embeddings``, ``initializer_range``, ``dtype``, ``param_dtype``,
  ``attention_impl``, ``remat``, ``scan_layers``), ``replace``, ``to_dict``/``from_dict`` and
  ``num_params``; ``get_preset(name, **overrides)`` and ``preset_names()``;
* ``Encoder(config, add_pooler)`` - the Flax encoder, called as ``(input_ids, token_type_ids,
  attention_mask, *, deterministic, output_hidden_states, position_ids, pack_ids, pool_positions)``
  and returning ``bertjax.layers.core.EncoderOutput``;
* ``MaskedLMHead(config)`` - ``(hidden [..., H], word_embeddings [V, H]) -> logits [..., V]``;
* ``ENCODER_NAME`` (the encoder's params subtree) and ``WORD_EMBEDDINGS`` (the path of the table
  tied to the MLM decoder inside it);
* ``POOLER_IN_PRETRAINING`` (the pooler is trained by pretraining: NSP) and
  ``CHOICE_POOLS_FIRST_TOKEN`` (multiple choice pools the first unpadded token, not position 0);
* ``forward_flops_per_sequence(config, seq_len, num_masked)``.

Task heads (``bertjax.models.heads``), the trainer, ``convert``, ``load_pretrained`` and the
benchmarks reach an architecture only through :func:`architecture` / :func:`config_from_dict`.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

from bertjax.models import bert, modernbert

ARCHITECTURES: dict[str, ModuleType] = {
    "bert": bert,
    "modernbert": modernbert,
}
DEFAULT = "bert"


def architecture(name_or_config: Any) -> ModuleType:
    """The architecture module for a name or a model config; unknown names list the known ones."""
    name = getattr(name_or_config, "architecture", name_or_config) or DEFAULT
    if name not in ARCHITECTURES:
        raise ValueError(
            f"config key model.architecture={name!r} is not a known architecture; known: "
            f"{sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]


def get_preset(name: str, architecture_name: str = DEFAULT, **overrides: Any):
    """A preset of an architecture (``base``, ``modernbert-base``, ...) with field overrides."""
    return architecture(architecture_name).get_preset(name, **overrides)


def config_from_dict(values: dict[str, Any]):
    """A model config from its ``to_dict()`` form (``architecture`` key; absent = BERT)."""
    return architecture(values.get("architecture", DEFAULT)).Config.from_dict(values)


def config_fields(architecture_name: str) -> tuple[str, ...]:
    """Every field of an architecture's model config (what ``config.model`` may override)."""
    return tuple(f.name for f in dataclasses.fields(architecture(architecture_name).Config))


_FIELD_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def experiment_keys() -> dict[str, type]:
    """Every model field of every architecture with its type: the ``config.model`` keys an
    experiment config defines (as typed placeholders, so ``--config.model.X=`` works for all)."""
    keys: dict[str, type] = {}
    for arch in ARCHITECTURES.values():
        for field in dataclasses.fields(arch.Config):
            keys.setdefault(field.name, _FIELD_TYPES[str(field.type).split(" ")[0]])
    return keys


def model_overrides(model: Any, vocab_size: int) -> tuple[ModuleType, dict[str, Any]]:
    """The architecture an experiment's ``config.model`` names (``architecture``, default bert)
    and the fields it sets (unset/None keys are left to the preset).

    ``vocab_size`` comes from the vocabulary; a ``model.vocab_size`` that disagrees is an error, and
    so is a field that the architecture does not have (one line naming the key).
    """
    arch = architecture(model.get("architecture") or DEFAULT)
    fields = set(config_fields(arch.Config.architecture))
    overrides = {}
    for key, value in model.items():
        if key in ("architecture", "preset") or value is None:
            continue
        if key not in fields:
            raise ValueError(
                f"config key model.{key}={value!r} does not apply to architecture "
                f"{arch.Config.architecture!r}"
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

"""The architecture contract: everything the rest of bertjax may know about one encoder family.

Each ``bertjax/models/<name>.py`` ends with ``ARCHITECTURE = Architecture(...)`` and the registry
(``bertjax.models.ARCHITECTURES``) holds one line per module. The trainer, the heads, ``plan``,
``compile``, the benchmarks, ``convert`` and ``load_pretrained`` ask this object; none of them
compares an architecture's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# A model config field's annotation -> the Python type an experiment's placeholder gets.
_FIELD_TYPES = {"int": int, "float": float, "str": str, "bool": bool}

# The fields every architecture's config has (what the trainer, heads and tools read).
SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "intermediate_size",
    "hidden_act",
    "hidden_dropout",
    "attention_dropout",
    "dropout_impl",
    "max_position_embeddings",
    "initializer_range",
    "dtype",
    "param_dtype",
    "attention_impl",
    "remat",
    "scan_layers",
)

# The heads a pretraining objective trains: masked LM ("mlm") and next-sentence prediction ("nsp").
PRETRAINING_HEADS = ("mlm", "nsp")


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One encoder family.

    Attributes:
      name: ``model.architecture`` in experiment configs and checkpoints.
      config_class: a frozen dataclass with ``architecture = name`` (class attribute), the
        ``SHARED_FIELDS``, ``replace``, ``to_dict``/``from_dict`` and ``num_params(include_heads)``:
        the parameters of its pretraining model (``bertjax.models.heads.PreTrainingModel`` with
        its ``pretraining_heads``), or of that model's encoder alone.
      get_preset: ``(preset name, **field overrides) -> config``; ``preset_names() -> [names]``.
      encoder: the Flax encoder, built as ``encoder(config, add_pooler=..., name=encoder_name)`` and
        called as ``(input_ids, segment_ids, input_mask, *, deterministic,
        output_hidden_states, position_ids, pack_ids, pool_positions) -> EncoderOutput``.
      masked_lm_head: ``(config)``, called as ``(hidden [..., H], word_embeddings [V, H]) ->
        logits [..., V]``, or with ``labels`` [...] as ``(..., labels) -> (nll, label logit -
        max logit)`` [...] without the logits (``bertjax.layers.fast_ops.decode``).
      token_head: a per-token transform before the token and span classifiers (``(config)`` on
        ``[..., H]``, named ``head``), or None.
      encoder_name: the encoder's subtree in every model's params (``bert``, HF's
        ``base_model_prefix``); ``word_embeddings``: the path of the table tied to the MLM decoder
        inside it.
      pretraining_heads: the heads its pretraining trains (a subset of ``PRETRAINING_HEADS``).
      pooler_in_pretraining: the pretraining model carries the pooler even without NSP.
      choice_pools_first_token: multiple choice pools the first unpadded token, not position 0.
      forward_flops_per_sequence: ``(config, seq_len, num_masked) -> FLOPs`` of one pretraining
        sequence's forward pass.
      hf_reference: the transformers class with the same pretraining numerics (the reference of
        the equality tests and the benchmarks' peer).
      scanned_layers: where ``scan_layers=True`` stacks the layers inside the encoder's params and
        the unrolled name of layer ``i`` (``("encoder/layers", "encoder/layer_{i}")``); None: the
        architecture does not scan (``scan_layers=True`` is refused by its config).
    """

    name: str
    config_class: type
    get_preset: Callable[..., Any]
    preset_names: Callable[[], list[str]]
    encoder: Any
    masked_lm_head: Any
    token_head: Any
    encoder_name: str
    word_embeddings: tuple[str, ...]
    pretraining_heads: tuple[str, ...]
    pooler_in_pretraining: bool
    choice_pools_first_token: bool
    forward_flops_per_sequence: Callable[[Any, int, int], float]
    hf_reference: str
    scanned_layers: tuple[str, str] | None = None

    def __post_init__(self):
        problems = []
        if getattr(self.config_class, "architecture", None) != self.name:
            problems.append(f"config_class.architecture is not {self.name!r}")
        fields = {f.name for f in dataclasses.fields(self.config_class)}
        problems += [f"config has no field {f!r}" for f in SHARED_FIELDS if f not in fields]
        problems += [
            f"pretraining head {h!r} is not one of {PRETRAINING_HEADS}"
            for h in self.pretraining_heads
            if h not in PRETRAINING_HEADS
        ]
        if "mlm" not in self.pretraining_heads:
            problems.append("pretraining must train the masked LM head ('mlm')")
        if self.scanned_layers is not None and "{i}" not in self.scanned_layers[1]:
            problems.append("scanned_layers[1] must name layer i as '{i}'")
        if problems:
            raise TypeError(f"architecture {self.name!r}: " + "; ".join(problems))

    @property
    def nsp(self) -> bool:
        """Whether its pretraining trains next-sentence prediction (and so the pooler)."""
        return "nsp" in self.pretraining_heads

    @property
    def can_scan(self) -> bool:
        """Whether ``scan_layers=True`` builds (nn.scan over the layers)."""
        return self.scanned_layers is not None

    def config_fields(self) -> tuple[str, ...]:
        """Every field of its model config (what ``config.model`` may override)."""
        return tuple(f.name for f in dataclasses.fields(self.config_class))

    def field_types(self) -> dict[str, type]:
        """Every model config field with its Python type."""
        return {
            f.name: _FIELD_TYPES[str(f.type).split(" ")[0]]
            for f in dataclasses.fields(self.config_class)
        }

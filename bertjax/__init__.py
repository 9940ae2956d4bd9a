"""bertjax: BERT-style encoder pretraining and fine-tuning in JAX/Flax.

The public face: the Flax modules and their config presets, the architecture registry, the loss
functions, and (lazily, so that ``import bertjax`` stays light) the pretrained-weights loader and
the tokenizers.
"""

__version__ = "0.5.0"

__all__ = [
    "ARCHITECTURES",
    "BertConfig",
    "BertModel",
    "BertOutput",
    "PreTrainingModel",
    "architecture",
    "classification_loss",
    "cross_entropy",
    "get_preset",
    "load_pretrained",
    "load_tokenizer",
    "masked_lm_loss",
    "nsp_loss",
    "preset_names",
    "regression_loss",
]


# Every public name is loaded on first use (PEP 562), so that `import bertjax.<module>` (e.g. the
# TensorFlow- and JAX-free `bertjax prepare`) does not pay for JAX and Flax.
_LAZY = {
    "ARCHITECTURES": "bertjax.models",
    "architecture": "bertjax.models",
    "BertConfig": "bertjax.models.bert",
    "BertModel": "bertjax.models.bert",
    "BertOutput": "bertjax.models.bert",
    "get_preset": "bertjax.models",  # (name, architecture_name="bert", **overrides)
    "preset_names": "bertjax.models",
    "PreTrainingModel": "bertjax.models.heads",
    "classification_loss": "bertjax.losses",
    "cross_entropy": "bertjax.losses",
    "masked_lm_loss": "bertjax.losses",
    "nsp_loss": "bertjax.losses",
    "regression_loss": "bertjax.losses",
    "load_pretrained": "bertjax.pretrained",
    "load_tokenizer": "bertjax.text",
}
# Names bertjax 0.2 gave: an error naming the new one for this release, then gone. ImportError, so
# that ``from bertjax import <old name>`` shows the sentence too.
_RENAMED = {"BertForPreTraining": "PreTrainingModel"}


def __getattr__(name):
    if name in _RENAMED:
        raise ImportError(f"bertjax.{name} was renamed bertjax.{_RENAMED[name]} in bertjax 0.3")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bertjax' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_LAZY])

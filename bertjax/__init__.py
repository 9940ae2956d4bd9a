"""bertjax: BERT pretraining and fine-tuning in JAX/Flax.

The public face: the Flax modules and their config presets, the loss functions, and (lazily, so that
``import bertjax`` stays light) the pretrained-weights loader and the tokenizers.
"""

from bertjax.losses import (
    classification_loss,
    cross_entropy,
    masked_lm_loss,
    nsp_loss,
    regression_loss,
)
from bertjax.model_config import BertConfig, get_preset, preset_names
from bertjax.modeling import BertForPreTraining, BertModel, BertOutput

__version__ = "0.1.0"

__all__ = [
    "BertConfig",
    "BertForPreTraining",
    "BertModel",
    "BertOutput",
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


def __getattr__(name):
    if name == "load_pretrained":
        from bertjax.pretrained import load_pretrained

        return load_pretrained
    if name == "load_tokenizer":
        from bertjax.tokenization import load_tokenizer

        return load_tokenizer
    raise AttributeError(f"module 'bertjax' has no attribute {name!r}")

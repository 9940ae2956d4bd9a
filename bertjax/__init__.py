"""bertjax: BERT-style encoder pretraining and fine-tuning in JAX/Flax.

The public face: the Flax modules and their config presets, the architecture registry, the loss
functions, and (lazily, so that ``import bertjax`` stays light) the pretrained-weights loader and
the tokenizers.
"""

from bertjax.losses import (
    classification_loss,
    cross_entropy,
    masked_lm_loss,
    nsp_loss,
    regression_loss,
)
from bertjax.models import ARCHITECTURES, architecture
from bertjax.models.bert import BertConfig, BertModel, BertOutput, get_preset, preset_names
from bertjax.models.heads import PreTrainingModel

BertForPreTraining = PreTrainingModel  # BERT's name for the encoder + MLM (+ NSP) heads

__version__ = "0.2.0"

__all__ = [
    "ARCHITECTURES",
    "BertConfig",
    "BertForPreTraining",
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


def __getattr__(name):
    # Lazy: the loader pulls in safetensors/Orbax and the tokenizers TensorFlow.
    if name == "load_pretrained":
        from bertjax.pretrained import load_pretrained

        return load_pretrained
    if name == "load_tokenizer":
        from bertjax.text import load_tokenizer

        return load_tokenizer
    raise AttributeError(f"module 'bertjax' has no attribute {name!r}")

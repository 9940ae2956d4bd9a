"""Random weights for transformers models in comparison tests."""

import numpy as np


def randomize(model, seed: int, only: tuple[str, ...] = ()) -> None:
    """Weights with O(1) activations (HF's 0.02 init leaves every layer near the identity): norm
    scales 1 + 0.2 N, biases 0.1 N, matrices N / sqrt(fan_in), embeddings 0.5 N; ``only``: the
    parameters whose names start with one of these prefixes."""
    import torch  # the test extra

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only and not name.startswith(only):
                continue
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif p.ndim == 2 and "embeddings" not in name:
                p.copy_(noise / np.sqrt(p.shape[1]))
            else:
                p.copy_(0.5 * noise)


def random_bert_for_pretraining(path, vocab_size: int):
    """A transformers ``BertForPreTraining`` (2 x 32, dropout 0) with :func:`randomize`d weights,
    the NSP head included, saved to ``path``; returns the model (eval mode)."""
    import torch
    import transformers

    config = transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(config).eval()
    randomize(model, seed=1)
    model.save_pretrained(path)
    return model

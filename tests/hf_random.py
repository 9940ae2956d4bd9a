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

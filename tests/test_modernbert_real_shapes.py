"""The ModernBERT family at its released widths (Ettin, mmBERT): transformers'
ModernBertForMaskedLM (its ModernBertModel's hidden states and its logits) with random weights at
a preset's hidden, intermediate and head sizes and vocabulary (mmBERT's 256,000 tokens), but only
the first four layers (layer 0: global without attention norm, 1-2: sliding window, 3: global),
converted to bertjax, gives the same hidden states and MLM logits on a padded batch whose rows are
wider than the sliding window.

The suite runs mmBERT-small (the cheapest width with the 256,000-token vocabulary) and Ettin-400m
(1024 wide); ``python tests/test_modernbert_real_shapes.py [preset ...]`` runs every preset (or
those named) and prints the largest differences and the time of each."""

from __future__ import annotations

import sys
import time

import jax
import numpy as np
import pytest
from hf_random import randomize

from bertjax.convert import modernbert_hf as mhf
from bertjax.convert.checkpoint import unflatten_params
from bertjax.models import modernbert
from bertjax.models.heads import PreTrainingModel

LAYERS = 4  # global (no attention norm), local, local, global: global_attn_every_n_layers=3
LENGTHS = (160, 97)  # a padded batch; both rows wider than the window (|q - k| <= 64)
TOL = 1e-5
TOKEN_IDS = dict(pad_token_id=0, cls_token_id=1, sep_token_id=2)


def _batch(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    seq = max(LENGTHS)
    mask = (np.arange(seq)[None, :] < np.array(LENGTHS)[:, None]).astype(np.int32)
    ids = rng.integers(3, vocab, (len(LENGTHS), seq)).astype(np.int32)
    ids[:, 0] = 1  # [CLS]
    return np.where(mask > 0, ids, 0), mask


def _positions(mask, count: int, seed: int = 0) -> np.ndarray:
    """``count`` sorted real positions per row [batch, count]: the first, the last, random others."""
    rng = np.random.default_rng(seed)
    rows = []
    for length in mask.sum(1):
        inner = rng.choice(np.arange(1, length - 1), count - 2, replace=False)
        rows.append(np.sort(np.concatenate([[0, length - 1], inner])))
    return np.asarray(rows, np.int32)


def compare(preset: str, layers: int = LAYERS, predictions: int = 24) -> dict[str, tuple]:
    """(largest |bertjax - transformers|, largest |transformers|) of each hidden state (at real
    tokens) and of the MLM logits at ``predictions`` real positions per row (transformers'
    ``sparse_prediction``, the training path: bertjax's masked_lm_positions) for ``preset``'s
    widths at ``layers`` layers, random weights (``hf_random``)."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    cfg = modernbert.get_preset(preset, num_layers=layers, **TOKEN_IDS)
    # both rows have keys outside the window (|q - k| > local_attention // 2); a global layer after 0
    assert cfg.local_attention // 2 + 1 < min(LENGTHS) and cfg.global_attn_every_n_layers < layers
    hf_config = transformers.ModernBertConfig(
        **mhf.config_to_hf(cfg), attn_implementation="eager", sparse_prediction=True
    )
    with no_init_weights():  # randomize fills every parameter
        hf = transformers.ModernBertForMaskedLM(hf_config).eval()
    hf.tie_weights()  # what the skipped initialisation would have done
    randomize(hf, seed=1)
    ids, mask = _batch(cfg.vocab_size)
    positions = _positions(mask, predictions)
    labels = np.full(ids.shape, -100)
    np.put_along_axis(labels, positions, 0, axis=1)
    with torch.no_grad():
        out = hf(
            torch.from_numpy(ids).long(),
            attention_mask=torch.from_numpy(mask).long(),
            labels=torch.from_numpy(labels).long(),
            output_hidden_states=True,
        )
    real = mask.astype(bool)
    want_hidden = [h.numpy()[real] for h in out.hidden_states]
    want_logits = out.logits.numpy()  # [batch * predictions, vocab], row by row
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    flat, heads = mhf.from_hf_tensors(cfg, state, preset)
    assert heads == ("mlm",)
    del hf, state, out
    params = unflatten_params(flat)

    model = PreTrainingModel(cfg, nsp=False)
    encoder = modernbert.ModernBertModel(cfg, add_pooler=False)

    @jax.jit
    def run(p):
        enc = encoder.apply({"params": p["model"]}, ids, None, mask, output_hidden_states=True)
        logits = model.apply({"params": p}, ids, None, mask, positions)["mlm_logits"]
        return enc.hidden_states, logits.reshape(want_logits.shape)

    hidden, logits = run(params)
    pairs = [
        (f"hidden_states[{i}]", np.asarray(h)[real], w)
        for i, (h, w) in enumerate(zip(hidden, want_hidden, strict=True))
    ]
    pairs.append(("mlm_logits", np.asarray(logits), want_logits))
    return {
        name: (float(np.abs(got - want).max()), float(np.abs(want).max()))
        for name, got, want in pairs
    }


@pytest.mark.parametrize("preset", ["mmbert-small", "ettin-400m"])
def test_family_widths_match_transformers(preset):
    """mmBERT's 256,000-token vocabulary (its cheapest width) and Ettin-400m's 1024-wide layers;
    ``python tests/test_modernbert_real_shapes.py`` runs every preset."""
    pytest.importorskip("transformers")
    result = compare(preset)
    assert result["mlm_logits"][1] > 10.0  # the weights are not near zero
    # float32 rounding: TOL relative to the largest value compared (logits reach ~50-100)
    assert all(diff <= TOL * max(1.0, top) for diff, top in result.values()), result


if __name__ == "__main__":
    for name in sys.argv[1:] or modernbert.preset_names():
        start = time.perf_counter()
        result = compare(name)
        seconds = time.perf_counter() - start
        hidden = max(d for k, (d, _) in result.items() if k.startswith("hidden"))
        diff, top = result["mlm_logits"]
        print(
            f"{name}: hidden states max |diff| {hidden:.2e}, MLM logits {diff:.2e} "
            f"(largest |logit| {top:.1f}), {seconds:.1f} s",
            flush=True,
        )

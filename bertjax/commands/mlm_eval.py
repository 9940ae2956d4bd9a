"""``bertjax evaluate-mlm``: the held-out masked-LM loss and accuracy of any checkpoint (any
architecture, any format) on prepared pretraining records, so that runs trained with different
recipes (masking rates, packing, NSP or not) are compared on the same held-out tokens.

The records fix the masked positions (static masking), so two checkpoints see exactly the same
predictions to make. Packed records (several sequences per row) are evaluated as packed: each
sequence attends only to itself, as in training. The loss is the weighted mean cross-entropy over every masked position of
the split (``bertjax.losses.masked_lm_loss``), the accuracy the fraction predicted exactly.
"""

from __future__ import annotations

import argparse
import json
import logging

import jax
import numpy as np

from bertjax import losses, models
from bertjax.data import pipeline
from bertjax.models.heads import PreTrainingModel
from bertjax.pretrained import load_pretrained

log = logging.getLogger("bertjax")


def evaluate_mlm(
    checkpoint: str, data_dir: str, split: str = "eval", batch_size: int = 32, max_batches: int = 0
) -> dict[str, float]:
    """MLM loss / accuracy of ``checkpoint`` (HF, Google or bertjax) on ``data_dir``'s ``split``
    (static masking), every record once (``max_batches`` > 0 stops early)."""
    meta = pipeline.read_metadata(data_dir)
    if meta["masking"] != "static":
        raise ValueError(f"{data_dir}: evaluate-mlm needs records with static masks")
    pretrained = load_pretrained(checkpoint, heads="available")
    if "mlm" not in pretrained.heads:
        raise ValueError(f"{checkpoint}: the checkpoint has no masked-LM head")
    config = pretrained.config
    if meta.get("vocab_size") not in (None, config.vocab_size):
        raise ValueError(
            f"{data_dir}: records of a {meta['vocab_size']}-token vocabulary, but {checkpoint} "
            f"embeds {config.vocab_size}"
        )
    model = PreTrainingModel(config, nsp=False)
    keep = {models.architecture(config).encoder_name, "predictions"}
    params = {k: v for k, v in pretrained.params.items() if k in keep}

    sums = jax.jit(lambda params, batch: masked_lm_sums(model, params, batch))
    data = pipeline.PretrainingData(
        data_dir,
        split,
        batch_size,
        seed=0,
        process_index=0,
        process_count=1,
        repeat=False,
        shuffle=False,
        drop_remainder=False,
    )
    totals = np.zeros(3)
    batches = 0
    for batch in data:
        if max_batches and batches >= max_batches:
            break
        totals += np.asarray(jax.device_get(sums(params, batch)), np.float64)
        batches += 1
    if totals[2] == 0:
        raise ValueError(f"{data_dir}: no masked positions in the {split} split")
    return {
        "mlm_loss": float(totals[0] / totals[2]),
        "mlm_accuracy": float(totals[1] / totals[2]),
        "masked_positions": int(totals[2]),
        "batches": batches,
    }


def masked_lm_sums(model: PreTrainingModel, params, batch: dict) -> tuple:
    """(summed loss, summed correct, summed weight) of a batch's masked positions; packed rows
    (``pack_ids``, ``position_ids``) are run as packed: each sequence attends only to itself."""
    packed = {k: batch[k] for k in ("pack_ids", "position_ids") if k in batch}
    out = model.apply(
        {"params": params},
        batch["input_ids"],
        batch["segment_ids"],
        batch["input_mask"],
        batch["masked_lm_positions"],
        deterministic=True,
        masked_lm_ids=batch["masked_lm_ids"],  # the trainer's loss: no [k, vocab] logits
        **packed,
    )
    weights = batch["masked_lm_weights"]
    loss, accuracy = losses.weighted_nll(out["mlm_nll"], out["mlm_margin"] >= 0, weights, 1.0)
    return loss, accuracy, weights.sum()


def main(argv: list[str]) -> None:
    """``bertjax evaluate-mlm --checkpoint=DIR --data=PREPARED_DIR [--split=eval]``."""
    parser = argparse.ArgumentParser(
        prog="bertjax evaluate-mlm", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--checkpoint", required=True, help="HF / Google / bertjax checkpoint")
    parser.add_argument("--data", required=True, help="a `bertjax prepare` output directory")
    parser.add_argument("--split", default="eval")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--max_batches", type=int, default=0)
    args = parser.parse_args(argv)
    result = evaluate_mlm(args.checkpoint, args.data, args.split, args.batch_size, args.max_batches)
    print(json.dumps(result, sort_keys=True))

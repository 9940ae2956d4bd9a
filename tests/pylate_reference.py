"""Writes the PyLate reference fixtures of tests/test_colbert*.py (tests/data/pylate/): two tiny
ColBERT directories saved by PyLate itself (BERT and ModernBERT encoders, 16-dim projection,
query_length 12, document_length 20) and ``reference.npz``, PyLate's own numbers on them:
``ColBERT.encode`` of TEXTS as queries and documents, ``colbert_scores``, and the ``Contrastive``
and ``Distillation`` losses with their gradients with respect to the token embeddings.

Run under PyLate 1.6.0 (it pins sentence-transformers 5.3.0 and transformers <= 5.3.0, so not in
the project's environment), from the repository root::

    PYTHONPATH=.:tests:PYLATE_ENV python tests/pylate_reference.py

The files here were written with PYLATE_ENV = ``pip install --no-deps --target`` of pylate 1.6.0,
sentence-transformers 5.3.0, transformers 5.3.0, tokenizers 0.22.2, huggingface-hub 1.3.0 and
httpx/httpcore/h11/anyio, beside the project's torch 2.13, plus an empty ``datasets`` package
(PyLate's package import needs the name; nothing here uses it).

The tests read the files only; they never import PyLate.
"""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import torch

OUT = pathlib.Path(__file__).resolve().parent / "data" / "pylate"
QUERY_LENGTH, DOCUMENT_LENGTH, DIM = 12, 20, 16
TEXTS = [
    "The quick brown fox.",
    "lazy dog",
    "Hello, world!",
    "x",
    " ".join(["the quick brown fox jumps over the lazy dog"] * 4),  # longer than both lengths
    "jumps over everything, twice!",
    "a # sign and Ω are unknown: [UNK]",  # [UNK] is in PyLate's skiplist ('#' is not a token)
]


class _Given(torch.nn.Module):
    """A stand-in model for PyLate's losses: the features carry the token embeddings."""

    skiplist = [5, 6]
    do_query_expansion = True

    def forward(self, features):
        return {"token_embeddings": features["embeddings"]}


def _features(gen, rows, length, dim, skip_ids=(5, 6)):
    emb = torch.randn(rows, length, dim, generator=gen, requires_grad=True)
    ids = torch.randint(7, 30, (rows, length), generator=gen)
    ids[:, 3] = skip_ids[0]  # a skiplisted token in every row
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return {"embeddings": emb, "input_ids": ids, "attention_mask": mask}


def main() -> None:
    from helpers import tiny_hf
    from pylate import losses, models, scores

    out = {}
    OUT.mkdir(parents=True, exist_ok=True)
    for kind in ("bert", "modernbert"):
        hf = tiny_hf(OUT / f"_hf_{kind}", kind)
        torch.manual_seed(0)
        model = models.ColBERT(
            str(hf),
            device="cpu",
            embedding_size=DIM,
            query_length=QUERY_LENGTH,
            document_length=DOCUMENT_LENGTH,
        )
        shutil.rmtree(OUT / kind, ignore_errors=True)
        model.save(str(OUT / kind))
        shutil.rmtree(hf)
        (OUT / kind / "README.md").unlink(missing_ok=True)
        model = models.ColBERT(str(OUT / kind), device="cpu")
        for name, is_query in (("query", True), ("document", False)):
            for i, vectors in enumerate(model.encode(TEXTS, is_query=is_query, batch_size=3)):
                out[f"{kind}/{name}/{i}"] = vectors
    gen = torch.Generator().manual_seed(0)
    # colbert_scores: 3 queries x 4 documents, with and without masks
    q, d = torch.randn(3, 5, 8, generator=gen), torch.randn(4, 6, 8, generator=gen)
    qm, dm = torch.ones(3, 5), (torch.arange(6)[None, :] < torch.tensor([[6], [4], [2], [5]]))
    qm[1, 3:] = 0
    out["scores/q"], out["scores/d"] = q.numpy(), d.numpy()
    out["scores/q_mask"], out["scores/d_mask"] = qm.numpy(), dm.float().numpy()
    out["scores/plain"] = scores.colbert_scores(q, d).numpy()
    out["scores/masked"] = scores.colbert_scores(q, d, qm, dm.float()).numpy()
    # Contrastive: 4 queries, a positive and 2 hard negatives each; temperature 1 and 0.05
    given = _Given()
    feats = [_features(gen, 4, 7, 8)] + [_features(gen, 4, 9, 8) for _ in range(3)]
    for j, f in enumerate(feats):
        for key, value in f.items():
            out[f"contrastive/{j}/{key}"] = value.detach().numpy()
    for t in (1.0, 0.05):
        for f in feats:
            f["embeddings"].grad = None
        loss = losses.Contrastive(given, temperature=t)(feats)
        loss.backward()
        out[f"contrastive/loss/{t}"] = loss.detach().numpy()
        for j, f in enumerate(feats):
            out[f"contrastive/grad/{t}/{j}"] = f["embeddings"].grad.numpy().copy()
    # Distillation: 3 queries, 4 scored documents each (teacher scores given as labels)
    query = _features(gen, 3, 7, 8)
    docs = _features(gen, 12, 9, 8)
    labels = torch.randn(3, 4, generator=gen) * 3
    for name, f in (("query", query), ("documents", docs)):
        for key, value in f.items():
            out[f"distillation/{name}/{key}"] = value.detach().numpy()
    out["distillation/labels"] = labels.numpy()
    for normalize in (True, False):
        for f in (query, docs):
            f["embeddings"].grad = None
        loss = losses.Distillation(given, normalize_scores=normalize)([query, docs], labels)
        loss.backward()
        out[f"distillation/loss/{normalize}"] = loss.detach().numpy()
        out[f"distillation/grad/{normalize}/query"] = query["embeddings"].grad.numpy().copy()
        out[f"distillation/grad/{normalize}/documents"] = docs["embeddings"].grad.numpy().copy()
    np.savez_compressed(OUT / "reference.npz", **out)
    print(f"wrote {OUT}: {len(out)} arrays")


if __name__ == "__main__":
    main()

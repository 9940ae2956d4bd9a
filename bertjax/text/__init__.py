"""Tokenizers (WordPiece, SentencePiece, Hugging Face ``tokenizer.json``) and vocabulary training.

``load_tokenizer(path)`` picks the tokenizer a file names; every tokenizer has the interface of
``tokenization.TokenizerBase`` (ids of the special tokens, ``encode``, ``word_start_table``,
``tf_encode``).
"""

from __future__ import annotations

import bertjax.fs as fs
from bertjax.text.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from bertjax.text.tokenization import (
    SentencePieceTokenizer,
    WordPieceTokenizer,
    infer_do_lower_case,
    load_vocab,
)

__all__ = ["HFTokenizer", "SentencePieceTokenizer", "WordPieceTokenizer", "load_tokenizer"]


def load_tokenizer(path: str, do_lower_case: bool | None = None):
    """`*.model` -> SentencePieceTokenizer; a Hugging Face `tokenizer.json` (or a directory holding
    one) -> HFTokenizer; anything else -> WordPieceTokenizer on a vocab.txt.

    do_lower_case None infers it for WordPiece (uncased when no token holds an upper-case letter);
    for SentencePiece, case handling is part of the model and a conflicting value is an error.
    """
    path = str(path)
    if path.endswith(".json") or fs.isdir(path):
        return load_hf_tokenizer(path, do_lower_case)
    if path.endswith(".model"):
        tok = SentencePieceTokenizer(path)
        if do_lower_case is not None and bool(do_lower_case) != tok.do_lower_case:
            raise ValueError(
                f"{path}: do_lower_case={do_lower_case} but the SentencePiece model "
                f"{'folds' if tok.do_lower_case else 'keeps'} case"
            )
        return tok
    if do_lower_case is None:
        do_lower_case = infer_do_lower_case(load_vocab(path))
    return WordPieceTokenizer(path, do_lower_case=do_lower_case)

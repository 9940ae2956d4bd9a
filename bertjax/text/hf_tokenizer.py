"""Any Hugging Face `tokenizer.json` (WordPiece, BPE, Unigram) as a bertjax tokenizer.

`HFTokenizer` wraps `tokenizers.Tokenizer` behind the interface of `WordPieceTokenizer`: ids are
those of transformers' fast tokenizer on the same file (`add_special_tokens=False`). Special tokens
come from `special_tokens_map.json` / `tokenizer_config.json` beside the file when present, else
from the usual names in the vocabulary: [CLS]/[SEP]/[PAD]/[MASK]/[UNK] (BERT, ModernBERT) or
<s>/</s>/<pad>/<mask>/<unk> (RoBERTa). Padding and truncation stored in the file are switched off.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel

import bertjax.fs as fs
from bertjax.text.tokenization import (
    SPECIAL_TOKENS,
    TokenizerBase,
    is_cjk_char,
    is_punctuation_char,
)

if TYPE_CHECKING:
    import tensorflow as tf

TOKENIZER_FILE = "tokenizer.json"
_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # later files win
# (attribute, key in the config files, fallback names tried in order), in SPECIAL_TOKENS order
_ROLES = (
    ("pad_id", "pad_token", ("[PAD]", "<pad>")),
    ("unk_id", "unk_token", ("[UNK]", "<unk>")),
    ("cls_id", "cls_token", ("[CLS]", "<s>", "<cls>")),
    ("sep_id", "sep_token", ("[SEP]", "</s>", "<sep>")),
    ("mask_id", "mask_token", ("[MASK]", "<mask>")),
)


def _read_text(path: str) -> str:
    return fs.read_bytes(path).decode("utf-8")


def _config_tokens(json_path: str) -> dict[str, str]:
    """Special-token names ({"cls_token": "<s>", ...}) from the config files beside json_path."""
    out: dict[str, str] = {}
    for name in _CONFIG_FILES:
        path = os.path.join(os.path.dirname(json_path), name)
        if not fs.exists(path):
            continue
        try:
            config = json.loads(_read_text(path))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a JSON file ({e})") from None
        for _, key, _ in _ROLES:
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str) and value:
                out[key] = value
    return out


def _find_types(node, types: tuple[str, ...]) -> list[dict]:
    """Pre-tokenizers (dicts) of these "type"s in a tokenizer.json section, through "Sequence"s."""
    if not isinstance(node, dict):
        return []
    found = [node] if node.get("type") in types else []
    for child in node.get("pretokenizers") or []:
        found += _find_types(child, types)
    return found


class HFTokenizer(TokenizerBase):
    """A `tokenizers.Tokenizer` loaded from a tokenizer.json, with bertjax's tokenizer interface.

    `encode` adds no special tokens; `encode_batch` is the fast (parallel, Rust) batch version and
    `tf_encode` runs it in-graph through `tf.numpy_function`. Text that spells an added token
    ("[MASK]") gives that token's id, as in transformers.
    """

    kind = "hf"

    def __init__(self, tokenizer_file: str):
        self.vocab_file = str(tokenizer_file)
        if not fs.exists(self.vocab_file):
            raise FileNotFoundError(f"{self.vocab_file}: tokenizer file not found")
        data = _read_text(self.vocab_file)
        try:
            self._tok = Tokenizer.from_str(data)
            self._spec = json.loads(data)
        except Exception as e:  # tokenizers raises a bare Exception with a long message
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"{self.vocab_file}: not a tokenizers JSON file ({reason})") from None
        self._tok.no_padding()
        self._tok.no_truncation()
        token_to_id = self._tok.get_vocab(with_added_tokens=True)
        self.vocab = [f"<hole_{i}>" for i in range(max(token_to_id.values(), default=-1) + 1)]
        for token, i in token_to_id.items():
            self.vocab[i] = token
        self._token_to_id = {t: i for i, t in enumerate(self.vocab)}
        self._added_ids = set(self._tok.get_added_tokens_decoder())

        config = _config_tokens(self.vocab_file)
        if "pad_token" in config and config.get("pad_token") == config.get("mask_token"):
            del config["pad_token"]  # PyLate saves pad_token=[MASK] (its query padding)
        model_unk = self._spec.get("model", {}).get("unk_token")
        for (attr, key, names), role in zip(_ROLES, SPECIAL_TOKENS):
            tried = [config[key]] if key in config else []
            tried += [model_unk] if attr == "unk_id" and isinstance(model_unk, str) else []
            tried += [n for n in names if n not in tried]
            found = next((self._token_to_id[t] for t in tried if t in self._token_to_id), None)
            if found is None:
                raise ValueError(
                    f"{self.vocab_file}: tokenizer has no {role} token (tried {', '.join(tried)})"
                )
            setattr(self, attr, found)
        if len(set(self.special_ids)) != len(SPECIAL_TOKENS):
            raise ValueError(f"{self.vocab_file}: special tokens share ids {self.special_ids}")
        norm = self._tok.normalizer
        self.do_lower_case = norm is not None and norm.normalize_str("ABC") == "abc"

    @property
    def tokenizer(self):
        """The underlying `tokenizers.Tokenizer` (padding and truncation off)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        """Text -> ids (no [CLS]/[SEP] added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Texts -> ids per text, tokenized in parallel (no [CLS]/[SEP] added)."""
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text with the tokenizer's decoder (drops [PAD], keeps other special tokens)."""
        ids = [int(i) for i in ids]
        self.convert_ids_to_tokens(ids)  # IndexError naming an id outside the vocabulary
        return self._tok.decode([i for i in ids if i != self.pad_id], skip_special_tokens=False)

    def word_start_table(self) -> np.ndarray:
        """[vocab] bool: True where a token starts a word, for whole-word masking.

        WordPiece (and BPE with a continuing-subword prefix): not a "##" continuation. Otherwise
        by the pre-tokenizer's word marker: "Ġ"-led for ByteLevel (the bytes decoded first),
        "▁"-led for Metaspace; with either, also added/special tokens, tokens of punctuation
        and/or whitespace only, and (Metaspace) CJK-led tokens. Raises ValueError when the file
        has neither a continuation prefix nor a word marker.
        """
        model = self._spec.get("model") or {}
        prefix = model.get("continuing_subword_prefix")
        if prefix:
            return np.array(
                [not (t.startswith(prefix) and len(t) > len(prefix)) for t in self.vocab]
            )
        pre = self._spec.get("pre_tokenizer")
        if _find_types(pre, ("ByteLevel",)):
            marker, byte_decoder = "\u0120", ByteLevel()
            texts = [byte_decoder.decode([t]) for t in self.vocab]
        elif metaspace := _find_types(pre, ("Metaspace",)):
            marker, texts = metaspace[0].get("replacement", "\u2581"), self.vocab
        else:
            raise ValueError(f"{self.vocab_file}: cannot tell word starts (no marker, no prefix)")
        table = np.zeros(len(self.vocab), dtype=bool)
        for i, (token, text) in enumerate(zip(self.vocab, texts)):
            table[i] = (
                token.startswith(marker)
                or i in self._added_ids
                or (bool(text) and all(is_punctuation_char(c) or c.isspace() for c in text))
                or (marker != "\u0120" and bool(text) and is_cjk_char(text[0]))
            )
        table[list(self.special_ids)] = True
        return table

    def tf_encode(self, texts: tf.Tensor) -> tf.RaggedTensor:
        """In-graph encode: texts [n] string -> [n, None] int64 ids (a scalar -> [None])."""
        import tensorflow as tf

        texts = tf.convert_to_tensor(texts, dtype=tf.string)
        scalar = texts.shape.rank == 0

        def encode_flat(batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            ids = self.encode_batch([t.decode("utf-8", errors="replace") for t in batch])
            lengths = np.array([len(row) for row in ids], dtype=np.int64)
            flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum()))
            return flat, lengths

        values, lengths = tf.numpy_function(
            encode_flat, [tf.reshape(texts, [-1])], [tf.int64, tf.int64], stateful=False
        )
        values.set_shape([None])
        lengths.set_shape([None])
        ids = tf.RaggedTensor.from_row_lengths(values, lengths, validate=False)
        return ids[0] if scalar else ids


def load_hf_tokenizer(path: str, do_lower_case: bool | None = None) -> HFTokenizer:
    """HFTokenizer from a tokenizer.json file or from a directory holding one.

    Case handling is part of the file's normalizer: a do_lower_case that conflicts with it is a
    ValueError (None accepts either).
    """
    path = str(path)
    if fs.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
    tok = HFTokenizer(path)
    if do_lower_case is not None and bool(do_lower_case) != tok.do_lower_case:
        raise ValueError(
            f"{path}: do_lower_case={do_lower_case} but the tokenizer's normalizer "
            f"{'folds' if tok.do_lower_case else 'keeps'} case"
        )
    return tok

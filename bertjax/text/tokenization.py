"""BERT tokenizers: exact WordPiece (cased or uncased) and SentencePiece, in Python and in-graph.

The Python path (`encode`) follows BERT's reference rules exactly and caches word -> ids lookups so
data preparation runs at tens of thousands of lines per second. The in-graph path (`tf_encode`) is
built from tensorflow-text ops with character classes generated from the same Python predicates, so
it gives the same ids as `encode` inside a `tf.data` pipeline.

Rules of BERT's basic tokenization (google-research/bert; reference for equality tests:
transformers v5's Python `BertTokenizerLegacy`, and its Rust-backed `BertTokenizer`):
  1. clean: drop U+0000, U+FFFD and every Unicode "C*" character except tab/newline/return; map
     "Zs" characters and tab/newline/return to a space;
  2. put spaces around CJK ideographs;
  3. NFC-normalize (transformers' Python BertTokenizer does; the original BERT did not) and split
     on whitespace (Python's str.split);
  4. uncased only: lower-case, then NFD and drop "Mn" (combining) characters;
  5. split off every punctuation character (Unicode "P*" plus all ASCII non-alphanumerics);
  6. WordPiece: greedy longest-match-first with "##" continuations; a word longer than
     `max_chars_per_word` characters, or one that cannot be covered, becomes [UNK].
Literal "[CLS]"-like strings in the text are ordinary text (split as punctuation + word), as in the
original BERT; transformers instead keeps them as special tokens. The Rust BertTokenizer lower-cases
per character, so an upper-case final sigma gives "σ" there and "ς" here (and in the Python one).
TensorFlow is imported only by `tf_encode` (and for remote vocabulary files).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

import bertjax.fs as fs
from bertjax.text.bulk_wordpiece import BulkWordPiece
from bertjax.text.chars import (  # noqa: F401  (re-exported: the rules' public names)
    SUBWORD_PREFIX,
    basic_split_word,
    basic_tokenize,
    is_cjk_char,
    is_punctuation_char,
    is_removed_char,
    is_whitespace_char,
    whitespace_words,
)

if TYPE_CHECKING:
    import tensorflow as tf

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
SP_SPACE = "\u2581"  # SentencePiece's word-start marker "▁"
_CACHE_LIMIT = 1 << 20  # entries in the word -> ids cache before it is cleared


# Vocabulary files.
def load_vocab(path: str) -> list[str]:
    """Reads a BERT vocab.txt (one token per line, id = line number - 1) through bertjax.fs (local or gs://).

    Raises ValueError naming the file and line for an empty file, an empty or whitespace-holding
    token, a duplicate token, invalid UTF-8 or a missing special token (SPECIAL_TOKENS).
    """
    if not fs.exists(path):
        raise FileNotFoundError(f"{path}: vocabulary file not found")
    data = fs.read_bytes(path)
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if not lines:
        raise ValueError(f"{path}: vocabulary file is empty")
    tokens: list[str] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(lines, start=1):
        try:
            token = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{path}:{lineno}: invalid UTF-8 in vocabulary token ({e.reason})"
            ) from None
        if not token:
            raise ValueError(f"{path}:{lineno}: empty vocabulary token")
        if token != token.strip() or len(token.split()) != 1:
            raise ValueError(f"{path}:{lineno}: vocabulary token {token!r} contains whitespace")
        if token in seen:
            raise ValueError(
                f"{path}:{lineno}: duplicate vocabulary token {token!r} (first on line {seen[token]})"
            )
        seen[token] = lineno
        tokens.append(token)
    missing = [t for t in SPECIAL_TOKENS if t not in seen]
    if missing:
        raise ValueError(f"{path}: vocabulary lacks the special token(s) {', '.join(missing)}")
    return tokens


def infer_do_lower_case(vocab: Sequence[str]) -> bool:
    """Uncased unless more than 0.5% of ordinary tokens (not special, not [unusedN]) hold an
    upper-case letter: the uncased BERT vocab still has a few symbols Python calls upper case
    (e.g. 'ℝ'), a cased vocab has thousands of capitalised words."""
    ordinary = [t for t in vocab if not (t.startswith("[") and t.endswith("]"))]
    upper = sum(1 for t in ordinary if any(c.isupper() for c in t))
    return upper <= 0.005 * len(ordinary)


# Tokenizers.
class TokenizerBase:
    """Shared id <-> token conversion; subclasses set vocab, specials and `_token_to_id`."""

    kind: str
    vocab: list[str]
    vocab_file: str
    do_lower_case: bool
    pad_id: int
    unk_id: int
    cls_id: int
    sep_id: int
    mask_id: int
    _token_to_id: dict[str, int]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def special_ids(self) -> tuple[int, ...]:
        """Ids of [PAD], [UNK], [CLS], [SEP], [MASK] in that order."""
        return (self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id)

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> list[int]:
        """Token strings to ids; tokens not in the vocabulary map to [UNK]."""
        return [self._token_to_id.get(t, self.unk_id) for t in tokens]

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Ids to token strings; raises IndexError naming an id outside the vocabulary."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.vocab):
                raise IndexError(f"token id {i} is outside the vocabulary [0, {len(self.vocab)})")
            out.append(self.vocab[i])
        return out

    def tokenize(self, text: str) -> list[str]:
        """Text -> word pieces (strings)."""
        return [self.vocab[i] for i in self.encode(text)]

    def encode(self, text: str) -> list[int]:  # pragma: no cover - overridden
        raise NotImplementedError

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.vocab_file!r}, vocab_size={self.vocab_size}, "
            f"do_lower_case={self.do_lower_case})"
        )


class WordPieceTokenizer(TokenizerBase):
    """BERT WordPiece tokenizer (basic tokenization + greedy longest-match WordPiece)."""

    kind = "wordpiece"

    def __init__(self, vocab_file: str, do_lower_case: bool = True, max_chars_per_word: int = 100):
        self.vocab_file = str(vocab_file)
        self.vocab = load_vocab(self.vocab_file)
        self.do_lower_case = bool(do_lower_case)
        self.max_chars_per_word = int(max_chars_per_word)
        self._token_to_id = {t: i for i, t in enumerate(self.vocab)}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
            self._token_to_id[t] for t in SPECIAL_TOKENS
        )
        # Continuation pieces without their "##" (no string concatenation per lookup); the longest
        # piece of each kind bounds the greedy search.
        self._continuations = {
            t[2:]: i
            for i, t in enumerate(self.vocab)
            if t.startswith(SUBWORD_PREFIX) and len(t) > 2
        }
        self._max_piece_chars = max(map(len, self.vocab))
        self._max_continuation_chars = max(map(len, self._continuations), default=0)
        self._cache: dict[str, tuple[int, ...]] = {}  # whitespace word -> ids
        self._piece_cache: dict[str, list[int]] = {}  # basic-tokenized word -> WordPiece ids
        self._tf_graph = None
        self._bulk = None
        self._word_start = None

    def bulk_encoder(self):
        """The block-at-a-time encoder (`bertjax.text.bulk_wordpiece.BulkWordPiece`), built once."""
        if self._bulk is None:
            self._bulk = BulkWordPiece(self)
        return self._bulk

    def _wordpiece(self, word: str) -> list[int]:
        """Greedy longest-match-first WordPiece on one basic-tokenized word."""
        n = len(word)
        if n > self.max_chars_per_word:
            return [self.unk_id]
        table, longest = self._token_to_id, self._max_piece_chars  # the first piece
        ids = []
        start = 0
        while start < n:
            end = n if n - start <= longest else start + longest
            while end > start:
                piece_id = table.get(word[start:end])
                if piece_id is not None:
                    break
                end -= 1
            else:
                return [self.unk_id]
            ids.append(piece_id)
            start = end
            table, longest = self._continuations, self._max_continuation_chars  # "##" pieces
        return ids

    def _encode_word(self, word: str) -> tuple[int, ...]:
        """Ids for one whitespace-delimited word, cached."""
        ids = self._cache.get(word)
        if ids is None:
            pieces = self._piece_cache
            out: list[int] = []
            for w in basic_split_word(word, self.do_lower_case):
                piece_ids = pieces.get(w)
                if piece_ids is None:
                    piece_ids = pieces[w] = self._wordpiece(w)
                out.extend(piece_ids)
            ids = tuple(out)
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
                pieces.clear()
            self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        """Text -> WordPiece ids (no [CLS]/[SEP] added)."""
        words = whitespace_words(text)
        cache = self._cache
        try:  # every word seen before (the common case): one comprehension over the cache
            return [i for word in words for i in cache[word]]
        except KeyError:
            pass
        encode_word = self._encode_word
        return [i for word in words for i in (cache.get(word) or encode_word(word))]

    def decode(self, ids: Iterable[int]) -> str:
        """Joins pieces back to text (drops [PAD]; "##" pieces are glued to the previous one)."""
        tokens = [t for t in self.convert_ids_to_tokens(ids) if t != "[PAD]"]
        return " ".join(tokens).replace(" " + SUBWORD_PREFIX, "").replace(SUBWORD_PREFIX, "")

    def word_start_table(self) -> np.ndarray:
        """[vocab] bool: True where a token starts a word (not a "##" continuation)."""
        if self._word_start is None:
            self._word_start = np.array(
                [not (t.startswith(SUBWORD_PREFIX) and len(t) > 2) for t in self.vocab]
            )
        return self._word_start

    def tf_encode(self, texts: tf.Tensor) -> tf.RaggedTensor:
        """In-graph encode: texts [n] string -> [n, None] int64 ids, equal to `encode`."""
        import tensorflow as tf

        from bertjax.text.tf_wordpiece import WordPieceGraph

        if self._tf_graph is None:
            with tf.init_scope():  # tables and char classes are built eagerly, once
                self._tf_graph = WordPieceGraph(self)
        return self._tf_graph(texts)


class SentencePieceTokenizer(TokenizerBase):
    """Wraps a SentencePiece .model; its specials are exposed as [PAD]/[UNK]/[CLS]/[SEP]/[MASK].

    Special pieces are looked up by BERT name first ("[CLS]"), then by the model's own ids
    (pad/unk/bos/eos) or names ("<pad>", "<mask>"). Lower-casing is part of the model's normalizer
    (`do_lower_case` is True when it folds case, e.g. rule "nmt_nfkc_cf").
    """

    kind = "sentencepiece"

    def __init__(self, model_file: str):
        import sentencepiece as spm  # noqa: PLC0415

        self.vocab_file = str(model_file)
        if not fs.exists(self.vocab_file):
            raise FileNotFoundError(f"{self.vocab_file}: SentencePiece model not found")
        self._model_proto = fs.read_bytes(self.vocab_file)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(self._model_proto)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError with a long message
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"{self.vocab_file}: not a SentencePiece model ({reason})") from None
        pieces = [self._sp.IdToPiece(i) for i in range(self._sp.GetPieceSize())]
        lookup = {p: i for i, p in enumerate(pieces)}

        def find(bert_name: str, sp_id: int, *aliases: str) -> int:
            if bert_name in lookup:
                return lookup[bert_name]
            if sp_id >= 0:
                return sp_id
            for alias in aliases:
                if alias in lookup:
                    return lookup[alias]
            raise ValueError(f"{self.vocab_file}: SentencePiece model has no {bert_name} piece")

        sp = self._sp
        self.pad_id = find("[PAD]", sp.pad_id(), "<pad>")
        self.unk_id = find("[UNK]", sp.unk_id(), "<unk>")
        self.cls_id = find("[CLS]", sp.bos_id(), "<s>", "<cls>")
        self.sep_id = find("[SEP]", sp.eos_id(), "</s>", "<sep>")
        self.mask_id = find("[MASK]", -1, "<mask>")
        if len(set(self.special_ids)) != len(SPECIAL_TOKENS):
            raise ValueError(f"{self.vocab_file}: special pieces share ids {self.special_ids}")
        self.vocab = pieces
        for name, i in zip(SPECIAL_TOKENS, self.special_ids):
            self.vocab[i] = name
        self._token_to_id = {t: i for i, t in enumerate(self.vocab)}
        self.do_lower_case = self._sp.Normalize("ABC") == self._sp.Normalize("abc")
        self._tf_tokenizer = None

    def encode(self, text: str) -> list[int]:
        """Text -> SentencePiece ids (no [CLS]/[SEP] added)."""
        return self._sp.EncodeAsIds(text)

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text via SentencePiece (drops [PAD], keeps other specials as their names)."""
        ids = [int(i) for i in ids if int(i) != self.pad_id]
        out, run = [], []
        for i in ids:
            if i in self.special_ids:
                if run:
                    out.append(self._sp.DecodeIds(run))
                    run = []
                out.append(self.vocab[i])
            else:
                run.append(i)
        if run:
            out.append(self._sp.DecodeIds(run))
        return " ".join(out)

    def word_start_table(self) -> np.ndarray:
        """[vocab] bool: True for "▁"-prefixed pieces, CJK-led pieces and special/control pieces."""
        table = np.zeros(len(self.vocab), dtype=bool)
        for i, piece in enumerate(self.vocab):
            table[i] = (
                piece.startswith(SP_SPACE)
                or (bool(piece) and is_cjk_char(piece[0]))
                or self._sp.IsControl(i)
                or self._sp.IsUnknown(i)
                or i in self.special_ids
            )
        return table

    def tf_encode(self, texts: tf.Tensor) -> tf.RaggedTensor:
        """In-graph encode: texts [n] string -> [n, None] int64 ids, equal to `encode`."""
        import tensorflow as tf

        if self._tf_tokenizer is None:
            import tensorflow_text as tf_text  # noqa: PLC0415

            with tf.init_scope():
                self._tf_tokenizer = tf_text.SentencepieceTokenizer(
                    model=self._model_proto, out_type=tf.int32
                )
        return tf.cast(self._tf_tokenizer.tokenize(texts), tf.int64)

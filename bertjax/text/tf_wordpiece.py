"""The in-graph (tensorflow-text) version of ``WordPieceTokenizer.encode``: the same rules and
ids, with character classes generated from the same Python predicates (``bertjax.text.chars``)."""

import functools
import unicodedata
from collections.abc import Sequence

import tensorflow as tf

import bertjax.text.chars as chars

SUBWORD_PREFIX = chars.SUBWORD_PREFIX


@functools.cache
def _char_class_ranges(predicate_name: str) -> tuple[tuple[int, int], ...]:
    """Inclusive code-point ranges where a character predicate holds (for in-graph regexes)."""
    predicate = getattr(chars, predicate_name, None) or globals()[predicate_name]
    ranges: list[tuple[int, int]] = []
    start = None
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:  # surrogates cannot occur in valid UTF-8
            hit = False
        else:
            hit = predicate(chr(cp))
        if hit and start is None:
            start = cp
        elif not hit and start is not None:
            ranges.append((start, cp - 1))
            start = None
    if start is not None:
        ranges.append((start, 0x10FFFF))
    return tuple(ranges)


def _is_split_space(char: str) -> bool:
    """Characters Python's str.split() splits on that survive BERT's cleaning."""
    return char.isspace() and not chars.is_removed_char(char)


def _is_combining_mark(char: str) -> bool:
    return unicodedata.category(char) == "Mn"


def _is_cased(char: str) -> bool:
    """Unicode "Cased" and not "Case_Ignorable", as Python's str.lower() sees it (final sigma)."""
    return ("1" + char + "\u03a3").lower()[-1] == "\u03c2"


def _is_case_ignorable(char: str) -> bool:
    """Unicode "Case_Ignorable", as Python's str.lower() sees it (final sigma)."""
    return ("\u0391" + char + "\u03a3").lower()[-1] == "\u03c2" and not _is_cased(char)


def _regex_class(predicate_name: str) -> str:
    """An RE2 character class matching exactly the code points where the predicate holds."""
    parts = (
        f"\\x{{{lo:X}}}" if lo == hi else f"\\x{{{lo:X}}}-\\x{{{hi:X}}}"
        for lo, hi in _char_class_ranges(predicate_name)
    )
    return "[" + "".join(parts) + "]"


class WordPieceGraph:
    """tensorflow-text version of `WordPieceTokenizer.encode` (same rules, same ids)."""

    def __init__(self, tok):
        import tensorflow_text as tf_text  # noqa: PLC0415

        self._tf_text = tf_text
        self.do_lower_case = tok.do_lower_case
        self.max_chars = tok.max_chars_per_word
        self.removed = _regex_class("is_removed_char")
        self.space = _regex_class("_is_split_space")
        self.punct = _regex_class("is_punctuation_char")
        self.marks = _regex_class("_is_combining_mark")
        self.cjk = (
            "([" + "".join(f"\\x{{{lo:X}}}-\\x{{{hi:X}}}" for lo, hi in chars.CJK_RANGES) + "])"
        )
        self.lower_fixes = _lower_fixes(tok.vocab) if tok.do_lower_case else ()
        if tok.do_lower_case:
            cased, ignorable = _regex_class("_is_cased"), _regex_class("_is_case_ignorable")
            neither = "[^" + cased[1:-1] + ignorable[1:-1] + "]"
            # Σ -> ς when: cased, case-ignorable*, Σ, not followed by (case-ignorable*, cased).
            self.final_sigma = f"({cased}{ignorable}*)\u03a3({ignorable}*(?:{neither}|$))"
        table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(tok.vocab), tf.range(len(tok.vocab), dtype=tf.int64)
            ),
            default_value=-1,
        )
        self.wordpiece = tf_text.WordpieceTokenizer(
            table,
            suffix_indicator=SUBWORD_PREFIX,
            max_bytes_per_word=4 * self.max_chars,  # words over max_chars are [UNK] beforehand
            token_out_type=tf.int64,
            unknown_token="[UNK]",
        )

    def __call__(self, texts: tf.Tensor) -> tf.RaggedTensor:
        texts = tf.convert_to_tensor(texts, dtype=tf.string)
        scalar = texts.shape.rank == 0
        texts = tf.reshape(texts, [-1])  # [n]
        t = tf.strings.regex_replace(texts, self.removed, "")
        t = tf.strings.regex_replace(t, self.cjk, r" \1 ")
        t = self._tf_text.normalize_utf8(t, "NFC")
        words = self._tf_text.regex_split(t, self.space)  # [n, (words)]
        flat = words.flat_values  # [words]
        if self.do_lower_case:
            # Python's final-sigma rule with Python's Unicode tables (ICU's are another version).
            flat = tf.strings.regex_replace(flat, self.final_sigma, "\\1\u03c2\\2")
            flat = tf.strings.regex_replace(flat, "\u03a3", "\u03c3")
            for char, lowered in self.lower_fixes:
                flat = tf.strings.regex_replace(flat, f"\\x{{{ord(char):X}}}", lowered)
            flat = tf.strings.lower(flat, encoding="utf-8")
            flat = self._tf_text.normalize_utf8(flat, "NFD")
            flat = tf.strings.regex_replace(flat, self.marks, "")
        pieces = self._tf_text.regex_split(
            flat, f"{self.punct}|{self.space}", keep_delim_regex_pattern=self.punct
        )  # [words, (pieces)]
        values = pieces.flat_values
        too_long = tf.strings.length(values, unit="UTF8_CHAR") > self.max_chars
        values = tf.where(too_long, tf.constant("[UNK]"), values)
        ids = self.wordpiece.tokenize(values)  # [pieces, (ids)]
        ids = words.with_flat_values(pieces.with_flat_values(ids))  # [n, words, pieces, ids]
        ids = ids.merge_dims(1, -1)  # [n, (ids)]
        return ids[0] if scalar else ids


def _lower_fixes(vocab: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """Characters whose ICU lower-casing (tf.strings.lower) differs from Python's str.lower().

    ICU and Python ship different Unicode versions; only characters that reach the vocabulary
    matter (any other makes its word [UNK] either way), so those are patched before lower-casing.
    """
    vocab_chars = {c for token in vocab for c in token}
    candidates = [
        chr(cp)
        for cp in range(0x110000)
        if not 0xD800 <= cp <= 0xDFFF
        and chr(cp).lower() != chr(cp)
        and (chr(cp) in vocab_chars or not vocab_chars.isdisjoint(chr(cp).lower()))
        and not chars.is_removed_char(chr(cp))
    ]
    if not candidates:
        return ()
    icu = tf.strings.lower([c.encode() for c in candidates], encoding="utf-8").numpy()
    return tuple((c, c.lower()) for c, got in zip(candidates, icu) if got.decode() != c.lower())

"""BERT's character classes and basic tokenization (clean, CJK spacing, NFC, whitespace split,
lower-casing and accent stripping, punctuation split): the rules in ``bertjax.text.tokenization``."""

import re
import unicodedata

SUBWORD_PREFIX = "##"


# CJK Unified Ideographs blocks, as BERT defines "Chinese character".
CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)


# Character classes (BERT definitions).
def is_cjk_char(char: str) -> bool:
    """True for a CJK ideograph, which BERT always treats as a word of its own."""
    cp = ord(char)
    return any(lo <= cp <= hi for lo, hi in CJK_RANGES)


def is_removed_char(char: str) -> bool:
    """True for a character that BERT's text cleaning drops (NUL, U+FFFD, Unicode "C*" controls)."""
    if char in "\t\n\r":
        return False
    return char in "\x00\ufffd" or unicodedata.category(char).startswith("C")


def is_whitespace_char(char: str) -> bool:
    """True for a character that BERT's text cleaning maps to a space."""
    return char in " \t\n\r" or unicodedata.category(char) == "Zs"


def is_punctuation_char(char: str) -> bool:
    """True for BERT punctuation: Unicode "P*" and every ASCII character that is not alphanumeric."""
    cp = ord(char)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


class _CleanTable(dict):
    """str.translate table for BERT's cleaning + CJK spacing, filled lazily per character."""

    def __missing__(self, cp: int) -> str | None:
        char = chr(cp)
        if is_removed_char(char):
            out = None
        elif is_whitespace_char(char):
            out = " "
        elif is_cjk_char(char):
            out = f" {char} "
        else:
            out = char
        self[cp] = out
        return out


_CLEAN = _CleanTable()
# ASCII fast path: only C0 controls and DEL are removed (tab/newline/return are split on later).
_ASCII_CLEAN = {cp: None for cp in [*range(0, 9), 11, 12, *range(14, 32), 127]}
_ASCII_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# A cleaned ASCII word (no controls, no whitespace): runs of alphanumerics and single punctuation.
_ASCII_PIECES = re.compile(r"[0-9A-Za-z]+|[^0-9A-Za-z]")


def whitespace_words(text: str) -> list[str]:
    """Steps 1-3: clean, space out CJK ideographs, NFC (as transformers does) and split on spaces."""
    if text.isascii():
        return (text.translate(_ASCII_CLEAN) if _ASCII_CONTROL.search(text) else text).split()
    return unicodedata.normalize("NFC", text.translate(_CLEAN)).split()


def _strip_accents(text: str) -> str:
    """NFD, then drop combining marks (category Mn)."""
    return "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")


def _split_punctuation(text: str) -> list[str]:
    """Splits every punctuation character into a word of its own."""
    out: list[str] = []
    word: list[str] = []
    for char in text:
        if is_punctuation_char(char):
            if word:
                out.append("".join(word))
                word = []
            out.append(char)
        else:
            word.append(char)
    if word:
        out.append("".join(word))
    return out


def basic_split_word(word: str, do_lower_case: bool) -> list[str]:
    """Steps 4-5 on one whitespace-delimited word."""
    if do_lower_case:
        word = word.lower()
        if not word.isascii():
            word = _strip_accents(word)
    if word.isascii():  # every ASCII character left is alphanumeric or punctuation
        return [word] if word.isalnum() else _ASCII_PIECES.findall(word)
    # Lower-casing or accent stripping can, in rare cases, leave whitespace: split on it again.
    return [piece for part in _split_punctuation(word) for piece in part.split()]


def basic_tokenize(text: str, do_lower_case: bool) -> list[str]:
    """BERT's BasicTokenizer: clean, split CJK, whitespace, lower+strip accents, punctuation."""
    return [w for word in whitespace_words(text) for w in basic_split_word(word, do_lower_case)]

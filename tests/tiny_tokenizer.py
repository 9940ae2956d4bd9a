"""A stand-in tokenizer for data-reader tests (no vocabulary file, no TensorFlow)."""

import re


class TinyTokenizer:
    """Stand-in with the bertjax.text.tokenization interface: lower-case, punctuation split, WordPiece."""

    def __init__(self, words):
        self.vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
        self._ids = {t: i for i, t in enumerate(self.vocab)}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = 0, 1, 2, 3, 4

    def tokenize(self, text):
        out = []
        for word in re.findall(r"\w+|[^\w\s]", text.lower()):
            pieces, start = [], 0
            while start < len(word):
                for end in range(len(word), start, -1):
                    piece = word[start:end] if start == 0 else "##" + word[start:end]
                    if piece in self._ids:
                        pieces.append(piece)
                        start = end
                        break
                else:
                    pieces, start = ["[UNK]"], len(word)
            out.extend(pieces)
        return out

    def convert_tokens_to_ids(self, tokens):
        return [self._ids.get(t, self.unk_id) for t in tokens]

    def encode(self, text):
        return self.convert_tokens_to_ids(self.tokenize(text))

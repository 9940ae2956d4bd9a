"""Training a new vocabulary: BERT WordPiece vocab.txt or a SentencePiece unigram model.

Special-token layout (both kinds): [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4, then the learned
pieces. A WordPiece vocabulary that comes out smaller than `vocab_size` is padded at the end with
[unused0], [unused1], ... so its size is exactly `vocab_size` (model embedding tables stay fixed).

WordPiece words come from `tokenization.basic_tokenize` (the very rules the tokenizer applies), and
the pieces are learned by tensorflow-text's WordPiece learner (a threshold binary search of the
bottom-up algorithm of the BERT paper's vocabulary).
"""

import argparse
import collections
import io
from collections.abc import Iterator, Sequence

from bertjax import atomic
from bertjax.data import corpus
from bertjax.text import load_tokenizer, tokenization

KINDS = ("wordpiece", "sentencepiece")


def corpus_lines(
    spec: str | Sequence[str],
    corpus_format: str = "bert",
    max_lines: int | None = None,
    text_column: str = "text",
    text_column_setting: str = "text_column",
) -> Iterator[str]:
    """The sentences of a corpus, read exactly as ``prepare`` reads it (``bertjax.data.corpus``:
    globs, ``gs://``, ``tfds:``; formats bert / text / jsonl / parquet), stopping after
    ``max_lines``; errors call the option that chose ``text_column`` ``text_column_setting``."""
    count = 0
    documents = corpus.iter_documents(
        spec, corpus_format, text_column=text_column, text_column_setting=text_column_setting
    )
    for document in documents:
        for sentence in document:
            if max_lines is not None and count >= max_lines:
                return
            count += 1
            yield sentence


def count_words(lines: Iterator[str], do_lower_case: bool) -> collections.Counter:
    """Counts BERT basic-tokenized words (whitespace words are counted first, then split once)."""
    raw = collections.Counter()
    for line in lines:
        raw.update(tokenization.whitespace_words(line))
    counts = collections.Counter()
    for word, n in raw.items():
        for w in tokenization.basic_split_word(word, do_lower_case):
            counts[w] += n
    return counts


MAX_PIECE_CHARS = 50  # longer words are left out of WordPiece learning
MAX_ALPHABET = 1000  # the most frequent characters; words with other characters are left out
LEARN_ITERATIONS = 4


def _greedy_starts(word: str, tokens: dict[str, int], max_len: int) -> list[int] | None:
    """Start offsets of the greedy longest-match WordPiece split of word, None if not coverable."""
    starts, start, n = [], 0, len(word)
    while start < n:
        end = min(n, start + max_len)
        while end > start:
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in tokens:
                break
            end -= 1
        if end == start:
            return None
        starts.append(start)
        start = end
    return starts


def _piece_counts(words: list[tuple[str, int]], tokens: dict[str, int] | None) -> dict[str, int]:
    """One pass of the bottom-up WordPiece learner (tensorflow-text's algorithm).

    Counts every substring that starts where a piece of the current split starts (every offset
    when tokens is None), then, longest first, subtracts each candidate's count from its shorter
    prefixes so a prefix keeps only the occurrences its extensions do not explain.
    """
    by_len: list[dict[str, int]] = [{} for _ in range(MAX_PIECE_CHARS + 1)]
    max_len = max((len(t) for t in tokens), default=1) if tokens is not None else 0
    for word, count in words:
        n = len(word)
        starts = range(n) if tokens is None else _greedy_starts(word, tokens, max_len)
        if starts is None:
            continue
        for start in starts:
            prefix = "" if start == 0 else "##"
            for end in range(start + 1, n + 1):
                table = by_len[end - start]
                piece = prefix + word[start:end]
                table[piece] = table.get(piece, 0) + count
    adjusted: dict[str, int] = {}
    for length in range(MAX_PIECE_CHARS, 0, -1):
        for piece, count in by_len[length].items():
            adjusted[piece] = count
            skip = 2 if piece.startswith("##") else 0
            for k in range(1, length):
                shorter = by_len[k]
                head = piece[: skip + k]
                if head in shorter:
                    shorter[head] -= count
    return adjusted


def _learn_at_threshold(
    words: list[tuple[str, int]], first_pass: dict[str, int], chars: set[str], thresh: int
) -> dict[str, int]:
    """Pieces (with counts) kept at a count threshold after LEARN_ITERATIONS passes."""

    def keep(counts: dict[str, int]) -> dict[str, int]:
        kept = {p: c for p, c in counts.items() if c >= thresh}
        for c in chars:
            kept.setdefault(c, 1)
            kept.setdefault("##" + c, 1)
        return kept

    tokens = keep(first_pass)  # the first pass does not depend on the threshold: computed once
    for _ in range(LEARN_ITERATIONS - 1):
        tokens = keep(_piece_counts(words, tokens))
    return tokens


def _final_vocab(chars: set[str], tokens: dict[str, int]) -> list[str]:
    """Specials, single characters (sorted), then pieces by falling count (ties alphabetical)."""
    ranked = sorted(tokens.items(), key=lambda kv: (-kv[1], kv[0]))
    out = dict.fromkeys([*tokenization.SPECIAL_TOKENS, *sorted(chars), *(p for p, _ in ranked)])
    return list(out)


def _learn_wordpiece(counts: collections.Counter, vocab_size: int) -> list[str]:
    """WordPiece learning on word counts -> vocabulary of exactly vocab_size tokens.

    Geometric search over the count threshold for the largest vocabulary not above vocab_size
    (within 5%); the closest larger one is cut at its rarest pieces when none fits, and a smaller
    one is padded with [unusedN].
    """
    specials = set(tokenization.SPECIAL_TOKENS)
    words = [(w, c) for w, c in counts.items() if len(w) <= MAX_PIECE_CHARS and w not in specials]
    char_counts: collections.Counter = collections.Counter()
    for w, c in words:
        for ch in w:
            char_counts[ch] += c
    alphabet = {
        ch for ch, _ in sorted(char_counts.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_ALPHABET]
    }
    words = [(w, c) for w, c in words if alphabet.issuperset(w)]
    words.sort(key=lambda wc: -wc[1])
    chars = {ch for w, _ in words for ch in w}
    first_pass = _piece_counts(words, None)
    lo, hi = 1, max(c for _, c in words) + 1
    best_under: list[str] | None = None
    best_over: list[str] | None = None
    while hi - lo > 1:
        thresh = max(lo + 1, min(hi - 1, round((lo * hi) ** 0.5)))
        vocab = _final_vocab(chars, _learn_at_threshold(words, first_pass, chars, thresh))
        if len(vocab) > vocab_size:
            lo, best_over = thresh, vocab  # raise the threshold
        else:
            hi, best_under = thresh, vocab
            if len(vocab) >= 0.95 * vocab_size:
                break
    if best_under is not None and (best_over is None or len(best_under) >= 0.95 * vocab_size):
        vocab = best_under
    elif best_over is not None:
        vocab = best_over
    else:  # a single threshold candidate: every word count is 1
        vocab = _final_vocab(chars, _learn_at_threshold(words, first_pass, chars, 1))
    if len(vocab) > vocab_size:
        fixed = [t for t in vocab if t in specials or len(t.removeprefix("##")) == 1]
        if len(fixed) > vocab_size:
            raise ValueError(
                f"vocab_size={vocab_size} is too small for the {len(fixed)} special and "
                "single-character pieces of this corpus"
            )
        keep = set(fixed) | set([t for t in vocab if t not in fixed][: vocab_size - len(fixed)])
        vocab = [t for t in vocab if t in keep]
    return vocab + [f"[unused{i}]" for i in range(vocab_size - len(vocab))]


def _train_sentencepiece(
    lines: Iterator[str], prefix: str, vocab_size: int, do_lower_case: bool, seed: int
) -> str:
    """Unigram SentencePiece with the BERT specials; writes prefix.model and prefix.vocab."""
    import sentencepiece as spm  # noqa: PLC0415

    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    seen = 0

    def counted() -> Iterator[str]:
        nonlocal seen
        for line in lines:
            seen += 1
            yield line

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=counted(),
            model_writer=model,
            model_type="unigram",
            vocab_size=vocab_size,
            pad_id=0,
            unk_id=1,
            bos_id=2,
            eos_id=3,
            pad_piece="[PAD]",
            unk_piece="[UNK]",
            bos_piece="[CLS]",
            eos_piece="[SEP]",
            control_symbols=["[MASK]"],
            normalization_rule_name="nmt_nfkc_cf" if do_lower_case else "nmt_nfkc",
            character_coverage=1.0,  # every character seen (no [UNK] for rare letters)
            input_sentence_size=2_000_000,
            shuffle_input_sentence=True,
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as e:
        if seen == 0:
            raise ValueError("vocabulary training input holds no text") from None
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        raise ValueError(f"SentencePiece training failed: {msg}") from None
    proto = model.getvalue()
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(proto)
    vocab_text = "".join(
        f"{sp.IdToPiece(i)}\t{sp.GetScore(i):g}\n" for i in range(sp.GetPieceSize())
    )
    atomic.write_text(prefix + ".vocab", vocab_text)
    atomic.write_bytes(prefix + ".model", proto)
    return prefix + ".model"


def train_vocab(
    files: list[str],
    output: str,
    vocab_size: int,
    kind: str = "wordpiece",
    do_lower_case: bool = True,
    max_lines: int | None = None,
    seed: int = 0,
    corpus_format: str = "bert",
    text_column: str = "text",
    text_column_setting: str = "text_column",
) -> str:
    """Trains a vocabulary on a corpus (files, globs, ``gs://``, ``tfds:``; read as ``prepare``
    reads it, in ``corpus_format``) and returns the written path.

    kind "wordpiece": writes `output` as a BERT vocab.txt of exactly `vocab_size` tokens.
    kind "sentencepiece": writes `output`.model and `output`.vocab (a trailing ".model" on `output`
    is dropped) for a unigram model whose pieces 0-4 are [PAD] [UNK] [CLS] [SEP] [MASK]; lower-casing
    is built into the model's normalizer when do_lower_case.
    Input is streamed; only the first max_lines non-blank lines are read when given.
    `text_column_setting` is what errors call the option that chose `text_column` (`--text_column`,
    `data.text_column`).
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: must be one of {', '.join(KINDS)}")
    if vocab_size <= len(tokenization.SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} must exceed the {len(tokenization.SPECIAL_TOKENS)} specials"
        )
    if max_lines is not None and max_lines <= 0:
        raise ValueError(f"max_lines={max_lines} must be positive")
    lines = corpus_lines(files, corpus_format, max_lines, text_column, text_column_setting)
    if kind == "sentencepiece":
        prefix = output.removesuffix(".model")
        return _train_sentencepiece(lines, prefix, vocab_size, do_lower_case, seed)
    counts = count_words(lines, do_lower_case)
    if not counts:
        raise ValueError(f"no text in the vocabulary training input ({files})")
    vocab = _learn_wordpiece(counts, vocab_size)
    atomic.write_text(output, "".join(t + "\n" for t in vocab))
    return output


def main(argv: list[str]) -> None:
    """`bertjax vocab`: train a WordPiece vocab.txt or a SentencePiece model from text files."""
    parser = argparse.ArgumentParser(prog="bertjax vocab", description=main.__doc__)
    parser.add_argument(
        "--input",
        action="append",
        required=True,
        help="text file glob; repeat the flag or separate globs with commas",
    )
    parser.add_argument("--output", required=True, help="vocab.txt path, or model prefix")
    parser.add_argument("--vocab_size", type=int, default=30522)
    parser.add_argument("--kind", choices=KINDS, default="wordpiece")
    parser.add_argument(
        "--lower_case",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="lower-case and strip accents (--nolower_case / --no-lower_case to keep case)",
    )
    parser.add_argument("--nolower_case", dest="lower_case", action="store_false")
    parser.add_argument("--max_lines", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--format",
        default="bert",
        choices=corpus.FORMATS,
        help="corpus format, as for `bertjax prepare` (bert: one sentence per line)",
    )
    parser.add_argument("--text_column", default="text", help="JSON key / Parquet column")
    args = parser.parse_args(argv)
    path = train_vocab(
        args.input,
        args.output,
        args.vocab_size,
        kind=args.kind,
        do_lower_case=args.lower_case,
        max_lines=args.max_lines,
        seed=args.seed,
        corpus_format=args.format,
        text_column=args.text_column,
        text_column_setting="--text_column",
    )
    tok = load_tokenizer(path, None if args.kind == "sentencepiece" else args.lower_case)
    print(f"wrote {path} ({tok.kind}, {tok.vocab_size} tokens, do_lower_case={tok.do_lower_case})")

"""Corpus readers: sentence splitting, the bert/text formats, globs, gfile paths, TFDS, demo corpus."""

import os

import pytest
import tensorflow as tf

from bertjax.data import corpus, demo_corpus


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Mr. Smith met Dr. Watson. They spoke.", ["Mr. Smith met Dr. Watson.", "They spoke."]),
        (
            "It costs 3.50 dollars. Cheap, e.g. Apples too.",
            ["It costs 3.50 dollars.", "Cheap, e.g. Apples too."],
        ),
        (
            "J. R. R. Tolkien wrote it. So did I. Then he left.",
            ["J. R. R. Tolkien wrote it.", "So did I.", "Then he left."],
        ),
        ('"Stop!" he cried. "Why?" She left.', ['"Stop!" he cried.', '"Why?"', "She left."]),
        ("He said “go.” Then (Really.) Yes!", ["He said “go.”", "Then (Really.)", "Yes!"]),
        ("The U.S. Army came. Wait... What?", ["The U.S. Army came.", "Wait...", "What?"]),
        ("他来了。她走了。", ["他来了。", "她走了。"]),
        ("no capital. after this", ["no capital. after this"]),
        ("   ", []),
    ],
)
def test_split_sentences(text, expected):
    assert corpus.split_sentences(text) == expected


def test_headings():
    for line in [
        "CHAPTER IV.",
        "Chapter 12",
        "BOOK THE FIRST",
        "[ 3 ]",
        "XIV",
        "PREFACE",
        "Stave One: Marley",
    ]:
        assert corpus.is_heading(line), line
    for line in [
        "Chapter and verse were quoted at length.",
        "I went home.",
        "Bookshelves lined the wall.",
    ]:
        assert not corpus.is_heading(line), line


def test_bert_format(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"\xef\xbb\xbfFirst one.\r\nSecond one.\r\n\r\n\r\nOther doc.\n  \nLast doc.")
    assert list(corpus.iter_documents(str(path), "bert")) == [
        ["First one.", "Second one."],
        ["Other doc."],
        ["Last doc."],
    ]


GUTENBERG = """\ufeffThe Project Gutenberg EBook of Test, by Nobody\r
\r
Title: Test\r
\r
*** START OF THIS PROJECT GUTENBERG EBOOK TEST ***\r
\r
Produced by Someone Kind\r
\r
CHAPTER I.\r
\r
It was a dark night. Mr. Holmes\r
smoked a pipe.\r
\r
"Who is there?" he asked.\r
\r
CHAPTER II.\r
\r
Morning came. The rain stopped.\r
\r
\r
\r
A new part began here.\r
\r
*** END OF THIS PROJECT GUTENBERG EBOOK TEST ***\r
Licence text that must not appear.\r
"""


def test_text_format_gutenberg(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(GUTENBERG.encode("utf-8"))
    assert list(corpus.iter_documents(str(path), "text")) == [
        ["It was a dark night.", "Mr. Holmes smoked a pipe.", '"Who is there?" he asked.'],
        ["Morning came.", "The rain stopped."],
        ["A new part began here."],
    ]


def test_text_format_without_gutenberg_markers_keeps_everything(tmp_path):
    path = tmp_path / "plain.txt"
    path.write_text("Title line here.\n\nBody text. More text.\n")
    assert list(corpus.iter_documents(str(path), "text")) == [
        ["Title line here.", "Body text.", "More text."]
    ]


def test_globs_sorted_and_errors(tmp_path):
    for name in ["b.txt", "a.txt"]:
        (tmp_path / name).write_text(f"{name} sentence.\n")
    sources = corpus.list_sources(f"{tmp_path}/*.txt")
    assert [os.path.basename(s.path) for s in sources] == ["a.txt", "b.txt"]
    assert len(corpus.list_sources([f"{tmp_path}/a.txt", f"{tmp_path}/b.txt"])) == 2
    with pytest.raises(FileNotFoundError, match="matches no files"):
        corpus.list_sources(f"{tmp_path}/*.none")
    with pytest.raises(FileNotFoundError, match="missing.txt does not exist"):
        corpus.list_sources(f"{tmp_path}/missing.txt")
    with pytest.raises(ValueError, match="is a directory"):
        corpus.list_sources(str(tmp_path))
    with pytest.raises(ValueError, match="empty corpus spec"):
        corpus.list_sources(" , ")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\nbad \xff byte\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: not valid UTF-8"):
        list(corpus.iter_documents(str(bad), "bert"))
    with pytest.raises(ValueError, match="unknown corpus format"):
        list(corpus.iter_documents(str(bad), "xml"))


def test_gfile_scheme_paths():
    """Paths with a scheme (gs://, ...) go through tf.io.gfile; TF's ram:// filesystem stands in."""
    tf.io.gfile.makedirs("ram://corpus")
    for i in range(2):
        with tf.io.gfile.GFile(f"ram://corpus/part{i}.txt", "w") as f:
            f.write(f"Doc {i} first.\r\nDoc {i} second.\r\n\r\nDoc {i} again.\r\n")
    docs = list(corpus.iter_documents("ram://corpus/part*.txt", "bert"))
    assert docs == [
        ["Doc 0 first.", "Doc 0 second."],
        ["Doc 0 again."],
        ["Doc 1 first.", "Doc 1 second."],
        ["Doc 1 again."],
    ]


def test_tfds_dataset_by_name(tmp_path):
    import tensorflow_datasets as tfds

    class TinyTextCorpus(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                features=tfds.features.FeaturesDict(
                    {"text": tfds.features.Text(), "title": tfds.features.Text()}
                ),
            )

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i in range(3):
                yield (
                    i,
                    {
                        "text": f"Article {i} starts. It goes on.\nNew paragraph {i}.",
                        "title": f"T{i}",
                    },
                )

    TinyTextCorpus(data_dir=str(tmp_path)).download_and_prepare()
    docs = list(
        corpus.iter_documents("tfds:tiny_text_corpus:train", "text", tfds_data_dir=str(tmp_path))
    )
    assert sorted(docs) == [
        [f"Article {i} starts.", "It goes on.", f"New paragraph {i}."] for i in range(3)
    ]
    titles = list(
        corpus.iter_documents(
            "tfds:tiny_text_corpus:train:title", "bert", tfds_data_dir=str(tmp_path)
        )
    )
    assert sorted(titles) == [["T0"], ["T1"], ["T2"]]
    with pytest.raises(ValueError, match="has no feature 'body'"):
        corpus.list_sources("tfds:tiny_text_corpus:train:body", tfds_data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="bad TFDS corpus spec"):
        corpus.list_sources("tfds:tiny_text_corpus")


@pytest.mark.shared_data
def test_real_gutenberg_novel(shared_data):
    path = shared_data / "corpus" / "gutenberg" / "Pride-and-Prejudice_1342__1342-0.txt"
    docs = list(corpus.iter_documents(str(path), "text"))
    assert 55 <= len(docs) <= 70  # 61 chapters (+ title page)
    assert docs[1][0].startswith("It is a truth universally acknowledged, that a single man")
    text = " ".join(s for d in docs for s in d)
    assert "Project Gutenberg" not in text and "Chapter 1" not in text
    assert docs[1][3] == "Mr. Bennet replied that he had not."


def test_demo_corpus_from_stdlib_docstrings(tmp_path):
    """The demo corpus on a small stand-in "stdlib" (the full build is timed outside the suite)."""
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    (lib / "site-packages").mkdir()
    (lib / "pkg" / "mod.py").write_text(
        '"""Tools for testing the corpus builder. They are tiny on purpose.\n\n'
        '>>> do_not_keep()\n"""\n'
        'import sys\nsys.exit("a module must never be run")\n'
        'class Thing:\n    """A thing that holds values. It is used twice."""\n'
        '    def method(self):\n        """Return the value of this thing. Nothing else happens here."""\n'
    )
    (lib / "copy.py").write_text(
        '"""A thing that holds values. It is used twice."""\n'
    )  # duplicate
    (lib / "site-packages" / "other.py").write_text(
        '"""Not the standard library at all. Skip it."""\n'
    )
    paths = demo_corpus.build_demo_corpus(str(tmp_path / "out"), stdlib_dir=str(lib))
    text = "".join(open(p).read() for p in paths)
    assert text == (  # files in a folder come before its sub-folders; the copy in mod.py is skipped
        "A thing that holds values.\nIt is used twice.\n\n"
        "Tools for testing the corpus builder.\nThey are tiny on purpose.\n"
        "Return the value of this thing.\nNothing else happens here.\n\n"
    )
    assert paths == demo_corpus.build_demo_corpus(str(tmp_path / "out"), stdlib_dir=str(lib))
    assert text == "".join(open(p).read() for p in paths)  # deterministic

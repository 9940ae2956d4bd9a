"""An offline English demo corpus: the docstrings of the running Python's standard library.

The stdlib sources are parsed with `ast` (nothing is imported or run). A module is one document: its
module, class and function docstrings in source order (and each topic of `pydoc_data/topics.py`, the
language reference that `help()` shows, is one document), each cleaned to prose (doctest sessions, code
blocks after `::`, parameter lists and reST/markup-only lines dropped), cut into sentences with
`corpus.split_sentences`. A docstring seen before (inherited copies, shared boilerplate) is skipped.
Modules are dealt round-robin into `NUM_FILES` files in the "bert" format (one sentence per line, a
blank line between documents) so `prepare` can use several workers. Same Python -> same bytes.
"""

from __future__ import annotations

import ast
import collections
import functools
import hashlib
import inspect
import os
import re
import sysconfig
from collections.abc import Iterator

from bertjax.data.corpus import split_sentences

NUM_FILES = 8
MIN_SENTENCE_WORDS = 4
_SKIP_DIRS = frozenset("site-packages dist-packages __pycache__ ensurepip venv".split())
_TOPICS = os.path.join("pydoc_data", "topics.py")
_FIELD = re.compile(
    r"^\s*(:\w+|@\w+|Args:|Arguments:|Returns?:|Raises:|Yields?:|Example|Note:|\.\.)"
)
_MARKUP_ONLY = re.compile(r"^[\s\-=~*#^`'\"|+_.:]*$")
_WORD = re.compile(r"[A-Za-z][a-z]+")
_STATEMENT_FIELDS = frozenset({"body", "orelse", "handlers", "finalbody", "cases"})


def stdlib_sources(stdlib_dir: str | None = None) -> Iterator[str]:
    """Paths of the standard library's .py files (site-packages excluded), sorted."""
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test_"):
                yield os.path.join(dirpath, name)


def _prose_paragraphs(doc: str) -> Iterator[str]:
    """Paragraphs of a cleaned docstring that read as prose."""
    paragraphs: list[list[str]] = [[]]
    in_code = False
    for line in inspect.cleandoc(doc).splitlines():
        stripped = line.strip()
        if not stripped:
            paragraphs.append([])
            continue
        if in_code and line[:1].isspace():
            continue  # the indented block of a "::" literal
        in_code = False
        if stripped.startswith((">>>", "...")) or _FIELD.match(line) or _MARKUP_ONLY.match(line):
            paragraphs.append([])
            continue
        if line[:1].isspace():  # indented: argument descriptions, tables, code
            paragraphs.append([])
            continue
        paragraphs[-1].append(stripped)
        if stripped.endswith("::"):
            in_code = True
            paragraphs.append([])
    for lines in paragraphs:
        text = " ".join(lines)
        words = text.split()
        if len(words) >= MIN_SENTENCE_WORDS and len(_WORD.findall(text)) >= 0.6 * len(words):
            yield text


def _docstring_groups(path: str) -> list[list[str]]:
    """The docstrings of one source file, grouped by document (one group, or one per pydoc topic)."""
    with open(path, "rb") as f:
        source = f.read()
    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError):
        return []  # e.g. files for another Python version kept as data
    if path.endswith(_TOPICS):  # the language reference pydoc shows: {topic: text}
        dicts = [n for n in ast.walk(tree) if isinstance(n, ast.Dict)]
        return [[v.value] for d in dicts for v in d.values if isinstance(v, ast.Constant)]
    nodes = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = [
        ast.get_docstring(n, clean=False)
        for n in [tree, *_statements(tree)]
        if n is tree or isinstance(n, nodes)
    ]
    return [[d for d in docs if d]]


def _statements(tree: ast.Module) -> Iterator[ast.AST]:
    """The statement-level nodes of tree in `ast.walk`'s breadth-first order, without descending
    into expressions (no definition is inside one): the same definitions in the same order, at a
    fraction of the walk."""
    queue = collections.deque([tree])
    while queue:
        node = queue.popleft()
        for field in _statement_fields(type(node)):
            queue.extend(getattr(node, field))
        yield node


@functools.cache
def _statement_fields(node_type: type) -> tuple[str, ...]:
    """The fields of a node type that hold statements (or handlers, cases), in `_fields` order."""
    return tuple(f for f in node_type._fields if f in _STATEMENT_FIELDS)


def source_documents(path: str, seen: set[bytes]) -> list[list[str]]:
    """Documents (sentence lists) of one source file's not-yet-seen docstrings; updates `seen`."""
    documents = []
    for group in _docstring_groups(path):
        sentences = []
        for doc in group:
            digest = hashlib.sha1(" ".join(doc.split()).encode()).digest()
            if digest in seen:
                continue
            seen.add(digest)
            for paragraph in _prose_paragraphs(doc):
                sentences.extend(
                    s for s in split_sentences(paragraph) if len(s.split()) >= MIN_SENTENCE_WORDS
                )
        if len(sentences) >= 2:
            documents.append(sentences)
    return documents


def build_demo_corpus(output_dir: str, stdlib_dir: str | None = None) -> list[str]:
    """Writes the stdlib-docstring corpus as `demo-{i:02d}-of-{n:02d}.txt`; returns the paths."""
    os.makedirs(output_dir, exist_ok=True)
    paths = [
        os.path.join(output_dir, f"demo-{i:02d}-of-{NUM_FILES:02d}.txt") for i in range(NUM_FILES)
    ]
    handles = [open(f"{p}.tmp", "w", encoding="utf-8") for p in paths]  # noqa: SIM115
    seen: set[bytes] = set()
    count = 0
    try:
        for source in stdlib_sources(stdlib_dir):
            for sentences in source_documents(source, seen):
                handles[count % NUM_FILES].write("\n".join(sentences) + "\n\n")
                count += 1
    finally:
        for handle in handles:
            handle.close()
    if count == 0:
        raise ValueError(
            f"no docstrings found under {stdlib_dir or sysconfig.get_paths()['stdlib']}"
        )
    for path in paths:
        os.replace(f"{path}.tmp", path)
    return paths

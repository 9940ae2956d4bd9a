"""The progress of long phases (bertjax.progress): lines every BERTJAX_PROGRESS_SECONDS where
stderr is not a terminal, a tqdm bar on a terminal, nothing outside a phase or in a short one; the
commands' phases are checked where they run (test_retrieval_evaluate, test_mining, test_embed,
test_reranker_training, test_finetune)."""

from __future__ import annotations

import io
import re

import pytest

from bertjax import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream, total=10, steps=5, what="embedding the corpus"):
    with progress.phase(what, total, "texts", stream=stream):
        for _ in range(steps):
            progress.advance(total // steps)


def test_lines_name_the_phase_count_rate_and_time_left(monkeypatch):
    monkeypatch.setenv(progress.SECONDS_VARIABLE, "0")
    out = io.StringIO()
    _run(out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 5, lines  # 2, 4, 6, 8 of 10, then the last one
    assert re.fullmatch(
        r"bertjax: embedding the corpus: 2/10 texts \(20%\), [\d,.]+ texts/s, about \d+ s left",
        lines[0],
    ), lines[0]
    assert re.fullmatch(
        r"bertjax: embedding the corpus: 10/10 texts \(100%\), [\d,.]+ texts/s, done in \d+ s",
        lines[-1],
    ), lines[-1]


def test_a_phase_shorter_than_the_interval_prints_nothing(monkeypatch):
    monkeypatch.delenv(progress.SECONDS_VARIABLE, raising=False)  # 30 s
    out = io.StringIO()
    _run(out)
    assert out.getvalue() == ""
    monkeypatch.setenv(progress.SECONDS_VARIABLE, "inf")
    _run(out)
    assert out.getvalue() == ""


def test_outside_a_phase_nothing_is_counted_and_inside_one_the_outer_counts(monkeypatch):
    monkeypatch.setenv(progress.SECONDS_VARIABLE, "0")
    progress.advance(3)  # a library call outside any command: nothing to show, no error
    out = io.StringIO()
    with progress.phase("reranking", 4, "pairs", stream=out):
        with progress.phase("predicting", 100, "rows", stream=out):  # inner: the outer counts
            progress.advance(2)
        progress.advance(2)
    lines = out.getvalue().splitlines()
    assert all(line.startswith("bertjax: reranking: ") for line in lines), lines
    assert "4/4 pairs (100%)" in lines[-1] and "done in" in lines[-1]


def test_a_terminal_gets_a_bar(monkeypatch):
    monkeypatch.setattr(progress, "BAR_DELAY", 0.0)
    out = _Terminal()
    _run(out, total=8, steps=4)
    text = out.getvalue()
    assert "embedding the corpus" in text and "8/8" in text and "texts/s" in text.replace(" ", "")


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_bad_interval_is_one_line_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(progress.SECONDS_VARIABLE, value)
    with pytest.raises(ValueError, match=progress.SECONDS_VARIABLE) as e:
        _run(io.StringIO())
    assert "\n" not in str(e.value)


def test_durations_read_as_a_person_writes_them():
    assert [progress.duration(s) for s in (0.4, 42, 185, 7322)] == [
        "0 s",
        "42 s",
        "3 min 05 s",
        "2 h 02 min",
    ]


def test_prepare_shows_lines_of_bytes_where_stderr_is_not_a_terminal(monkeypatch, capsys):
    from bertjax.data import units

    monkeypatch.setenv(progress.SECONDS_VARIABLE, "0")
    bar = units._progress_bar(1000, show=True)  # stderr is pytest's capture: not a terminal
    bar.n = 400
    bar.set_postfix_str("12 docs, 3 docs/s", refresh=True)
    bar.n = 1000
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("bertjax: prepare: 400/1,000 bytes (40%)"), lines
    assert lines[-1].startswith("bertjax: prepare: 1,000/1,000 bytes (100%)"), lines

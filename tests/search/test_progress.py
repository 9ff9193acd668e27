"""The tiny progress bar."""

from __future__ import annotations

import io

from kareus.search._progress import ProgressBar


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_in_place_on_a_terminal():
    out = _Tty()
    with ProgressBar(4, desc="search", file=out) as bar:
        bar.update(1, status="front 1 pts")
        bar.update(3)
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n")
    assert "search [" in text and "4/4" in text and "front 1 pts" in text
    assert "#" * 24 in text


def test_bar_off_by_default_when_not_a_terminal():
    out = io.StringIO()
    bar = ProgressBar(10, file=out)
    bar.update(10)
    bar.close()
    assert out.getvalue() == ""


def test_bar_sparse_on_a_file_when_forced():
    out = io.StringIO()
    bar = ProgressBar(100, file=out, enabled=True)
    for _ in range(100):
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert 10 <= len(lines) <= 12 and lines[-1].split("] ")[1].startswith("100/100")
    assert "\r" not in out.getvalue()


def test_bar_line_with_zero_total():
    assert "0/0" in ProgressBar(0, enabled=False).line()

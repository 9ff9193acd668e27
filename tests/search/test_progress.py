"""Progress: kareus's own bar on a terminal, plain lines in a pipe, tqdm when installed."""

from __future__ import annotations

import io
import sys
import time
import types

import pytest

from kareus.search import progress as _progress
from kareus.search.progress import ProgressBar, in_notebook


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_bar_in_place_on_a_terminal():
    out = _Tty()
    with ProgressBar(4, desc="search", file=out) as bar:
        assert bar.mode == "inplace"
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
    assert bar.mode == "off" and out.getvalue() == ""


def test_plain_lines_every_interval_in_a_pipe():
    """Forced on a file: one line at the start, then one per interval, then a final one."""
    out, clock = io.StringIO(), _Clock()
    bar = ProgressBar(60, desc="attn", file=out, enabled=True, interval_s=5.0, clock=clock)
    assert bar.mode == "lines"
    for _ in range(60):  # a step a second for a minute
        clock.t += 1.0
        bar.update(1, status="front 3 pts")
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # at 1 s, then every 5 s (6, 11, ..., 56), then the final 60/60 line
    assert len(lines) == 1 + 11 + 1
    assert lines[0].startswith("attn [") and " 1/60 1s front 3 pts" in lines[0]
    assert lines[-1].split("] ")[1].startswith("60/60 60s")
    times = [int(line.split("] ")[1].split()[1].rstrip("s")) for line in lines]
    assert all(b - a >= 4 for a, b in zip(times, times[1:]))


def test_final_line_not_repeated_when_just_printed():
    out, clock = io.StringIO(), _Clock()
    bar = ProgressBar(1, file=out, enabled=True, clock=clock)
    bar.update(1)
    bar.close()
    bar.close()
    assert out.getvalue().splitlines() == ["[" + "#" * 24 + "] 1/1 0s"]


def test_unknown_total_shows_elapsed_time_only():
    clock = _Clock()
    bar = ProgressBar(None, desc="composing", enabled=False, clock=clock)
    clock.t = 12.4
    bar.set_status("5 systems")
    assert bar.line() == "composing 12s 5 systems"
    assert "0/0" in ProgressBar(0, enabled=False).line()


def test_heartbeat_prints_while_a_long_call_runs():
    # Counted, not timed: the body runs until the heartbeat thread has drawn three lines
    # (a clock that moves a second at every read makes each redraw due), however late a
    # loaded machine schedules that thread; the deadline only ends a broken heartbeat.
    out, clock = io.StringIO(), _Clock()

    def tick() -> float:
        clock.t += 1.0
        return clock.t

    bar = ProgressBar(None, desc="composing", file=out, enabled=True, interval_s=0.5,
                      clock=tick)
    with bar, bar.heartbeat(every_s=0.001):
        deadline = time.monotonic() + 60.0
        while out.getvalue().count("\n") < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        drawn_in_the_body = out.getvalue().count("\n")
    lines = out.getvalue().splitlines()
    assert drawn_in_the_body >= 3
    assert all(line.startswith("composing ") for line in lines)


def test_heartbeat_silent_when_off():
    out = io.StringIO()
    bar = ProgressBar(None, file=out)
    with bar.heartbeat(every_s=0.01):
        time.sleep(0.05)
    bar.close()
    assert out.getvalue() == ""


def test_notebook_detection(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    assert not in_notebook()

    class ZMQInteractiveShell:  # the class name Jupyter's kernel shell has
        pass

    fake = types.ModuleType("IPython")
    fake.get_ipython = ZMQInteractiveShell  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", fake)
    assert in_notebook()
    fake.get_ipython = lambda: None  # type: ignore[attr-defined]
    assert not in_notebook()


def test_own_bar_in_a_notebook_without_tqdm(monkeypatch: pytest.MonkeyPatch):
    """A notebook's stderr is no terminal; the bar still draws in place there."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    monkeypatch.setattr(_progress, "in_notebook", lambda: True)
    monkeypatch.setattr(_progress, "_tqdm_class", lambda: None)
    with ProgressBar(2, desc="mlp") as bar:
        assert bar.mode == "inplace"
        bar.update(2)
    assert out.getvalue().startswith("\rmlp [") and "2/2" in out.getvalue()


def test_tqdm_auto_when_installed(monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("tqdm", reason="tqdm is optional; the own bar is tested above")
    out = _Tty()
    monkeypatch.setattr(sys, "stderr", out)
    with ProgressBar(3, desc="attn") as bar:
        assert bar.mode == "tqdm"
        bar.update(1, status="front 2 pts")
        bar.update(2)
    text = out.getvalue()
    assert "attn" in text and "3/3" in text and "front 2 pts" in text
    out.truncate(0)
    with ProgressBar(None, desc="composing 5 systems") as bar:
        bar.set_status("done")
    assert "composing 5 systems 00:00, done" in out.getvalue() and "it/s" not in out.getvalue()
    # never tqdm when asked not to, nor for an explicit file
    assert ProgressBar(3, use_tqdm=False).mode == "inplace"
    assert ProgressBar(3, file=_Tty()).mode == "inplace"

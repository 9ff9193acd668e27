"""Progress for long searches and compositions, on a terminal, in a notebook or in a log.

One ``ProgressBar`` picks how to show itself from where its output goes:

* **tqdm** (``tqdm.auto``: a widget in Jupyter, a text bar on a terminal) when tqdm is
  installed and the output is a terminal or a notebook; tqdm is optional, never required.
* **in place**: kareus's own bar, ``desc [#####.....] done/total 12s status``, redrawn
  with a carriage return, on a terminal or in a notebook without tqdm.
* **lines**: when the output is neither (a pipe, a log file, a CI job), a plain line
  when it starts, then at most one every ``interval_s`` seconds (default 5), and a final
  one when it closes, so a log shows the run advancing without filling up.

A bar without a known total (``total=None``) shows the elapsed time only; with
``ProgressBar.heartbeat`` a background thread redraws it while one long call runs
(what the workflow does while it composes the systems' frontiers).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["DEFAULT_INTERVAL_S", "ProgressBar", "in_notebook"]

#: Seconds between two plain lines when the output is not a terminal.
DEFAULT_INTERVAL_S = 5.0


def in_notebook() -> bool:
    """Whether this process is a Jupyter (or Colab) kernel."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()  # type: ignore[attr-defined]
    except Exception:  # a broken IPython is not a notebook
        return False
    return shell is not None and type(shell).__name__ in ("ZMQInteractiveShell", "Shell")


def _isatty(file: Any) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _tqdm_class() -> Any:
    try:
        from tqdm.auto import tqdm  # optional
    except ImportError:
        return None
    return tqdm


class ProgressBar:
    """Progress of ``total`` steps (or of elapsed time only) on ``file``.

    Args:
        total: Steps in all (>= 0), or ``None`` when unknown (elapsed time only).
        desc: Label in front of the bar.
        enabled: ``None`` = only when ``file`` is a terminal or this is a notebook;
            ``True`` also writes plain lines to a file or pipe; ``False`` = silent.
        file: Where to draw; ``None`` = ``sys.stderr`` (at the time of the call).
        width: Bar width in characters (kareus's own bar).
        interval_s: Seconds between plain lines when ``file`` is not a terminal.
        use_tqdm: ``None`` = ``tqdm.auto`` when it is installed and ``file`` is the
            process's stderr on a terminal or in a notebook; ``False`` = never.
        clock: Monotonic clock in seconds (tests inject one).

    Attributes:
        mode: ``"tqdm"``, ``"inplace"``, ``"lines"`` or ``"off"``.
    """

    def __init__(self, total: int | None, *, desc: str = "", enabled: bool | None = None,
                 file: TextIO | None = None, width: int = 24,
                 interval_s: float = DEFAULT_INTERVAL_S, use_tqdm: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        default_file = file is None
        self.file = sys.stderr if file is None else file
        self.total = None if total is None else max(int(total), 0)
        self.desc = desc
        self.width = width
        self.interval_s = float(interval_s)
        self.n = 0
        self.status = ""
        self._clock = clock
        isatty = _isatty(self.file)
        notebook = default_file and in_notebook()
        interactive = isatty or notebook
        on = interactive if enabled is None else bool(enabled)
        self._tqdm: Any = None
        if not on:
            self.mode = "off"
        elif interactive and use_tqdm is not False and default_file and _tqdm_class():
            self.mode = "tqdm"
        elif interactive:
            self.mode = "inplace"
        else:
            self.mode = "lines"
        self._start = clock()
        self._last_line: float | None = None
        self._last_text = ""
        self._closed = False
        self._lock = threading.Lock()
        if self.mode == "tqdm":
            # without a total: the elapsed time and the status only (no "0it [?it/s]")
            fmt = "{desc} {elapsed}{postfix}" if self.total is None else None
            self._tqdm = _tqdm_class()(total=self.total, desc=desc or None, file=self.file,
                                       leave=True, dynamic_ncols=True, bar_format=fmt)

    @property
    def enabled(self) -> bool:
        """Whether anything is shown."""
        return self.mode != "off"

    def update(self, n: int = 1, status: str | None = None) -> None:
        """Advance by ``n`` steps and optionally replace the status text."""
        with self._lock:
            self.n += n
            if status is not None:
                self.status = status
            if self._tqdm is not None:
                if status is not None:
                    self._tqdm.set_postfix_str(status, refresh=False)
                self._tqdm.update(n)
                return
            self._draw()

    def set_status(self, status: str) -> None:
        """Replace the status text after the bar."""
        with self._lock:
            self.status = status
            if self._tqdm is not None:
                self._tqdm.set_postfix_str(status)
                return
            self._draw()

    def refresh(self) -> None:
        """Redraw (elapsed time moves on); a plain line only once ``interval_s`` passed."""
        with self._lock:
            if self._tqdm is not None:
                self._tqdm.refresh()
                return
            self._draw()

    def elapsed_s(self) -> float:
        """Seconds since the bar was made."""
        return self._clock() - self._start

    def line(self) -> str:
        """The text of the bar as it stands."""
        head = f"{self.desc} " if self.desc else ""
        tail = f" {self.status}" if self.status else ""
        elapsed = f"{self.elapsed_s():.0f}s"
        if self.total is None:
            return f"{head}{elapsed}{tail}"
        frac = min(self.n / self.total, 1.0) if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        return f"{head}[{bar}] {self.n}/{self.total} {elapsed}{tail}"

    def _draw(self, final: bool = False) -> None:
        if self.mode in ("off", "tqdm") or self._closed:
            return
        if self.mode == "inplace":
            self.file.write("\r" + self.line() + ("\n" if final else ""))
        else:
            now = self._clock()
            due = self._last_line is None or now - self._last_line >= self.interval_s
            text = self.line()
            if not (due or final) or (final and text == self._last_text):
                return
            self._last_line, self._last_text = now, text
            self.file.write(text + "\n")
        self.file.flush()

    @contextmanager
    def heartbeat(self, every_s: float | None = None) -> Iterator[ProgressBar]:
        """Redraw from a background thread while the ``with`` body runs.

        Args:
            every_s: Seconds between redraws; ``None`` = 0.5 s in place, ``interval_s``
                for plain lines.
        """
        if self.mode == "off":
            yield self
            return
        period = every_s if every_s is not None else (
            self.interval_s if self.mode == "lines" else 0.5)
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(period):
                self.refresh()

        thread = threading.Thread(target=beat, name="kareus-progress", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()

    def close(self) -> None:
        """Draw the final state and stop drawing."""
        with self._lock:
            if self._closed:
                return
            if self._tqdm is not None:
                self._tqdm.close()
            elif self.enabled:
                self._draw(final=True)
            self._closed = True

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""A tiny progress bar on stderr for long searches.

kareus's dependency list is closed (numpy, xgboost, attrs, typing-extensions,
nvidia-ml-py), so tqdm is not available; this is the few lines a search needs: a
bar of profiles done out of the budget, with a short status after it, redrawn in
place on a terminal and printed sparsely (every 10%) when stderr is a file.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """Draws ``desc [#####.....] done/total status`` on ``file``.

    Args:
        total: Steps in all (>= 0).
        desc: Label in front of the bar.
        enabled: ``None`` = only when ``file`` is a terminal.
        file: Where to draw; ``None`` = ``sys.stderr``.
        width: Bar width in characters.
    """

    def __init__(self, total: int, *, desc: str = "", enabled: bool | None = None,
                 file: TextIO | None = None, width: int = 24) -> None:
        self.file = sys.stderr if file is None else file
        self.total = max(int(total), 0)
        self.desc = desc
        self.width = width
        self.n = 0
        self.status = ""
        isatty = bool(getattr(self.file, "isatty", lambda: False)())
        self.enabled = isatty if enabled is None else bool(enabled)
        self._inplace = isatty
        self._last_decile = -1
        self._start = time.monotonic()
        self._closed = False

    def update(self, n: int = 1, status: str | None = None) -> None:
        """Advance by ``n`` steps and optionally replace the status text."""
        self.n += n
        if status is not None:
            self.status = status
        self._draw()

    def set_status(self, status: str) -> None:
        self.status = status
        self._draw()

    def line(self) -> str:
        """The text of the bar as it stands."""
        frac = min(self.n / self.total, 1.0) if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self._start
        head = f"{self.desc} " if self.desc else ""
        tail = f" {self.status}" if self.status else ""
        return f"{head}[{bar}] {self.n}/{self.total} {elapsed:.0f}s{tail}"

    def _draw(self, final: bool = False) -> None:
        if not self.enabled or self._closed:
            return
        if self._inplace:
            self.file.write("\r" + self.line() + ("\n" if final else ""))
        else:
            decile = int(10 * self.n / self.total) if self.total else 10
            if decile == self._last_decile and not final:
                return
            self._last_decile = decile
            self.file.write(self.line() + "\n")
        self.file.flush()

    def close(self) -> None:
        """Draw the final state and stop drawing."""
        if self.enabled and not self._closed:
            self._draw(final=True)
        self._closed = True

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

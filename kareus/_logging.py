"""The ``kareus`` logger: what the library decided, through the standard ``logging``.

Every module logs to a child of the ``kareus`` logger (``logging.getLogger(__name__)``
through ``get_logger``): resumed searches, refusals (a folder or plan of another
job, a plan digest that differs between ranks), fallbacks (clock changes delivered by
event polling when the host-function extension is unavailable) and device and kernel
choices (which collective backend runs, which GPUs are measured).

The library only logs: the ``kareus`` logger has a ``logging.NullHandler``, so
nothing is printed unless the application configures logging. The command line does
that with ``configure`` (``kareus -v`` for info, ``-vv`` for debug); in your own
program, for example::

    import logging
    logging.basicConfig(level=logging.INFO)   # or:
    logging.getLogger("kareus").setLevel(logging.DEBUG)

This module imports nothing from kareus, so every layer may use it.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from kareus.errors import ArgumentError

__all__ = ["LOGGER_NAME", "configure", "get_logger"]

#: The name of the library's root logger.
LOGGER_NAME = "kareus"

_root = logging.getLogger(LOGGER_NAME)
if not any(isinstance(h, logging.NullHandler) for h in _root.handlers):
    _root.addHandler(logging.NullHandler())

_FORMAT = "kareus: %(levelname)s: %(message)s"


class _CliHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler ``configure`` installs (so that a second call replaces it).

    Without an explicit stream it writes to whatever ``sys.stderr`` is at each record, so
    a redirected or captured stderr (tests, notebooks) never leaves it writing to a
    closed file.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self._follow = stream is None
        super().__init__(stream)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr if self._follow else self._stream

    @stream.setter
    def stream(self, value: TextIO) -> None:
        self._stream = value


def get_logger(name: str = LOGGER_NAME) -> logging.Logger:
    """The logger of a kareus module (pass ``__name__``); the ``kareus`` logger by default.

    Args:
        name: A module name under ``kareus`` (``"kareus.exec.frequency"``) or ``"kareus"``.

    Raises:
        ValueError: ``name`` is not ``kareus`` or below it.
    """
    if name != LOGGER_NAME and not name.startswith(LOGGER_NAME + "."):
        raise ArgumentError(f"kareus loggers live under {LOGGER_NAME!r}, got {name!r}")
    return logging.getLogger(name)


def configure(verbosity: int = 0, *, stream: TextIO | None = None) -> logging.Handler:
    """Send the ``kareus`` logger's records to ``stream`` (what ``kareus -v`` does).

    Args:
        verbosity: 0 = warnings and errors, 1 = also info, 2 or more = also debug.
        stream: Where to write; ``None`` = ``sys.stderr``.

    Returns:
        The installed handler (a later call replaces it instead of adding another).
    """
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 \
        else logging.DEBUG
    for h in list(_root.handlers):
        if isinstance(h, _CliHandler):
            _root.removeHandler(h)
    handler = _CliHandler(stream)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.setLevel(level)
    _root.addHandler(handler)
    _root.setLevel(level)
    return handler

"""``python -m kareus`` runs the command line (and [`entry`][kareus.__main__.entry] is the
``kareus`` script's entry point)."""

from __future__ import annotations

import sys


def entry() -> int:
    """Run the ``kareus`` command as a process; returns its exit status.

    The command's modules are imported here, inside the guard: a Ctrl-C that arrives while
    they load (before [`console_main`][kareus.cli.console_main] has put its own handlers in
    place) is the same one line as later, ``kareus: interrupted``, and status 130, never a
    traceback from the imports.
    """
    try:
        from kareus.cli import console_main

        return console_main()
    except KeyboardInterrupt:
        print("kareus: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(entry())

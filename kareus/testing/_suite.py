"""The machinery the conformance suites share: running a table of checks, and pytest mix-ins.

Each suite (surrogates, acquisition passes, profilers) is a table of named checks; each
check raises ``AssertionError`` saying what is wrong. ``_run_checks`` runs a table and
names the first check that fails, whatever the plug-in raised there (an exception the
plug-in raises where the contract wants a result is a failure of that check, not a crash
of the suite); ``_add_tests`` gives a mix-in class one pytest test per check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kareus.errors import ArgumentError, ArgumentTypeError


def _run_checks(what: str, checks: dict[str, Callable[..., None]], skip: tuple[str, ...],
                *args: Any) -> None:
    """Run ``checks`` (name -> check) on ``args``, naming the first that fails.

    Raises:
        AssertionError: naming the check that failed and what went wrong: its assertion,
            or any other exception raised inside it (with the exception's type).
    """
    _check_run_arguments(what, checks, skip, *args)
    for name, check in checks.items():
        if name in skip:
            continue
        try:
            check(*args)
        except AssertionError as e:
            raise AssertionError(f"{what} conformance check {name!r} failed: {e}") from e
        except Exception as e:
            raise AssertionError(f"{what} conformance check {name!r} failed: it raised "
                                 f"{type(e).__name__}: {e}") from e


def _check_run_arguments(what: str, checks: dict[str, Callable[..., None]],
                         skip: tuple[str, ...], *args: Any) -> None:
    """A factory that cannot be called, or ``skip`` names that are no checks, are the
    caller's mistakes: typed errors naming the argument, before any check runs."""
    if what != "kernel set" and args and not callable(args[0]):
        raise ArgumentTypeError(f"make must be a callable that returns a new {what} (e.g. "
                                f"a class or a lambda), not {type(args[0]).__name__}")
    if isinstance(skip, str) or not isinstance(skip, (tuple, list, set, frozenset)):
        raise ArgumentTypeError(f"skip must be a tuple of check names, e.g. (\"{next(iter(checks))}\",), "
                                f"not {type(skip).__name__} {skip!r:.40}")
    unknown = [s for s in skip if s not in checks]
    if unknown:
        raise ArgumentError(f"skip names no {what} check {unknown!r:.60}; the checks: "
                            f"{', '.join(checks)}")


def _add_tests(cls: type, checks: dict[str, Callable[..., None]],
               args: Callable[[Any], tuple[Any, ...]]) -> type:
    """Give ``cls`` one pytest test per check, called with ``args(self)``."""
    for name, check in checks.items():
        def test(self: Any, _check: Callable[..., None] = check, _name: str = name) -> None:
            if _name in getattr(self, "skip_checks", ()):
                return
            _check(*args(self))
        test.__name__ = f"test_conformance_{name}"
        test.__doc__ = f"Conformance check {name!r}."
        setattr(cls, test.__name__, test)
    return cls

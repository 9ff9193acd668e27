"""Packages whose public names load on first use.

A package ``__init__`` that imports every module it re-exports makes importing any one of
its modules load all of them (``import kareus.profilers.emulator`` would load the NVML
profiler and, through it, the whole execution layer). The packages of kareus instead list
each public name with the module that defines it, and ``attach`` gives them a module
``__getattr__`` that imports that module the first time the name is asked for. The same
names are imported under ``TYPE_CHECKING`` in the package, for type checkers and the API
reference; ``tests/test_public_api.py`` checks that the two lists agree.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def attach(namespace: dict[str, Any], names: Mapping[str, str], *,
           fallback: Callable[[str], Any] | None = None
           ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` for a package's lazily loaded ``names``.

    Args:
        namespace: The package's ``globals()``.
        names: Public name -> the module that defines it.
        fallback: Called with a name that is not in ``names`` (deprecated aliases); raises
            ``AttributeError`` when absent.
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
            namespace[name] = value  # loaded once
            return value
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*names, *(k for k in namespace if not k.startswith("_"))}
                      - {"TYPE_CHECKING", "annotations"})

    return __getattr__, __dir__

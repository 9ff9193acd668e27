"""Load a script of bench/ as a module, for tests of its pure functions (importable from
every test: pytest puts tests/ on the path for its conftest.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as the module ``name`` (registered in ``sys.modules``, which
    dataclasses and pickling need)."""
    path = BENCH / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

"""Load a script of bench/ (or of bench/probes/) as a module, for tests of its pure
functions (importable from every test: pytest puts tests/ on the path for its conftest.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"
PROBES = BENCH / "probes"


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as the module ``kareus_bench_<name>``; ``"probes/<stem>"`` loads
    ``bench/probes/<stem>.py`` as ``kareus_bench_<stem>`` (registered in ``sys.modules``,
    which dataclasses and pickling need, under a prefix, so that a bench never shadows a
    package of its name for the rest of the test run: a bench once registered as
    ``grouped_gemm`` made Megatron-Core's ``import grouped_gemm`` find it)."""
    path = BENCH / f"{name}.py"
    stem = "kareus_bench_" + Path(name).name
    spec = importlib.util.spec_from_file_location(stem, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules[stem] = mod
    spec.loader.exec_module(mod)
    return mod

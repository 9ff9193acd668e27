"""The package's layers import only downward: model <- search <- compose <- exec <- workflow / cli.

A lower layer that imports a higher one would let objects cross layers untyped (as ``Any``)
and make the policy layers depend on hardware code; the policy layers (model, search,
compose) must also run on any CPU, so they never import torch or pynvml, not even lazily.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kareus"
RANK = {"model": 1, "search": 2, "compose": 3, "exec": 4, "workflow": 5, "cli": 5, "interop": 5,
        "tune": 5}
HARDWARE = ("torch", "pynvml", "triton", "liger_kernel", "zeus", "ray")
POLICY = ("model", "search", "compose")


def _layer(path: Path) -> str | None:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0] if parts and parts[0] in RANK else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute module name imported anywhere in ``path`` (functions included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            if node.module == "kareus":
                found += [(node.lineno, f"kareus.{a.name}") for a in node.names]
    return found


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = _layer(path)
        if layer is None:
            continue
        for line, module in _imports(path):
            parts = module.split(".")
            where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
            if parts[0] == "kareus":
                if len(parts) == 1:
                    bad.append(f"{where} (the top-level package imports every layer)")
                elif parts[1] in RANK and RANK[parts[1]] > RANK[layer]:
                    bad.append(f"{where} (an upward import: {layer} is below {parts[1]})")
                elif parts[1] == "testing":
                    bad.append(f"{where} (library code must not import kareus.testing)")
            elif layer in POLICY and parts[0] in HARDWARE:
                bad.append(f"{where} (hardware code in the policy layer {layer})")
    return bad


def test_layers_import_only_downward() -> None:
    bad = _violations()
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", ["kareus.model.profiler", "kareus.model.partition"])
def test_checker_sees_the_role_contracts(module: str) -> None:
    # The walk must actually visit the files it guards: a checker that parses nothing
    # would pass vacuously.
    path = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
    assert path.exists(), f"{module} should be a module of kareus/model"
    assert _layer(path) == "model"


def test_checker_flags_an_upward_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "kareus"
    (fake / "model").mkdir(parents=True)
    (fake / "model" / "bad.py").write_text("from kareus.exec import EmulatedProfiler\nimport torch\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    bad = _violations()
    assert len(bad) == 2
    assert "upward" in bad[0] and "hardware" in bad[1]

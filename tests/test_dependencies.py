"""The package metadata declares exactly what kareus imports.

Every third-party module imported anywhere in ``kareus/`` (functions included) is a
required dependency, belongs to an extra, or is one of the few optional modules kareus
only uses when it finds them; every required dependency is imported somewhere; no extra
lists a package twice.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kareus"

#: import name -> distribution name, where they differ
DISTRIBUTION = {"pynvml": "nvidia-ml-py", "megatron": "megatron-core", "yaml": "pyyaml"}

#: imported only when found, never required (each is detected at run time)
OPTIONAL = {
    "tqdm": "progress bars in notebooks when installed (kareus/search/progress.py)",
    "mscclpp": "not on PyPI; used when the user has it (kareus/exec/collectives)",
    "liger_kernel": "fused kernels when installed (kareus/exec/kernels)",
    "triton": "installed with torch (the torch extra)",
}


def _imports() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "kareus" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


@pytest.fixture(scope="module")
def project() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    path = ROOT / "pyproject.toml"
    if not path.is_file():
        pytest.skip("not a source checkout")
    return tomllib.loads(path.read_text(encoding="utf-8"))["project"]


def test_every_import_is_declared(project):
    required = {_name(r) for r in project["dependencies"]}
    extras = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    missing = {}
    for module, where in sorted(_imports().items()):
        dist = DISTRIBUTION.get(module, module).lower().replace("_", "-")
        if dist not in required and dist not in extras and module not in OPTIONAL:
            missing[module] = sorted(where)
    assert not missing, f"imported but not declared: {missing}"


def test_every_required_dependency_is_imported(project):
    imported = {DISTRIBUTION.get(m, m).lower().replace("_", "-") for m in _imports()}
    unused = [r for r in project["dependencies"] if _name(r) not in imported]
    assert not unused, f"declared but never imported: {unused}"


def test_no_extra_lists_a_package_twice(project):
    for extra, reqs in project["optional-dependencies"].items():
        names = [_name(r) for r in reqs]
        assert len(names) == len(set(names)), f"extra {extra!r} repeats a package: {names}"


def test_package_metadata(project):
    assert project["license"] == "Apache-2.0" and (ROOT / "LICENSE").is_file()
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")[:200]
    assert project["keywords"] and any(c.startswith("Topic ::") for c in project["classifiers"])
    assert {"dev", "docs", "plot", "torch"} <= set(project["optional-dependencies"])

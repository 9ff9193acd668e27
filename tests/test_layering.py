"""The package's layers import only downward: model <- search <- compose <- exec <- profilers <-
workflow / cli.

A lower layer that imports a higher one would let objects cross layers untyped (as ``Any``)
and make the policy layers depend on hardware code; the policy layers (model, search,
compose) must also run on any CPU, so they never import torch or pynvml, not even lazily.
No modules import each other either, not even through a function-local import
(``test_no_import_cycles``), and no package imports another package's private (underscore)
module (``test_no_package_imports_another_packages_private_module``). The checks read the
sources (``ast``) and import nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kareus"
RANK = {"model": 1, "search": 2, "compose": 3, "exec": 4, "profilers": 5, "workflow": 6,
        "cli": 6, "tune": 6, "integrations": 6}
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


# ------------------------------------------------------------------ import cycles
#
# No two modules of the package may import each other, directly or through others, not even
# through an import inside a function: a function-local import that only breaks a cycle hides
# a dependency that runs both ways. The graph below has an edge A -> B for every import of B
# anywhere in A (functions and ``if TYPE_CHECKING:`` blocks included), and for every package
# that Python initialises on the way to B (importing ``kareus.profilers.nvml._meter`` runs
# ``kareus/profilers/nvml/__init__.py`` first) unless that package contains A (it is initialised
# before A runs).

#: Cycles allowed to stay, each as the sorted names of its modules, with the reason it is the
#: right design. Empty: every cycle so far was a dependency to turn one way.
ALLOWED_CYCLES: dict[tuple[str, ...], str] = {}


def _module_name(path: Path, package: Path) -> str:
    parts = (package.name, *path.relative_to(package).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(package: Path | None = None) -> dict[str, set[str]]:
    """``module -> modules of the package it imports``, function-local imports included."""
    package = PACKAGE if package is None else package
    files = {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:  # relative: resolved against the importing package
                    anchor = name.split(".")
                    if path.name != "__init__.py":
                        anchor = anchor[:-1]
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join([*anchor, node.module])
                targets.append(base)
                targets += [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
        edges: set[str] = set()
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                step = ".".join(parts[:i])
                if step in files and not (name == step or name.startswith(step + ".")):
                    edges.add(step)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(tuple(sorted(component)))
    return sorted(found)


def _path_around(graph: dict[str, set[str]], cycle: tuple[str, ...]) -> str:
    """One loop through the cycle's modules, for the failure message."""
    members = set(cycle)
    start = cycle[0]
    # breadth-first from start's successors back to start, inside the component
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child not in previous:
                    previous[child] = node
                    nxt.append(child)
        if start in previous:
            break
        frontier = nxt
    loop = [start]
    node = previous[start]
    while node != start:
        loop.append(node)
        node = previous[node]
    return " -> ".join([start, *reversed(loop[1:]), start])


def test_no_import_cycles() -> None:
    graph = _import_graph()
    bad = [f"{_path_around(graph, c)}" for c in _cycles(graph) if c not in ALLOWED_CYCLES]
    assert not bad, ("import cycles (a function-local import does not break one: move the "
                     "shared code to a module both import):\n" + "\n".join(bad))
    stale = [c for c in ALLOWED_CYCLES if c not in _cycles(graph)]
    assert not stale, f"allowed cycles that are gone (remove them from ALLOWED_CYCLES): {stale}"


def test_cycle_checker_sees_function_local_imports(tmp_path: Path) -> None:
    fake = tmp_path / "kareus"
    (fake / "exec" / "nvml").mkdir(parents=True)
    for init in (fake, fake / "exec", fake / "exec" / "nvml"):
        (init / "__init__.py").write_text("")
    (fake / "exec" / "nvml" / "__init__.py").write_text(
        "from kareus.exec.nvml._runner import run\n")
    (fake / "exec" / "nvml" / "_runner.py").write_text("from kareus.exec.loop import go\n")
    (fake / "exec" / "nvml" / "_helpers.py").write_text("")
    (fake / "exec" / "loop.py").write_text(
        "def go():\n    from kareus.exec.nvml._helpers import x\n")
    (fake / "exec" / "leaf.py").write_text("import kareus.exec.loop\n")
    graph = _import_graph(fake)
    # loop imports nvml._helpers, and so runs nvml/__init__, which imports _runner -> loop
    assert _cycles(graph) == [
        ("kareus.exec.loop", "kareus.exec.nvml", "kareus.exec.nvml._runner")]
    assert "kareus.exec.nvml" not in graph["kareus.exec.nvml._runner"]  # its own package
    path = _path_around(graph, _cycles(graph)[0])
    assert path.startswith("kareus.exec.loop -> ") and path.endswith(" -> kareus.exec.loop")


# ------------------------------------------------------------------ private modules
#
# A private module (a name starting with an underscore, at any depth: ``kareus.exec._graphs``,
# ``kareus.exec.kernels._attention``) is its package's business: only modules inside that
# package (its own modules and its subpackages') import it. Anything another package needs
# is a public name (in a public module or the package's ``__all__``), documented as such.
# A sibling subpackage is another package: ``kareus.exec.train`` importing
# ``kareus.exec.kernels._attention`` is a violation, while ``kareus.exec.train`` importing
# ``kareus.exec._executor_role`` is not (``kareus.exec.train`` is inside ``kareus.exec``: a
# package's internals serve its subpackages). The check covers the top-level modules of
# ``kareus`` (the workflow and the command line) as a package of their own, so they use
# only what the layers offer in public.

#: Private imports allowed to stay for now, by ``(importing file, private module)``, with
#: the reason. Each is the change of a file another change is moving; remove an entry when
#: its import goes (the test fails on a stale entry).
PENDING_PRIVATE_IMPORTS: dict[tuple[str, str], str] = {
    ("kareus/cli.py", "kareus.exec._graphs"): (
        "the command asks for workspace-free GEMMs at process start, before its Ctrl-C "
        "handling is in place: importing kareus.exec there would load every exec module "
        "first; the leaf module alone is cheap"),
}


def _private_owner(module: str) -> str | None:
    """The package a private module belongs to (the part before its first underscore
    name), or ``None`` when ``module`` is public."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def _private_imports(package: Path | None = None) -> list[str]:
    """``file:line imports module`` for every import of another package's private module
    (functions and ``if TYPE_CHECKING:`` blocks included; relative imports resolved)."""
    package = PACKAGE if package is None else package
    modules = {_module_name(p, package) for p in package.rglob("*.py")}
    bad = []
    for path in sorted(package.rglob("*.py")):
        name = _module_name(path, package)
        home = name if path.name == "__init__.py" else name.rpartition(".")[0]
        rel = path.relative_to(package.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:
                    anchor = home.split(".")
                    base = ".".join([*anchor[:len(anchor) - node.level + 1], node.module])
                # ``from kareus.exec import _graphs`` imports a module too (a private name
                # of a public module, ``from m import _helper``, is not a module)
                targets = [base, *(f"{base}.{a.name}" for a in node.names
                                   if f"{base}.{a.name}" in modules)]
            for target in targets:
                owner = _private_owner(target)
                if owner is None or not owner.startswith(package.name):
                    continue  # public, or another project's (torch's private modules)
                if home == owner or home.startswith(owner + "."):
                    continue  # inside the package that owns it
                if (rel, target) in PENDING_PRIVATE_IMPORTS:
                    continue
                bad.append(f"{rel}:{node.lineno} imports {target} (private to {owner})")
    return bad


def test_no_package_imports_another_packages_private_module() -> None:
    bad = _private_imports()
    assert not bad, ("imports of another package's private module (make what is needed a "
                     "public name of that package):\n" + "\n".join(bad))


def test_pending_private_imports_are_still_there() -> None:
    found = set()
    for rel, module in PENDING_PRIVATE_IMPORTS:
        text = (PACKAGE.parent / rel).read_text(encoding="utf-8")
        if module in text:
            found.add((rel, module))
    stale = sorted(set(PENDING_PRIVATE_IMPORTS) - found)
    assert not stale, f"pending private imports that are gone (remove them): {stale}"


def test_private_import_checker_flags_a_violation(tmp_path: Path) -> None:
    fake = tmp_path / "kareus"
    for pkg in ("exec", "exec/kernels", "exec/train", "integrations"):
        (fake / pkg).mkdir(parents=True, exist_ok=True)
        (fake / pkg / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "exec" / "_role.py").write_text("")
    (fake / "exec" / "kernels" / "_attention.py").write_text("")
    # inside the owning package (a subpackage using its parent's internals): allowed
    (fake / "exec" / "train" / "loop.py").write_text(
        "from kareus.exec._role import Executor\nfrom .. import _role\n")
    (fake / "exec" / "kernels" / "base.py").write_text("from ._attention import f\n")
    # a sibling subpackage's private module, in a function: flagged
    (fake / "exec" / "train" / "model.py").write_text(
        "def f():\n    from kareus.exec.kernels._attention import attention_forward\n")
    # another package's private module, three spellings: flagged
    (fake / "integrations" / "layer.py").write_text(
        "import kareus.exec._role\nfrom kareus.exec import _role\n"
        "from ..exec._role import Executor\nimport torch._C\n")
    bad = _private_imports(fake)
    assert bad == [
        "kareus/exec/train/model.py:2 imports kareus.exec.kernels._attention "
        "(private to kareus.exec.kernels)",
        "kareus/integrations/layer.py:1 imports kareus.exec._role (private to kareus.exec)",
        "kareus/integrations/layer.py:2 imports kareus.exec._role (private to kareus.exec)",
        "kareus/integrations/layer.py:3 imports kareus.exec._role (private to kareus.exec)",
    ]

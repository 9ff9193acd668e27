"""Every public class and function of the package has a docstring.

Public means: the name does not start with an underscore, and it is a module-level class or
function, or a method of a public class (private modules included: their public names are
what the packages re-export). Overrides of an abstract method inherit the base's docstring
in the docs and in ``help()``, so a method is also documented when a base class of the same
module tree documents the method of that name. Nested functions are implementation detail.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kareus"


def _is_public(name: str) -> bool:
    return not name.startswith("_")


def _documented_methods(trees: dict[Path, ast.Module]) -> dict[str, set[str]]:
    """Class name -> names of the methods it documents (for inherited docstrings)."""
    out: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, set()).update(
                    m.name for m in node.body
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and ast.get_docstring(m))
    return out


def _base_names(cls: ast.ClassDef) -> list[str]:
    names = []
    for base in cls.bases:
        node = base.value if isinstance(base, ast.Subscript) else base
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        elif isinstance(node, ast.Name):
            names.append(node.id)
    return names


def _bases_closure(name: str, classes: dict[str, list[str]]) -> set[str]:
    seen: set[str] = set()
    todo = list(classes.get(name, []))
    while todo:
        b = todo.pop()
        if b not in seen:
            seen.add(b)
            todo.extend(classes.get(b, []))
    return seen


def missing_docstrings() -> list[str]:
    """``path:line name`` of every public class or function without a docstring."""
    trees = {p: ast.parse(p.read_text(encoding="utf-8"), str(p))
             for p in sorted(PACKAGE.rglob("*.py"))}
    documented = _documented_methods(trees)
    classes = {n.name: _base_names(n) for t in trees.values() for n in ast.walk(t)
               if isinstance(n, ast.ClassDef)}
    missing = []
    for path, tree in trees.items():
        rel = path.relative_to(PACKAGE.parent)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _is_public(node.name) and not ast.get_docstring(node):
                    missing.append(f"{rel}:{node.lineno} {node.name}")
            elif isinstance(node, ast.ClassDef) and _is_public(node.name):
                if not ast.get_docstring(node):
                    missing.append(f"{rel}:{node.lineno} {node.name}")
                bases = _bases_closure(node.name, classes)
                for m in node.body:
                    if not isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        continue
                    if not _is_public(m.name) or ast.get_docstring(m):
                        continue
                    if any(m.name in documented.get(b, ()) for b in bases):
                        continue  # documented where it is declared
                    missing.append(f"{rel}:{m.lineno} {node.name}.{m.name}")
    return missing


def test_every_public_definition_has_a_docstring():
    missing = missing_docstrings()
    assert not missing, f"{len(missing)} public definitions without a docstring:\n" + "\n".join(
        missing)


def test_the_walk_finds_a_missing_docstring(tmp_path, monkeypatch):
    pkg = tmp_path / "kareus"
    pkg.mkdir()
    (pkg / "mod.py").write_text(
        '"""A module."""\n\n'
        "class Base:\n"
        '    """Documented."""\n\n'
        "    def run(self):\n"
        '        """Runs."""\n\n'
        "class Thing(Base):\n"
        '    """Documented."""\n\n'
        "    def run(self):\n"
        "        return 1\n\n"
        "    def other(self):\n"
        "        return 2\n\n"
        "def public():\n"
        "    return 3\n\n"
        "def _private():\n"
        "    return 4\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    assert missing_docstrings() == ["kareus/mod.py:15 Thing.other", "kareus/mod.py:18 public"]

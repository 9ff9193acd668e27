"""The documentation site's sources read as the built pages show them.

Cheap checks on the sources, no site built: a page of the site names another page through
a link, not as the plain text ``docs/search.md``; the navigation names each entry once; a
docstring cross-references in the syntax the API reference renders (mkdocstrings'
``[`Plan`][kareus.compose.Plan]``), not in Sphinx roles, which it shows as literal text.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PACKAGE = ROOT / "kareus"

_SPHINX_ROLE = re.compile(r":(class|meth|func|attr|mod|data|exc|obj|const):`")
# still to convert: the modules under the command line's current rework
_ROLES_LEFT_IN: set[str] = set()

# ``docs/x.md`` in prose: not a link target, not part of a longer path
_PLAIN_REF = re.compile(r"(?<!\]\()(?<![/`\w])docs/[\w/-]+\.md")
_CODE_SPAN = re.compile(r"(`+).+?\1")


def _prose_lines(text: str):
    """(line number, line without its code spans) outside fenced code blocks."""
    fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            yield number, _CODE_SPAN.sub("", line)


def test_pages_link_to_pages_instead_of_naming_their_files():
    found = [f"{page.relative_to(ROOT)}:{number}: {m.group(0)}"
             for page in sorted(DOCS.rglob("*.md"))
             for number, line in _prose_lines(page.read_text(encoding="utf-8"))
             for m in _PLAIN_REF.finditer(line)]
    assert not found, ("write [Title](page.md) for a page of the site:\n"
                       + "\n".join(found))


def test_navigation_names_each_entry_once():
    nav: list[str] = []
    in_nav = False
    for line in (ROOT / "mkdocs.yml").read_text(encoding="utf-8").splitlines():
        if line.startswith("nav:"):
            in_nav = True
            continue
        if in_nav and line and not line.startswith(" "):
            break
        m = re.match(r"\s*- ([^:]+):", line)
        if in_nav and m:
            nav.append(m.group(1).strip())
        elif in_nav and re.match(r"\s*- \S+\.md$", line):
            nav.append("")  # an untitled page takes its heading, maybe a section's name
    assert "" not in nav, "give every page of the navigation its own title"
    assert len(nav) == len(set(nav)), f"a navigation title repeats: {nav}"


def test_docstrings_use_no_sphinx_roles():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in _ROLES_LEFT_IN:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                found += [f"{rel}:{node.lineno}: {m.group(0)}"
                          for m in _SPHINX_ROLE.finditer(node.value.value)]
    assert not found, ("write [`Name`][kareus.package.Name] (or ``Name`` for what the API "
                       "reference does not show):\n" + "\n".join(found))

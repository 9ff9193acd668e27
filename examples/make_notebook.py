"""Write examples/tutorial.ipynb and docs/tutorial.md from examples/tutorial.py.

The script is the source of truth (cells split at ``# %%`` markers): edit it, then run
``python examples/make_notebook.py``; tests/test_examples.py fails while they differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def script_cells(path: Path) -> list[tuple[str, str]]:
    """``(kind, source)`` per cell: kind is ``"markdown"`` or ``"code"``."""
    cells: list[tuple[str, list[str]]] = []
    for line in path.read_text().splitlines():
        if line.startswith("# %%"):
            cells.append(("markdown" if "[markdown]" in line else "code", []))
            continue
        if not cells:
            continue
        kind, lines = cells[-1]
        if kind == "markdown":
            lines.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
        else:
            lines.append(line)
    return [(kind, "\n".join(lines).strip("\n")) for kind, lines in cells]


def build(script: Path):  # type: ignore[no-untyped-def]
    import nbformat  # a dev dependency

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    for kind, source in script_cells(script):
        nb.cells.append(nbformat.v4.new_markdown_cell(source) if kind == "markdown"
                        else nbformat.v4.new_code_cell(source))
    return nb


def markdown(script: Path) -> str:
    """The tutorial as a Markdown page: prose cells as text, code cells as Python blocks."""
    parts = ["<!-- generated from examples/tutorial.py by examples/make_notebook.py -->"]
    for kind, source in script_cells(script):
        parts.append(source if kind == "markdown" else f"```python\n{source}\n```")
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(
        prog="make_notebook.py",
        description="Write examples/tutorial.ipynb and docs/tutorial.md from "
                    "examples/tutorial.py (the source of truth, cells split at '# %%' "
                    "markers). It takes no options.").parse_args(argv)
    import nbformat

    nb = build(HERE / "tutorial.py")
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i}"
    nbformat.write(nb, HERE / "tutorial.ipynb")
    print(f"wrote {HERE / 'tutorial.ipynb'} ({len(nb.cells)} cells)")
    doc = HERE.parent / "docs" / "tutorial.md"
    doc.write_text(markdown(HERE / "tutorial.py"))
    print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

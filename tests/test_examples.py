import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load_maker():
    spec = importlib.util.spec_from_file_location("make_notebook", EXAMPLES / "make_notebook.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_notebook_matches_script():
    nbformat = pytest.importorskip("nbformat")
    maker = _load_maker()
    nb = nbformat.read(EXAMPLES / "tutorial.ipynb", as_version=4)
    expected = maker.script_cells(EXAMPLES / "tutorial.py")
    got = [(c.cell_type, c.source) for c in nb.cells]
    assert got == expected, "examples/tutorial.ipynb is stale: run examples/make_notebook.py"


def test_tutorial_page_matches_script():
    maker = _load_maker()
    page = (EXAMPLES.parent / "docs" / "tutorial.md").read_text()
    assert page == maker.markdown(EXAMPLES / "tutorial.py"), (
        "docs/tutorial.md is stale: run examples/make_notebook.py")


@pytest.mark.parametrize(("flag", "status"), [("--help", 0), ("--bogus", 2)])
def test_make_notebook_help_prints_help_and_writes_nothing(flag, status):
    outputs = [EXAMPLES / "tutorial.ipynb", EXAMPLES.parent / "docs" / "tutorial.md"]
    before = [(p.read_bytes(), p.stat().st_mtime_ns) for p in outputs]
    out = subprocess.run([sys.executable, str(EXAMPLES / "make_notebook.py"), flag],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == status, out.stderr[-2000:]
    assert "usage: make_notebook.py" in out.stdout + out.stderr and "wrote" not in out.stdout
    assert [(p.read_bytes(), p.stat().st_mtime_ns) for p in outputs] == before


def test_tutorial_script_runs(tmp_path):
    pytest.importorskip("matplotlib")
    env = dict(os.environ, KAREUS_TUTORIAL_OUT=str(tmp_path), MPLBACKEND="Agg")
    out = subprocess.run([sys.executable, str(EXAMPLES / "tutorial.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kareus plan v1" in out.stdout
    assert (tmp_path / "plan.json").is_file()
    assert (tmp_path / "frontiers.png").stat().st_size > 1000


def test_custom_plugins_example_runs():
    out = subprocess.run([sys.executable, str(EXAMPLES / "custom_plugins.py")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "passes the surrogate conformance suite" in out.stdout
    assert "passes the profiler conformance suite" in out.stdout
    assert "PartitionFrontier('fwd_mlp'" in out.stdout

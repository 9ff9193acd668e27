"""bench/ as bench/README.md describes it: every script of bench/ has a row in the tracked
table whose results exist, every script of bench/probes/ has a row in the probes table
whose results exist, every result file is named there, and every Python script prints its
help (``--help`` exits 0; a script whose optional dependency is missing is skipped)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import BENCH, PROBES

REPO = BENCH.parent
README = BENCH / "README.md"
#: optional dependencies a bench script may import at start (the help then needs them)
OPTIONAL = {"torch", "triton", "scipy", "pynvml", "cupy", "lowtime", "xgboost", "networkx"}


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _rows(title: str) -> list[list[str]]:
    """The cells of the first table of a README section, header and rule left out."""
    lines: list[str] = []
    for ln in _section(title).splitlines():
        if ln.startswith("|"):
            lines.append(ln)
        elif lines:
            break
    assert len(lines) > 2, title
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines[2:]]


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _scripts(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".py", ".sh"))


def _tracked() -> dict[str, list[str]]:
    """script -> results of record (paths relative to the repository)."""
    out: dict[str, list[str]] = {}
    for cells in _rows("Tracked benchmarks"):
        assert len(cells) == 6, cells
        results = [r if "/" in r.rstrip("/") else f"bench/results/{r}" for r in _names(cells[3])]
        for script in _names(cells[1]):
            out[script] = results
    return out


def _probes() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for cells in _rows("Probes"):
        assert len(cells) == 5, cells
        out[_names(cells[0])[0]] = [f"bench/probes/results/{r}" for r in _names(cells[3])]
    return out


def test_every_tracked_benchmark_is_in_the_table_with_its_results():
    tracked = _tracked()
    assert sorted(tracked) == _scripts(BENCH)
    for script, results in tracked.items():
        assert results, script
        for r in results:
            assert (REPO / r).exists(), f"{script}: {r} does not exist"


def test_every_probe_is_in_the_probes_section_with_its_results():
    probes = _probes()
    assert sorted(probes) == _scripts(PROBES)
    for script, results in probes.items():
        assert results, script
        for r in results:
            assert (REPO / r).exists(), f"{script}: {r} does not exist"


def test_every_result_file_is_named_in_the_readme():
    text = README.read_text()
    for folder in (BENCH / "results", PROBES / "results"):
        for entry in folder.iterdir():
            name = entry.name + ("/" if entry.is_dir() else "")
            assert f"`{name}`" in text, f"{entry.relative_to(REPO)} is not in bench/README.md"


@pytest.mark.parametrize("script", [f"bench/{s}" for s in _scripts(BENCH) if s.endswith(".py")]
                         + [f"bench/probes/{s}" for s in _scripts(PROBES) if s.endswith(".py")])
def test_the_script_prints_its_help(script):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, script, "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    missing = re.search(r"No module named '([\w.]+)'", done.stderr)
    if done.returncode and missing and missing.group(1).split(".")[0] in OPTIONAL:
        pytest.skip(f"{script} needs {missing.group(1)}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout

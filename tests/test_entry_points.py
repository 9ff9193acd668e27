"""The functions ``kareus`` exports say what they return and show a minimal example.

Each example is a doctest in the function's docstring, run here, so that what ``help()``
and the API reference show keeps working.
"""

from __future__ import annotations

import doctest
import inspect

import pytest

import kareus
from kareus.model import files

ENTRY_POINTS = sorted(name for name in kareus.__all__
                      if inspect.isfunction(getattr(kareus, name)))


@pytest.fixture(autouse=True)
def _clean_registry():
    before = set(files.registered_models()) | set(files.registered_gpus())
    yield
    for name in set(files.registered_models()) | set(files.registered_gpus()):
        if name not in before:
            files.unregister(name)


def test_the_entry_points_are_the_functions_expected():
    assert {"optimize", "compose_systems", "get_gpu", "register_gpu",
            "register_model"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_documents_what_it_returns_and_writes(name):
    doc = inspect.getdoc(getattr(kareus, name)) or ""
    assert "\nReturns:\n" in doc, f"kareus.{name}: no Returns section"
    assert "\nExamples:\n" in doc and ">>> " in doc, f"kareus.{name}: no example"
    assert "writ" in doc.lower(), f"kareus.{name}: does not say what it writes"


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_example_runs(name):
    tests = doctest.DocTestFinder(recurse=False).find(getattr(kareus, name), f"kareus.{name}")
    assert tests and tests[0].examples
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_optimize_writes_nothing_until_the_result_is_saved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    workload = kareus.Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2,
                                      seq_len=1024, num_microbatches=4)
    result = kareus.optimize(workload, "h200-sxm", budget=4, progress=False)
    assert list(tmp_path.iterdir()) == []
    paths = result.save(tmp_path / "out", figure=False)
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"results.json", "plan.json",
                                                               "frontier.json"}
    assert set(paths) == {"results", "plan", "frontier"}

"""The curated top-level API: what ``import kareus`` offers, and what it keeps out."""

from __future__ import annotations

import abc
import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kareus
import kareus.compose
import kareus.exec
import kareus.model
import kareus.search

#: The six pluggable roles, each an abstract base class at the top level, and their defaults,
#: which live in the layers (``kareus.<layer>.<name>``).
ROLES = {
    "Partition": {"TransformerPartition": "model", "CallablePartition": "exec"},
    "Profiler": {"EmulatedProfiler": "profilers", "NVMLProfiler": "profilers",
                 "ReplayProfiler": "profilers"},
    "Surrogate": {"GaussianProcessSurrogate": "search"},
    "AcquisitionPass": {"HypervolumePass": "search", "NeighbourhoodPass": "search",
                        "HingePass": "search"},
    "FrontierComposer": {"MicrobatchComposer": "compose", "IterationComposer": "compose"},
    "Executor": {"TorchExecutor": "exec"},
}

#: The entry points and the objects that flow between the layers.
ENTRY_POINTS = (
    "optimize", "OptimizationResult", "compose_systems", "MultiPassSearch", "get_gpu",
    "register_gpu", "register_model", "verify",
    "Workload", "ModelArch", "Parallelism", "GPUSpec", "Plan", "ScheduleConfig", "ConfigSpace",
    "Measurement", "PartitionFrontier", "MicrobatchFrontier", "IterationFrontier", "KareusError",
    "SearchSpec",
)

#: The whole top level: the entry points, the value objects, the roles and the version.
SURFACE = sorted([*ENTRY_POINTS, *ROLES, "__version__"])

#: Execution and measurement plumbing: importable from its layer, not offered at the top level.
PLUMBING = {
    "StreamOrderedTrigger": "exec", "CollectiveBackend": "exec", "FrequencyController": "exec",
    "DryRunFrequencyController": "exec", "NVMLFrequencyController": "exec",
    "OwnKernelCollective": "exec", "NCCLCappedCollective": "exec", "EnergyMeter": "profilers",
    "PartitionRunner": "profilers",
}


def test_all_is_sorted_unique_and_importable():
    names = kareus.__all__
    assert names == sorted(names)
    assert len(set(names)) == len(names)
    missing = [n for n in names if not hasattr(kareus, n)]
    assert missing == []
    namespace: dict[str, object] = {}
    exec("from kareus import *", namespace)
    assert set(names) <= set(namespace)


def test_the_surface_is_entry_points_value_objects_and_roles():
    assert kareus.__all__ == SURFACE


def test_roles_are_abcs_and_defaults_implement_them():
    for role, defaults in ROLES.items():
        base = getattr(kareus, role)
        assert role in kareus.__all__
        assert isinstance(base, abc.ABCMeta) and inspect.isabstract(base), role
        for name, layer in defaults.items():
            assert name not in kareus.__all__, name  # implementations stay in their layers
            impl = getattr(importlib.import_module(f"kareus.{layer}"), name)
            assert issubclass(impl, base), f"{name} is not a {role}"
            assert not inspect.isabstract(impl), f"{name} leaves abstract methods"


def test_the_default_passes_are_the_ones_listed():
    from kareus.search import default_passes

    listed = set(ROLES["AcquisitionPass"])
    used = {type(p).__name__ for p, _ in default_passes()}
    assert used == listed
    assert "UncertaintyPass" not in used  # in reference_passes(), the reference artifact's mix


def test_entry_points_are_exported():
    missing = [n for n in ENTRY_POINTS if n not in kareus.__all__]
    assert missing == []


def test_errors_live_in_kareus_errors_with_only_the_base_at_the_top():
    import kareus.errors

    for name in kareus.errors.__all__:
        assert issubclass(getattr(kareus.errors, name), kareus.KareusError), name
        assert name == "KareusError" or name not in kareus.__all__, name
    assert kareus.KareusError is kareus.errors.KareusError


@pytest.mark.parametrize(("name", "home"), sorted(kareus._MOVED.items()))
def test_a_name_moved_off_the_top_level_still_imports_with_a_warning(name, home):
    with pytest.warns(DeprecationWarning, match=rf"import it from {home} "):
        value = getattr(kareus, name)
    assert value is getattr(importlib.import_module(home), name)


def test_an_unknown_top_level_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        kareus.Nope  # noqa: B018
    assert not hasattr(kareus, "StreamOrderedTrigger")


def test_exec_plumbing_stays_in_its_layer():
    for name, layer in PLUMBING.items():
        assert name not in kareus.__all__, name
        assert not hasattr(kareus, name), name
        assert name in importlib.import_module(f"kareus.{layer}").__all__, name


def test_top_level_names_are_the_layer_objects():
    # a top-level name is the layer's object itself, not a copy or a wrapper
    layers = (kareus.model, kareus.search, kareus.compose, kareus.exec)
    for name in kareus.__all__:
        homes = [layer for layer in layers if name in getattr(layer, "__all__", ())]
        for layer in homes:
            assert getattr(layer, name) is getattr(kareus, name), (name, layer.__name__)


def test_import_kareus_loads_no_heavy_module():
    # the package, every layer, the command line and the tuning driver import without
    # torch, NVML, XGBoost or matplotlib (each is imported where it is used)
    code = (
        "import json, sys\n"
        "import kareus, kareus.model, kareus.search, kareus.compose, kareus.exec, kareus.cli, "
        "kareus.tune, kareus.profilers\n"
        "heavy = ('torch', 'pynvml', 'xgboost', 'matplotlib')\n"
        "print(json.dumps([m for m in heavy if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_import_kareus_and_its_command_load_no_numpy():
    # the console entry point imports these before it installs its Ctrl-C handling: nothing
    # slow may load before then (numpy alone takes a tenth of a second)
    code = ("import json, sys\n"
            "import kareus, kareus.cli, kareus.__main__\n"
            "print(json.dumps([m for m in ('numpy', 'scipy', 'attrs', 'kareus.model') "
            "if m in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_subpackages_are_reached_from_the_top_level():
    code = "import kareus; print(kareus.model.__name__, kareus.errors.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["kareus.model", "kareus.errors"]


def test_a_lazy_package_lists_the_same_names_for_type_checkers_as_it_loads():
    # kareus.profilers loads its names on first use (kareus._lazy) and imports the same names
    # under TYPE_CHECKING for type checkers and the API reference: the two lists must agree
    import ast

    import kareus.profilers as pkg

    tree = ast.parse(Path(pkg.__file__).read_text(encoding="utf-8"))
    checked = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.If)
               for stmt in node.body if isinstance(stmt, ast.ImportFrom) for a in stmt.names}
    assert checked == set(pkg._NAMES) == set(pkg.__all__)
    for name in pkg.__all__:
        assert getattr(pkg, name).__name__ == name


def test_importing_the_emulator_loads_nothing_of_the_execution_layer():
    code = ("import json, sys\nimport kareus.profilers.emulator\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kareus.exec'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize(("old", "new"), [
    ("kareus.exec.emulator", "kareus.profilers.emulator"),
    ("kareus.exec.nvml", "kareus.profilers.nvml"),
    ("kareus.exec.replay", "kareus.profilers.replay"),
    ("kareus.exec.calibrate", "kareus.profilers.calibrate"),
    ("kareus.exec.profile_build", "kareus.profilers.profile_build"),
])
def test_a_moved_module_imports_by_its_old_path_with_a_warning(old, new):
    code = ("import importlib, json, sys, warnings\n"
            "warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            f"    old = importlib.import_module({old!r})\n"
            f"new = importlib.import_module({new!r})\n"
            "print(json.dumps([old is new, [str(x.message) for x in w "
            "if x.category is DeprecationWarning]]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    same, messages = json.loads(out.stdout)
    assert same
    assert any(f"{old} has moved to {new}" in m for m in messages)


def test_a_name_moved_out_of_exec_still_imports_with_a_warning():
    import kareus.profilers

    with pytest.warns(DeprecationWarning, match="kareus.exec.EmulatedProfiler has moved to "
                                                "kareus.profilers.EmulatedProfiler"):
        from kareus.exec import EmulatedProfiler
    assert EmulatedProfiler is kareus.profilers.EmulatedProfiler
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        kareus.exec.Nope  # noqa: B018


def test_dir_lists_the_public_names_and_no_implementation_names():
    names = dir(kareus)
    assert set(kareus.__all__) <= set(names)
    assert not {"TYPE_CHECKING", "annotations", "_compat", "_PUBLIC"} & set(names)

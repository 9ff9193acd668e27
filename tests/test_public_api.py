"""The curated top-level API: what ``import kareus`` offers, and what it keeps out."""

from __future__ import annotations

import abc
import inspect
import json
import subprocess
import sys

import kareus
import kareus.compose
import kareus.exec
import kareus.model
import kareus.search

#: The six pluggable roles and their defaults (the design's role table).
ROLES = {
    "Partition": ("TransformerPartition", "CallablePartition"),
    "Profiler": ("EmulatedProfiler", "NVMLProfiler", "ReplayProfiler"),
    "Surrogate": ("GaussianProcessSurrogate",),
    "AcquisitionPass": ("HypervolumePass", "UncertaintyPass"),
    "FrontierComposer": ("MicrobatchComposer", "IterationComposer"),
    "Executor": ("TorchExecutor",),
}

#: The entry points and the objects that flow between the layers.
ENTRY_POINTS = (
    "optimize", "OptimizationResult", "compose_systems", "MultiPassSearch",
    "Workload", "ModelArch", "GPUSpec", "Plan", "ScheduleConfig", "ConfigSpace", "Measurement",
    "PartitionFrontier", "MicrobatchFrontier", "IterationFrontier", "KareusError",
)

#: Execution plumbing: importable from kareus.exec, not offered at the top level.
PLUMBING = (
    "StreamOrderedTrigger", "CollectiveBackend", "FrequencyController",
    "DryRunFrequencyController", "NVMLFrequencyController", "OwnKernelCollective",
    "NCCLCappedCollective", "EnergyMeter", "PartitionRunner",
)


def test_all_is_sorted_unique_and_importable():
    names = kareus.__all__
    assert names == sorted(names)
    assert len(set(names)) == len(names)
    missing = [n for n in names if not hasattr(kareus, n)]
    assert missing == []
    namespace: dict[str, object] = {}
    exec("from kareus import *", namespace)
    assert set(names) <= set(namespace)


def test_roles_are_abcs_and_defaults_implement_them():
    for role, defaults in ROLES.items():
        base = getattr(kareus, role)
        assert role in kareus.__all__
        assert isinstance(base, abc.ABCMeta) and inspect.isabstract(base), role
        for name in defaults:
            assert name in kareus.__all__, name
            impl = getattr(kareus, name)
            assert issubclass(impl, base), f"{name} is not a {role}"
            assert not inspect.isabstract(impl), f"{name} leaves abstract methods"


def test_entry_points_are_exported():
    missing = [n for n in ENTRY_POINTS if n not in kareus.__all__]
    assert missing == []


def test_every_error_is_exported_and_a_kareus_error():
    import kareus.errors

    for name in kareus.errors.__all__:
        assert name in kareus.__all__, name
        assert issubclass(getattr(kareus, name), kareus.KareusError), name
    assert issubclass(kareus.SpecFileError, kareus.KareusError)


def test_exec_plumbing_stays_in_its_layer():
    for name in PLUMBING:
        assert name not in kareus.__all__, name
        assert not hasattr(kareus, name), name
        assert name in kareus.exec.__all__, name


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
        "kareus.tune\n"
        "heavy = ('torch', 'pynvml', 'xgboost', 'matplotlib')\n"
        "print(json.dumps([m for m in heavy if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []

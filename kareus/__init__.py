"""kareus: joint communication-SM, launch-slot and frequency scheduling for LLM training.

kareus cuts a training iteration into partitions (a collective next to computation
that does not depend on it), finds each partition type's time-energy Pareto
frontier with multi-objective Bayesian optimisation, composes those frontiers into
microbatch and iteration frontiers over the pipeline schedule, and applies the
chosen point in a PyTorch training loop.

The top level is the curated public API:

- the entry points: [`optimize`][kareus.workflow.optimize] and its
  [`OptimizationResult`][kareus.workflow.OptimizationResult], [`verify`][kareus.workflow.verify]
  (a plan measured where it runs, against its prediction),
  [`compose_systems`][kareus.workflow.compose_systems] (the five systems of one workload side by
  side), the [`MultiPassSearch`][kareus.search.MultiPassSearch] ask/tell loop, and
  [`get_gpu`][kareus.model.get_gpu], [`register_gpu`][kareus.model.files.register_gpu],
  [`register_model`][kareus.model.files.register_model] for presets and your own files;
- the inputs and what flows between the layers: [`Workload`][kareus.model.Workload],
  [`ModelArch`][kareus.model.ModelArch], [`Parallelism`][kareus.model.Parallelism],
  [`GPUSpec`][kareus.model.GPUSpec], [`ScheduleConfig`][kareus.model.ScheduleConfig],
  [`ConfigSpace`][kareus.model.ConfigSpace], [`Measurement`][kareus.model.Measurement], the three
  frontiers ([`PartitionFrontier`][kareus.search.PartitionFrontier],
  [`MicrobatchFrontier`][kareus.compose.MicrobatchFrontier],
  [`IterationFrontier`][kareus.compose.IterationFrontier]), the [`Plan`][kareus.compose.Plan]
  and the [`SearchSpec`][kareus.search.SearchSpec] (how each partition type is searched:
  ``optimize(search=...)``);
- the six pluggable roles, each an abstract base class: [`Partition`][kareus.model.Partition],
  [`Profiler`][kareus.model.Profiler], [`Surrogate`][kareus.search.Surrogate],
  [`AcquisitionPass`][kareus.search.AcquisitionPass],
  [`FrontierComposer`][kareus.compose.FrontierComposer] and [`Executor`][kareus.exec.Executor];
- [`KareusError`][kareus.errors.KareusError], the base of every error kareus raises on purpose.

The implementations live in their layers: the default partition
([`TransformerPartition`][kareus.model.TransformerPartition]) in [`kareus.model`][kareus.model];
the surrogates ([`GaussianProcessSurrogate`][kareus.search.GaussianProcessSurrogate]) and the
acquisition passes (the default mix, [`default_passes`][kareus.search.default_passes]:
[`HypervolumePass`][kareus.search.HypervolumePass],
[`NeighbourhoodPass`][kareus.search.NeighbourhoodPass], [`HingePass`][kareus.search.HingePass])
in [`kareus.search`][kareus.search]; the composers
([`MicrobatchComposer`][kareus.compose.MicrobatchComposer],
[`IterationComposer`][kareus.compose.IterationComposer]) in [`kareus.compose`][kareus.compose];
the profilers ([`EmulatedProfiler`][kareus.profilers.EmulatedProfiler],
[`NVMLProfiler`][kareus.profilers.NVMLProfiler], [`ReplayProfiler`][kareus.profilers.ReplayProfiler]),
[`CallablePartition`][kareus.exec.CallablePartition] and
[`TorchExecutor`][kareus.exec.TorchExecutor] in [`kareus.exec`][kareus.exec]; the error classes
in [`kareus.errors`][kareus.errors]. Those names were importable from the top level before; they
still are, with a ``DeprecationWarning`` naming where to import them from.

Imports run downward only: [`kareus.model`][kareus.model] <- [`kareus.search`][kareus.search] <-
[`kareus.compose`][kareus.compose] <- [`kareus.exec`][kareus.exec] <-
[`kareus.workflow`][kareus.workflow] and the command line. Execution plumbing (collective backends,
frequency controllers and the stream-ordered trigger) is in [`kareus.exec`][kareus.exec]; fakes and
conformance suites for plug-ins are in [`kareus.testing`][kareus.testing].

Importing kareus is light: the names above are loaded on first use, so ``import kareus``
(and the ``kareus`` command before it has set up its Ctrl-C handling) imports neither numpy,
torch, xgboost nor pynvml.
"""

from __future__ import annotations

from kareus import _compat
from kareus._version import __version__

_compat.install()  # old import paths of moved modules keep working for one release

# Not typing.TYPE_CHECKING: importing typing takes ~10 ms, and this module runs before the
# command's entry point can guard a Ctrl-C (type checkers read any constant of this name).
TYPE_CHECKING = False
if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from kareus.compose import (
        FrontierComposer,
        IterationFrontier,
        MicrobatchFrontier,
        Plan,
    )
    from kareus.errors import KareusError
    from kareus.exec import Executor
    from kareus.model import (
        ConfigSpace,
        GPUSpec,
        Measurement,
        ModelArch,
        Parallelism,
        Partition,
        Profiler,
        ScheduleConfig,
        Workload,
        get_gpu,
    )
    from kareus.model.files import register_gpu, register_model
    from kareus.search import (
        AcquisitionPass,
        MultiPassSearch,
        PartitionFrontier,
        SearchSpec,
        Surrogate,
    )
    from kareus.workflow import OptimizationResult, compose_systems, optimize, verify

#: The public names and the module each is loaded from on first use.
_PUBLIC: dict[str, str] = {
    # entry points
    "optimize": "kareus.workflow",
    "verify": "kareus.workflow",
    "OptimizationResult": "kareus.workflow",
    "compose_systems": "kareus.workflow",
    "MultiPassSearch": "kareus.search",
    "get_gpu": "kareus.model",
    "register_gpu": "kareus.model.files",
    "register_model": "kareus.model.files",
    # value objects and frontiers
    "Workload": "kareus.model",
    "ModelArch": "kareus.model",
    "Parallelism": "kareus.model",
    "GPUSpec": "kareus.model",
    "ScheduleConfig": "kareus.model",
    "ConfigSpace": "kareus.model",
    "Measurement": "kareus.model",
    "PartitionFrontier": "kareus.search",
    "MicrobatchFrontier": "kareus.compose",
    "IterationFrontier": "kareus.compose",
    "Plan": "kareus.compose",
    "SearchSpec": "kareus.search",
    # the six roles
    "Partition": "kareus.model",
    "Profiler": "kareus.model",
    "Surrogate": "kareus.search",
    "AcquisitionPass": "kareus.search",
    "FrontierComposer": "kareus.compose",
    "Executor": "kareus.exec",
    # the base of the errors
    "KareusError": "kareus.errors",
}

#: Names the top level offered before it was curated, and where they live now: still
#: importable from here, with a DeprecationWarning.
_MOVED: dict[str, str] = {
    "TransformerPartition": "kareus.model",
    "GaussianProcessSurrogate": "kareus.search",
    "HypervolumePass": "kareus.search",
    "UncertaintyPass": "kareus.search",
    "MicrobatchComposer": "kareus.compose",
    "IterationComposer": "kareus.compose",
    "SYSTEMS": "kareus.compose",
    "CallablePartition": "kareus.exec",
    "EmulatedProfiler": "kareus.profilers",
    "NVMLProfiler": "kareus.profilers",
    "ReplayProfiler": "kareus.profilers",
    "TorchExecutor": "kareus.exec",
    "ConfigError": "kareus.errors",
    "FolderInUseError": "kareus.errors",
    "GraphCaptureError": "kareus.errors",
    "HardwareError": "kareus.errors",
    "InfeasibleError": "kareus.errors",
    "InvalidSMCountError": "kareus.errors",
    "OutputError": "kareus.errors",
    "PlanError": "kareus.errors",
    "UnknownPresetError": "kareus.errors",
    "UnknownSlotError": "kareus.errors",
    "UnsupportedFrequencyError": "kareus.errors",
    "WorkloadError": "kareus.errors",
    "SpecFileError": "kareus.model.files",
}

#: The subpackages and modules ``kareus.<name>`` reaches without an import of its own (as when
#: the top level imported every layer).
_SUBMODULES = frozenset({"model", "search", "compose", "exec", "profilers", "workflow", "errors",
                         "testing", "interop", "tune", "cli", "integrations"})

__all__ = [
    "AcquisitionPass",
    "ConfigSpace",
    "Executor",
    "FrontierComposer",
    "GPUSpec",
    "IterationFrontier",
    "KareusError",
    "Measurement",
    "MicrobatchFrontier",
    "ModelArch",
    "MultiPassSearch",
    "OptimizationResult",
    "Parallelism",
    "Partition",
    "PartitionFrontier",
    "Plan",
    "Profiler",
    "ScheduleConfig",
    "SearchSpec",
    "Surrogate",
    "Workload",
    "__version__",
    "compose_systems",
    "get_gpu",
    "optimize",
    "register_gpu",
    "register_model",
    "verify",
]


def __getattr__(name: str) -> object:
    """Load a public name (or a subpackage) on first use; a name that moved off the top level
    is returned with a ``DeprecationWarning`` naming its new import path."""
    import importlib
    import warnings

    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # loaded once
        return value
    if name in _MOVED:
        where = _MOVED[name]
        warnings.warn(f"kareus.{name} has moved off the top level: import it from {where} "
                      f"(from {where} import {name})", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(where), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"kareus.{name}")
    raise AttributeError(f"module 'kareus' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the public names and the module's own dunders; not the names its code uses
    # (TYPE_CHECKING, annotations, the private helpers)
    return sorted({*__all__, *(k for k in globals() if k.startswith("__"))})

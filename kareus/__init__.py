"""kareus: joint communication-SM, launch-slot and frequency scheduling for LLM training.

kareus cuts a training iteration into partitions (a collective next to computation
that does not depend on it), finds each partition type's time-energy Pareto
frontier with multi-objective Bayesian optimisation, composes those frontiers into
microbatch and iteration frontiers over the pipeline schedule, and applies the
chosen point in a PyTorch training loop.

The top level is the curated public API:

- the entry points: [`optimize`][kareus.workflow.optimize] and its
  [`OptimizationResult`][kareus.workflow.OptimizationResult],
  [`compose_systems`][kareus.compose.compose_systems] (the five systems of one workload side by
  side), the [`MultiPassSearch`][kareus.search.MultiPassSearch] ask/tell loop;
- the inputs and what flows between the layers: [`Workload`][kareus.model.Workload],
  [`ModelArch`][kareus.model.ModelArch], [`Parallelism`][kareus.model.Parallelism],
  [`GPUSpec`][kareus.model.GPUSpec], [`ScheduleConfig`][kareus.model.ScheduleConfig],
  [`ConfigSpace`][kareus.model.ConfigSpace], [`Measurement`][kareus.model.Measurement], the three
  frontiers and the [`Plan`][kareus.compose.Plan];
- the six pluggable roles, each an abstract base class, with their defaults:
  [`Partition`][kareus.model.Partition]
  ([`TransformerPartition`][kareus.model.TransformerPartition],
  [`CallablePartition`][kareus.exec.CallablePartition]), [`Profiler`][kareus.model.Profiler]
  ([`EmulatedProfiler`][kareus.exec.EmulatedProfiler], [`NVMLProfiler`][kareus.exec.NVMLProfiler],
  [`ReplayProfiler`][kareus.exec.ReplayProfiler]), [`Surrogate`][kareus.search.Surrogate]
  ([`GaussianProcessSurrogate`][kareus.search.GaussianProcessSurrogate]),
  [`AcquisitionPass`][kareus.search.AcquisitionPass]
  ([`HypervolumePass`][kareus.search.HypervolumePass],
  [`UncertaintyPass`][kareus.search.UncertaintyPass]),
  [`FrontierComposer`][kareus.compose.FrontierComposer]
  ([`MicrobatchComposer`][kareus.compose.MicrobatchComposer],
  [`IterationComposer`][kareus.compose.IterationComposer]) and [`Executor`][kareus.exec.Executor]
  ([`TorchExecutor`][kareus.exec.TorchExecutor]);
- the errors (all subclasses of [`KareusError`][kareus.errors.KareusError]).

Everything else lives in the layer packages, imported downward only:
[`kareus.model`][kareus.model] <- [`kareus.search`][kareus.search] <-
[`kareus.compose`][kareus.compose] <- [`kareus.exec`][kareus.exec] <-
[`kareus.workflow`][kareus.workflow] and the command line. Execution plumbing (collective backends,
frequency controllers and the stream-ordered trigger) is in [`kareus.exec`][kareus.exec]; fakes and
conformance suites for plug-ins are in [`kareus.testing`][kareus.testing].

Importing kareus is light: it imports neither torch, xgboost nor pynvml.
"""

from __future__ import annotations

from kareus._version import __version__
from kareus.compose import (
    SYSTEMS,
    FrontierComposer,
    IterationComposer,
    IterationFrontier,
    MicrobatchComposer,
    MicrobatchFrontier,
    Plan,
    compose_systems,
)
from kareus.errors import (
    ConfigError,
    FolderInUseError,
    GraphCaptureError,
    HardwareError,
    InfeasibleError,
    InvalidSMCountError,
    KareusError,
    OutputError,
    PlanError,
    UnknownPresetError,
    UnknownSlotError,
    UnsupportedFrequencyError,
    WorkloadError,
)
from kareus.exec import (
    CallablePartition,
    EmulatedProfiler,
    Executor,
    NVMLProfiler,
    ReplayProfiler,
    TorchExecutor,
)
from kareus.model import (
    ConfigSpace,
    GPUSpec,
    Measurement,
    ModelArch,
    Parallelism,
    Partition,
    Profiler,
    ScheduleConfig,
    TransformerPartition,
    Workload,
    get_gpu,
)
from kareus.model.files import SpecFileError, register_gpu, register_model
from kareus.search import (
    AcquisitionPass,
    GaussianProcessSurrogate,
    HypervolumePass,
    MultiPassSearch,
    PartitionFrontier,
    Surrogate,
    UncertaintyPass,
)
from kareus.workflow import OptimizationResult, optimize

__all__ = [
    "AcquisitionPass",
    "CallablePartition",
    "ConfigError",
    "ConfigSpace",
    "EmulatedProfiler",
    "Executor",
    "FolderInUseError",
    "FrontierComposer",
    "GPUSpec",
    "GaussianProcessSurrogate",
    "GraphCaptureError",
    "HardwareError",
    "HypervolumePass",
    "InfeasibleError",
    "InvalidSMCountError",
    "IterationComposer",
    "IterationFrontier",
    "KareusError",
    "Measurement",
    "MicrobatchComposer",
    "MicrobatchFrontier",
    "ModelArch",
    "MultiPassSearch",
    "NVMLProfiler",
    "OptimizationResult",
    "OutputError",
    "Parallelism",
    "Partition",
    "PartitionFrontier",
    "Plan",
    "PlanError",
    "Profiler",
    "ReplayProfiler",
    "SYSTEMS",
    "ScheduleConfig",
    "SpecFileError",
    "Surrogate",
    "TorchExecutor",
    "TransformerPartition",
    "UncertaintyPass",
    "UnknownPresetError",
    "UnknownSlotError",
    "UnsupportedFrequencyError",
    "Workload",
    "WorkloadError",
    "__version__",
    "compose_systems",
    "get_gpu",
    "optimize",
    "register_gpu",
    "register_model",
]

"""Execution, the hardware side: frequency control, collectives, kernels, executors.

This package and [`kareus.profilers`][kareus.profilers] (which measures, on the emulated GPU or
on real ones, and builds on this one) are the only ones that touch hardware, and only lazily:
importing it initialises neither CUDA nor NVML, and imports neither torch nor pynvml.

- Frequency: [`FrequencyController`][kareus.exec.FrequencyController] with
  [`NVMLFrequencyController`][kareus.exec.NVMLFrequencyController] and
  [`DryRunFrequencyController`][kareus.exec.DryRunFrequencyController]; a
  [`FrequencyTrigger`][kareus.exec.FrequencyTrigger]
  ([`StreamOrderedTrigger`][kareus.exec.StreamOrderedTrigger]) applies changes in stream order.
- Collectives with an exact SM count: [`CollectiveBackend`][kareus.exec.CollectiveBackend] with
  [`OwnKernelCollective`][kareus.exec.OwnKernelCollective],
  [`NCCLCappedCollective`][kareus.exec.NCCLCappedCollective],
  [`MscclppCollective`][kareus.exec.MscclppCollective] (and
  [`ProcessGroupCollective`][kareus.exec.ProcessGroupCollective], NCCL's own CTA count, for uncapped
  systems).
- Execution of plans in a training loop: [`Executor`][kareus.exec.Executor] /
  [`TorchExecutor`][kareus.exec.TorchExecutor], and runnable partitions
  ([`RunnableTransformerPartition`][kareus.exec.RunnableTransformerPartition],
  [`CallablePartition`][kareus.exec.CallablePartition]).
"""

from __future__ import annotations

from kareus.exec._graphs import prefer_workspace_free_gemms
from kareus.exec.collectives import (
    CollectiveArgumentError,
    CollectiveBackend,
    CollectiveEnvironment,
    CollectiveError,
    CollectiveLaunchError,
    CollectiveUnavailableError,
    CommSMCountError,
    ExtensionBuildError,
    LoopbackCollective,
    MscclppCollective,
    NCCLCappedCollective,
    NoCollectiveBackendError,
    OwnKernelCollective,
    ProcessGroupCollective,
    select_collective_backend,
)
from kareus.exec.executor import (
    CollectiveLaunch,
    Executor,
    PartitionHook,
    PartitionScope,
    RecordingStreamBackend,
    StreamBackend,
    TorchExecutor,
    TorchStreamBackend,
)
from kareus.exec.frequency import (
    DryRunFrequencyController,
    EventPollingMarker,
    FrequencyController,
    FrequencyPermissionError,
    FrequencyTrigger,
    HostFunctionMarker,
    NVMLFrequencyController,
    StreamMarker,
    StreamOrderedTrigger,
)
from kareus.exec.nvml_device import nvml_device_index
from kareus.exec.torch_partition import (
    CallablePartition,
    PartitionProgram,
    RunnablePartition,
    RunnableTransformerPartition,
    runnable_partitions,
)

__all__ = [
    "CallablePartition",
    "CollectiveArgumentError",
    "CollectiveBackend",
    "CollectiveEnvironment",
    "CollectiveError",
    "CollectiveLaunch",
    "CollectiveLaunchError",
    "CollectiveUnavailableError",
    "CommSMCountError",
    "DryRunFrequencyController",
    "EventPollingMarker",
    "Executor",
    "ExtensionBuildError",
    "FrequencyController",
    "FrequencyPermissionError",
    "FrequencyTrigger",
    "HostFunctionMarker",
    "LoopbackCollective",
    "MscclppCollective",
    "NCCLCappedCollective",
    "NVMLFrequencyController",
    "NoCollectiveBackendError",
    "OwnKernelCollective",
    "PartitionHook",
    "PartitionProgram",
    "PartitionScope",
    "ProcessGroupCollective",
    "RecordingStreamBackend",
    "RunnablePartition",
    "RunnableTransformerPartition",
    "StreamBackend",
    "StreamMarker",
    "StreamOrderedTrigger",
    "TorchExecutor",
    "TorchStreamBackend",
    "nvml_device_index",
    "prefer_workspace_free_gemms",
    "runnable_partitions",
    "select_collective_backend",
]


def __getattr__(name: str) -> object:
    """Names this package re-exported before the profilers moved to ``kareus.profilers``:
    returned from there with a ``DeprecationWarning`` (one release)."""
    from kareus._compat import moved_attribute

    return moved_attribute(__name__, name)

"""Execution: profilers, energy meters, frequency control, collectives, executors.

Only this package touches hardware, and only lazily: importing it initialises
neither CUDA nor NVML, and imports neither torch nor pynvml.

- Profilers ([`Profiler`][kareus.exec.Profiler]): [`EmulatedProfiler`][kareus.exec.EmulatedProfiler]
  (the embedded emulated GPU), [`NVMLProfiler`][kareus.exec.NVMLProfiler] (real GPUs, NVML energy
  counter), [`ReplayProfiler`][kareus.exec.ReplayProfiler] (recorded measurements).
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
from kareus.exec.emulator import EmulatedGPU, EmulatedProfiler, EmulationTrace
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
from kareus.exec.nvml import (
    Coordinator,
    EnergyMeter,
    LocalCoordinator,
    MeasurementRecord,
    NVMLProfiler,
    PartitionRunner,
    TorchDistributedCoordinator,
    TorchPartitionRunner,
    nvml_device_index,
)
from kareus.exec.replay import ReplayProfiler
from kareus.exec.torch_partition import (
    CallablePartition,
    PartitionProgram,
    RunnablePartition,
    RunnableTransformerPartition,
    runnable_partitions,
)
from kareus.model.profiler import Profiler, ProfilerWrapper

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
    "Coordinator",
    "DryRunFrequencyController",
    "EmulatedGPU",
    "EmulatedProfiler",
    "EmulationTrace",
    "EnergyMeter",
    "EventPollingMarker",
    "Executor",
    "ExtensionBuildError",
    "FrequencyController",
    "FrequencyPermissionError",
    "FrequencyTrigger",
    "HostFunctionMarker",
    "LocalCoordinator",
    "LoopbackCollective",
    "MeasurementRecord",
    "MscclppCollective",
    "NCCLCappedCollective",
    "NVMLFrequencyController",
    "NVMLProfiler",
    "NoCollectiveBackendError",
    "OwnKernelCollective",
    "PartitionHook",
    "PartitionProgram",
    "PartitionRunner",
    "PartitionScope",
    "ProcessGroupCollective",
    "Profiler",
    "ProfilerWrapper",
    "RecordingStreamBackend",
    "ReplayProfiler",
    "RunnablePartition",
    "RunnableTransformerPartition",
    "StreamBackend",
    "StreamMarker",
    "StreamOrderedTrigger",
    "TorchDistributedCoordinator",
    "TorchExecutor",
    "TorchPartitionRunner",
    "TorchStreamBackend",
    "nvml_device_index",
    "prefer_workspace_free_gemms",
    "runnable_partitions",
    "select_collective_backend",
]

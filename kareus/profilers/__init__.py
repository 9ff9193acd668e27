"""Measurement: everything that turns a partition and a configuration into a Measurement.

Each implements the [`Profiler`][kareus.model.Profiler] role (``measure(partition, config) ->
Measurement``) and says what it is (how the partition's steps are executed, whether it runs
on GPUs, an identity for manifests and resumes):

- [`EmulatedProfiler`][kareus.profilers.EmulatedProfiler]: the embedded emulated GPU
  ([`EmulatedGPU`][kareus.profilers.EmulatedGPU]), a physical time and power model; the
  default, on any CPU.
- [`NVMLProfiler`][kareus.profilers.NVMLProfiler]: real GPUs, NVML's energy counter read at its
  step edges ([`EnergyMeter`][kareus.profilers.EnergyMeter]) over steady-state windows, ranks
  kept in agreement by a [`Coordinator`][kareus.profilers.Coordinator].
- [`ReplayProfiler`][kareus.profilers.ReplayProfiler] / [`RecordingProfiler`][kareus.profilers.RecordingProfiler]:
  measurements recorded once and replayed.
- [`EmulatedCollectiveTimes`][kareus.profilers.EmulatedCollectiveTimes]: how long a real
  collective takes (measured curves, or the emulator's link model), the times the
  time-faithful one-GPU stand-in holds
  ([`TimedLoopbackGroupCollective`][kareus.exec.train.TimedLoopbackGroupCollective]).
- Calibration of the emulator from a GPU's own measurements: ``kareus.profilers.calibrate``
  (``kareus calibrate``) and ``kareus.profilers.profile_build`` (a GPU profile from recorded
  files).

This package sits above [`kareus.exec`][kareus.exec] (the NVML profiler runs partitions through
the executor) and below the workflow. Importing it, or one of its modules, loads only what is
used: the emulator imports nothing of the execution layer, torch or pynvml.
"""

from __future__ import annotations

from kareus._lazy import attach

TYPE_CHECKING = False
if TYPE_CHECKING:
    from kareus.model.profiler import Profiler, ProfilerWrapper
    from kareus.profilers.collective_times import EmulatedCollectiveTimes
    from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler, EmulationTrace
    from kareus.profilers.nvml import (
        Coordinator,
        EnergyMeter,
        LocalCoordinator,
        MeasurementRecord,
        NVMLProfiler,
        PartitionRunner,
        TorchDistributedCoordinator,
        TorchPartitionRunner,
    )
    from kareus.profilers.replay import RecordingProfiler, ReplayProfiler

_NAMES = {
    "Profiler": "kareus.model.profiler",
    "ProfilerWrapper": "kareus.model.profiler",
    **dict.fromkeys(("EmulatedGPU", "EmulatedProfiler", "EmulationTrace"),
                    "kareus.profilers.emulator"),
    **dict.fromkeys(("Coordinator", "EnergyMeter", "LocalCoordinator", "MeasurementRecord",
                     "NVMLProfiler", "PartitionRunner", "TorchDistributedCoordinator",
                     "TorchPartitionRunner"), "kareus.profilers.nvml"),
    **dict.fromkeys(("RecordingProfiler", "ReplayProfiler"), "kareus.profilers.replay"),
    "EmulatedCollectiveTimes": "kareus.profilers.collective_times",
}

__all__ = [
    "Coordinator",
    "EmulatedCollectiveTimes",
    "EmulatedGPU",
    "EmulatedProfiler",
    "EmulationTrace",
    "EnergyMeter",
    "LocalCoordinator",
    "MeasurementRecord",
    "NVMLProfiler",
    "PartitionRunner",
    "Profiler",
    "ProfilerWrapper",
    "RecordingProfiler",
    "ReplayProfiler",
    "TorchDistributedCoordinator",
    "TorchPartitionRunner",
]

__getattr__, __dir__ = attach(globals(), _NAMES)

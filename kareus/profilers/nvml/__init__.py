"""Energy from NVML, measured so that repeated measurements agree.

NVML's total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``, millijoules
since driver load) does not move continuously: on an H200 it changes in steps about
every 75-100 ms (``counter_step_s`` in ``data/h200_llama3b_tp4_smoke.json`` and the TP=2
grids ``data/h200_llama3b_tp2_grid*.json``), and a read returns a value up to one step
stale.
Reading it at arbitrary moments around a window of at least 1.5 s scattered the energy of
one schedule by 0.9-7.6% between rounds on 2x H200 (median 4.0%;
``bench/probes/results/h200_overlap_repeat_2xh200.json``, docs/emulator.md). Three things fix
that here:

* **Step-edge reads.** [`EnergyMeter`][kareus.profilers.EnergyMeter] polls the counter of each local GPU
  on a background thread and keeps only the moments it *changes* (its edges) with their
  host time. The energy between two edges is exact, and their host times are known
  to about the polling period, so average power over an edge-to-edge span of a few
  steps is accurate to a fraction of a percent.
* **Steady-state windows.** [`NVMLProfiler`][kareus.profilers.NVMLProfiler] runs the partition back to
  back for a warm-up, then a measurement span of whole counter steps, then a short tail, with a
  device event after every run. The events give the host time at which each run
  finished, so the runs completed between the span's first and last counter step are
  counted (fractionally at the ends): energy per run = counter energy over the span /
  runs in it, time per run = span / runs in it. Under a power cap the GPU's clock
  wanders, and this keeps energy and time of exactly the same span together. The span
  is cut into sub-windows whose spread is checked; while it is above the target, the
  profiler measures again.
* **Thermal state.** Before each candidate, the profiler waits until every GPU's
  temperature is back near the baseline taken when the profiler started (not a fixed
  sleep), so the heat of one configuration does not leak into the next.

Where the runner's executor captures CUDA graphs (the default on a GPU), each step is a
graph replay, as in training; every measurement records that (``execution``) and the
fraction of its window the GPU was busy (``gpu_busy``: the GPU's own time per step, from
steps queued behind a sleeping kernel, over the measured time per step). Below 90%
(``HOST_BOUND_BUSY``) the host set the pace, and the measurement is flagged as
host-bound.

Static power is measured, not assumed:
[`NVMLProfiler.measure_static_power`][kareus.profilers.NVMLProfiler.measure_static_power] reads the power
of GPUs blocked in a receive whose sender is late (the power a GPU draws while it waits on
communication), and of idle GPUs.

Scope: a measurement sums the energy of every GPU of the partition's group (each rank
reads its own GPU, and the ranks sum). All ranks must call
[`NVMLProfiler.measure`][kareus.profilers.NVMLProfiler.measure] with the same arguments in the same
order; step counts are decided by rank 0 and broadcast, so no loop length depends on one rank's
timing.

``pynvml`` (the ``nvidia-ml-py`` package) is imported lazily; pass a fake module as
``nvml=`` to test without GPUs.

Modules (import the names from this package, not from them): ``kareus.exec.nvml_device``
(loading NVML, and [`nvml_device_index`][kareus.exec.nvml_device_index]: this process's GPU in
NVML's numbering, by UUID; a leaf beside this package, since the frequency controllers need it
too), ``_meter`` ([`EnergyMeter`][kareus.profilers.EnergyMeter]), ``_coordinator`` (agreement among
ranks), ``_runner`` (running partition steps) and ``_profiler``
([`NVMLProfiler`][kareus.profilers.NVMLProfiler]).
"""

from __future__ import annotations

from kareus.exec.nvml_device import cuda_device_uuid, load_nvml, nvml_device_index
from kareus.profilers.nvml._coordinator import (
    Coordinator,
    LocalCoordinator,
    TorchDistributedCoordinator,
)
from kareus.profilers.nvml._meter import EnergyMeter
from kareus.profilers.nvml._profiler import HOST_BOUND_BUSY, MeasurementRecord, NVMLProfiler
from kareus.profilers.nvml._runner import PartitionRunner, TorchPartitionRunner

__all__ = [
    "HOST_BOUND_BUSY",
    "Coordinator",
    "EnergyMeter",
    "LocalCoordinator",
    "MeasurementRecord",
    "NVMLProfiler",
    "PartitionRunner",
    "TorchDistributedCoordinator",
    "TorchPartitionRunner",
    "cuda_device_uuid",
    "load_nvml",
    "nvml_device_index",
]

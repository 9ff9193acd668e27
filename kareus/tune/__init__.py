"""Tuning on the target machine: the whole kareus job, measured on the job's own GPUs.

``tune`` is what ``kareus optimize --profiler nvml`` runs on every rank under
``torchrun`` (one process per GPU of one pipeline stage's TP x CP group; the stages of a
pipeline run the same partition types, so one group measures them all). It profiles every
partition type of the workload with the multi-pass search through the
[`NVMLProfiler`][kareus.profilers.NVMLProfiler], measures the baselines' configurations and the
work outside partitions, composes the five systems, and writes the same ``results.json``,
``plan.json`` and search logs as the emulated job, plus ``tune.json`` (the machine, the
clocks, the backends, the GPU time).

Every rank must issue the same collectives in the same order. So only rank 0 runs the
search and the composition: ``LockstepProfiler`` announces each measurement (the
partition, by its index in a ``Catalog`` every rank builds from the workload, and the
configuration, by value) with one broadcast, then measures it together with the other
ranks, which ``follow`` the announcements until rank 0 says it is done. Nothing a rank
decides alone changes how many collectives run.

The frequency dimension is the set of clocks the profiler may set: every clock of the
GPU's search grid with ``allow_clock_changes`` (an
[`NVMLFrequencyController`][kareus.exec.NVMLFrequencyController], restored on exit), else the GPU's
default clock alone (a [`DryRunFrequencyController`][kareus.exec.DryRunFrequencyController], as on
shared machines whose clocks must not change); the output says which. The collective
backend is a dimension where more than one runs on the group (kareus's own SM-capped
kernels and NCCL with capped CTAs), so each partition type's choice is measured.

Resuming: the search logs resume as in the emulated job, and every other measurement
(baselines, outside work) is appended to ``logs/measurements.jsonl`` and served from
there by a later run of the same command; the followers measure whatever rank 0 still
asks for.

A world of one process runs the same path on one GPU, each TP and CP group stood in for
by a loopback of its size (``one_gpu_backends``: a real kernel
of each collective's bytes that communicates with nobody): a smoke run of the tuning path,
whose figures are not kareus's.

Each measured step is a CUDA-graph replay where the executor captures graphs (the default
on a GPU, as in training); ``tune.json`` records the execution mode and the measurements
whose GPU was busy less than 90% of their window (``host_bound``).

Modules (import the names from this package, not from them): ``_lockstep`` (the
``Catalog``, ``LockstepProfiler`` and ``follow``: how the ranks stay in
step), ``_job`` (``run_lockstep`` and ``TuneReport``: the job over a built
profiler and what it writes, hardware-free) and ``_hardware`` (``tune``: the GPUs,
backends, clocks and profiler of a run on the machine).
"""

from __future__ import annotations

# The `x as x` names are public but outside __all__ (the CLI and the tests use them).
from kareus.tune._hardware import detect_gpu_preset as detect_gpu_preset
from kareus.tune._hardware import one_gpu_backends as one_gpu_backends
from kareus.tune._hardware import tune
from kareus.tune._hardware import tuning_backends as tuning_backends
from kareus.tune._job import MEASUREMENTS_NAME as MEASUREMENTS_NAME
from kareus.tune._job import TuneReport, run_lockstep
from kareus.tune._lockstep import Catalog, LockstepProfiler, follow

__all__ = ["Catalog", "LockstepProfiler", "TuneReport", "follow", "run_lockstep", "tune"]

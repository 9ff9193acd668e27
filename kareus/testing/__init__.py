"""Fakes and conformance suites for testing kareus and plug-ins written for it.

* [`FakeProfiler`][kareus.testing.FakeProfiler] - a cheap analytic
  [`Profiler`][kareus.model.Profiler] with the shape that matters to a search;
  [`check_profiler`][kareus.testing.check_profiler] - conformance checks for any profiler
  (``kareus.testing.profiler``).
* [`RecordingExecutor`][kareus.testing.RecordingExecutor],
  [`RecordingCollective`][kareus.testing.RecordingCollective],
  [`RecordingTrigger`][kareus.testing.RecordingTrigger] - fakes of the executor, a collective
  backend and a frequency trigger; [`check_executor`][kareus.testing.check_executor] - conformance
  checks for any [`Executor`][kareus.exec.Executor] (``kareus.testing.executor``).
* [`check_surrogate`][kareus.testing.check_surrogate] - conformance checks for any
  [`Surrogate`][kareus.search.Surrogate].
* [`check_acquisition_pass`][kareus.testing.check_acquisition_pass] - conformance checks for any
  [`AcquisitionPass`][kareus.search.AcquisitionPass].
* [`check_partition`][kareus.testing.check_partition] - conformance checks for any
  [`Partition`][kareus.model.Partition].
* [`check_kernels`][kareus.testing.check_kernels] - conformance checks for any kernel set
  (``kareus.exec.kernels.KernelSet``: each op against its formula in float64).
* [`moe_block_reference`][kareus.testing.moe_block_reference] - a mixture-of-experts block
  (router, top-k, SwiGLU experts, shared experts) as plain autograd of whole tensors, the
  reference an MoE implementation's outputs and gradients are compared with
  (``kareus.testing.moe``).
* [`check_microbatch_composer`][kareus.testing.check_microbatch_composer],
  [`check_iteration_composer`][kareus.testing.check_iteration_composer] - conformance checks for any
  [`FrontierComposer`][kareus.compose.FrontierComposer] of either level.

Each check raises ``AssertionError`` saying what is wrong. To run them as separate
pytest tests, subclass [`SurrogateConformance`][kareus.testing.SurrogateConformance] or
[`AcquisitionPassConformance`][kareus.testing.AcquisitionPassConformance] in a ``Test*`` class and
implement the factory method::

    class TestMySurrogate(SurrogateConformance):
        def make_surrogate(self):
            return MySurrogate(seed=0)

This module imports neither pytest nor any hardware library.
"""

from __future__ import annotations

from kareus.testing.acquisition import (
    PASS_CHECKS,
    AcquisitionPassConformance,
    check_acquisition_pass,
    make_acquisition_context,
)
from kareus.testing.composer import (
    ITERATION_COMPOSER_CHECKS,
    MICROBATCH_COMPOSER_CHECKS,
    IterationComposerConformance,
    MicrobatchComposerConformance,
    check_iteration_composer,
    check_microbatch_composer,
)
from kareus.testing.executor import (
    EXECUTOR_CHECKS,
    ExecutorConformance,
    RecordingCollective,
    RecordingExecutor,
    RecordingTrigger,
    check_executor,
    make_test_plan,
    make_workload_plan,
)
from kareus.testing.kernels import KERNEL_CHECKS, KernelSetConformance, check_kernels
from kareus.testing.moe import moe_block_reference
from kareus.testing.partition import PARTITION_CHECKS, PartitionConformance, check_partition
from kareus.testing.profiler import (
    PROFILER_CHECKS,
    FakeProfiler,
    ProfilerConformance,
    check_profiler,
)
from kareus.testing.surrogate import SURROGATE_CHECKS, SurrogateConformance, check_surrogate

__all__ = [
    "EXECUTOR_CHECKS",
    "ITERATION_COMPOSER_CHECKS",
    "KERNEL_CHECKS",
    "MICROBATCH_COMPOSER_CHECKS",
    "PARTITION_CHECKS",
    "PASS_CHECKS",
    "PROFILER_CHECKS",
    "SURROGATE_CHECKS",
    "AcquisitionPassConformance",
    "ExecutorConformance",
    "FakeProfiler",
    "IterationComposerConformance",
    "KernelSetConformance",
    "MicrobatchComposerConformance",
    "PartitionConformance",
    "ProfilerConformance",
    "RecordingCollective",
    "RecordingExecutor",
    "RecordingTrigger",
    "SurrogateConformance",
    "check_acquisition_pass",
    "check_executor",
    "check_iteration_composer",
    "check_kernels",
    "check_microbatch_composer",
    "check_partition",
    "check_profiler",
    "check_surrogate",
    "make_acquisition_context",
    "make_test_plan",
    "make_workload_plan",
    "moe_block_reference",
]


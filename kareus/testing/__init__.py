"""Fakes and conformance suites for testing kareus and plug-ins written for it.

* :class:`FakeProfiler` - a cheap analytic :class:`~kareus.model.Profiler` with the shape
  that matters to a search; :func:`check_profiler` - conformance checks for any profiler
  (:mod:`kareus.testing.profiler`).
* :class:`RecordingExecutor`, :class:`RecordingCollective`, :class:`RecordingTrigger` -
  fakes of the executor, a collective backend and a frequency trigger;
  :func:`check_executor` - conformance checks for any
  :class:`~kareus.exec.executor.Executor` (:mod:`kareus.testing.executor`).
* :func:`check_surrogate` - conformance checks for any :class:`~kareus.search.Surrogate`.
* :func:`check_acquisition_pass` - conformance checks for any
  :class:`~kareus.search.AcquisitionPass`.
* :func:`check_partition` - conformance checks for any :class:`~kareus.model.Partition`.
* :func:`check_microbatch_composer`, :func:`check_iteration_composer` - conformance checks
  for any :class:`~kareus.compose.FrontierComposer` of either level.

Each check raises ``AssertionError`` saying what is wrong. To run them as separate
pytest tests, subclass :class:`SurrogateConformance` or :class:`AcquisitionPassConformance`
in a ``Test*`` class and implement the factory method::

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
)
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
    "MICROBATCH_COMPOSER_CHECKS",
    "PARTITION_CHECKS",
    "PASS_CHECKS",
    "PROFILER_CHECKS",
    "SURROGATE_CHECKS",
    "AcquisitionPassConformance",
    "ExecutorConformance",
    "FakeProfiler",
    "IterationComposerConformance",
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
    "check_microbatch_composer",
    "check_partition",
    "check_profiler",
    "check_surrogate",
    "make_acquisition_context",
    "make_test_plan",
]


"""Conformance suites for [`FrontierComposer`][kareus.compose.FrontierComposer] implementations.

A composer of either level plugs into [`compose_systems`][kareus.workflow.compose_systems] and
[`kareus.optimize`][kareus.workflow.optimize], which call it with one context object, so each level
has its own suite:

* microbatch composers (partition frontiers -> the microbatch frontier of every
  ``(stage, phase)``), called as ``compose(frontiers, MicrobatchContext(partitions=...,
  outside=...))``: [`check_microbatch_composer`][kareus.testing.check_microbatch_composer],
  ``MICROBATCH_COMPOSER_CHECKS``,
  [`MicrobatchComposerConformance`][kareus.testing.MicrobatchComposerConformance];
* iteration composers (microbatch frontiers -> the iteration frontier), called as
  ``compose(frontiers, IterationContext(static_power_w=..., gpu=..., schedule=..., tail=...,
  label=..., workload=...))``:
  [`check_iteration_composer`][kareus.testing.check_iteration_composer],
  ``ITERATION_COMPOSER_CHECKS``,
  [`IterationComposerConformance`][kareus.testing.IterationComposerConformance].

The checks compose a tiny workload (Qwen3-1.7B, TP=2, PP=2, DP=2, three microbatches)
whose partition types were measured exhaustively on a small grid by
[`FakeProfiler`][kareus.testing.FakeProfiler]. They check the contract, not one algorithm: the
result has the right type and keys; it is a Pareto front sorted by time; every point
keeps the choices that produce it, and those choices cost what the point says (a
microbatch choice picks measured configurations at its frequency; an iteration plan's
time is the pipeline DAG's longest path over its microbatch points plus the per-iteration
tail, and its energy their dynamic energy plus the tail's plus static power x time); the
inputs are not changed; the same input gives the same output. Beyond that, what
``kareus.optimize`` relies on: a microbatch choice records its partition set's nanobatch
count (or none), and a composer's ``compose`` takes the context positionally (the
keyword form of earlier releases is refused when the class is defined).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from kareus.compose import (
    AnyIterationComposer,
    AnyMicrobatchComposer,
    FrontierComposer,
    IterationContext,
    IterationFrontier,
    MicrobatchComposer,
    MicrobatchContext,
    MicrobatchFrontier,
)
from kareus.model.config import ConfigSpace
from kareus.model.measurement import Measurement
from kareus.model.partition import PartitionSet, build_partitions
from kareus.model.pipeline import PipelineSchedule, one_f_one_b
from kareus.model.workload import Workload
from kareus.search import Observation, PartitionFrontier
from kareus.testing._suite import _add_tests, _run_checks
from kareus.testing.profiler import FakeProfiler

__all__ = [
    "ITERATION_COMPOSER_CHECKS",
    "MICROBATCH_COMPOSER_CHECKS",
    "ComposerCase",
    "IterationComposerConformance",
    "MicrobatchComposerConformance",
    "check_iteration_composer",
    "check_microbatch_composer",
    "composer_case",
]

_REL = 1e-9


class ComposerCase:
    """The tiny job every composer check composes, built once.

    Attributes:
        workload: Qwen3-1.7B, TP=2, PP=2, DP=2, microbatch size 2, 1,024 tokens,
            three microbatches, two nanobatches.
        partitions: Its partition set.
        frontiers: Partition type name -> its frontier (every configuration of a small
            grid measured by the fake profiler).
        outside: The work outside partitions at every frequency of the grid (closed-form
            figures: the fake profiler measures partitions only).
        static_power_w: Static power of every GPU of the job together.
        tail: The work once per iteration after the flush (closed-form figures): every plan
            must add its time and dynamic energy.
        schedule: The 1F1B schedule of the job.
        gpu: The GPU preset name.
        microbatch: The microbatch frontiers of the default
            [`MicrobatchComposer`][kareus.compose.MicrobatchComposer], the input of iteration
            composers.
    """

    def __init__(self) -> None:
        profiler = FakeProfiler("a100-40gb")
        self.workload = Workload.preset("qwen3-1.7b", tp=2, pp=2, dp=2, microbatch_size=2,
                                        seq_len=1024, num_microbatches=3, nanobatches=2)
        self.partitions: PartitionSet = build_partitions(self.workload)
        gpu = profiler.gpu
        freqs = list(gpu.search_clocks_mhz[::4])
        self.frontiers: dict[str, PartitionFrontier] = {}
        for name, part in self.partitions.types.items():
            space = ConfigSpace(part, gpu, freqs_mhz=freqs, comm_sms=[4, 16, 32])
            obs = [Observation(config=c, measurement=profiler.measure(part, c))
                   for c in space.configs]  # every configuration of the grid
            self.frontiers[name] = PartitionFrontier.from_observations(name, gpu.name, obs)
        # FakeProfiler measures partitions only: the work outside them gets closed-form
        # figures here (time inversely proportional to the clock, dynamic power ~ f^2.5).
        group = self.workload.parallelism.tp * self.workload.parallelism.cp
        static = profiler.static_power_w(group)
        self.outside: dict[tuple[int, str], dict[int, Measurement]] = {}
        for key, work in self.partitions.outside.items():
            row: dict[int, Measurement] = {}
            for f in freqs:
                r = f / gpu.max_clock_mhz
                t = work.flops / 1e14 / r + 1e-5 * len(work.comms)
                row[f] = Measurement(time_s=t, energy_j=(200.0 * r ** 2.5 * group + static) * t,
                                     static_power_w=static)
            self.outside[key] = row
        self.static_power_w = profiler.static_power_w(self.workload.parallelism.world_size)
        world = self.workload.parallelism.world_size
        self.tail = Measurement(time_s=2e-3, energy_j=2e-3 * (150.0 * world + self.static_power_w),
                                static_power_w=self.static_power_w)
        self.schedule: PipelineSchedule = one_f_one_b(self.workload.parallelism.pp,
                                                      self.workload.num_microbatches)
        self.gpu = gpu.name
        self.microbatch_context = MicrobatchContext(partitions=self.partitions,
                                                    outside=self.outside)
        self.microbatch: dict[tuple[int, str], MicrobatchFrontier] = MicrobatchComposer(
            ).compose(self.frontiers, self.microbatch_context)

    def iteration_context(self, *, label: str = "kareus") -> IterationContext:
        """The context an iteration composer gets for this job."""
        return IterationContext(static_power_w=self.static_power_w, gpu=self.gpu,
                                schedule=self.schedule, tail=self.tail, label=label,
                                workload=self.workload.to_dict())


@functools.cache
def composer_case() -> ComposerCase:
    """The shared ``ComposerCase`` (built on first use, about a second)."""
    return ComposerCase()


# ------------------------------------------------------------------------ shared checks


def _check_type(make: Callable[[], FrontierComposer[Any, Any, Any]]) -> None:
    c = make()
    assert isinstance(c, FrontierComposer), \
        f"factory returned {type(c).__name__}, not a FrontierComposer"
    assert isinstance(repr(c), str) and repr(c), "repr must be a non-empty string"


def _assert_front(times: list[float], energies: list[float], what: str) -> None:
    assert times, f"{what} has no points"
    for i in range(1, len(times)):
        assert times[i - 1] < times[i] and energies[i - 1] > energies[i], \
            f"{what}: points must be a Pareto front, fastest first (point {i} is not)"


def _snapshot(frontiers: Mapping[Any, Any]) -> dict[Any, Any]:
    return {k: (v.to_json() if hasattr(v, "to_json") else repr(v)) for k, v in frontiers.items()}


# -------------------------------------------------------------------- microbatch level


def _compose_mb(comp: AnyMicrobatchComposer, case: ComposerCase
                ) -> dict[tuple[int, str], MicrobatchFrontier]:
    return comp.compose(case.frontiers, case.microbatch_context)


def _check_mb_keys(make: Callable[[], AnyMicrobatchComposer]) -> None:
    case = composer_case()
    out = _compose_mb(make(), case)
    assert isinstance(out, Mapping), f"compose must return a mapping, got {type(out).__name__}"
    want = {(s, ph) for s in range(case.workload.parallelism.pp) for ph in ("fwd", "bwd")}
    assert set(out) == want, f"keys must be every (stage, phase) {sorted(want)}, got {sorted(out)}"
    for key, fr in out.items():
        assert isinstance(fr, MicrobatchFrontier), \
            f"{key}: expected a MicrobatchFrontier, got {type(fr).__name__}"
        assert (fr.stage, fr.phase) == key, f"{key}: frontier says stage {fr.stage} {fr.phase}"
        _assert_front([p.time_s for p in fr.points], [p.dynamic_energy_j for p in fr.points],
                      f"microbatch frontier {key}")


def _check_mb_choices_cost_what_they_say(make: Callable[[], AnyMicrobatchComposer]) -> None:
    case = composer_case()
    out = _compose_mb(make(), case)
    scale = float(case.workload.parallelism.dp)
    for (stage, phase), fr in out.items():
        counts = {t: c for t, c in case.partitions.counts[phase].items() if c > 0}
        for p in fr.points:
            ch = p.choice
            configs = dict(ch.configs)
            assert set(configs) == set(counts), \
                f"{stage} {phase}: a choice must configure {sorted(counts)}, got {sorted(configs)}"
            t = case.outside[(stage, phase)][ch.freq_mhz].time_s
            e = case.outside[(stage, phase)][ch.freq_mhz].dynamic_energy_j
            for name, count in counts.items():
                cfg = configs[name]
                assert cfg.freq_mhz == ch.freq_mhz, \
                    f"{name}: configuration at {cfg.freq_mhz} MHz in a {ch.freq_mhz} MHz choice"
                obs = [o for o in case.frontiers[name].observations if o.config == cfg]
                assert obs, f"{name}: {cfg} was never measured"
                t += count * obs[0].time_s
                e += count * obs[0].dynamic_energy_j
            assert abs(p.time_s - t) <= _REL * t, \
                f"{stage} {phase}: point time {p.time_s} but its choice takes {t}"
            assert abs(p.dynamic_energy_j - e * scale) <= _REL * e * scale, \
                f"{stage} {phase}: point energy {p.dynamic_energy_j} but its choice uses {e * scale}"


def _check_mb_no_mutation(make: Callable[[], AnyMicrobatchComposer]) -> None:
    case = composer_case()
    before = _snapshot(case.frontiers)
    _compose_mb(make(), case)
    assert _snapshot(case.frontiers) == before, "compose must not change its input frontiers"


def _check_mb_deterministic(make: Callable[[], AnyMicrobatchComposer]) -> None:
    case = composer_case()
    a = _compose_mb(make(), case)
    b = _compose_mb(make(), case)
    assert _snapshot(a) == _snapshot(b), "the same input must give the same frontiers"


def _check_mb_missing_frontier(make: Callable[[], AnyMicrobatchComposer]) -> None:
    case = composer_case()
    try:
        make().compose({}, case.microbatch_context)
    except ValueError:
        return
    raise AssertionError("composing without the frontiers the counts need must raise "
                         "ValueError")


def _check_mb_records_nanobatches(make: Callable[[], AnyMicrobatchComposer]) -> None:
    case = composer_case()
    n = case.workload.nanobatches
    for key, fr in _compose_mb(make(), case).items():
        counts = {p.choice.nanobatches for p in fr.points}
        assert counts <= {None, n}, \
            (f"{key}: choices must record the partition set's {n} nanobatches (or none), got "
             f"{sorted(c for c in counts if c is not None)}; kareus.optimize refuses them")


#: Name -> check, for microbatch composers (each takes a factory of new composers).
MICROBATCH_COMPOSER_CHECKS: dict[str, Callable[[Callable[[], Any]], None]] = {
    "type": _check_type,
    "keys": _check_mb_keys,
    "choices_cost_what_they_say": _check_mb_choices_cost_what_they_say,
    "no_mutation": _check_mb_no_mutation,
    "deterministic": _check_mb_deterministic,
    "missing_frontier": _check_mb_missing_frontier,
    "records_nanobatches": _check_mb_records_nanobatches,
}


def check_microbatch_composer(make: Callable[[], AnyMicrobatchComposer], *,
                              skip: tuple[str, ...] = ()) -> None:
    """Run every microbatch-composer conformance check on composers made by ``make``.

    Args:
        make: Returns a new composer each call.
        skip: Names (keys of ``MICROBATCH_COMPOSER_CHECKS``) to skip.

    Raises:
        AssertionError: naming the first check that fails.
    """
    _run_checks("microbatch composer", MICROBATCH_COMPOSER_CHECKS, skip, make)


class MicrobatchComposerConformance:
    """Mix-in: subclass in a ``Test*`` class and implement [`make_composer`][kareus.testing.MicrobatchComposerConformance.make_composer]; pytest
    then runs one test per check of ``MICROBATCH_COMPOSER_CHECKS``."""

    skip_checks: tuple[str, ...] = ()

    def make_composer(self) -> AnyMicrobatchComposer:
        """A new composer under test."""
        raise NotImplementedError("implement make_composer() to return a new composer")


_add_tests(MicrobatchComposerConformance, MICROBATCH_COMPOSER_CHECKS,
           lambda self: (self.make_composer,))


# --------------------------------------------------------------------- iteration level


def _compose_it(comp: AnyIterationComposer, case: ComposerCase, *, label: str = "kareus"
                ) -> IterationFrontier:
    return comp.compose(case.microbatch, case.iteration_context(label=label))


def _check_it_frontier(make: Callable[[], AnyIterationComposer]) -> None:
    case = composer_case()
    fr = _compose_it(make(), case, label="under-test")
    assert isinstance(fr, IterationFrontier), \
        f"compose must return an IterationFrontier, got {type(fr).__name__}"
    assert fr.label == "under-test", f"the label must be recorded, got {fr.label!r}"
    _assert_front([p.time_s for p in fr.points], [p.energy_j for p in fr.points],
                  "iteration frontier")
    for p in fr.points:
        assert p.plan.label == "under-test", "every plan must carry the label"
        assert p.plan.gpu == case.gpu, f"plan GPU {p.plan.gpu!r}, expected {case.gpu!r}"
        assert (p.time_s, p.energy_j) == (p.plan.time_s, p.plan.energy_j), \
            "a point's time and energy must be its plan's"


def _check_it_plans_cost_what_they_say(make: Callable[[], AnyIterationComposer]) -> None:
    case = composer_case()
    fr = _compose_it(make(), case)
    for i, pt in enumerate(fr.points):
        durations: dict[Any, float] = {}
        dyn = 0.0
        for c in case.schedule.nodes:
            ch = pt.plan.choice(c)
            match = [p for p in case.microbatch[(c.stage, c.phase)].points if p.choice == ch]
            assert match, f"plan {i}: the choice of {c.key()} is not on its microbatch frontier"
            durations[c] = match[0].time_s
            dyn += match[0].dynamic_energy_j
        t = case.schedule.makespan(durations) + case.tail.time_s
        e = dyn + case.tail.dynamic_energy_j + case.static_power_w * t
        assert abs(pt.time_s - t) <= _REL * t, \
            (f"plan {i}: time {pt.time_s} but the longest path of its choices plus the "
             f"per-iteration tail is {t} (context.tail must be added to every plan)")
        assert abs(pt.energy_j - e) <= _REL * e, \
            f"plan {i}: energy {pt.energy_j} but its choices and the tail use {e}"


def _check_it_no_mutation(make: Callable[[], AnyIterationComposer]) -> None:
    case = composer_case()
    before = _snapshot(case.microbatch)
    _compose_it(make(), case)
    assert _snapshot(case.microbatch) == before, "compose must not change its input frontiers"


def _check_it_deterministic(make: Callable[[], AnyIterationComposer]) -> None:
    case = composer_case()
    a = _compose_it(make(), case)
    b = _compose_it(make(), case)
    assert [p.plan.digest for p in a] == [p.plan.digest for p in b], \
        "the same input must give the same plans"


def _check_it_missing_frontier(make: Callable[[], AnyIterationComposer]) -> None:
    case = composer_case()
    partial = dict(list(case.microbatch.items())[1:])
    try:
        make().compose(partial, case.iteration_context())
    except ValueError:
        return
    raise AssertionError("composing without a computation's microbatch frontier must raise "
                         "ValueError")


#: Name -> check, for iteration composers (each takes a factory of new composers).
ITERATION_COMPOSER_CHECKS: dict[str, Callable[[Callable[[], Any]], None]] = {
    "type": _check_type,
    "frontier": _check_it_frontier,
    "plans_cost_what_they_say": _check_it_plans_cost_what_they_say,
    "no_mutation": _check_it_no_mutation,
    "deterministic": _check_it_deterministic,
    "missing_frontier": _check_it_missing_frontier,
}


def check_iteration_composer(make: Callable[[], AnyIterationComposer], *,
                             skip: tuple[str, ...] = ()) -> None:
    """Run every iteration-composer conformance check on composers made by ``make``.

    Args:
        make: Returns a new composer each call.
        skip: Names (keys of ``ITERATION_COMPOSER_CHECKS``) to skip.

    Raises:
        AssertionError: naming the first check that fails.
    """
    _run_checks("iteration composer", ITERATION_COMPOSER_CHECKS, skip, make)


class IterationComposerConformance:
    """Mix-in: subclass in a ``Test*`` class and implement [`make_composer`][kareus.testing.IterationComposerConformance.make_composer]; pytest
    then runs one test per check of ``ITERATION_COMPOSER_CHECKS``."""

    skip_checks: tuple[str, ...] = ()

    def make_composer(self) -> AnyIterationComposer:
        """A new composer under test."""
        raise NotImplementedError("implement make_composer() to return a new composer")


_add_tests(IterationComposerConformance, ITERATION_COMPOSER_CHECKS,
           lambda self: (self.make_composer,))

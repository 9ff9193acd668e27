"""The FrontierComposer role: the defaults pass the conformance suites, the suites catch
composers that break the contract, and the systems builder takes any composer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import pytest

from kareus.compose import (
    FrontierComposer,
    IterationComposer,
    IterationContext,
    IterationFrontier,
    MicrobatchComposer,
    MicrobatchContext,
    MicrobatchFrontier,
)
from kareus.model.config import ConfigSpace
from kareus.search import PartitionFrontier
from kareus.testing import (
    IterationComposerConformance,
    MicrobatchComposerConformance,
    check_iteration_composer,
    check_microbatch_composer,
)
from kareus.workflow import compose_systems, exhaustive_search


class TestMicrobatchComposer(MicrobatchComposerConformance):
    def make_composer(self) -> MicrobatchComposer:
        return MicrobatchComposer()


class TestIterationComposer(IterationComposerConformance):
    def make_composer(self) -> IterationComposer:
        return IterationComposer()


class TestCoarseIterationComposer(IterationComposerConformance):
    """A coarse time unit explores less of the trade-off but keeps the contract."""

    def make_composer(self) -> IterationComposer:
        return IterationComposer(resolution=0.5)


class _SlowerThanItSays(MicrobatchComposer):
    """Reports every microbatch point 1% faster than its choice runs."""

    def compose(self, frontiers: Mapping[str, PartitionFrontier],
                context: MicrobatchContext | None = None, /, **fields: Any
                ) -> dict[tuple[int, str], MicrobatchFrontier]:
        out = super().compose(frontiers, context)
        return {k: attrs.evolve(fr, points=tuple(attrs.evolve(p, time_s=p.time_s * 0.99)
                                                  for p in fr.points))
                for k, fr in out.items()}


class _Unlabelled(IterationComposer):
    """Drops the label it was given."""

    def compose(self, frontiers: Mapping[tuple[int, str], MicrobatchFrontier],
                context: IterationContext | None = None, /, **fields: Any) -> IterationFrontier:
        assert context is not None
        return super().compose(frontiers, attrs.evolve(context, label=""))


class _Tailless(IterationComposer):
    """Drops the per-iteration tail it was given (what keyword contexts let slip through)."""

    def compose(self, frontiers: Mapping[tuple[int, str], MicrobatchFrontier],
                context: IterationContext | None = None, /, **fields: Any) -> IterationFrontier:
        assert context is not None
        return super().compose(frontiers, attrs.evolve(context, tail=None))


def test_suites_catch_broken_composers():
    with pytest.raises(AssertionError, match="plans_cost_what_they_say.*tail"):
        check_iteration_composer(_Tailless)
    with pytest.raises(AssertionError, match="choices_cost_what_they_say"):
        check_microbatch_composer(_SlowerThanItSays)
    with pytest.raises(AssertionError, match="'frontier'.*label"):
        check_iteration_composer(_Unlabelled)
    with pytest.raises(AssertionError, match="not a FrontierComposer"):
        check_iteration_composer(lambda: object())  # type: ignore[arg-type, return-value]


def test_the_role_is_abstract_and_generic():
    with pytest.raises(TypeError):
        FrontierComposer()  # type: ignore[abstract]
    assert FrontierComposer[Mapping[str, int], MicrobatchContext, int] is not FrontierComposer
    assert isinstance(MicrobatchComposer(), FrontierComposer)
    assert isinstance(IterationComposer(), FrontierComposer)


class _CountingIterationComposer(IterationComposer):
    """The default composer, counting its calls: a stand-in for a user's own."""

    def __init__(self) -> None:
        super().__init__(resolution=0.05)
        self.calls = 0

    def compose(self, frontiers: Mapping[tuple[int, str], MicrobatchFrontier],
                context: IterationContext | None = None, /, **fields: Any) -> IterationFrontier:
        self.calls += 1
        return super().compose(frontiers, context)


def test_compose_systems_takes_any_composer(tiny_workload, fake_profiler):
    def search(p, part):
        return exhaustive_search(p, ConfigSpace(part, p.gpu, freqs_mhz=p.gpu.search_clocks_mhz[::6],
                                                comm_sms=[8]))

    mine = _CountingIterationComposer()
    res = compose_systems(tiny_workload, fake_profiler, search=search,
                          systems=["megatron", "kareus"], iteration_composer=mine)
    # Megatron-LM once; kareus four times: the union of its nanobatched and unsplit
    # microbatch frontiers, each set alone, and Megatron-LM's own measurements of the unsplit
    # set (its frontier is the Pareto union).
    assert mine.calls == 1 + 4 and list(res.frontiers) == ["megatron", "kareus"]
    assert res["kareus"].stats["compositions"] == 4
    assert res["kareus"].stats["unit_s"] > 0
    with pytest.raises(TypeError, match="iteration_composer must be a kareus FrontierComposer"):
        compose_systems(tiny_workload, fake_profiler, search=search,
                        iteration_composer=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="microbatch_composer must be a kareus FrontierComposer"):
        compose_systems(tiny_workload, fake_profiler, search=search,
                        microbatch_composer=lambda f, **k: {})  # type: ignore[arg-type]

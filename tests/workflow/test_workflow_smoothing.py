"""optimize(smooth=True): kareus composes on smoothed values; the baselines stay measured."""

from __future__ import annotations

import pytest

from kareus.errors import ArgumentTypeError, OutputError
from kareus.model import Workload
from kareus.workflow import optimize

SHAPE = dict(tp=2, pp=2, num_microbatches=4, microbatch_size=2, seq_len=1024)


@pytest.fixture(scope="module")
def runs():
    wl = Workload.preset("qwen3-1.7b", **SHAPE)
    return {smooth: optimize(wl, "h200-sxm", budget=8, progress=False, smooth=smooth)
            for smooth in (False, True)}


def test_smoothing_changes_kareus_s_values_only(runs):
    plain, smooth = runs[False], runs[True]
    for name in plain.frontiers:
        if name == "kareus":
            continue
        assert [(p.time_s, p.energy_j) for p in smooth.frontiers[name].points] == \
            [(p.time_s, p.energy_j) for p in plain.frontiers[name].points], name
    # the same configurations were measured, and kareus's are valued differently
    mine, theirs = smooth.composition.partitions["kareus"], plain.composition.partitions["kareus"]
    assert mine.keys() == theirs.keys()
    changed = 0
    for key in mine:
        assert [o.config for o in mine[key].observations] == \
            [o.config for o in theirs[key].observations]
        changed += sum(a.measurement != b.measurement for a, b in
                       zip(mine[key].observations, theirs[key].observations))
    assert changed > 0
    assert smooth.profiles == plain.profiles


def test_a_smoothed_frontier_still_holds_every_baseline_point(runs):
    result = runs[True]
    kareus = sorted((p.time_s, p.energy_j) for p in result.kareus.points)
    for name, frontier in result.frontiers.items():
        if name == "kareus":
            continue
        for p in frontier.points:
            within = [e for t, e in kareus if t <= p.time_s * (1 + 1e-9)]
            assert within and min(within) <= p.energy_j * (1 + 1e-9), name


def test_a_smoothed_run_resumes_exactly_and_its_folder_records_it(tmp_path):
    wl = Workload.preset("qwen3-1.7b", **SHAPE)
    first = optimize(wl, "h200-sxm", budget=8, progress=False, smooth=True, log_dir=tmp_path)
    again = optimize(wl, "h200-sxm", budget=8, progress=False, smooth=True, log_dir=tmp_path)
    assert [(p.time_s, p.energy_j) for p in again.kareus.points] == \
        [(p.time_s, p.energy_j) for p in first.kareus.points]
    with pytest.raises(OutputError, match="smooth"):
        optimize(wl, "h200-sxm", budget=8, progress=False, log_dir=tmp_path)


def test_smooth_must_be_a_bool():
    wl = Workload.preset("qwen3-1.7b", **SHAPE)
    with pytest.raises(ArgumentTypeError, match="smooth must be True or False"):
        optimize(wl, "h200-sxm", budget=8, progress=False, smooth="yes")  # type: ignore[arg-type]

"""kareus's frontier is never behind a baseline's, at any search budget (emulated).

Every configuration a baseline measured is a point of kareus's space, measured already: it
enters kareus's partition frontiers, and each baseline's own measurements are composed as one
of kareus's candidates, so kareus's iteration frontier holds every baseline point.
"""

from __future__ import annotations

import pytest

from kareus.model import Workload
from kareus.workflow import optimize

JOBS = [
    ("qwen3-1.7b", "h200-sxm", dict(tp=2, pp=2, num_microbatches=4, microbatch_size=2,
                                    seq_len=1024)),
    ("qwen3-1.7b", "a100-40gb", dict(tp=2, cp=2, pp=2, num_microbatches=4, microbatch_size=2,
                                     seq_len=2048)),
    ("llama3.2-3b", "h100-sxm", dict(tp=4, pp=2, num_microbatches=4, microbatch_size=2,
                                     seq_len=1024)),
]


def _behind(kareus, baseline) -> list[tuple[float, float, float]]:
    """Baseline points (time, energy) for which kareus has no plan as fast and as frugal:
    ``(time_s, baseline energy, kareus's lowest energy within that time)``."""
    points = sorted((p.time_s, p.energy_j) for p in kareus.points)
    bad = []
    for p in baseline.points:
        within = [e for t, e in points if t <= p.time_s * (1 + 1e-9)]
        best = min(within) if within else float("inf")
        if best > p.energy_j * (1 + 1e-9):
            bad.append((p.time_s, p.energy_j, best))
    return bad


@pytest.mark.parametrize("budget", [8, 16, 32])
@pytest.mark.parametrize(("preset", "gpu", "shape"), JOBS)
def test_kareus_is_behind_no_baseline_at_any_budget(preset, gpu, shape, budget):
    result = optimize(Workload.preset(preset, **shape), gpu, budget=budget, progress=False)
    for name, frontier in result.frontiers.items():
        if name != "kareus":
            assert _behind(result.kareus, frontier) == [], (name, budget)


def test_kareus_frontiers_hold_every_configuration_the_baselines_measured():
    wl = Workload.preset(*JOBS[0][:1], **JOBS[0][2])
    result = optimize(wl, "h200-sxm", budget=8, progress=False)
    kareus = result.composition.partitions["kareus"]
    for name in ("perseus", "nanobatching+perseus"):
        for tname, pf in result.composition.partitions[name].items():
            mine = [k for k in kareus if k.split("@")[0] == tname]
            configs = set().union(*({o.config for o in kareus[k].measured()} for k in mine))
            assert {o.config for o in pf.measured()} <= configs, (name, tname)


def test_kareus_searches_start_from_the_baselines_measurements(tmp_path):
    """The baselines measure first; kareus's search of each type starts from their
    measurements (priors, outside its budget), nothing is measured twice, and the profile
    counts are kareus's own."""
    from kareus.profilers import EmulatedProfiler
    from kareus.search import prior_count, search_log_path

    class Counting(EmulatedProfiler):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.seen: list = []

        def measure(self, partition, config):
            self.seen.append((partition.name, partition.compute_ops, config))
            return super().measure(partition, config)

    wl = Workload.preset(JOBS[0][0], **JOBS[0][2])
    prof = Counting("h200-sxm")
    result = optimize(wl, profiler=prof, budget=8, progress=False, log_dir=tmp_path)
    assert len(prof.seen) == len(set(prof.seen))  # one measurement per configuration
    perseus = result.composition.partitions["perseus"]
    for key, pf in result.composition.partitions["kareus"].items():
        assert result.profiles[key] == 8
        assert len(pf.measured()) >= 8 + (len(perseus[key.split("@")[0]].measured())
                                          if key.endswith("@n1") else 0)
        assert prior_count(search_log_path(tmp_path, key)) > 0


def test_optimize_takes_a_prior_model_and_stays_ahead_of_every_baseline(tmp_path):
    """``prior_model=``: each search's prior mean is that model's prediction (recorded in
    its log and the manifest); kareus is still behind no baseline; a model of another GPU
    or not a profiler is refused in one line; resuming without it is refused."""
    import json

    from kareus.errors import ArgumentError, ArgumentTypeError, OutputError
    from kareus.profilers import EmulatedGPU, EmulatedProfiler
    from kareus.search import search_log_path

    wl = Workload.preset(JOBS[0][0], **JOBS[0][2])
    model = EmulatedGPU.from_spec("h200-sxm")
    measured = EmulatedProfiler(model.perturbed(1), seed=1)  # the GPU is not the model
    result = optimize(wl, profiler=measured, budget=8, progress=False, log_dir=tmp_path,
                      prior_model=EmulatedProfiler(model, noise=0.0))
    for name, frontier in result.frontiers.items():
        if name != "kareus":
            assert _behind(result.kareus, frontier) == [], name
    for key in result.profiles:
        head = json.loads(search_log_path(tmp_path, key).read_text().splitlines()[0])
        assert head["prior_mean"]["source"].startswith("EmulatedProfiler h200-sxm")
        assert head["initial_size"] == 0  # the model, calibrated on the priors, starts it
    manifest = json.loads((tmp_path / "kareus-manifest.json").read_text())
    assert manifest["inputs"]["prior_model"]["noise"] == 0.0
    with pytest.raises(ArgumentError, match="prior_model models a100-40gb"):
        optimize(wl, "h200-sxm", budget=8, progress=False,
                 prior_model=EmulatedProfiler("a100-40gb", noise=0.0))
    with pytest.raises(ArgumentTypeError, match="prior_model must be a kareus Profiler"):
        optimize(wl, "h200-sxm", budget=8, progress=False, prior_model="h200-sxm")
    with pytest.raises(OutputError):  # the folder's manifest (or a log) says otherwise
        optimize(wl, profiler=EmulatedProfiler(model.perturbed(1), seed=1), budget=8,
                 progress=False, log_dir=tmp_path)

"""SearchSpec: one value for every place a partition type is searched."""

from __future__ import annotations

import pickle

import pytest

from kareus.errors import ArgumentError, ConfigError
from kareus.model import Workload, build_partitions
from kareus.profilers.emulator import EmulatedProfiler
from kareus.search import (
    GaussianProcessSurrogate,
    HypervolumePass,
    MultiPassSearch,
    NeighbourhoodPass,
    SearchSpec,
    search_log_path,
)

PART = build_partitions(Workload.preset("qwen3-1.7b", tp=2, microbatch_size=2,
                                        seq_len=1024))["fwd_mlp"]


def test_fields_are_checked_where_the_spec_is_made():
    with pytest.raises(ArgumentError, match="at least 1"):
        SearchSpec(budget=0)
    with pytest.raises(ConfigError, match="seed must be >= 0"):
        SearchSpec(seed=-1)
    with pytest.raises(TypeError, match="budget must be a whole number"):
        SearchSpec(budget="8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        SearchSpec(batch_size=0)
    with pytest.raises(ValueError, match="unknown surrogate"):
        SearchSpec(surrogate="forest")
    with pytest.raises(TypeError, match="AcquisitionPass"):
        SearchSpec(passes=["hv"])  # type: ignore[list-item]
    spec = SearchSpec(passes=[HypervolumePass("total"), (NeighbourhoodPass(), 0.5)])
    assert [w for _, w in spec.passes or ()] == [1.0, 0.5]
    assert isinstance(SearchSpec(surrogate="gp").surrogate_template(), GaussianProcessSurrogate)


def test_the_search_it_builds_is_the_one_multipass_search_would_run(tmp_path):
    prof = EmulatedProfiler("h200-sxm", seed=2)
    spec = SearchSpec(budget=12, seed=2)
    got = spec.run(prof, PART, log=search_log_path(tmp_path, "fwd_mlp"))
    want = MultiPassSearch(EmulatedProfiler("h200-sxm", seed=2).space(PART), budget=12,
                           seed=2).run(EmulatedProfiler("h200-sxm", seed=2), PART,
                                       progress=False)
    assert got.to_dict() == want.to_dict()
    assert (tmp_path / "search-fwd_mlp.jsonl").is_file()
    assert '"execution"' in (tmp_path / "search-fwd_mlp.jsonl").read_text().splitlines()[0]
    fresh = EmulatedProfiler("h200-sxm", seed=2)
    assert spec(fresh, PART).to_dict() == got.to_dict()  # a spec is a search function


def test_every_search_gets_its_own_passes_and_the_spec_pickles():
    mine = HypervolumePass("total")
    spec = SearchSpec(passes=[mine])
    search = spec.search(EmulatedProfiler("h200-sxm").space(PART))
    assert search.passes[0][0] is not mine and isinstance(search.passes[0][0], HypervolumePass)
    assert pickle.loads(pickle.dumps(spec)).budget == spec.budget

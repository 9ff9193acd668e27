"""ReplayProfiler: lookups on synthetic data, and the search replayed on the grid measured
on real H200 GPUs (data/h200_llama3b_tp*_grid.json); runs on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kareus.errors import ConfigError
from kareus.model.config import ScheduleConfig
from kareus.model.partition import build_partitions
from kareus.model.workload import Workload
from kareus.profilers.replay import ReplayProfiler
from kareus.search.pareto import hypervolume, pareto_front, reference_point

DATA = sorted((Path(__file__).resolve().parents[2] / "data").glob("h200_llama3b_tp*_grid.json"))


def _row(part, sms, slot, t, e, kind="grid"):
    return {"kind": kind, "partition": part,
            "config": {"freq_mhz": 1980, "comm_sms": sms, "launch_slot": slot},
            "measurement": {"time_s": t, "energy_j": e, "static_power_w": 400.0}}


def synthetic():
    rows = [_row("fwd_attn", s, slot, 1e-3 * (1 + 0.1 * s), 2.0 + 0.01 * s)
            for s in (2, 4) for slot in ("attn_norm", "qkv", None)]
    rows += [_row("fwd_attn", 2, "qkv", 9e-3, 9.0, kind="repeat"),
             _row("fwd_attn", None, None, 3e-3, 5.0, kind="megatron"),
             {"kind": "grid_failed", "partition": "fwd_attn", "config": {}, "error": "x"}]
    return {"gpu": "h200-sxm", "static_power_w": 400.0,
            "workload": {"model": "llama3.2-3b", "tp": 4, "cp": 1}, "measurements": rows}


def attn():
    wl = Workload.preset("llama3.2-3b", tp=4, microbatch_size=8, seq_len=4096, nanobatches=2)
    return build_partitions(wl)["fwd_attn"]


def test_lookup_cycles_samples_and_keeps_baselines_apart():
    rp = ReplayProfiler(synthetic())
    p = attn()
    c = ScheduleConfig(1980, 2, "qkv")
    first, second, third = (rp.measure(p, c) for _ in range(3))
    assert first.time_s == pytest.approx(1.2e-3) and second.time_s == pytest.approx(9e-3)
    assert third == first
    assert ReplayProfiler(synthetic(), samples="mean").measure(p, c).energy_j == \
        pytest.approx((2.02 + 9.0) / 2)
    assert rp.baseline("fwd_attn", "megatron").energy_j == 5.0
    with pytest.raises(KeyError, match="recorded"):
        rp.baseline("fwd_attn", "nanobatch")
    assert rp.static_power_w() == 400.0 and rp.static_power_w(8) == pytest.approx(800.0)


def test_unmeasured_config_names_what_is_recorded():
    rp = ReplayProfiler(synthetic())
    with pytest.raises(ConfigError, match=r"SM counts \[2, 4\]"):
        rp.measure(attn(), ScheduleConfig(1980, 8, "qkv"))


def test_space_is_the_recorded_grid():
    rp = ReplayProfiler(synthetic())
    space = rp.space(attn())
    assert len(space) == 6 and space.comm_sms == (2, 4)
    assert space.slots == ("attn_norm", "qkv", None)
    broken = synthetic()
    broken["measurements"].pop(0)
    with pytest.raises(ConfigError, match="not a full product"):
        ReplayProfiler(broken).grid_space(attn())
    # A recording that is not a grid (a search's) is searched over the GPU's full space:
    # the replayed search asks the configurations it asked when it was recorded.
    assert len(ReplayProfiler(broken).space(attn())) > 6


def test_file_without_rows_is_rejected(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"gpu": "h200-sxm", "static_power_w": 1.0, "measurements": []}))
    with pytest.raises(ValueError, match="no replayable"):
        ReplayProfiler(path)


@pytest.mark.parametrize(("corrupt", "needle"), [
    (lambda d: d["measurements"][0].pop("config"), "row 0: missing field 'config'"),
    (lambda d: d["measurements"][1]["measurement"].pop("energy_j"),
     "row 1: missing field 'energy_j'"),
    (lambda d: d["measurements"][2]["measurement"].__setitem__("time_s", [1]), "row 2:"),
    (lambda d: d["measurements"][0]["measurement"].__setitem__("energy_j", -1.0), "row 0:"),
    (lambda d: d.__setitem__("measurements", True), "measurements must be a list"),
    (lambda d: d.__setitem__("static_power_w", "hot"), "could not convert"),
    (lambda d: d.__setitem__("static_power_w", -5.0), "static_power_w must be a positive"),
    (lambda d: d["measurements"].__setitem__(3, [1, 2]), "row 3: a row must be an object"),
])
def test_a_corrupt_recording_is_refused_in_one_line(tmp_path, corrupt, needle):
    data = synthetic()
    corrupt(data)
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        ReplayProfiler(path)
    msg = str(err.value)
    assert needle in msg and str(path) in msg and "\n" not in msg
    assert "record it again" in msg or "static_power_w" in msg


def test_a_recording_that_is_not_an_object_is_refused(tmp_path):
    path = tmp_path / "rec.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a kareus recording"):
        ReplayProfiler(path)


# ----------------------------------------------------------------- measured H200 data


@pytest.mark.skipif(not DATA, reason="no measured grid in data/")
def test_measured_grid_is_complete_and_physical():
    data = json.loads(DATA[-1].read_text())
    rp = ReplayProfiler(DATA[-1], kinds=("grid",))
    w = data["workload"]
    wl = Workload.preset(w["model"], tp=w["tp"], microbatch_size=w["microbatch_size"],
                         seq_len=w["seq_len"], nanobatches=w["nanobatches"])
    ps = build_partitions(wl)
    assert data["static_power_w"] > 0 and "H200" in data["machine"]
    for name in rp.partitions:
        space = rp.space(ps[name])  # raises unless every configuration was measured
        ms = [rp.measure(ps[name], c) for c in space.configs]
        assert all(m.time_s > 0 and m.energy_j > 0 for m in ms)
        # Group power stays within what the GPUs can draw (static .. 700 W each, + margin).
        for m in ms:
            assert data["static_power_w"] * 0.8 < m.average_power_w < 760.0 * w["tp"]


@pytest.mark.skipif(not DATA, reason="no measured grid in data/")
def test_search_replayed_on_measured_grid_finds_most_of_the_front():
    pytest.importorskip("xgboost")
    from kareus.search import MultiPassSearch

    data = json.loads(DATA[-1].read_text())
    w = data["workload"]
    wl = Workload.preset(w["model"], tp=w["tp"], microbatch_size=w["microbatch_size"],
                         seq_len=w["seq_len"], nanobatches=w["nanobatches"])
    ps = build_partitions(wl)
    rp = ReplayProfiler(data, kinds=("grid",))
    for name in rp.partitions:
        space = rp.space(ps[name])
        pts = np.array([(rp.measure(ps[name], c).time_s, rp.measure(ps[name], c).energy_j)
                        for c in space.configs])
        ref = reference_point(pts, 0.1)
        exhaustive = hypervolume(pareto_front(pts), ref)
        budget = max(8, len(space) // 3)
        search = MultiPassSearch(space, budget=budget, batch_size=8, seed=0,
                                 stop_patience=None, progress=False)
        front = search.run(ReplayProfiler(data, kinds=("grid",)), ps[name])
        got = np.array([(o.time_s, o.energy_j) for o in front.points])
        assert len(front.measured()) == budget
        assert hypervolume(got, ref) / exhaustive > 0.9, name


def test_rows_read_back_from_logs_keep_their_order_ahead_of_the_rows_measured_here():
    """Two partitions of one name (the nanobatched and the unsplit ``fwd_mlp``) measured
    in turn: rows added back from their logs keep that order, ahead of a later row."""
    from kareus.model.measurement import Measurement
    from kareus.profilers.emulator import EmulatedProfiler
    from kareus.profilers.replay import RecordingProfiler

    wl = Workload.preset("qwen3-1.7b", tp=2, microbatch_size=2, seq_len=512)
    part = build_partitions(wl.with_(nanobatches=1)).types["fwd_mlp"]
    rec = RecordingProfiler(EmulatedProfiler("h200-sxm", seed=0))
    cfg = ScheduleConfig(1980, 8, None)
    own = rec.measure(part, cfg)  # measured in this run, after the two read back below
    first, second = (Measurement(time_s=t, energy_j=1.0, static_power_w=0.0)
                     for t in (1e-3, 2e-3))
    assert rec.add_earlier("fwd_mlp", cfg, first) and rec.add_earlier("fwd_mlp", cfg, second)
    replay = ReplayProfiler(rec.to_dict())
    assert [replay.measure(part, cfg) for _ in range(3)] == [first, second, own]

"""The search's features: ConfigSpace's physical ones, SMs per relative clock, hide balance."""

from __future__ import annotations

import numpy as np
import pytest

from kareus.model import ConfigSpace, ScheduleConfig


def test_search_features_add_sms_per_relative_clock_and_hide_balance(medium_space):
    from kareus.search import search_features

    f = search_features(medium_space)
    base = medium_space.features()
    assert f.shape == (len(medium_space), base.shape[1] + 3)
    np.testing.assert_array_equal(f[:, :base.shape[1]], base)
    c = medium_space.configs[-1]
    assert f[-1, 5] == pytest.approx(c.comm_sms * 1410 / c.freq_mhz)
    assert f[-1, 7] == pytest.approx(c.comm_sms * (1410 / c.freq_mhz) ** 2)
    # The balance falls as SMs rise (same clock and slot); sequential rows sit above all.
    bal = f[:, 6]
    seq = f[:, 4] == 1.0
    assert bal[seq].min() > bal[~seq].max()
    by = {cfg: b for cfg, b in zip(medium_space.configs, bal)}
    some = next(cfg for cfg in medium_space.configs if cfg.launch_slot is not None)
    more = ScheduleConfig(some.freq_mhz, some.comm_sms + 1, some.launch_slot)
    if more in by:
        assert by[more] < by[some]


def test_squared_ratio_lines_up_a_ridge_that_grows_faster_than_the_clock():
    # qwen3-1.7b's attention-input all-reduce on the emulated A100: the fewest SMs that
    # hide it (launched at attn_norm) grow about as clock^2, so SMs x (max/MHz)^2 takes
    # about one value along the ridge while SMs x max/MHz drifts with the clock.
    from kareus.model import Workload, build_partitions
    from kareus.profilers.emulator import EmulatedProfiler
    from kareus.search import search_features

    wl = Workload.preset("qwen3-1.7b", cp=2, tp=4, microbatch_size=8, seq_len=4096)
    part = build_partitions(wl)["fwd_attn_in_ar"]
    space = ConfigSpace(part, "a100-40gb", freqs_mhz=[1410, 1200, 1050, 900],
                        comm_sms=range(1, 33), slots=["attn_norm"])
    prof = EmulatedProfiler("a100-40gb", noise=0.0)
    feats = search_features(space)
    index = {c: i for i, c in enumerate(space.configs)}
    ridge = []
    for f in space.freqs_mhz:
        times = [prof.measure(part, ScheduleConfig(f, s, "attn_norm")).time_s
                 for s in space.comm_sms]
        ridge.append(index[ScheduleConfig(f, space.comm_sms[int(np.argmin(times))],
                                          "attn_norm")])
    lin, sq = np.log(feats[ridge, 5]), np.log(feats[ridge, 7])
    assert np.ptp(feats[ridge, 1]) >= 10       # the SM count moves a lot along the ridge
    assert np.std(sq) < 0.5 * np.std(lin)


def test_hide_balance_lines_up_the_hinge_across_clocks_and_slots():
    # Where the collective just hides (emulated A100, llama3.2-3b fwd_attn) the balance
    # feature should take about one value for every clock and slot: that is what lets a
    # tree find the hinge with one split. Compare its scatter at the hinge with the
    # scatter of the SMs-per-relative-clock feature there.
    from kareus.model import Workload, build_partitions
    from kareus.profilers.emulator import EmulatedProfiler
    from kareus.search import search_features

    part = build_partitions(Workload.preset("llama3.2-3b", tp=4))["fwd_attn"]
    space = ConfigSpace(part, "a100-40gb", freqs_mhz=[1410, 1200, 990], comm_sms=range(1, 33))
    prof = EmulatedProfiler("a100-40gb", noise=0.0)
    feats = search_features(space)
    index = {c: i for i, c in enumerate(space.configs)}
    hinge_bal, hinge_ratio = [], []
    for f in space.freqs_mhz:
        for slot in space.slots:
            if slot is None:
                continue
            hidden = [s for s in space.comm_sms
                      if prof.trace(part, ScheduleConfig(f, s, slot)).exposed_comm_s == 0.0]
            if not hidden or hidden[0] == 1:
                continue
            i = index[ScheduleConfig(f, hidden[0], slot)]
            hinge_bal.append(feats[i, 6])
            hinge_ratio.append(np.log(feats[i, 5]))
    assert len(hinge_bal) >= 6
    assert np.std(hinge_bal) < 0.5 * np.std(hinge_ratio)


def test_backend_column_comes_after_the_derived_ones():
    # In a space of several collective backends ConfigSpace adds a backend column; the
    # derived columns 5-7 keep their positions and the backend moves to column 8 on, where
    # the default surrogate and the hinge pass look for it.
    from kareus.model import Workload, build_partitions
    from kareus.search import EXTRA_COLUMNS_FROM, search_features

    part = build_partitions(Workload.preset("llama3.2-3b", tp=2, microbatch_size=2,
                                            seq_len=1024))["fwd_attn"]
    one = ConfigSpace(part, "h200-sxm", freqs_mhz=[1980, 1500], comm_sms=[4, 8])
    two = ConfigSpace(part, "h200-sxm", freqs_mhz=[1980, 1500], comm_sms=[4, 8],
                      backends=["own", "nccl_capped"])
    f1, f2 = search_features(one), search_features(two)
    assert f1.shape[1] == EXTRA_COLUMNS_FROM
    assert f2.shape[1] == EXTRA_COLUMNS_FROM + 1
    assert f2[:, EXTRA_COLUMNS_FROM].tolist() == [
        float(two.backends.index(c.backend)) for c in two.configs]
    # Row by row, the fixed columns of a configuration are those of its twin without a
    # backend (the hide balance knows nothing of the backend).
    index = {(c.freq_mhz, c.comm_sms, c.launch_slot): i for i, c in enumerate(one.configs)}
    for row, c in zip(f2, two.configs):
        np.testing.assert_array_equal(
            row[:EXTRA_COLUMNS_FROM], f1[index[(c.freq_mhz, c.comm_sms, c.launch_slot)]])

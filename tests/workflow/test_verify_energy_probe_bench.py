"""bench/probes/verify_energy_probe.py on a CPU: its command line, its refusal without a
GPU, and the arithmetic that places verify's energy miss (the per-layer counts, the
composition as the tune composes, the loop's regression over two depths, the table)."""

from __future__ import annotations

import attrs
import pytest
from bench_scripts import load_bench

from kareus.model.partition import build_partitions
from kareus.model.workload import Parallelism, Workload, get_model

probe = load_bench("probes/verify_energy_probe")


def _workload(layers: int, nanobatches: int = 1) -> Workload:
    return Workload(model=attrs.evolve(get_model("qwen3-1.7b"), layers=layers),
                    parallelism=Parallelism(tp=4, cp=2), microbatch_size=8, seq_len=4096,
                    num_microbatches=4, nanobatches=nanobatches)


def test_command_line_and_refusal_without_a_gpu(capsys):
    args = probe.parse_args(["--layers", "4", "--small-layers", "2", "--schedule",
                             "nanobatching", "--loopback", "faithful"])
    assert (args.layers, args.small_layers, args.schedule, args.loopback) == (
        4, 2, "nanobatching", "faithful")
    with pytest.raises(SystemExit):
        probe.parse_args(["--layers", "2", "--small-layers", "2"])
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the refusal is not reachable")
    assert probe.main([]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("nanobatches", [1, 2])
def test_one_layers_partitions_are_what_the_composition_counts_per_layer(nanobatches):
    pset = build_partitions(_workload(4, nanobatches))
    per_layer = probe.per_layer_counts(pset.counts, 4)
    # full recomputation: every forward type runs twice per layer, every backward one once
    assert set(per_layer) == set(pset.types)
    for phase, counts in pset.counts.items():
        for name, c in counts.items():
            assert c % 4 == 0, (phase, name)
    assert sum(per_layer.values()) * 4 == sum(c for ph in pset.counts.values()
                                              for c in ph.values())
    seq = probe.mix_order(pset.counts, 4)
    assert sorted(seq) == sorted(n for n, c in per_layer.items() for _ in range(c))
    assert seq[0].startswith("fwd")
    if nanobatches == 1:
        assert per_layer == {"fwd_attn_in": 2, "fwd_attn_out": 2, "fwd_mlp": 2,
                             "bwd_mlp": 1, "bwd_attn_out": 1, "bwd_attn_in": 1}


def test_the_composition_and_the_regression_agree_on_a_loop_that_is_the_sum_of_its_parts():
    pset = build_partitions(_workload(4))
    per_layer = probe.per_layer_counts(pset.counts, 4)
    singles = {n: {"time_s": 1e-3 * (k + 1), "energy_j": 0.5 * (k + 1)}
               for k, n in enumerate(sorted(per_layer))}
    outside = {"fwd": {"time_s": 0.004, "energy_j": 2.0},
               "bwd": {"time_s": 0.008, "energy_j": 4.0}}
    tail = {"time_s": 0.002, "energy_j": 1.0}
    c = {L: probe.composed(singles, per_layer, layers=L, microbatches=4, outside=outside,
                           tail=tail) for L in (1, 4)}
    layer_e = 4 * sum(n * singles[t]["energy_j"] for t, n in per_layer.items())
    assert c[4]["layer_energy_j"] == pytest.approx(layer_e)
    assert c[4]["outside_energy_j"] == pytest.approx(4 * 6.0 + 1.0)
    assert c[4]["energy_j"] == pytest.approx(4 * layer_e + 25.0)
    assert c[4]["outside_time_s"] == pytest.approx(4 * 0.012 + 0.002)
    # a loop that costs exactly the composition at two depths: the regression recovers
    # the composition's per-layer and outside parts
    reg = probe.regression(c[1], c[4], 1, 4)
    for key in ("layer_time_s", "layer_energy_j", "outside_time_s", "outside_energy_j"):
        assert reg[key] == pytest.approx(c[4][key])


def test_the_table_sets_each_measured_piece_beside_its_reference():
    fig = {"time_s": 0.1, "energy_j": 10.0, "sm_clock_mhz": 1800.0}
    hot = {"time_s": 0.098, "energy_j": 10.8, "sm_clock_mhz": 1850.0}
    comp = {**fig, "layer_time_s": 0.02, "layer_energy_j": 2.0, "outside_time_s": 0.02,
            "outside_energy_j": 2.0}
    data = {"options": {"layers": 4},
            "composed": {"tune": comp, "steady": comp},
            "loop": {"verify": hot, "steady": fig,
                     "regression": {"layer_time_s": 0.02, "layer_energy_j": 2.2,
                                    "outside_time_s": 0.02, "outside_energy_j": 2.0}},
            "mix": {"mix": hot, "singles": fig},
            "types": {"fwd_mlp": {"tune": fig, "steady": fig}},
            "outside": {"fwd": {"tune": fig, "steady": fig}}}
    rows = probe.compare_rows(data)
    by = {(r[0], r[1]): r for r in rows}
    assert by[("loop L=4 verify", "composed tune")][6:8] == ["0.980", "1.080"]
    assert by[("loop L=4 verify", "loop steady")][7] == "1.080"
    assert by[("per layer (loop)", "composed steady")][7] == "1.100"
    assert by[("outside+tail (loop)", "composed steady")][7] == "1.000"
    assert by[("layer mix", "sum of singles")][8:] == ["1850", "1800"]
    assert ("fwd_mlp", "steady") in by and ("outside fwd", "steady") in by
    data["mix_microbatch"] = {"mix": hot, "singles": fig}
    data["programs_iteration"] = fig
    data["options"]["small_layers"] = 1
    data["composed_small"] = {"steady": fig}
    data["loop"]["small"] = {"steady": hot}
    by = {(r[0], r[1]): r for r in probe.compare_rows(data)}
    assert by[("loop L=1 steady", "composed steady")][6:8] == ["0.980", "1.080"]
    assert "compare the loop's SM clocks, 1850 and 1800 MHz" in probe.findings(data)[4]
    assert by[("microbatch mix", "sum of singles")][7] == "1.080"
    assert by[("loop L=4 steady", "M x microbatch mix + tail")][7] == "1.000"
    text = probe.table(rows)
    assert text.splitlines()[0].split()[:2] == ["measured", "against"]


def test_the_findings_name_the_ratio_that_answers_each_question():
    fig = {"time_s": 0.1, "energy_j": 10.0, "sm_clock_mhz": 1800.0}
    hot = {"time_s": 0.098, "energy_j": 10.8, "sm_clock_mhz": 1850.0}
    comp = {**fig, "layer_time_s": 0.02, "layer_energy_j": 2.0, "outside_time_s": 0.02,
            "outside_energy_j": 2.0}
    data = {"composed": {"tune": comp, "steady": comp},
            "loop": {"verify": hot, "steady": fig,
                     "regression": {"layer_time_s": 0.02, "layer_energy_j": 2.0,
                                    "outside_time_s": 0.02, "outside_energy_j": 2.5}},
            "mix": {"mix": fig, "singles": fig},
            "types": {"fwd_mlp": {"tune": hot, "steady": fig}},
            "outside": {"fwd": {"tune": fig, "steady": fig}}}
    data["mix_microbatch"] = {"mix": hot, "singles": fig}
    data["programs_iteration"] = fig
    lines = probe.findings(data)
    assert "additivity over a microbatch (outside work included): energy 1.080, time 0.980" \
        in lines[6]
    assert "loop steady / (M x microbatch mix + tail): energy 1.000" in lines[7]
    assert "energy 1.080, time 0.980" in lines[0]
    assert "loop verify / loop steady: energy 1.080" in lines[1]
    assert "per piece 1.000-1.080" in lines[2]
    assert "per layer 1.000" in lines[4] and "outside the layers 1.250" in lines[4]
    assert "SM clock 1800 against 1800 MHz" in lines[5]


def test_a_microbatch_of_programs_is_its_outside_work_and_every_layer():
    pset = build_partitions(_workload(2))
    seq = probe.microbatch_order(pset.counts, 2)
    per_layer = probe.per_layer_counts(pset.counts, 2)
    assert seq[0] == "outside:fwd" and seq.count("outside:bwd") == 1
    assert len(seq) == 2 + 2 * sum(per_layer.values())
    fwd = seq[1:seq.index("outside:bwd")]
    assert len(fwd) == 2 * 3 and all(n.startswith("fwd") for n in fwd)
    alone = {n: {"time_s": 1.0, "energy_j": 2.0, "sm_clock_mhz": 1600.0}
             for n in set(seq) if not n.startswith("outside")}
    alone |= {"outside:fwd": {"time_s": 3.0, "energy_j": 1.0, "sm_clock_mhz": 1980.0},
              "outside:bwd": {"time_s": 1.0, "energy_j": 1.0, "sm_clock_mhz": None}}
    tot = probe.summed(alone, seq)
    n = len(seq) - 2
    assert tot["time_s"] == n + 4.0 and tot["energy_j"] == 2.0 * n + 2.0
    # the clock weighted by time, over the programs that have one
    assert tot["sm_clock_mhz"] == pytest.approx((1600.0 * n + 1980.0 * 3) / (n + 3))


def test_the_emulated_estimate_limits_the_mix_as_a_whole_and_says_it_is_emulated(tmp_path,
                                                                                 capsys):
    out = tmp_path / "e.json"
    assert probe.main(["--emulated", "--layers", "2", "--small-layers", "1", "--seq-len",
                       "1024", "--json", str(out)]) == 0
    assert "EMULATED (h200-sxm), 2 layer(s)" in capsys.readouterr().out
    import json

    data = json.loads(out.read_text())
    assert data["measured"] is False and "EMULATED" in data["what"]
    assert [d["layers"] for d in data["depths"]] == [1, 2]
    for d in data["depths"]:
        limit = d["power_limit_w"]
        assert d["alone"]["power_w"] <= limit * (1 + 1e-9)  # each piece within it alone
        assert d["mix"]["power_w"] <= limit * (1 + 1e-9)  # and the iteration as a whole
        assert d["mix"]["sm_clock_mhz"] <= 1980
        assert d["energy_ratio"] == pytest.approx(d["mix"]["energy_j"] / d["alone"]["energy_j"])
        assert d["time_ratio"] == pytest.approx(d["mix"]["time_s"] / d["alone"]["time_s"])


def test_a_steady_window_reads_the_counter_inside_it():
    # a fake GPU drawing 80 W idle: each step of the window takes ~5 ms of host time
    import time

    from fake_nvml import FakeNVML

    from kareus.profilers.nvml import EnergyMeter

    nvml = FakeNVML(1, period_s=0.02, idle_w=80.0)
    meter = EnergyMeter(nvml=nvml, device_indices=[0], poll_interval_s=0.001).start()
    try:
        got = probe.steady(lambda: time.sleep(0.005), meter, settle_s=0.05, window_s=0.5,
                           sync=lambda: None)
    finally:
        meter.stop()
    assert got["power_w"] == pytest.approx(80.0, rel=0.05)
    assert got["energy_j"] == pytest.approx(80.0 * got["time_s"], rel=0.05)
    assert got["counter_steps"] >= 10 and got["steps"] >= 3
    assert got["window_s"] >= 0.5 and len(got["sub_powers_w"]) == 4

"""The measured op table (data/h200_op_roofline.json, 1x H200) read on the CPU.

It must name its machine and software, cover every op of every partition type of the
three presets at their default shapes, and agree with the partition model it was
measured against: each op's FLOPs and bytes are the model's, its roofline is
``max(FLOPs / peak, bytes / bandwidth)`` with the table's own measured ceilings, and each
partition's roofline sum adds its ops'.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest

from kareus.model.partition import build_partitions
from kareus.model.workload import Workload

DATA = Path(__file__).resolve().parents[2] / "data" / "h200_op_roofline.json"


@pytest.fixture(scope="module")
def table():
    return json.loads(DATA.read_text())


def test_the_table_names_its_machine_and_software(table):
    assert "H200" in table["gpu"]
    for key in ("driver", "torch", "cuda", "triton", "measured_utc", "command"):
        assert table[key], key
    assert table["gemm_peak_tflops"] > 0 and table["hbm_tb_s"] > 0


def test_every_op_of_every_partition_type_is_measured_against_the_model(table):
    peak, bw = table["gemm_peak_tflops"] * 1e12, table["hbm_tb_s"] * 1e12
    rows = {(r["workload"], r["op"]): r for r in table["rows"]}
    parts = {(p["workload"], p["partition"]): p for p in table["partitions"]}
    assert set(table["workloads"]) == {"llama3.2-3b", "qwen3-1.7b", "llama3.3-70b"}
    for name, par in table["workloads"].items():
        wl = Workload.preset(name, **par, **table["batch"])
        # the table was measured on the decoder's kernels, which have no query/key norm yet:
        # the model as it ran
        wl = wl.with_(model=attrs.evolve(wl.model, qk_norm=False))
        ps = build_partitions(wl)
        for pname in ps.names:
            part = ps[pname]
            assert (name, pname) in parts, (name, pname)
            roof_sum = 0.0
            for op in part.compute_ops:
                r = rows[(name, op.name)]
                assert pname in r["partitions"]
                assert r["flops"] == pytest.approx(op.flops)
                assert r["bytes"] == pytest.approx(op.bytes_moved)
                roof = max(op.flops / peak, op.bytes_moved / bw) * 1e3
                assert r["roofline_ms"] == pytest.approx(roof, rel=1e-9)
                assert r["measured_ms"] > 0
                assert r["ratio"] == pytest.approx(r["measured_ms"] / r["roofline_ms"])
                assert r["kind"] in ("gemm", "attention", "elementwise")
                assert r["kernel"]
                roof_sum += roof
            p = parts[(name, pname)]
            assert p["roofline_sum_ms"] == pytest.approx(roof_sum, rel=1e-9)
            assert p["ratio"] == pytest.approx(p["compute_ms"] / p["roofline_sum_ms"])


def test_powers_are_measured_and_bounded_by_the_power_limit(table):
    limit = table["power_limit_w"]
    assert 0 < table["idle_power_w"] < limit
    for r in table["rows"]:
        assert r["power_w"] is not None and math.isfinite(r["power_w"]), r["op"]
        # NVML's energy counter over >= 1 s: the average can exceed the enforced limit
        # only by the controller's short overshoot.
        assert table["idle_power_w"] < r["power_w"] < 1.1 * limit, r["op"]


def test_gemm_rows_carry_their_shape_and_the_best_matmul(table):
    for r in table["rows"]:
        if r["kind"] != "gemm":
            continue
        m, k, n = r["mkn"]
        assert 2 * m * k * n == pytest.approx(r["flops"])
        assert r["best_matmul_ms"] > 0 and 0 < r["peak_frac"] <= 1.2


def test_gemms_are_compared_with_the_best_matmul_timed_beside_them(table):
    # vs_best_matmul: the median of rounds timing the op and the best plain matmul at its
    # shape one after the other; the GEMM target is met on either side of "or".
    for r in table["rows"]:
        if r["kind"] == "gemm":
            assert 0.5 < r["vs_best_matmul"] < 2.0, r["op"]
            assert r["peak_frac"] >= 0.75 or r["vs_best_matmul"] <= 1.05, (r["workload"], r["op"])


def test_partitions_are_also_set_against_the_attention_ceiling(table):
    # The same run timed SDPA at a large causal shape; with the attention ops' rooflines
    # at that throughput instead of the GEMM peak, each partition's ratio is recomputed.
    fwd, bwd = table["attention_fwd_tflops"], table["attention_bwd_tflops"]
    assert 0 < bwd < table["gemm_peak_tflops"] and 0 < fwd < table["gemm_peak_tflops"]
    assert 0 < table["launch_floor_ms"] < 0.05
    bw = table["hbm_tb_s"] * 1e12
    rows = {(r["workload"], r["op"]): r for r in table["rows"]}
    for p in table["partitions"]:
        total = 0.0
        for (wl, op), r in rows.items():
            if wl != p["workload"] or p["partition"] not in r["partitions"]:
                continue
            if r["kind"] == "attention":
                att = bwd if op.endswith("_bwd") else fwd
                total += max(r["flops"] / (att * 1e12), r["bytes"] / bw) * 1e3
            else:
                total += r["roofline_ms"]
        assert p["ratio_attention_ceiling"] == pytest.approx(p["compute_ms"] / total, rel=1e-9)
        assert p["ratio_attention_ceiling"] <= p["ratio"] + 1e-12


def test_tune_summary_names_the_fastest_setting_against_the_default():
    from bench_scripts import load_bench

    roof = load_bench("op_roofline")
    rows = [{"workload": "w", "op": "rope", "setting": roof.TUNE_DEFAULTS["rope"], "ms": 0.010},
            {"workload": "w", "op": "rope", "setting": "grid=rows block_r=32 warps=4",
             "ms": 0.008},
            {"workload": "w", "op": "wgrad", "setting": "1x2x3 in^T@dout", "ms": 1.0},
            {"workload": "w", "op": "attention", "setting": "FLASH_ATTENTION", "error": "x"},
            {"workload": "w", "op": "swiglu", "setting": "block=1024 warps=4", "ms": 0.02}]
    got = {r["op"]: r for r in roof.tune_summary(rows)}
    assert set(got) == {"rope", "swiglu"}  # ops with a library default, timed
    assert got["rope"]["best"] == "grid=rows block_r=32 warps=4"
    assert got["rope"]["default_over_best"] == pytest.approx(1.25)
    assert got["swiglu"]["default_ms"] is None  # the default was not among the settings

"""bench/moe_gemm.py: the expert shapes are the runnable partitions' (the partition
model's per-rank shapes at EP=8 for both presets), and ``--smoke`` runs every GEMM on both
paths on the CPU (tiny shapes, not a measurement: the GPU run is), the two paths agreeing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from bench_scripts import load_bench


def test_expert_shapes_at_ep8():
    bench = load_bench("moe_gemm")
    q = bench.expert_shapes("qwen3-30b-a3b", ep=8, microbatch_size=8, seq_len=4096,
                            nanobatches=2, imbalance=1.0)
    # 4 sequences of 4096 tokens a nanobatch, top-8: 131,072 rows over 16 local experts
    assert (q["tokens"], q["rows"], q["local_experts"], q["hidden"], q["ffn"]) == (
        16384, 131072, 16, 2048, 768)
    assert q["counts"] == [8192] * 16
    m = bench.expert_shapes("mixtral-8x7b", ep=8, microbatch_size=8, seq_len=4096,
                            nanobatches=2, imbalance=1.5)
    assert (m["rows"], m["local_experts"], m["ffn"]) == (49152, 1, 14336)


def test_smoke_run_times_every_gemm_on_both_paths(tmp_path, capsys):
    bench = load_bench("moe_gemm")
    out = tmp_path / "gg.json"
    assert bench.main(["--smoke", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["smoke"] and data["dtype"] == "float32"
    rows = data["rows"]
    assert sorted((r["gemm"], r["path"]) for r in rows) == sorted(
        (g, p) for g in bench.GEMMS for p in bench.PATHS)
    assert all(r["time_s"] > 0 and r["flops"] > 0 for r in rows)
    assert all(r["rel_diff_between_paths"] < 1e-5 for r in rows)
    assert "not a measurement" in capsys.readouterr().out


def test_op_roofline_names_a_kernel_for_every_moe_op():
    from kareus.exec.kernels import TorchKernels
    from kareus.exec.torch_partition import runnable_partitions
    from kareus.model.workload import Workload

    roof = load_bench("op_roofline")
    names = TorchKernels().kernel_names()
    wl = Workload.preset("qwen3-30b-a3b", **roof.WORKLOADS["qwen3-30b-a3b"], **roof.BATCH)
    ops = {op.name for p in runnable_partitions(wl).values() for op in p.compute_ops}
    dense = {"qkv", "out_proj", "out_dgrad", "out_wgrad", "qkv_dgrad", "qkv_wgrad"}
    moe = {n for n in ops if n.startswith(("router", "permute", "expert_", "unpermute",
                                           "shared_"))}
    assert len(moe) >= 15
    for name in moe:
        fam = roof.FAMILY.get(name, "matmul")
        assert fam in names, name  # the kernel the table prints
        if fam == "matmul":  # a GEMM: a dense one gemm_mkn knows, or a MoE one
            assert name.startswith(("router", "shared_")), name
    assert dense <= roof._DENSE_GEMMS
    assert "qwen3-30b-a3b" not in roof.DEFAULT_WORKLOADS


def test_op_roofline_targets_take_a_grouped_gemm_row():
    roof = load_bench("op_roofline")
    rows = [{"workload": "w", "op": "expert_down", "kind": "gemm", "peak_frac": 0.5},
            {"workload": "w", "op": "down", "kind": "gemm", "peak_frac": 0.5,
             "vs_best_matmul": 1.01}]
    got = roof.targets(rows, [])["gemm_ge_75pct_peak_or_within_5pct_best"]
    assert got["missed"] == ["w/expert_down 50% of peak, no single matmul"]

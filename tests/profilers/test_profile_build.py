"""Assembling a GPUProfile from the benchmarks' output files (kareus.profilers.profile_build)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kareus.model.gpu_profile import (
    GPUProfile,
    GPUProfileError,
    MachineInfo,
)
from kareus.profilers.profile_build import (
    build_gpu_profile,
    read_collectives,
    read_grid_static_power,
    read_op_table,
    read_power_probe,
)

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj))
    return path


def _op_table(tmp_path: Path) -> Path:
    """A small file in the layout of bench/op_roofline.py's JSON: ceilings one level down,
    one op listed under two partitions, candidate kernel sets, no per-op clock."""
    qkv = {"workload": "llama3.2-3b", "op": "qkv", "kind": "gemm", "measured_ms": 0.21,
           "roofline_ms": 0.19, "ratio": 1.105, "kernel": "matmul", "flops": 1.0e11,
           "bytes": 1.0e8, "measured_in": "fwd_attn", "power_w": 655.0,
           "power_busy_frac": 0.98, "power_method": "cuda graph"}
    rope = {"workload": "llama3.2-3b", "op": "rope", "kind": "elementwise",
            "measured_ms": 0.021, "roofline_ms": 0.019, "ratio": 1.1, "kernel": "triton rope",
            "power_w": 480.0, "power_busy_frac": 0.9}
    return _write(tmp_path / "op_roofline.json", {
        "command": "python bench/op_roofline.py --json x.json --candidates reference",
        "machine": {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "cuda": "13.0",
                    "driver": "580.159.04", "sm_clock_mhz_at_start": 1980,
                    "max_sm_clock_mhz": 1980},
        "kernels": "fused", "ceilings": {"gemm_peak_tflops": 780.5, "hbm_tb_s": 4.3},
        "idle_power_w": 118.0,
        "rows": [{**qkv, "partition": "fwd_attn"}, {**rope, "partition": "fwd_attn"},
                 {**qkv, "partition": "bwd_attn"}, {**qkv, "partition": "bwd_attn"}],
        "partitions": [{"workload": "llama3.2-3b", "partition": "fwd_attn", "compute_ms": 0.78,
                        "roofline_sum_ms": 0.5, "ratio": 1.56}],
        "candidates": [
            {"kernels": "reference", "workload": "llama3.2-3b", "op": "rope",
             "kind": "elementwise", "measured_ms": 0.239, "roofline_ms": 0.019, "ratio": 12.6,
             "kernel": "eager"},
            {"kernels": "reference", "workload": "llama3.2-3b", "op": "rope_bwd",
             "kind": "elementwise", "measured_ms": 0.3, "roofline_ms": 0.02, "ratio": 15.0,
             "kernel": "eager"},
            {"kernels": "reference", "partition": "fwd_attn", "workload": "llama3.2-3b",
             "compute_ms": 1.2, "roofline_sum_ms": 0.5, "ratio": 2.4}],
    })


def _power_probe(tmp_path: Path) -> Path:
    return _write(tmp_path / "power.json", {
        "gpu": "NVIDIA H200", "driver": "580.159.04", "torch": "2.11.0+cu130",
        "loads": {"idle": {"avg_w": 79.6, "sm_clock_median_mhz": 345.0},
                  "spin": {"avg_w": 120.6, "sm_clock_median_mhz": 1980},
                  "gemm_d1.0": {"avg_w": 709.0, "sm_clock_median_mhz": 1500.0, "tflops": 667.7},
                  "gemm_d0.6": {"avg_w": 608.5, "sm_clock_median_mhz": 1980,
                                "tflops_of_gemm_part": 791.2},
                  "copy": {"avg_w": 407.6, "sm_clock_median_mhz": 1980, "tb_per_s": 4.23}}})


def _collectives(tmp_path: Path, name: str, world: int, backend_time: dict) -> Path:
    rows = [{"op": "all_reduce", "size_bytes": 64 << 20, "backend": b, "sms": s,
             "time_us": t, "algbw_gbps": 1.0, "busbw_gbps": 100.0 / (t / 1000)}
            for (b, s), t in backend_time.items()]
    return _write(tmp_path / name, {
        "world_size": world, "rows": rows,
        "machine": {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "cuda": "13.0",
                    "nccl": "2.28.9", "nvidia_smi": ["580.159.04, 1980 MHz, 700.00 W"]}})


def _grid(tmp_path: Path, name: str, blocked_w: float, tp: int) -> Path:
    return _write(tmp_path / name, {"workload": {"model": "llama3.2-3b", "tp": tp, "cp": 1},
                                    "blocked_power_w": blocked_w, "idle_power_w": 0.98 * blocked_w,
                                    "measurements": []})


def test_builder_assembles_a_profile_from_synthetic_files(tmp_path):
    c2 = _collectives(tmp_path, "c2.json", 2, {("nccl_capped", 8): 440.0,
                                               ("nccl_uncapped", None): 250.0})
    c2r = _collectives(tmp_path, "c2r.json", 2, {("nccl_capped", 8): 999.0,
                                                 ("own_reg", 8): 300.0})
    c4 = _collectives(tmp_path, "c4.json", 4, {("own", 4): 800.0})
    prof = build_gpu_profile(
        gpu="h200-sxm", power_probe=_power_probe(tmp_path),
        grids=[_grid(tmp_path, "g2.json", 240.0, 2), _grid(tmp_path, "g4.json", 504.0, 4)],
        collectives=[c4, c2, c2r], op_table=_op_table(tmp_path), root=tmp_path)
    assert prof.gpu == "h200-sxm" and prof.sm_count == 132
    # Per-op rows: ms -> s, one record per partition an op is listed in (a repeated row
    # dropped), the candidate set under its own name, the peaks of the same run.
    assert prof.kernel_set == "fused" and prof.kernel_sets == ("fused", "reference")
    qkv = prof.op_profile("llama3.2-3b", "fwd_attn", "qkv")
    assert qkv.time_s == pytest.approx(2.1e-4) and qkv.roofline_s == pytest.approx(1.9e-4)
    assert (qkv.power_w, qkv.power_busy_fraction, qkv.kernel) == (655.0, 0.98, "matmul")
    assert qkv.freq_mhz is None  # the file records no clock per op
    assert prof.op_profile("llama3.2-3b", "bwd_attn", "qkv").time_s == qkv.time_s
    assert len([o for o in prof.ops if o.kernels == "fused"]) == 3
    ref = prof.op_profile("llama3.2-3b", "fwd_attn", "rope", kernels="reference")
    assert ref.time_s == pytest.approx(2.39e-4) and ref.power_w is None
    assert len(prof.ops) == 4
    assert any("1 repeated" in n for n in prof.notes)
    assert any("rope_bwd" not in n and "1 candidate row" in n for n in prof.notes)
    assert any("not recorded" in n and "sm_clock_mhz_at_start" in n for n in prof.notes)
    assert prof.gemm_peak_tflops == 780.5 and prof.hbm_bandwidth_gbps == pytest.approx(4300.0)
    # Power: idle from the probe, static = median of blocked power per GPU (120, 126).
    assert prof.idle_power_w == 79.6 and prof.idle_freq_mhz == 345
    assert prof.static_power_w == pytest.approx(123.0)
    assert {lp.source for lp in prof.load_powers} == {"power.json", "g2.json", "g4.json",
                                                      "op_roofline.json"}
    # Collectives: group size from the file, us -> s, the first file wins on a clash.
    assert len(prof.collectives) == 4
    capped = prof.collective_curve("nccl_capped", "all_reduce", 2, 64 << 20)
    assert len(capped) == 1 and capped[0].time_s == pytest.approx(4.4e-4)
    assert capped[0].source == "c2.json"
    assert prof.collective_curve("own", "all_reduce", 4, 64 << 20)[0].group_size == 4
    assert prof.machine == MachineInfo(gpu_name="NVIDIA H200", driver="580.159.04",
                                       torch="2.11.0+cu130", cuda="13.0", nccl="2.28.9")
    assert prof.sources[0].startswith("op_roofline.json (sha256 ")
    assert GPUProfile.from_dict(prof.to_dict()) == prof


def test_builder_without_per_op_data_uses_the_probe_and_says_so(tmp_path):
    prof = build_gpu_profile(gpu="h200-sxm", power_probe=_power_probe(tmp_path))
    assert prof.ops == () and prof.kernel_set == ""
    assert prof.gemm_peak_tflops == 791.2 and prof.gemm_peak_freq_mhz == 1980
    assert prof.hbm_bandwidth_gbps == pytest.approx(4230.0)
    assert prof.static_power_w == 120.6  # one spinning block: no grid measured blocked power
    assert any(n.startswith("ops: none") for n in prof.notes)
    assert any("spinning block" in n for n in prof.notes)


def test_readers_name_the_file_and_field(tmp_path):
    bad = _write(tmp_path / "ops.json", {"rows": [{"workload": "w", "partition": "p",
                                                   "op": "o", "kind": "gemm"}]})
    with pytest.raises(GPUProfileError, match=r"ops.json, rows\[0\]: missing 'measured_ms'"):
        read_op_table(bad)
    bad_kind = _write(tmp_path / "ops2.json", {"rows": [{"workload": "w", "partition": "p",
                                                         "op": "o", "kind": "conv",
                                                         "measured_ms": 1.0}]})
    with pytest.raises(GPUProfileError, match="kind must be one of"):
        read_op_table(bad_kind)
    with pytest.raises(GPUProfileError, match="missing 'world_size'"):
        read_collectives(_write(tmp_path / "c.json", {"rows": []}))
    with pytest.raises(GPUProfileError, match="missing 'loads'"):
        read_power_probe(_write(tmp_path / "p.json", {}))
    with pytest.raises(GPUProfileError, match="missing 'blocked_power_w'"):
        read_grid_static_power(_write(tmp_path / "g.json", {"workload": {"tp": 2}}))
    with pytest.raises(GPUProfileError, match="has no 'idle' load"):
        build_gpu_profile(gpu="h200-sxm", power_probe=_write(
            tmp_path / "p2.json", {"loads": {"spin": {"avg_w": 120.0}}}))


def test_builder_reads_the_projects_measured_files():
    """The measured files in the repository assemble into a valid profile that keeps every
    distinct collective point and every power reading of the probe."""
    colls = sorted((REPO / "bench" / "results").glob("collectives_*xh200_nvlink*.json"))
    probe = REPO / "bench" / "results" / "emulator_power_probe_h200.json"
    grids = sorted((REPO / "data").glob("*_grid*.json"))
    if not (colls and probe.exists() and grids):
        pytest.skip("measured files not in this checkout")
    prof = build_gpu_profile(gpu="h200-sxm", power_probe=probe, grids=grids,
                             collectives=colls, root=REPO)
    keys = set()
    for c in colls:
        keys.update(p.key for p in read_collectives(c))
    assert {p.key for p in prof.collectives} == keys
    assert {"own", "nccl_capped", "nccl_uncapped"} <= set(prof.backends)
    assert {p.group_size for p in prof.collectives} == {2, 4}
    probe_loads = json.loads(probe.read_text())["loads"]
    assert prof.idle_power_w == probe_loads["idle"]["avg_w"]
    assert len([lp for lp in prof.load_powers if lp.source.endswith(probe.name)]) == \
        len(probe_loads)
    assert prof.idle_power_w < prof.static_power_w < 200.0
    assert GPUProfile.from_dict(prof.to_dict()) == prof


def test_a_trimmed_table_with_partition_lists_and_the_raw_file_merge(tmp_path):
    """data/'s table lists each op once with its partitions; the raw bench file adds the
    candidate kernel sets (and repeats the main rows, which are not added twice)."""
    raw = _op_table(tmp_path)
    trimmed = _write(tmp_path / "trimmed.json", {
        "source": "op_roofline.json", "gpu": "NVIDIA H200", "driver": "580.159.04",
        "torch": "2.11.0+cu130", "cuda": "13.0", "kernels": "fused",
        "workloads": {"llama3.2-3b": {"tp": 4}}, "batch": {"microbatch_size": 8},
        "gemm_peak_tflops": 788.5, "hbm_tb_s": 4.15, "idle_power_w": 123.0,
        "rows": [{"workload": "llama3.2-3b", "op": "qkv", "partitions": ["fwd_attn", "bwd_attn"],
                  "kind": "gemm", "measured_ms": 0.2, "roofline_ms": 0.19, "kernel": "cublas",
                  "power_w": 650.0},
                 {"workload": "llama3.2-3b", "op": "rope", "partitions": ["fwd_attn"],
                  "kind": "elementwise", "measured_ms": 0.021, "roofline_ms": 0.019,
                  "kernel": "triton", "power_w": 480.0}]})
    table = read_op_table(trimmed)
    assert sorted(o.key[1:3] for o in table.ops) == [("bwd_attn", "qkv"), ("fwd_attn", "qkv"),
                                                     ("fwd_attn", "rope")]
    assert table.hbm_bandwidth_gbps == pytest.approx(4150.0) and table.gemm_peak_tflops == 788.5
    assert any('llama3.2-3b": {"tp": 4}' in n for n in table.notes)
    prof = build_gpu_profile(gpu="h200-sxm", power_probe=_power_probe(tmp_path),
                             op_table=[trimmed, raw], root=tmp_path)
    # Main rows from the trimmed table (its times, not the raw file's), the reference set
    # from the raw file, the peaks of the first file.
    assert prof.op_profile("llama3.2-3b", "fwd_attn", "qkv").time_s == pytest.approx(2.0e-4)
    assert prof.op_profile("llama3.2-3b", "fwd_attn", "rope",
                           kernels="reference").time_s == pytest.approx(2.39e-4)
    assert len(prof.ops) == 4
    assert prof.gemm_peak_tflops == 788.5
    assert [x.split(" ")[0] for x in prof.sources[:2]] == ["trimmed.json", "op_roofline.json"]
    # The raw file's identical measurement lends its power busy fraction; qkv differs.
    assert prof.op_profile("llama3.2-3b", "fwd_attn", "rope").power_busy_fraction == 0.9
    assert prof.op_profile("llama3.2-3b", "fwd_attn", "qkv").power_busy_fraction is None
    assert any("busy fraction of 1 identical record" in n for n in prof.notes)
    assert any("1 record(s) added from op_roofline.json (kernel sets reference)" in n
               for n in prof.notes)
    bad = _write(tmp_path / "bad.json", {"rows": [{"workload": "w", "op": "o", "kind": "gemm",
                                                   "partitions": [], "measured_ms": 1.0}]})
    with pytest.raises(GPUProfileError, match="'partitions' must be a non-empty list"):
        read_op_table(bad)

"""bench/probes/trace_compare.py on the CPU: categories of kernel names, and the per-category
comparison of two traces."""

from __future__ import annotations

import gzip
import json

import pytest
from bench_scripts import load_bench

tc = load_bench("probes/trace_compare")


def test_kernel_names_fall_into_their_categories():
    assert tc.category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm (cuBLAS)"
    assert tc.category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert tc.category("Memset (Device)") == "memset"
    assert tc.category("_rms_norm_bwd_kernel") == "triton _rms_norm_bwd_kernel"
    assert tc.category("void at::native::vectorized_elementwise_kernel<8, "
                       "at::native::CUDAFunctor_add<c10::BFloat16>>") == "torch add"
    assert tc.category("something else") == "other"


def _trace(path, ops):
    events = [{"ph": "X", "cat": c, "name": n, "dur": d, "ts": i}
              for i, (c, n, d) in enumerate(ops)]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 99, "ts": 0})
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_two_traces_compare_per_category(tmp_path):
    a = _trace(tmp_path / "a.json.gz", [("kernel", "nvjet_x", 10.0), ("gpu_memset",
                                                                       "Memset (Device)", 1.0)])
    b = _trace(tmp_path / "b.json.gz", [("kernel", "nvjet_x", 6.0), ("kernel", "nvjet_x", 6.0),
                                        ("kernel", "_swiglu_fwd_kernel", 3.0)])
    rows = {r["category"]: r for r in tc.compare(tc.by_category(tc.read(a)),
                                                  tc.by_category(tc.read(b)))}
    assert rows["gemm (cuBLAS)"]["ops_a"] == 1 and rows["gemm (cuBLAS)"]["ops_b"] == 2
    assert rows["gemm (cuBLAS)"]["diff_s"] == pytest.approx(2e-6)
    assert rows["memset"]["ops_b"] == 0 and rows["memset"]["diff_s"] == pytest.approx(-1e-6)
    assert rows["triton _swiglu_fwd_kernel"]["gpu_s_b"] == pytest.approx(3e-6)
    out = tmp_path / "o.json"
    assert tc.main([str(a), str(b), "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())["rows"]) == 3

"""bench/launch_cost.py on the CPU: its command line, its one-line refusal without CUDA, its
workloads (library presets that the partition builders accept), its check, and a whole
run end to end with the fake Triton of tests/exec/test_kernels_launch.py and a fake
``torch.cuda`` (the numbers mean nothing; every stage runs, the lean path takes its fast
launches, and the JSON holds every row). The measurement itself needs a GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
from bench_scripts import BENCH, load_bench

torch = pytest.importorskip("torch")
pytest.importorskip("triton")


@pytest.fixture(scope="module")
def lc():
    return load_bench("launch_cost")


def test_help_and_the_refusal_without_cuda():
    done = subprocess.run([sys.executable, str(BENCH / "launch_cost.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--check" in done.stdout
    if torch.cuda.is_available():  # pragma: no cover - a GPU machine
        return
    done = subprocess.run([sys.executable, str(BENCH / "launch_cost.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == ("launch_cost.py: needs a CUDA GPU "
                                   "(torch.cuda.is_available() is False)")


def test_bad_arguments_are_refused(lc):
    with pytest.raises(SystemExit):
        lc.main(["--calls", "5"])
    with pytest.raises(SystemExit):
        lc.main(["--workloads", "gpt-9"])


def test_workloads_are_the_presets_at_their_partition_shapes(lc):
    from kareus.exec._transformer_ops import _dims
    from kareus.model.workload import Workload

    labels = [w[0] for w in lc.WORKLOADS]
    assert len(set(labels)) == len(labels) == 4
    tokens = {}
    for label, preset, par, mb in lc.WORKLOADS:
        d = _dims(Workload.preset(preset, **par, microbatch_size=mb, seq_len=lc.SEQ_LEN,
                                  nanobatches=lc.NANOBATCHES))
        tokens[label] = d.t
    assert tokens["qwen3-1.7b tp4 cp2 mb16"] == 2 * tokens["qwen3-1.7b tp4 cp2 mb8"]
    assert set(lc.LEAN_TAG) == set(lc.OPS)


def test_check_flags_slow_missing_and_different_ops(lc):
    ok = {"workload": "w", "op": "rope", "path": "lean", "host_us": 9.0,
          "fast_path": True, "equal_to_plain": True}
    rows = [ok, {**ok, "path": "plain", "host_us": 90.0},
            {**ok, "workload": "-", "op": "empty kernel", "host_us": 40.0}]
    assert lc.check(rows, True) == []
    assert lc.check(rows, False) == ["lean launches unavailable in this process"]
    slow = {**ok, "host_us": 15.5, "fast_path": False, "equal_to_plain": False}
    bad = lc.check([slow], True)
    assert len(bad) == 3 and "15.5 us > 15 us" in bad[0]


class FakeEvent:
    def __init__(self, enable_timing=False):
        pass

    def record(self):
        pass

    def query(self):
        return False  # still busy: the spin outlasts the calls

    def elapsed_time(self, other):
        return 0.005


@pytest.fixture
def fake_gpu(lc, monkeypatch):
    """The bench on the CPU: the fake Triton of test_kernels_launch.py, a fake
    ``torch.cuda``, small sequences; yields the launch log."""
    import test_kernels_launch as fakes

    from kareus.exec.kernels import _launch
    from kareus.exec.kernels import _triton as kt

    log: list = []
    for name in fakes.KERNELS:
        monkeypatch.setattr(kt, name, fakes.FakeJIT(getattr(kt, name), log))
    for name in ("_bare4", "_bare30"):
        monkeypatch.setattr(lc, name, fakes.FakeJIT(getattr(lc, name), log))
    cuda = types.SimpleNamespace(
        is_available=lambda: True, synchronize=lambda: None, _sleep=lambda cycles: None,
        Event=FakeEvent, empty_cache=lambda: None, get_device_name=lambda: "fake GPU")
    for k, v in vars(cuda).items():
        monkeypatch.setattr(torch.cuda, k, v, raising=False)
    monkeypatch.setattr(lc, "_device", lambda torch: torch.device("cpu"))
    monkeypatch.setattr(lc, "SEQ_LEN", 128)  # small inputs: the fake kernels compute nothing
    monkeypatch.setattr(lc, "FLUSH_ELEMENTS", 1024)
    _launch.use_runtime(fakes.fake_runtime())
    kt.clear_plans()
    yield log
    kt.clear_plans()
    _launch.use_runtime()


def test_a_whole_run_with_a_fake_gpu(lc, fake_gpu, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert lc.main(["--json", str(out), "--no-liger", "--rounds", "1"]) == 0  # no --check
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert len(rows) == len(lc.WORKLOADS) * len(lc.OPS) * 2 + 4
    lean = [r for r in rows if r["path"] == "lean" and r["workload"] != "-"]
    assert all(r["fast_path"] and r["calls"] == 30 and r["gpu_us"] == 5.0 for r in lean)
    assert all(r["host_us_no_launch"] > 0 for r in lean)
    assert res["lean_runtime"] == {"available": True, "triton": "fake"}
    assert {r["op"] for r in rows if r["workload"] == "-"} == {
        "empty kernel, 4 arguments", "empty kernel, 30 arguments"}
    assert "fast" in {e[0] for e in fake_gpu}
    printed = capsys.readouterr().out
    assert "lean host time <= 15 us per kareus op" in printed
    assert set(res["workloads"]) == {w[0] for w in lc.WORKLOADS}


def test_a_failing_op_is_reported_and_the_run_goes_on(lc, fake_gpu, tmp_path, monkeypatch):
    real = lc.measure_op

    def measure_op(torch, label, op, *rest):
        if op == "rope":
            raise RuntimeError("boom")
        return real(torch, label, op, *rest)

    monkeypatch.setattr(lc, "measure_op", measure_op)
    out = tmp_path / "r.json"
    rc = lc.main(["--json", str(out), "--no-liger", "--rounds", "1", "--check",
                  "--workloads", lc.WORKLOADS[0][0]])
    assert rc == 1
    res = json.loads(out.read_text())
    failed = [r for r in res["rows"] if "error" in r]
    assert {(r["op"], r["path"]) for r in failed} == {("rope", "lean"), ("rope", "plain")}
    assert any("RuntimeError: boom" in m for m in res["check"]["missed"])
    assert len(res["rows"]) == (len(lc.OPS)) * 2 + 4


def test_the_python_share_swaps_the_launches_and_puts_them_back(lc, fake_gpu):
    from kareus.exec.kernels import _triton as kt

    g, u = torch.randn(8, 64), torch.randn(8, 64)
    kt.swiglu_fwd(g, u)
    kt.swiglu_fwd(g, u)
    assert [e[0] for e in fake_gpu] == ["plain", "fast"]
    saved = lc.no_launches(kt)
    assert saved
    kt.swiglu_fwd(g, u)  # launches nothing
    lc.put_back(saved)
    kt.swiglu_fwd(g, u)
    assert [e[0] for e in fake_gpu] == ["plain", "fast", "fast"]

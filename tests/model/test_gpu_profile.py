"""GPUProfile: validation and versioned JSON with a digest (the builder from measured files:
tests/profilers/test_profile_build.py)."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from kareus.errors import KareusError
from kareus.model.gpu_profile import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    CollectivePoint,
    GPUProfile,
    GPUProfileError,
    LoadPower,
    MachineInfo,
    OpProfile,
    profile_digest,
)

REPO = Path(__file__).resolve().parents[2]


def _profile(**changes: object) -> GPUProfile:
    base: dict[str, object] = dict(
        gpu="h200-sxm", sm_count=132,
        machine=MachineInfo(gpu_name="NVIDIA H200", driver="580.159.04", torch="2.11.0"),
        kernel_set="fused",
        gemm_peak_tflops=795.3, gemm_peak_freq_mhz=1980, hbm_bandwidth_gbps=4233.6,
        idle_power_w=79.6, idle_freq_mhz=345, static_power_w=120.1,
        load_powers=(LoadPower(load="idle", power_w=79.6, freq_mhz=345, source="probe.json"),
                     LoadPower(load="GEMM chain", power_w=709.1, freq_mhz=1500)),
        ops=(OpProfile(workload="llama3.2-3b tp4", partition="fwd_attn", op="qkv", kind="gemm",
                       time_s=2.1e-4, power_w=650.0, freq_mhz=1755, roofline_s=1.9e-4,
                       kernel="cublas", kernels="fused", power_busy_fraction=0.97),
             OpProfile(workload="llama3.2-3b tp4", partition="fwd_attn", op="rope",
                       kind="elementwise", time_s=2.2e-5, kernels="fused"),
             OpProfile(workload="llama3.2-3b tp4", partition="fwd_attn", op="rope",
                       kind="elementwise", time_s=2.39e-4, kernels="reference")),
        collectives=(CollectivePoint(backend="nccl_capped", collective="all_reduce",
                                     group_size=2, size_bytes=64 << 20, comm_sms=8,
                                     time_s=4.4e-4, bus_gbps=152.0),
                     CollectivePoint(backend="nccl_capped", collective="all_reduce",
                                     group_size=2, size_bytes=64 << 20, comm_sms=2,
                                     time_s=1.6e-3, bus_gbps=41.3),
                     CollectivePoint(backend="nccl_uncapped", collective="all_reduce",
                                     group_size=2, size_bytes=64 << 20, comm_sms=None,
                                     time_s=2.5e-4, bus_gbps=272.0)),
        sources=("a.json",), notes=("synthetic",))
    base.update(changes)
    return GPUProfile(**base)  # type: ignore[arg-type]


def test_round_trip_through_a_file_keeps_every_field_and_the_digest(tmp_path):
    p = _profile()
    path = p.save(tmp_path / "prof.json")
    data = json.loads(path.read_text())
    assert data["format"] == PROFILE_FORMAT and data["version"] == PROFILE_VERSION
    assert data["digest"] == p.digest and len(p.digest) == 64
    q = GPUProfile.load(path)
    assert q == p
    assert q.digest == p.digest
    assert GPUProfile.from_dict(q.to_dict()) == p


def test_digest_changes_with_the_content():
    assert _profile().digest != _profile(static_power_w=121.0).digest


def test_queries():
    p = _profile()
    assert p.clocks_observed_mhz == (345, 1500, 1755, 1980)
    assert p.backends == ("nccl_capped", "nccl_uncapped")
    assert p.op_profile("llama3.2-3b tp4", "fwd_attn", "qkv").kernel == "cublas"
    assert p.op_profile("llama3.2-3b tp4", "fwd_attn", "qkv").energy_j == pytest.approx(0.1365)
    assert p.op_profile("llama3.2-3b tp4", "fwd_attn", "rope").energy_j is None
    assert [o.op for o in p.ops_of("llama3.2-3b tp4", "fwd_attn")] == ["qkv", "rope"]
    assert p.kernel_sets == ("fused", "reference")
    assert p.op_profile("llama3.2-3b tp4", "fwd_attn", "rope").time_s == 2.2e-5
    assert p.op_profile("llama3.2-3b tp4", "fwd_attn", "rope",
                        kernels="reference").time_s == 2.39e-4
    assert [o.op for o in p.ops_of("llama3.2-3b tp4", "fwd_attn", kernels="reference")] == \
        ["rope"]
    curve = p.collective_curve("nccl_capped", "all_reduce", 2, 64 << 20)
    assert [c.comm_sms for c in curve] == [2, 8]
    assert p.uncapped_point("nccl_uncapped", "all_reduce", 2, 64 << 20).bus_gbps == 272.0
    assert p.uncapped_point("nccl_capped", "all_reduce", 2, 64 << 20) is None
    with pytest.raises(GPUProfileError, match="no op 'norm'.*llama3.2-3b tp4/fwd_attn"):
        p.op_profile("llama3.2-3b tp4", "fwd_attn", "norm")
    with pytest.raises(GPUProfileError, match="kernel set 'reference'.*kernel sets: 'fused'"):
        p.op_profile("llama3.2-3b tp4", "fwd_attn", "qkv", kernels="reference")


@pytest.mark.parametrize(("cls", "field", "value", "match"), [
    (OpProfile, "kind", "conv", "kind must be one of"),
    (OpProfile, "time_s", 0.0, "time_s must be a finite number > 0"),
    (OpProfile, "time_s", float("nan"), "time_s must be a finite number > 0"),
    (OpProfile, "power_w", -1.0, "power_w must be a finite number > 0 or null"),
    (OpProfile, "freq_mhz", 0, "freq_mhz must be a clock"),
    (OpProfile, "workload", "", "workload must be a non-empty string"),
    (OpProfile, "kernel", 3, "kernel must be a string"),
    (OpProfile, "kernels", None, "kernels must be a string"),
    (OpProfile, "power_busy_fraction", 1.5, r"power_busy_fraction must be in \(0, 1\]"),
    (OpProfile, "host_s", 0.0, r"host_s must be in \(0, 1.0\) seconds or null"),
    (OpProfile, "host_s", 2.5, "a launch of a second or more was blocked"),
    (OpProfile, "host_s", float("nan"), "host_s must be in"),
    (OpProfile, "host_s", "20us", "host_s must be in"),
    (CollectivePoint, "collective", "broadcast", "collective must be one of"),
    (CollectivePoint, "group_size", 1, "group_size must be an integer >= 2"),
    (CollectivePoint, "comm_sms", 0, "comm_sms must be an integer >= 1 or null"),
    (CollectivePoint, "bus_gbps", True, "bus_gbps must be a finite number"),
    (LoadPower, "power_w", float("inf"), "power_w must be a finite number"),
    (MachineInfo, "gpu_name", " ", "gpu_name must be a non-empty string"),
])
def test_every_record_field_is_validated(cls, field, value, match):
    p = _profile()
    good = {OpProfile: p.ops[0], CollectivePoint: p.collectives[0], LoadPower: p.load_powers[0],
            MachineInfo: p.machine}[cls]
    with pytest.raises(GPUProfileError, match=match) as info:
        attrs.evolve(good, **{field: value})
    assert isinstance(info.value, KareusError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(("changes", "match"), [
    ({"gpu": ""}, "gpu must be a non-empty string"),
    ({"sm_count": 1}, "sm_count must be an integer >= 2"),
    ({"kernel_set": 1}, "kernel_set must be a string"),
    ({"gemm_peak_tflops": 0}, "gemm_peak_tflops must be"),
    ({"hbm_bandwidth_gbps": -3.0}, "hbm_bandwidth_gbps must be"),
    ({"idle_freq_mhz": 20_000}, "idle_freq_mhz must be a clock"),
    ({"static_power_w": 50.0}, "below idle_power_w"),
    ({"machine": {"gpu_name": "x"}}, "machine must be a MachineInfo"),
    ({"ops": "qkv"}, "ops must be a list"),
    ({"collectives": [1]}, r"collectives\[0\] must be a CollectivePoint"),
    ({"notes": ["", "x"]}, "notes must hold non-empty strings"),
])
def test_profile_fields_are_validated(changes, match):
    with pytest.raises(GPUProfileError, match=match):
        _profile(**changes)


def test_host_costs_round_trip_and_need_their_method(tmp_path):
    p = _profile()
    hosted = _profile(ops=(attrs.evolve(p.ops[0], host_s=1.8e-5), *p.ops[1:]),
                      host_method="median of 30 calls, the GPU kept busy")
    q = GPUProfile.load(hosted.save(tmp_path / "h.json"))
    assert q == hosted and q.ops[0].host_s == 1.8e-5 and q.ops[1].host_s is None
    assert q.digest != p.digest
    with pytest.raises(GPUProfileError, match="host_method does not say"):
        _profile(ops=(attrs.evolve(p.ops[0], host_s=1.8e-5),))


def test_profiles_written_before_host_costs_load_with_their_digest(tmp_path):
    """A version-1 file without ``host_s`` / ``host_method`` (every profile written before
    they existed): it loads, has no host costs, and keeps its digest."""
    p = _profile()
    d = p.to_dict()
    assert "host_method" not in d["profile"]
    assert all("host_s" not in o for o in d["profile"]["ops"])
    q = GPUProfile.load(_write(tmp_path / "old.json", d))
    assert q.host_method == "" and all(o.host_s is None for o in q.ops)
    assert q.digest == d["digest"]
    shipped = GPUProfile.preset("h200-sxm")
    assert all(o.host_s is None for o in shipped.ops)
    raw = json.loads((REPO / "kareus/model/profiles/h200_sxm.json").read_text())
    assert shipped.digest == raw["digest"]


def test_duplicate_keys_are_refused():
    p = _profile()
    with pytest.raises(GPUProfileError, match="two entries"):
        _profile(ops=(p.ops[0], p.ops[0]))
    with pytest.raises(GPUProfileError, match="two entries"):
        _profile(collectives=(p.collectives[0], attrs.evolve(p.collectives[0], time_s=1.0)))


def _write(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj))
    return path


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d.update(format="other"), "not a kareus GPU profile"),
    (lambda d: d["profile"].update(static_power_w=130.0), "digest does not match"),
    (lambda d: d.update(extra=1), "unknown field"),
    (lambda d: d.pop("digest"), "missing digest"),
])
def test_bad_files_raise_one_typed_error(tmp_path, edit, match):
    d = _profile().to_dict()
    edit(d)
    with pytest.raises(GPUProfileError, match=match):
        GPUProfile.load(_write(tmp_path / "p.json", d))


def test_bad_content_with_a_matching_digest_is_still_validated(tmp_path):
    d = _profile().to_dict()
    body = d["profile"]
    body["ops"][0]["kind"] = "conv"
    d["digest"] = profile_digest(body)
    with pytest.raises(GPUProfileError, match="kind must be one of"):
        GPUProfile.load(_write(tmp_path / "p.json", d))
    body["ops"][0]["kind"] = "gemm"
    body["ops"][0]["color"] = "red"
    d["digest"] = profile_digest(body)
    with pytest.raises(GPUProfileError, match=r"ops\[0\]: unknown field\(s\) color"):
        GPUProfile.load(_write(tmp_path / "p.json", d))


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(GPUProfileError, match="does not exist"):
        GPUProfile.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(GPUProfileError, match="not valid JSON"):
        GPUProfile.load(tmp_path / "bad.json")
    with pytest.raises(GPUProfileError, match="holds a JSON list"):
        GPUProfile.load(_write(tmp_path / "list.json", [1]))


def test_the_shipped_h200_profile_loads_and_names_the_files_it_was_built_from():
    from kareus.model import build_partitions
    from kareus.model.gpu_profile import shipped_profiles
    from kareus.model.workload import Workload

    assert "h200-sxm" in shipped_profiles()
    prof = GPUProfile.preset("h200-sxm")
    assert prof.gpu == "h200-sxm" and prof.sm_count == 132
    # Every op of every partition type of the measured workloads, in the main kernel set,
    # but qwen3's fused qk-norm and RoPE: the profile was measured with kernels that ran no
    # qk-norm (RoPE alone stands in its records; the emulator costs the fused ops by their
    # kind's record until a profile measures them).
    shapes = {"llama3.2-3b": {"tp": 4}, "qwen3-1.7b": {"tp": 4, "cp": 2},
              "llama3.3-70b": {"tp": 8}}
    unmeasured = {"qk_norm_rope", "qk_norm_rope_bwd"}
    for name, par in shapes.items():
        wl = Workload.preset(name, microbatch_size=8, seq_len=4096, nanobatches=2, **par)
        for pname, part in build_partitions(wl).types.items():
            got = [o.op for o in prof.ops_of(name, pname)]
            ops = {o.name for o in part.compute_ops}
            rope_alone = {op.removeprefix("qk_norm_") for op in ops & unmeasured}
            assert got and set(got) == (ops - unmeasured) | rope_alone, (name, pname)
            assert bool(ops & unmeasured) == (name == "qwen3-1.7b" and "attn_in" in pname)
    # Each source file still holds what the profile was built from (else: rebuild it with
    # python bench/build_gpu_profile.py --out kareus/model/profiles/h200_sxm.json).
    import hashlib

    for src in prof.sources:
        path, _, digest = src.partition(" (sha256 ")
        file = REPO / path
        if digest and file.exists():
            assert hashlib.sha256(file.read_bytes()).hexdigest()[:12] == digest.rstrip(")"), (
                f"{path} changed since the shipped profile was built: run python "
                "bench/build_gpu_profile.py --out kareus/model/profiles/h200_sxm.json")
    with pytest.raises(GPUProfileError, match="ships no measured profile for 'a100-40gb'"):
        GPUProfile.preset("a100-40gb")

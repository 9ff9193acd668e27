"""CPU tests of the collective backends: validation, piece planning, selection, build.

None of these needs torch or a GPU; the build tests need nvcc and are skipped without it.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from kareus.errors import HardwareError, InvalidSMCountError, KareusError
from kareus.exec import _ext_build
from kareus.exec import collectives as C

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
CU_SOURCE = REPO / "ext" / "collectives" / "kareus_collectives.cu"
needs_nvcc = pytest.mark.skipif(_ext_build.find_nvcc() is None, reason="nvcc not installed")


# ------------------------------------------------------------------ SM counts


@pytest.mark.parametrize("sms", [1, 2, 64, 131])
def test_valid_sm_counts_pass_through(sms: int) -> None:
    assert C.validate_comm_sms(sms, 132) == sms


@pytest.mark.parametrize("sms", [0, -1, 132, 500])
def test_sm_count_out_of_range_says_the_range(sms: int) -> None:
    with pytest.raises(C.CommSMCountError, match=r"comm_sms must be in 1\.\.131 for a GPU with 132 SMs"):
        C.validate_comm_sms(sms, 132)


@pytest.mark.parametrize("sms", [2.0, "4", True, None])
def test_sm_count_must_be_int(sms: object) -> None:
    with pytest.raises(C.CommSMCountError, match="must be an int"):
        C.validate_comm_sms(sms, 132)


def test_backend_limit_is_reported_with_backend_name() -> None:
    with pytest.raises(C.CommSMCountError, match=r"1\.\.64 for the nccl_capped backend"):
        C.validate_comm_sms(100, 132, backend_limit=64, backend="nccl_capped")


def test_sm_count_error_types() -> None:
    err = C.CommSMCountError("x")
    assert isinstance(err, ValueError)
    assert isinstance(err, InvalidSMCountError)
    assert isinstance(err, KareusError)
    assert isinstance(C.CollectiveUnavailableError("x"), RuntimeError)
    assert isinstance(C.CollectiveUnavailableError("x"), HardwareError)
    assert isinstance(C.CollectiveArgumentError("x"), ValueError)
    assert isinstance(C.ExtensionBuildError("x"), RuntimeError)


# --------------------------------------------------------------- other checks


@pytest.mark.parametrize("world", [2, 4, 8])
def test_supported_world_sizes(world: int) -> None:
    assert C.validate_world_size(world) == world


@pytest.mark.parametrize("world", [1, 3, 6, 16])
def test_unsupported_world_size_points_to_nccl(world: int) -> None:
    with pytest.raises(C.CollectiveArgumentError, match="NCCLCappedCollective"):
        C.validate_world_size(world)


@pytest.mark.parametrize(
    ("given", "canonical"),
    [("bfloat16", "bfloat16"), ("torch.bfloat16", "bfloat16"), ("bf16", "bfloat16"),
     ("torch.float16", "float16"), ("half", "float16"), ("fp32", "float32"), ("float", "float32")],
)
def test_dtype_names(given: str, canonical: str) -> None:
    assert C.validate_dtype(given) == canonical


@pytest.mark.parametrize("bad", ["int8", "torch.float64", "float8_e4m3fn"])
def test_unsupported_dtype(bad: str) -> None:
    with pytest.raises(C.CollectiveArgumentError, match="cast the tensor"):
        C.validate_dtype(bad)


def test_all_reduce_algorithm_choice() -> None:
    assert C.choose_all_reduce_algorithm(4096, 4) == "one_shot"
    assert C.choose_all_reduce_algorithm(C.ONE_SHOT_MAX_BYTES, 4) == "one_shot"
    assert C.choose_all_reduce_algorithm(C.ONE_SHOT_MAX_BYTES + 1, 4) == "two_shot"
    assert C.choose_all_reduce_algorithm(256 * MIB, 2) == "one_shot"
    assert C.choose_all_reduce_algorithm(4096, 8, "two_shot") == "two_shot"
    with pytest.raises(C.CollectiveArgumentError, match="one_shot"):
        C.choose_all_reduce_algorithm(4096, 4, "ring")


def test_bus_bandwidth_factors_follow_nccl_tests() -> None:
    assert C.bus_bandwidth_factor("all_reduce", 4) == pytest.approx(1.5)
    assert C.bus_bandwidth_factor("all_reduce", 2) == pytest.approx(1.0)
    assert C.bus_bandwidth_factor("all_gather", 4) == pytest.approx(0.75)
    assert C.bus_bandwidth_factor("reduce_scatter", 8) == pytest.approx(0.875)
    with pytest.raises(C.CollectiveArgumentError):
        C.bus_bandwidth_factor("broadcast", 4)


# ------------------------------------------------------------- piece planning


def test_staging_need_matches_kernel_layout() -> None:
    # two-shot: 2 * world * chunk, chunk = ceil(numel/world) rounded up to 8 bf16 elements
    assert C.staging_bytes_needed("all_reduce", 1000, 2, 4, "two_shot") == 2 * 4 * 256 * 2
    assert C.staging_bytes_needed("all_reduce", 1001, 2, 4, "two_shot") == 2 * 4 * 256 * 2
    assert C.staging_bytes_needed("all_reduce", 1, 4, 4, "two_shot") == 2 * 4 * 4 * 4
    # one-shot and the others: world slots of the (rounded) message / shard
    assert C.staging_bytes_needed("all_reduce", 1001, 2, 4, "one_shot") == 4 * 1008 * 2
    assert C.staging_bytes_needed("all_gather", 7, 4, 8) == 8 * 8 * 4


@pytest.mark.parametrize("op", C.COLLECTIVE_OPS)
@pytest.mark.parametrize("numel", [1, 7, 4096, 3 * MIB + 5, 128 * MIB + 3])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_pieces_cover_the_message_and_fit(op: str, numel: int, world: int) -> None:
    staging = 64 * MIB
    algo = "two_shot" if op == "all_reduce" else "one_shot"
    pieces = C.plan_pieces(op, numel, 2, world, staging, algo)
    assert pieces[0][0] == 0
    assert sum(count for _, count in pieces) == numel
    for (s0, c0), (s1, _) in zip(pieces, pieces[1:]):
        assert s0 + c0 == s1
    for start, count in pieces:
        assert count > 0
        assert (start * 2) % 16 == 0  # pieces keep 16-byte alignment
        assert C.staging_bytes_needed(op, count, 2, world, algo) <= staging
    sizes = [count for _, count in pieces]
    assert max(sizes) - min(sizes) <= 128 * len(pieces)  # balanced: no sliver at the end


def test_pieces_of_empty_message() -> None:
    assert C.plan_pieces("all_reduce", 0, 2, 4, MIB) == []


def test_pieces_need_some_staging() -> None:
    with pytest.raises(C.CollectiveArgumentError, match="too small"):
        C.plan_pieces("all_gather", 10**6, 4, 8, 64)


# -------------------------------------------------------------------- selection


def env(**kw: object) -> C.CollectiveEnvironment:
    base: dict[str, object] = {"world_size": 4, "sm_count": 132}
    base.update(kw)
    return C.CollectiveEnvironment(**base)  # type: ignore[arg-type]


def test_own_kernels_preferred_on_one_node_with_peer_access() -> None:
    assert C.choose_collective_backend(env()) == "own"


def test_unknown_peer_access_still_tries_own_kernels() -> None:
    assert C.choose_collective_backend(env(peer_access=None)) == "own"


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"peer_access": False}, "peer access"),
        ({"world_size": 3}, "2, 4 or 8 GPUs"),
        ({"world_size": 16}, "2, 4 or 8 GPUs"),
        ({"single_node": False}, "one node"),
        ({"nvcc_available": False}, "nvcc"),
        ({"compute_capability": (6, 0)}, "compute capability"),
    ],
)
def test_falls_back_to_nccl_and_says_why_not_own(kw: dict[str, object], reason: str) -> None:
    e = env(**kw)
    assert reason in (C.backend_unavailable_reason("own", e) or "")
    assert C.choose_collective_backend(e) == "nccl_capped"


def test_no_backend_fits_raises_typed_error_with_reasons() -> None:
    e = env(peer_access=False, nccl_cta_caps=False)
    with pytest.raises(C.NoCollectiveBackendError) as info:
        C.choose_collective_backend(e)
    assert isinstance(info.value, RuntimeError)
    assert set(info.value.reasons) == {"own", "nccl_capped"}
    assert "peer access" in str(info.value)
    assert "max_ctas" in str(info.value)


def test_mscclpp_only_when_importable() -> None:
    assert "mscclpp" in (C.backend_unavailable_reason("mscclpp", env()) or "")
    assert C.choose_collective_backend(env(mscclpp_available=True), ("mscclpp", "own")) == "mscclpp"
    assert C.choose_collective_backend(env(), ("mscclpp", "own")) == "own"


def test_disabled_backends_are_skipped_with_the_given_reason() -> None:
    with pytest.raises(C.NoCollectiveBackendError, match="no runners"):
        C.choose_collective_backend(env(mscclpp_available=True), ("mscclpp",),
                                    disabled={"mscclpp": "no runners given"})


def test_preference_must_name_known_backends() -> None:
    with pytest.raises(C.CollectiveArgumentError, match="unknown collective backend"):
        C.choose_collective_backend(env(), ("gloo",))
    with pytest.raises(C.CollectiveArgumentError, match="at least one"):
        C.choose_collective_backend(env(), ())


def test_environment_checks_its_values() -> None:
    with pytest.raises(C.CollectiveArgumentError):
        env(world_size=0)
    with pytest.raises(C.CollectiveArgumentError):
        env(sm_count=1)


def test_mscclpp_backend_refuses_without_mscclpp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "mscclpp_available", lambda: False)
    with pytest.raises(C.CollectiveUnavailableError, match="not on PyPI"):
        C.MscclppCollective(runners={})


def test_importing_collectives_neither_imports_torch_nor_compiles(tmp_path: Path) -> None:
    code = (
        "import sys, os; import kareus.exec.collectives, kareus.exec._ext_build; "
        "print('torch' in sys.modules, os.listdir(os.environ['KAREUS_CACHE_DIR']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
        env={"KAREUS_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin",
             "PYTHONPATH": str(REPO)},
    )
    assert out.stdout.split() == ["False", "[]"]


# ------------------------------------------------------------------- the build


def test_gencode_targets_exactly_one_arch() -> None:
    assert _ext_build.gencode_flags("sm_90") == ["-gencode=arch=compute_90,code=sm_90"]
    with pytest.raises(ValueError, match="sm_90"):
        _ext_build.gencode_flags("hopper")


def test_source_hash_tracks_contents_and_flags(tmp_path: Path) -> None:
    src = tmp_path / "a.cu"
    src.write_text("__global__ void k() {}\n")
    h1 = _ext_build.source_hash([src], ["-O3"])
    assert h1 == _ext_build.source_hash([src], ["-O3"])
    assert h1 != _ext_build.source_hash([src], ["-O2"])
    assert h1 != _ext_build.source_hash([src], ["-O3"], extra="nvcc 13.1")
    src.write_text("__global__ void k() { }\n")
    assert h1 != _ext_build.source_hash([src], ["-O3"])


def test_cache_dir_honours_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAREUS_CACHE_DIR", str(tmp_path / "c"))
    assert _ext_build.cache_dir() == tmp_path / "c" / "ext"
    assert (tmp_path / "c" / "ext").is_dir()


def test_missing_sources_and_nvcc_are_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAREUS_EXT_DIR", str(tmp_path))
    with pytest.raises(C.ExtensionBuildError, match="KAREUS_EXT_DIR"):
        _ext_build.extension_source_dir("collectives")
    monkeypatch.setenv("KAREUS_NVCC", str(tmp_path / "no-nvcc"))
    assert _ext_build.find_nvcc() is None
    monkeypatch.delenv("KAREUS_EXT_DIR")
    with pytest.raises(C.ExtensionBuildError, match="nvcc not found"):
        _ext_build.build_shared_library("collectives")


@needs_nvcc
@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu(tmp_path: Path) -> None:
    obj = _ext_build.compile_object(CU_SOURCE, tmp_path / "k.o", arch="sm_90")
    data = obj.read_bytes()
    for kernel in (b"allreduce_oneshot", b"allreduce_twoshot", b"allgather", b"reducescatter",
                   b"allreduce_reg_onephase", b"allreduce_reg_twophase", b"allgather_reg",
                   b"reducescatter_reg"):
        assert kernel in data
    assert b"sm_90" in data


@needs_nvcc
@pytest.mark.slow
def test_shared_library_builds_once_loads_and_reports_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAREUS_CACHE_DIR", str(tmp_path))
    lib_path = _ext_build.build_shared_library("collectives", arch="sm_90")
    assert lib_path.is_file() and str(tmp_path) in str(lib_path)
    mtime = lib_path.stat().st_mtime_ns
    assert _ext_build.build_shared_library("collectives", arch="sm_90") == lib_path
    assert lib_path.stat().st_mtime_ns == mtime  # cache hit, no rebuild
    lib = ctypes.CDLL(str(lib_path))
    assert lib.kc_max_blocks() == C.OWN_MAX_BLOCKS
    assert lib.kc_max_ranks() == 8
    assert lib.kc_ipc_handle_bytes() == 64


def test_registered_all_reduce_algorithms() -> None:
    assert C.choose_registered_all_reduce_algorithm(64 * MIB, 4, "two_phase") == "two_phase"
    assert C.choose_registered_all_reduce_algorithm(64 * MIB, 4) in ("one_phase", "two_phase")
    with pytest.raises(C.CollectiveArgumentError, match="registered_algorithm"):
        C.choose_registered_all_reduce_algorithm(64 * MIB, 4, "two_shot")


def test_registered_staging_needs() -> None:
    # one-phase stores straight into the peers' tensors: no staging; two-phase: world chunks
    assert C.staging_bytes_needed("all_reduce", 10**6, 2, 4, "one_phase") == 0
    assert C.plan_pieces("all_reduce", 10**9, 2, 4, MIB, "one_phase") == [(0, 10**9)]
    assert C.staging_bytes_needed("all_reduce", 1000, 2, 4, "two_phase") == 4 * 256 * 2
    pieces = C.plan_pieces("all_reduce", 10**6, 2, 4, MIB, "two_phase")
    assert len(pieces) == 2 and sum(c for _, c in pieces) == 10**6


@pytest.mark.parametrize(("threads", "loads"), [(128, None), (None, 0), (None, 65)])
def test_build_options_are_checked(threads: int | None, loads: int | None) -> None:
    with pytest.raises(C.CollectiveArgumentError):
        C._build_defines(threads, loads)


def test_build_options_become_macros() -> None:
    assert C._build_defines(None, None) == {}
    assert C._build_defines(1024, 8) == {"KC_THREADS": 1024, "KC_INFLIGHT": 8}


# ------------------------------------------------- wrappers (launch arguments, no GPU)


class _Buf:
    """Stands in for a CUDA tensor: a size and an address."""

    def __init__(self, numel: int, ptr: int) -> None:
        self._numel, self._ptr = numel, ptr

    def numel(self) -> int:
        return self._numel

    def data_ptr(self) -> int:
        return self._ptr


def _own_without_gpu(monkeypatch: pytest.MonkeyPatch, registered: dict[int, list[int]]
                     ) -> tuple[C.OwnKernelCollective, list[tuple[object, ...]]]:
    """An OwnKernelCollective whose CUDA side is replaced by a log of launches."""
    monkeypatch.setattr(C, "_check_pair", lambda op, out, inp, world, dev: "bfloat16")
    own = object.__new__(C.OwnKernelCollective)
    own._closed, own._sm_count, own._max_blocks = False, 132, C.OWN_MAX_BLOCKS
    own._world, own._device, own._staging_bytes = 2, 0, C._MIB
    log: list[tuple[object, ...]] = []
    own._enter_stream = lambda stream: stream  # type: ignore[method-assign]
    own._registered_ptrs = lambda t: registered.get(t.data_ptr())  # type: ignore[method-assign]
    own._launch = lambda *a: log.append(("plain", *a))  # type: ignore[method-assign]
    own._launch_registered = lambda *a: log.append(("registered", *a))  # type: ignore[method-assign]
    return own, log


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_own_gather_and_scatter_launch_pieces_of_the_shard(op: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    own, log = _own_without_gpu(monkeypatch, {})
    m = 300_000  # bf16 shard: 2 x 600 kB does not fit 1 MiB of staging -> pieces
    shard, full = _Buf(m, 1 << 20), _Buf(2 * m, 1 << 30)
    out, inp = (full, shard) if op == "all_gather" else (shard, full)
    assert getattr(own, op)(out, inp, "s", 8) is out
    pieces = C.plan_pieces(op, m, 2, 2, C._MIB)
    assert len(pieces) > 1
    assert log == [("plain", op, "bfloat16", inp.data_ptr() + 2 * s, out.data_ptr() + 2 * s,
                    c, m, "", 8, "s") for s, c in pieces]


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_own_gather_and_scatter_use_registered_full_tensor(op: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    m = 1000
    shard, full = _Buf(m, 4096), _Buf(2 * m, 1 << 30)
    regs = [1 << 30, 1 << 31]
    # Only the full-size side (all-gather output, reduce-scatter input) counts as registered.
    own, log = _own_without_gpu(monkeypatch, {full.data_ptr(): regs, shard.data_ptr(): [1, 2]})
    out, inp = (full, shard) if op == "all_gather" else (shard, full)
    assert getattr(own, op)(out, inp, "s", 3) is out
    assert log == [("registered", op, "bfloat16", inp.data_ptr(), out.data_ptr(), regs, m, m, "",
                    3, "s")]
    log.clear()
    empty_shard = _Buf(0, 8)
    out, inp = (_Buf(0, 16), empty_shard) if op == "all_gather" else (empty_shard, _Buf(0, 16))
    assert getattr(own, op)(out, inp, "s", 3) is out and log == []

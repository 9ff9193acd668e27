"""Building the CUDA extensions (kareus.exec._ext_build): hashing, cache, messages; the
compile tests need nvcc and are skipped without it."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from kareus.exec import _ext_build
from kareus.exec import collectives as C

REPO = Path(__file__).resolve().parents[2]
CU_SOURCE = REPO / "ext" / "collectives" / "kareus_collectives.cu"
needs_nvcc = pytest.mark.skipif(_ext_build.find_nvcc() is None, reason="nvcc not installed")


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

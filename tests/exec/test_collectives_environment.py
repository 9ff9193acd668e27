"""Choosing a collective backend from a process group's environment
(kareus.exec.collectives._environment, ._mscclpp), and importing the package without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kareus.exec import collectives as C
from kareus.exec.collectives import _mscclpp

REPO = Path(__file__).resolve().parents[2]


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
    monkeypatch.setattr(_mscclpp, "mscclpp_available", lambda: False)
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

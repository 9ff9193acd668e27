"""kareus.exec.collectives._base and ._errors: the backend role's shared behaviour and the
collective errors, on any CPU (the backends' kernels are tested in test_collectives_gpu.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kareus.errors import ConfigError, HardwareError, InvalidSMCountError, KareusError
from kareus.exec import collectives as C


class _Capped(C.CollectiveBackend):
    """A backend of ``sm_count`` SMs whose ops only check and record their SM count."""

    name = "capped"

    def __init__(self, sm_count: int = 132, limit: int | None = None) -> None:
        self._sm_count, self._limit, self.calls, self.closed = sm_count, limit, [], 0

    @property
    def world_size(self) -> int:
        return 2

    @property
    def rank(self) -> int:
        return 0

    @property
    def sm_count(self) -> int:
        return self._sm_count

    @property
    def max_sms(self) -> int:
        return super().max_sms if self._limit is None else self._limit

    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        self.calls.append(("all_reduce", self._check_sms(sms)))
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        self.calls.append(("all_gather", self._check_sms(sms)))
        return output

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        self.calls.append(("reduce_scatter", self._check_sms(sms)))
        return output

    def close(self) -> None:
        self.closed += 1


class _Bound(C.CollectiveBackend):
    """A backend that states its group through the base class instead of overriding."""

    name = "bound"

    def __init__(self, *, bind: bool = True) -> None:
        if bind:
            self._bind(world_size=4, rank=3, device=1, sm_count=78)

    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        self._check_sms(sms)
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        return output

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        return output


def test_the_base_class_answers_for_a_bound_group():
    b = _Bound()
    assert (b.world_size, b.rank, b.sm_count, b.max_sms) == (4, 3, 78, 77)
    assert b.all_reduce("t", None, 77) == "t"
    with pytest.raises(C.CommSMCountError):
        b.all_reduce("t", None, 78)


def test_an_unbound_backend_says_what_to_implement():
    b = _Bound(bind=False)
    for prop in ("world_size", "rank", "sm_count"):
        with pytest.raises(NotImplementedError, match=r"_Bound .*self\._bind\(.*override world_size"):
            getattr(b, prop)


def test_a_collective_leaves_at_least_one_sm_to_computation():
    b = _Capped(sm_count=132)
    assert b.max_sms == 131
    assert b.all_reduce("t", None, 131) == "t"
    assert b.all_gather("o", "i", None, 1) == "o"
    assert b.calls == [("all_reduce", 131), ("all_gather", 1)]
    for bad in (0, 132, None, 2.0, True):
        with pytest.raises(C.CommSMCountError):
            b.reduce_scatter("o", "i", None, bad)


def test_a_backend_limit_is_named_in_the_error():
    b = _Capped(sm_count=132, limit=64)  # e.g. NCCL's MAXCHANNELS
    assert b.all_reduce("t", None, 64) == "t"
    with pytest.raises(C.CommSMCountError, match="1..64 for the capped backend, got 65"):
        b.all_reduce("t", None, 65)


def test_context_manager_closes_once():
    with _Capped() as b:
        assert b.closed == 0
    assert b.closed == 1


def test_error_hierarchy():
    assert issubclass(C.CommSMCountError, InvalidSMCountError)
    assert issubclass(C.CommSMCountError, ConfigError) and issubclass(C.CommSMCountError,
                                                                      ValueError)
    assert issubclass(C.CollectiveArgumentError, ValueError)
    for cls in (C.CollectiveUnavailableError, C.CollectiveLaunchError,
                C.NoCollectiveBackendError):
        assert issubclass(cls, HardwareError) and cls.exit_code == 1
    for cls in (C.CommSMCountError, C.CollectiveArgumentError, C.CollectiveUnavailableError):
        assert issubclass(cls, C.CollectiveError) and issubclass(cls, KareusError)


def test_no_backend_error_keeps_each_reason():
    exc = C.NoCollectiveBackendError({"own": "no peer access", "nccl_capped": "no max_ctas"})
    assert exc.reasons == {"own": "no peer access", "nccl_capped": "no max_ctas"}
    assert str(exc).startswith("no collective backend can run here (own: no peer access; "
                               "nccl_capped: no max_ctas).")
    assert "\n" not in str(exc)

"""kareus.exec.collectives._selection: building the first backend that can run on a group.

The backends themselves need torch.distributed; here they are replaced by recording stand-ins
so that what is checked is the choice, the arguments each gets and the refusals.
"""

from __future__ import annotations

from typing import Any

import pytest

from kareus.exec import collectives as C
from kareus.exec.collectives import _selection


class _Built:
    def __init__(self, name: str, **kwargs: Any) -> None:
        self.name, self.kwargs = name, kwargs


@pytest.fixture
def built(monkeypatch):
    classes = {name: (lambda n: (lambda **kw: _Built(n, **kw)))(name)
               for name in ("own", "nccl_capped", "mscclpp")}
    monkeypatch.setattr(_selection, "_BACKEND_CLASSES", classes)


def env(**kw: object) -> C.CollectiveEnvironment:
    base: dict[str, object] = {"world_size": 4, "sm_count": 132}
    base.update(kw)
    return C.CollectiveEnvironment(**base)  # type: ignore[arg-type]


def test_first_backend_that_can_run_gets_the_group_and_its_options(built):
    group = object()
    got = C.select_collective_backend(group=group, env=env(),
                                      options={"own": {"staging_bytes": 1 << 20}})
    assert (got.name, got.kwargs) == ("own", {"group": group, "staging_bytes": 1 << 20})
    got = C.select_collective_backend(env=env(peer_access=False))
    assert (got.name, got.kwargs) == ("nccl_capped", {"group": None})


def test_preference_order_is_followed(built):
    got = C.select_collective_backend(env=env(), prefer=("nccl_capped", "own"))
    assert got.name == "nccl_capped"


def test_mscclpp_needs_its_runners(built):
    ready = env(mscclpp_available=True)
    got = C.select_collective_backend(env=ready, prefer=("mscclpp", "nccl_capped"))
    assert got.name == "nccl_capped"  # no runners given: skipped
    runners = {"all_reduce": object()}
    got = C.select_collective_backend(env=ready, prefer=("mscclpp",),
                                      options={"mscclpp": {"runners": runners}})
    assert (got.name, got.kwargs["runners"]) == ("mscclpp", runners)


def test_no_backend_says_why_for_each(built):
    with pytest.raises(C.NoCollectiveBackendError) as info:
        C.select_collective_backend(env=env(peer_access=False, mscclpp_available=True),
                                    prefer=("own", "mscclpp"))
    msg = str(info.value)
    assert "own: the GPUs lack peer access" in msg
    assert "mscclpp: no runners given" in msg
    with pytest.raises(C.NoCollectiveBackendError, match="mscclpp: `import mscclpp` fails"):
        C.select_collective_backend(env=env(mscclpp_available=False), prefer=("mscclpp",),
                                    options={"mscclpp": {"runners": {}}})

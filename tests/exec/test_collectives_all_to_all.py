"""The all-to-all of the collective backends (a mixture of experts' dispatch and combine):
its split validation, the backends that refuse it in one line, the loopback stand-in's data,
and the process-group backend over two gloo processes on the CPU (uneven splits, a rank
sending nothing, each dtype), against the rows every rank knows it should receive.

The NCCL capped backend is checked on GPUs (tests/exec/test_collectives_all_to_all_gpu.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from kareus.exec import collectives as C

# ------------------------------------------------------------------------ validation


def test_valid_splits_come_back_as_int_lists():
    np = pytest.importorskip("numpy")
    assert C.validate_splits([1, 0, 2], (np.int64(3), 0, 0), world_size=3, output_rows=3,
                             input_rows=3) == ([1, 0, 2], [3, 0, 0])


@pytest.mark.parametrize(("outs", "ins", "match"), [
    ([1, 2], [3, 0, 0], "output_splits must list one row count per rank \\(3\\), got 2"),
    ([1, 1, 1], [3, 0, 1], "input_splits sum to 4 rows, the tensor has 3"),
    ([1, -1, 3], [3, 0, 0], "whole row counts >= 0"),
    ([1, 1.0, 1], [3, 0, 0], "whole row counts >= 0"),
    ([True, 1, 1], [3, 0, 0], "whole row counts >= 0"),
    ("abc", [3, 0, 0], "must be a list of row counts"),
])
def test_bad_splits_are_one_line_errors(outs, ins, match):
    with pytest.raises(C.CollectiveArgumentError, match=match) as err:
        C.validate_splits(outs, ins, world_size=3, output_rows=3, input_rows=3)
    assert "\n" not in str(err.value)


def test_tensor_checks_name_what_differs():
    torch = pytest.importorskip("torch")
    from kareus.exec.collectives._base import _check_all_to_all

    with pytest.raises(C.CollectiveArgumentError, match="rows of input"):
        _check_all_to_all(torch.zeros(2, 4), torch.zeros(2, 3), [1, 1], [1, 1], 2, None)
    with pytest.raises(C.CollectiveArgumentError, match="one dtype"):
        _check_all_to_all(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16),
                          [1, 1], [1, 1], 2, None)
    with pytest.raises(C.CollectiveArgumentError, match="contiguous"):
        _check_all_to_all(torch.zeros(4, 2).t(), torch.zeros(2, 4), [1, 1], [1, 1], 2, None)


# ------------------------------------------------------------------ refusing backends


class _NoAllToAll(C.CollectiveBackend):
    name = "older"

    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        return output

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        return output


def test_a_backend_without_all_to_all_refuses_in_one_line():
    with pytest.raises(C.CollectiveUnavailableError, match="older collective backend runs no "
                       "all-to-all; use nccl_capped"):
        _NoAllToAll().all_to_all(None, None, [0], [0], None, 4)


def test_own_kernels_refuse_all_to_all():
    own = C.OwnKernelCollective.__new__(C.OwnKernelCollective)  # nothing built: no GPU here
    with pytest.raises(C.CollectiveUnavailableError, match="own collective kernels have no "
                       "all-to-all yet.*use nccl_capped"):
        own.all_to_all(None, None, [0, 0], [0, 0], None, 8)


def test_every_backend_that_runs_it_says_so():
    for cls in (C.NCCLCappedCollective, C.ProcessGroupCollective, C.LoopbackCollective):
        assert cls.all_to_all is not C.CollectiveBackend.all_to_all


# ------------------------------------------------------------------- loopback's data


def test_loopback_rows_repeat_the_sent_rows():
    torch = pytest.importorskip("torch")
    from kareus.exec.collectives._loopback import cycle_rows

    inp = torch.arange(6.0).view(3, 2)
    out = torch.full((7, 2), -1.0)
    cycle_rows(torch, out, inp)
    assert out[:, 0].tolist() == [0, 2, 4, 0, 2, 4, 0]
    same = torch.empty(3, 2)
    assert torch.equal(cycle_rows(torch, same, inp), inp)  # one rank: a copy
    short = torch.empty(2, 2)
    assert torch.equal(cycle_rows(torch, short, inp), inp[:2])
    assert float(cycle_rows(torch, torch.ones(2, 2), torch.zeros(0, 2)).abs().sum()) == 0


# ------------------------------------------------------------- gloo, two processes


def _sent(torch: Any, src: int, dst: int, rows: int, width: int, dtype: Any) -> Any:
    """The rows rank ``src`` sends rank ``dst``: values naming both and the row."""
    r = torch.arange(rows, dtype=torch.float32).unsqueeze(1)
    c = torch.arange(width, dtype=torch.float32).unsqueeze(0)
    return (1000 * src + 100 * dst + r + c / 16).to(dtype)


#: rows rank s sends rank d, per case: uneven, one rank sending nothing, nobody sending
CASES = {"uneven": [[3, 5], [2, 0]], "empty_rank": [[0, 0], [4, 1]], "nothing": [[0, 0], [0, 0]]}


def _worker() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    coll = C.ProcessGroupCollective()
    width = 6
    for dtype in (torch.float32, torch.bfloat16):
        for name, table in CASES.items():
            ins = [table[rank][d] for d in range(world)]
            outs = [table[s][rank] for s in range(world)]
            inp = torch.cat([_sent(torch, rank, d, ins[d], width, dtype) for d in range(world)])
            out = torch.full((sum(outs), width), float("nan"), dtype=dtype)
            assert coll.all_to_all(out, inp, outs, ins, None, None) is out
            want = torch.cat([_sent(torch, s, rank, outs[s], width, dtype)
                              for s in range(world)])
            assert torch.equal(out, want), (name, dtype, rank)
    try:  # wrong splits: refused before anything is sent (the same on both ranks)
        coll.all_to_all(torch.zeros(3, 2), torch.zeros(3, 2), [1, 1], [3, 0], None, None)
    except C.CollectiveArgumentError as e:
        assert "output_splits sum to 2 rows" in str(e)
    else:
        raise AssertionError("bad splits were not refused")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} ok")


def test_process_group_all_to_all_over_two_gloo_ranks():
    pytest.importorskip("torch")
    from _helpers import run_gloo_ranks

    run_gloo_ranks(__file__)


if __name__ == "__main__":
    _worker()

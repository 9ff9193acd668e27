"""The outside work's byte-moving stand-in fills its buffers in chunks small enough for
CUDA's 32-bit-indexed random kernels."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kareus.exec import outside_work


@pytest.mark.parametrize("nbytes", [8, 13, 8 * 40 + 5, 8 * 64])
def test_random_bytes_fills_every_chunk(monkeypatch, nbytes):
    monkeypatch.setattr(outside_work, "_FILL_CHUNK", 16)  # words per random_ call
    calls = []
    real = torch.Tensor.random_

    def counted(self, *args, **kwargs):
        calls.append(self.numel())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "random_", counted)
    gen = torch.Generator().manual_seed(0)
    out = outside_work._random_bytes(torch, nbytes, gen, "cpu")
    assert out.dtype == torch.uint8 and out.numel() == nbytes
    words = nbytes // 8
    assert max(calls) <= 16
    assert sum(calls) == words + (nbytes - 8 * words)
    # every 8-byte word drawn (a zero word among 64-bit draws is practically impossible)
    assert (out[: 8 * words].view(torch.int64) != 0).all()



def test_sequence_parallel_outside_work_runs_its_tp_collectives_on_the_tp_group():
    # Under sequence parallelism the embedding's output is reduce-scattered and the final
    # norm's all-gathered over TP: kinds a GroupedCollective sends to CP unless the
    # collective names its group (here CP = 1: there is no CP backend at all).
    import torch

    from kareus.exec.executor import RecordingStreamBackend, TorchExecutor
    from kareus.exec.outside_work import RunnableOutsideWork
    from kareus.exec.train import GroupedCollective, LoopbackGroupCollective
    from kareus.model import ModelArch, Parallelism, Workload, build_partitions

    m = ModelArch(name="tiny", layers=2, hidden=64, heads=8, kv_heads=4, head_dim=8, ffn=128,
                  vocab=512)
    wl = Workload(model=m, parallelism=Parallelism(tp=4, sp=True), microbatch_size=2,
                  seq_len=64, num_microbatches=2, nanobatches=2)
    tp = LoopbackGroupCollective(group_size=4)
    ex = TorchExecutor(collective=GroupedCollective(tp=tp, cp=None),
                       streams=RecordingStreamBackend())
    ex.empty = lambda shape, dtype, **kw: torch.zeros(shape, dtype=dtype)  # on the CPU
    work = build_partitions(wl).outside[(0, "fwd")]
    prog = RunnableOutsideWork(work, wl, dtype="float32").build(device="cpu", collective=ex)
    with torch.no_grad():
        prog.run_plain()
    assert {k for k, _, _ in tp.calls} == {"reduce_scatter", "all_gather"}
    assert prog.state["xns"].shape[0] * 4 == prog.state["xn"].shape[0]  # norm on the shard


@pytest.mark.parametrize("tp", [2, 4])
def test_the_iteration_s_gradient_reduction_over_cp_runs_on_the_cp_group(tp):
    # CP = 2, DP = 1: the iteration's reduce-scatter of the fp32 gradients and all-gather
    # of the bf16 weights run over the CP group (Megatron-Core's dp_cp group is the CP
    # group here), whatever the TP group's size; on one process the loopback stand-in runs
    # them, nothing left out.
    import torch

    from kareus.exec.executor import RecordingStreamBackend, TorchExecutor
    from kareus.exec.outside_work import RunnableOutsideWork
    from kareus.exec.train import GroupedCollective, LoopbackGroupCollective
    from kareus.model import ModelArch, Parallelism, Workload, build_partitions
    from kareus.model.partition import stage_params_per_rank

    m = ModelArch(name="tiny", layers=2, hidden=64, heads=8, kv_heads=4, head_dim=8, ffn=128,
                  vocab=512)

    def run(par):
        wl = Workload(model=m, parallelism=par, microbatch_size=2, seq_len=64,
                      num_microbatches=2, nanobatches=2)
        tpc, cpc = LoopbackGroupCollective(group_size=tp), LoopbackGroupCollective(group_size=2)
        ex = TorchExecutor(collective=GroupedCollective(tp=tpc, cp=cpc),
                           streams=RecordingStreamBackend())
        ex.empty = lambda shape, dtype, **kw: torch.zeros(shape, dtype=dtype)  # on the CPU
        work = build_partitions(wl).iteration
        runnable = RunnableOutsideWork(work, wl, dtype="bfloat16")
        prog = runnable.build(device="cpu", collective=ex)
        with torch.no_grad():
            prog.run_plain()
        return wl, work, runnable, tpc, cpc

    wl, work, runnable, tpc, cpc = run(Parallelism(tp=tp, cp=2))
    assert [c.name for c in work.comms] == ["cp_grad_reduce_scatter", "cp_param_all_gather"]
    assert runnable.left_out == [] and tpc.calls == []
    n = int(stage_params_per_rank(wl))
    # bf16 elements of the fp32 gradients' bytes (4 n) and of the gathered bf16 weights
    # (2 n), in the order the iteration runs them (the last run's calls).
    assert [(k, e) for k, e, _ in cpc.calls[-2:]] == [("reduce_scatter", 2 * n),
                                                      ("all_gather", n)]
    # DP = 2: a group of DP x CP = 4 GPUs this stage's groups do not have: left out, listed.
    _, work, runnable, tpc, cpc = run(Parallelism(tp=tp, cp=2, dp=2))
    assert [c.group_size for c in work.comms] == [4, 4]
    assert len(runnable.left_out) == 2 and "a group of 4" in runnable.left_out[0]
    assert tpc.calls == cpc.calls == []


def test_unchained_layers_outside_work_is_refused_on_the_gpu_path_in_one_line():
    # a workload of unchained layers costs each layer's bare first unit as outside work:
    # the GPU path has no kernels for it yet, and says so
    from kareus.errors import ArgumentError
    from kareus.exec.outside_work import RunnableOutsideWork
    from kareus.model import Workload, build_partitions

    wl = Workload.preset("qwen3-1.7b", tp=2, chained_layers=False)
    work = build_partitions(wl).outside[(0, "fwd")]
    with pytest.raises(ArgumentError, match="unchained layers") as err:
        RunnableOutsideWork(work, wl)
    assert "\n" not in str(err.value)
    chained = wl.with_(chained_layers=True)
    RunnableOutsideWork(build_partitions(chained).outside[(0, "fwd")], chained)

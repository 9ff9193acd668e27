"""The mixture-of-experts kernels on a GPU: ``torch._grouped_mm`` is the path on sm90+ in
bfloat16 and agrees with the matmul loop and a float64 product (empty experts included);
the whole MoE block in bfloat16 against float64 autograd; the ops a captured step runs
(router, top-k, permutation, sort by local expert, grouped GEMMs with device counts,
un-permutation and the backward) capture in a CUDA graph and replay to the eager result;
every MoE partition type builds and runs graphed through the executor with the loopback
all-to-all. Skipped without CUDA::

    python -m pytest -q -m gpu tests/exec/test_kernels_moe_gpu.py
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kareus.exec.kernels import TorchKernels

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def rel(a, ref):
    return float((a.double() - ref.double()).norm() / ref.double().norm())


class _Loop(TorchKernels):
    grouped_gemm = "loop"


@pytest.mark.skipif(not SM90, reason="torch._grouped_mm's production path needs sm90+")
@pytest.mark.parametrize(("rows", "h", "f", "counts"), [
    (131072, 2048, 1536, [8192] * 16),  # qwen3-30b-a3b at EP=8, gate/up
    (4099, 1024, 512, [1000, 0, 3000, 99]),  # uneven, an empty expert
])
def test_grouped_mm_is_the_path_and_agrees_with_the_loop(rows, h, f, counts):
    ks, loop = TorchKernels(), _Loop()
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(len(counts), h, f, device="cuda") * h ** -0.5).to(torch.bfloat16)
    dy = torch.randn(rows, f, device="cuda", dtype=torch.bfloat16)
    assert ks.grouped_mm_path(x, w) == "grouped_mm"
    dev = torch.tensor(counts, device="cuda")
    got = ks.grouped_mm(x, w, dev)
    want = loop.grouped_mm(x, w, counts)
    ref = torch.cat([x[s:s + n].double() @ w[g].double() for g, (s, n) in
                     enumerate(zip([0, *torch.tensor(counts).cumsum(0).tolist()[:-1]],
                                   counts, strict=True)) if n])
    assert rel(got, ref) < 1e-2 and rel(want, ref) < 1e-2
    dgrad = ks.grouped_mm(dy, w.transpose(1, 2), dev)
    assert rel(dgrad, loop.grouped_mm(dy, w.transpose(1, 2), counts)) < 1e-2
    dw = ks.grouped_mm_wgrad(x, dy, dev)
    dw_loop = loop.grouped_mm_wgrad(x, dy, counts)
    for g, n in enumerate(counts):
        if n:
            assert rel(dw[g], dw_loop[g]) < 1e-2
        else:
            assert float(dw[g].abs().max()) == 0.0


def test_bf16_block_on_the_gpu_close_to_float64():
    from moe_block import dense_reference, make, moe_block

    ks = TorchKernels()
    xs, wr, w1, w2, dout = make(5, ranks=2, t=256, h=256, E=8, fe=128, empty=(3,))
    lo = ([x.bfloat16().cuda() for x in xs], wr.float().cuda(), w1.bfloat16().cuda(),
          w2.bfloat16().cuda(), [d.bfloat16().cuda() for d in dout])
    got = moe_block(ks, *lo, k=2, ep=2, router_dtype="float32")
    ref = dense_reference(*[[t.cpu() for t in v] if isinstance(v, list) else v.cpu()
                            for v in lo], k=2)
    for g, r in zip(got[0] + got[1], ref[0] + ref[1], strict=True):
        assert rel(g.cpu(), r) < 2e-2
    for g, r in zip(got[2:], ref[2:], strict=True):
        assert rel(g.cpu(), r) < 2e-2


def test_a_moe_step_captures_in_a_cuda_graph():
    ks = TorchKernels()
    t, h, E, k, fe, ep = 512, 256, 8, 2, 128, 2
    L = E // ep
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    wr = torch.randn(h, E, device="cuda") * 0.1
    w1 = (torch.randn(L, h, 2 * fe, device="cuda") * h ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(L, fe, h, device="cuda") * fe ** -0.5).to(torch.bfloat16)
    rows = t * k
    table = torch.tensor([[rows // (ep * L)] * L] * ep, device="cuda")  # received counts
    local = table.sum(0)
    counts = local if ks.grouped_mm_path(x, w1) == "grouped_mm" else local.tolist()
    dout = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)

    def step():
        probs, idx = ks.router_topk(ks.router(x, wr), k)
        sent, perm = ks.permute(x, idx, experts=E, ep=ep)
        xs = ks.expert_sort(sent, table)  # the all-to-all stands aside: rows as received
        h1 = ks.grouped_mm(xs, w1, counts)
        a = ks.expert_swiglu(h1)
        y = ks.expert_unsort(ks.grouped_mm(a, w2, counts), table)
        out = ks.unpermute(y, probs, perm)
        drows, dprobs = ks.unpermute_bwd(dout, y, probs, perm)
        dy = ks.expert_unsort_bwd(drows, table)
        da = ks.grouped_mm(dy, w2.transpose(1, 2), counts)
        dw2 = ks.grouped_mm_wgrad(a, dy, counts)
        dh = ks.expert_swiglu_bwd(da, h1)
        dx = ks.permute_bwd(ks.expert_sort_bwd(ks.grouped_mm(dh, w1.transpose(1, 2), counts),
                                               table), perm)
        dlogits = ks.router_topk_bwd(dprobs, probs, idx, E)
        return out, dx + ks.router_dgrad(dlogits, wr, dtype=x.dtype), dw2

    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up off the default stream, as capture needs
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured, strict=True):
        assert torch.equal(a, b)


def test_every_moe_partition_runs_graphed_with_the_loopback_all_to_all():
    from kareus.exec import LoopbackCollective, TorchExecutor, runnable_partitions
    from kareus.model.config import ScheduleConfig
    from kareus.model.workload import Workload
    from kareus.profilers.nvml import TorchPartitionRunner

    wl = Workload.preset("qwen3-30b-a3b", dp=8, ep=8, microbatch_size=2, seq_len=2048,
                         routing_imbalance=1.25)
    coll = LoopbackCollective()
    ex = TorchExecutor(collective=coll, graphs=True)
    runner = TorchPartitionRunner(ex, seed=3)
    parts = runnable_partitions(wl)
    assert any(p.comm_op.kind.value == "all_to_all" for p in parts.values())
    for part in parts.values():
        step = runner.prepare(part, ScheduleConfig(1980, 16, part.slots[0].name))
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        prog = runner.program(part)
        assert torch.isfinite(prog.comm_tensor.float()).all(), part.name
    runner.release()

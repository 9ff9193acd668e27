"""The planned layer rotating RoPE at per-token positions (packed documents: positions that
restart at each document), against the autograd reference layer at the same positions:
on the CPU in float64 with float32 RoPE angles (the baselines' schedules, Llama's and
Qwen3's layer, each recomputation policy), with attention masking those documents too
(torchtitan's block_causal), and on a GPU in bf16 with the production kernels (skipped
without CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _helpers import assert_runs_close, needs_cuda, rel_error, warm_up_on_a_side_stream
from _reference import full_weights, planned_weights, reference_run, shard, workload

from kareus.errors import WorkloadError
from kareus.exec.train import LoopbackGroups
from kareus.integrations import PlanApplier


def _packed(b: int, s: int, starts: tuple[int, ...]) -> torch.Tensor:
    """Positions of ``b`` sequences of ``s`` tokens, a document starting at each of
    ``starts`` (row ``r`` shifted by ``r``, so rows differ)."""
    rows = []
    for r in range(b):
        cuts = sorted({0, *((c + r) % s for c in starts)})
        pos = torch.cat([torch.arange(e - a) for a, e in zip(cuts, [*cuts[1:], s])])
        rows.append(pos)
    return torch.stack(rows)


#: float64 against float64 (the RoPE angles float32 on both sides)
_FLOAT64 = {"rtol": 1e-6, "atol": 2e-6}


def _float64_batch(wl, seed: int, starts: tuple[int, ...]):
    """A float64 input, the loss's weights ``c`` and packed positions (documents starting
    at ``starts``) of one microbatch of ``wl``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(wl.microbatch_size, wl.seq_len, wl.model.hidden, generator=g,
                    dtype=torch.float64)
    c = torch.randn(x.shape, generator=g, dtype=torch.float64)
    return x, c, _packed(wl.microbatch_size, wl.seq_len, starts)


def _bf16_batch(wl):
    """On the GPU, in bf16: the layer's weights (seed 2), an input and the loss's weights
    ``c`` (seed 1), and packed positions, of one microbatch of 4 sequences of 256 tokens."""
    dev = torch.device("cuda")
    w = {k: v.to(dev, torch.bfloat16) for k, v in full_weights(wl.model, 2).items()}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 256, wl.model.hidden, generator=g).to(dev, torch.bfloat16)
    c = torch.randn(4, 256, wl.model.hidden, generator=g).to(dev, torch.bfloat16)
    return w, x, c, _packed(4, 256, (37, 100, 190)).to(dev)


def _run(applier, x, w, positions, c, documents=False):
    x = x.clone().requires_grad_(True)
    p = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    y = applier.layer()(x, planned_weights(p, applier.workload.model), positions=positions,
                        documents=documents)
    (y * c).sum().backward()
    return y.detach(), x.grad, {k: v.grad for k, v in p.items()}


@pytest.mark.parametrize("qk", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("schedule", ["sequential", "nanobatching"])
def test_positions_rotate_as_the_reference_float64(schedule, qk):
    wl = workload(qk=qk)
    arch = wl.model
    w = {k: v.double() for k, v in full_weights(arch, 2).items()}
    x, c, pos = _float64_batch(wl, 1, (5, 11))
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule=schedule,
                          kernels="torch", eps=arch.norm_eps)
    got = _run(applier, x, w, pos, c)
    # (the RoPE angles are float32 on both sides: ~1e-7, as at positions 0 .. seq - 1)
    assert_runs_close(got, reference_run(x, w, arch, c, positions=pos), **_FLOAT64)
    # and the positions matter
    y0, _, _ = _run(applier, x, w, None, c)
    assert not torch.allclose(y0, got[0])


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("qk", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("schedule", ["sequential", "nanobatching"])
def test_documents_masked_as_the_reference_float64(schedule, qk, recompute):
    # each token attends to the earlier tokens of its own document only (a document starts
    # where its position is 0), as torchtitan's FlexAttention / VarlenAttention block_causal
    wl = workload(qk=qk, recompute=recompute)
    arch = wl.model
    w = {k: v.double() for k, v in full_weights(arch, 2).items()}
    x, c, pos = _float64_batch(wl, 3, (4, 9, 13))
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule=schedule,
                          kernels="torch", eps=arch.norm_eps)
    got = _run(applier, x, w, pos, c, documents=True)
    want = reference_run(x, w, arch, c, positions=pos, documents=True)
    assert_runs_close(got, want, **_FLOAT64)
    # the mask matters: causal over the whole sequence differs
    y_causal, _, _ = _run(applier, x, w, pos, c)
    assert not torch.allclose(y_causal, got[0])


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_plan_for_packed_documents_runs_them_masked(recompute):
    # a plan costed for packed documents (Workload.document_tokens) applies to layers that
    # mask them: the plan's schedule gives the baseline's values (float64, TP = 2 stood in
    # by one process); a plan costed for causal attention over whole sequences is refused
    # where the layers mask documents, and a plan of one document setting for a job of
    # another, each in one line
    from kareus.errors import PlanError
    from kareus.testing import RecordingExecutor, make_workload_plan

    wl = workload(2, recompute=recompute).with_(document_tokens=5)
    arch = wl.model
    w = {k: v.double() for k, v in shard(full_weights(arch, 2), arch, 2, 0).items()}
    x, c, pos = _float64_batch(wl, 4, (4, 9, 13))
    plan = make_workload_plan(wl, sms=8)
    assert plan.workload["document_tokens"] == 5

    def run(applier):
        xg = x.clone().requires_grad_(True)
        p = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        with applier.microbatch(0, "fwd"):
            y = applier.layer()(xg, planned_weights(p, arch), positions=pos, documents=True)
        with applier.microbatch(0, "bwd"):
            (y * c).sum().backward()
        return y.detach(), xg.grad, {k: v.grad for k, v in p.items()}

    def applier(plan, job=wl):
        return PlanApplier(workload=job, groups=LoopbackGroups(tp=2), plan=plan,
                           executor=RecordingExecutor(plan=plan) if plan else None,
                           baseline=RecordingExecutor(),
                           schedule=None if plan else "sequential", kernels="torch",
                           eps=arch.norm_eps, record=True)

    planned = applier(plan)
    got = run(planned)
    assert any(ph == "bwd" for ph, _, _ in planned.partitions_run)
    assert_runs_close(got, run(applier(None)))
    causal = wl.with_(document_tokens=None)
    with pytest.raises(PlanError, match="document_tokens") as err:
        run(applier(make_workload_plan(causal, sms=8), causal))
    assert "\n" not in str(err.value)
    with pytest.raises(PlanError, match="document_tokens: plan 5, job 7"):
        applier(plan, wl.with_(document_tokens=7))
    with pytest.raises(PlanError, match="document_tokens: plan 5, job None"):
        applier(plan, causal)


def test_the_document_mask_is_built_once_per_batch():
    # every layer of one forward (and the backward's re-run) gets the same positions
    # tensor: its DocumentMask is built once and shared; a changed or new tensor gets its own
    wl = workload(recompute="full")
    arch = wl.model
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule="nanobatching",
                          kernels="torch", eps=arch.norm_eps)
    ws = [planned_weights({k: v.clone().requires_grad_(True)
                           for k, v in full_weights(arch, seed).items()}, arch)
          for seed in (1, 2)]
    x = torch.randn(wl.microbatch_size, wl.seq_len, arch.hidden, requires_grad=True)
    pos = _packed(wl.microbatch_size, wl.seq_len, (4, 9, 13))
    built = []
    real = applier._document_mask

    def spy(given, positions, device):
        docs = real(given, positions, device)
        built.append(docs)
        return docs

    applier._document_mask = spy
    layer = applier.layer()
    y = layer(layer(x, ws[0], positions=pos, documents=True), ws[1], positions=pos,
              documents=True)
    y.sum().backward()  # full recomputation: each layer's forward re-run, masked again
    assert len(built) == 4 and all(d is built[0] for d in built)
    pos.add_(0)  # written since: built again
    layer(x, ws[0], positions=pos, documents=True)
    assert built[-1] is not built[0]
    layer(x, ws[0], positions=pos.clone(), documents=True)  # another tensor
    assert built[-1] is not built[-2]


def test_positions_must_match_the_batch():
    wl = workload()
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule="sequential",
                          kernels="torch", eps=wl.model.norm_eps)
    w = full_weights(wl.model, 2)
    x = torch.randn(wl.microbatch_size, wl.seq_len, wl.model.hidden)
    with pytest.raises(WorkloadError, match="positions of shape"):
        applier.layer()(x, planned_weights(w, wl.model), positions=torch.zeros(3, 3))


@needs_cuda
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("qk", [False, True], ids=["llama", "qwen3"])
def test_positions_on_the_gpu_kernels_bf16(qk, documents):
    # the production kernels (Triton RoPE) given per-token tables: as close to the fp32
    # reference at those positions as bf16 allows
    wl = workload(qk=qk, mbs=4, seq=256)
    arch = wl.model
    w, x, c, pos = _bf16_batch(wl)
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule="nanobatching",
                          eps=arch.norm_eps)
    y, dx, _ = _run(applier, x, w, pos, c, documents=documents)
    yr, dxr, _ = reference_run(x, w, arch, c.float(), dtype=torch.float32, positions=pos,
                               documents=documents)
    for got, want, what in ((y, yr, "output"), (dx, dxr, "input gradient")):
        err = rel_error(got, want)
        assert err < 2e-2, f"{what}: relative error {err:.3g}"


@needs_cuda
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_flex_documents_in_planned_layers_equal_the_dense_mask_bf16(recompute):
    # the planned layer's block-sparse path (compiled FlexAttention, heads of 32) against
    # its dense-mask path on the same bf16 inputs: output and every gradient
    from kareus.exec.kernels import TorchKernels

    wl = workload(qk=True, mbs=4, seq=256, head_dim=32, recompute=recompute)
    arch = wl.model
    w, x, c, pos = _bf16_batch(wl)
    runs = {}
    for backend in ("flex", "mask"):
        ks = TorchKernels()
        ks.documents_backend = backend
        applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1),
                              schedule="nanobatching", kernels=ks, eps=arch.norm_eps)
        runs[backend] = _run(applier, x, w, pos, c, documents=True)

    (y, dx, dw), (ym, dxm, dwm) = runs["flex"], runs["mask"]
    assert rel_error(y, ym) < 1e-2 and rel_error(dx, dxm) < 2e-2
    for k in dw:
        assert rel_error(dw[k], dwm[k]) < 2e-2, k


@needs_cuda
@pytest.mark.parametrize("documents,head_dim", [(False, 8), (True, 8), (True, 32)],
                         ids=["causal", "documents-dense-mask", "documents-flex"])
def test_positions_inside_an_enclosing_capture_follow_each_replay(documents, head_dim):
    # torchtitan's step capture: one forward-backward warmed up eagerly (here on plain
    # positions), captured on one batch's positions and replayed on another's, copied into
    # the captured tensors. The replay must rotate (and mask) by the copied positions:
    # equal to eager execution on them, to bf16 rounding. Heads of 8 attend through the
    # dense mask (FlexAttention's GPU kernel takes 16 and more), of 32 through compiled
    # FlexAttention, its block mask built inside the capture.
    wl = workload(qk=True, mbs=4, seq=256, head_dim=head_dim)
    arch = wl.model
    dev = torch.device("cuda")
    p = {k: v.to(dev, torch.bfloat16).requires_grad_(True)
         for k, v in full_weights(arch, 2).items()}
    g = torch.Generator().manual_seed(1)
    x_new = torch.randn(4, 256, arch.hidden, generator=g).to(dev, torch.bfloat16)
    pos_new = _packed(4, 256, (37, 100, 190)).to(dev)

    def step(applier, x, pos):
        y = applier.layer()(x, planned_weights(p, arch), positions=pos, documents=documents)
        y.float().square().mean().backward()
        return y.detach()

    eager = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule="nanobatching",
                        eps=arch.norm_eps, graphs=False)
    xe = x_new.clone().requires_grad_(True)
    want_y = step(eager, xe, pos_new)
    want = {k: v.grad.clone() for k, v in p.items()}

    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule="nanobatching",
                          eps=arch.norm_eps)
    x = torch.randn(4, 256, arch.hidden, generator=g).to(dev, torch.bfloat16)
    x.requires_grad_(True)
    pos = torch.arange(256, device=dev).expand(4, 256).clone()  # plain, as a warm-up may be
    for t in [*p.values(), x]:
        t.grad = torch.zeros_like(t)

    def body():
        for t in [*p.values(), x]:
            t.grad.zero_()
        return step(applier, x, pos)

    warm_up_on_a_side_stream(body)
    pos.copy_(_packed(4, 256, (11, 64)).to(dev))  # the captured batch's own documents
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_y = body()
    with torch.no_grad():
        x.copy_(x_new)
        pos.copy_(pos_new)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(got_y, want_y) < 2e-2
    assert rel_error(x.grad, xe.grad) < 2e-2
    for k in want:
        assert rel_error(p[k].grad, want[k]) < 2e-2, k

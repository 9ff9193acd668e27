"""Runnable partitions on the CPU: communication buffers come from the backend's ``empty``.

A backend that offers ``empty(shape, dtype)`` (the own kernels' registered memory) must
be asked for every tensor the partition's collective touches, in the same order on
every rank, and the executed results must not change. The partitions run on the CPU
through :class:`TorchExecutor` on a recording fake device; the fake collectives do
their arithmetic on the host. Skipped without torch.
"""

from __future__ import annotations

import attrs
import pytest

torch = pytest.importorskip("torch")

from kareus.exec.executor import RecordingStreamBackend, TorchExecutor
from kareus.exec.torch_partition import (
    RunnableTransformerPartition,
    runnable_partitions,
)
from kareus.model.config import ScheduleConfig
from kareus.model.workload import ModelArch, Parallelism, Workload
from kareus.profilers.nvml import TorchPartitionRunner
from kareus.testing import RecordingCollective

GROUP = 2  # the fake collectives act as a group of two identical ranks


def tiny_workload(cp: int = 1) -> Workload:
    m = ModelArch(name="tiny", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64,
                  ffn=512, vocab=1000)
    return Workload(model=m, parallelism=Parallelism(tp=2, cp=cp), microbatch_size=2,
                    seq_len=128, nanobatches=2)


# (workload's CP, partition): every collective kind, with and without ops writing the buffer.
CASES = [(1, "fwd_attn"), (1, "bwd_mlp"), (2, "fwd_attn_in_ag"), (2, "bwd_attn_out_rs"),
         (2, "fwd_mlp")]


class HostCollective(RecordingCollective):
    """Collectives of a group whose ranks all hold the same data, computed on the host:
    all-reduce doubles, all-gather repeats the shard, reduce-scatter adds the blocks."""

    def __init__(self) -> None:
        super().__init__(world_size=GROUP)

    def all_reduce(self, tensor, stream, sms):
        tensor.mul_(GROUP)
        return tensor

    def all_gather(self, output, input, stream, sms):
        output.view(GROUP, -1).copy_(input.view(1, -1).expand(GROUP, -1))
        return output

    def reduce_scatter(self, output, input, stream, sms):
        output.view(-1).copy_(input.view(GROUP, -1).sum(0))
        return output


class AllocatingCollective(HostCollective):
    """Offers ``empty``, as OwnKernelCollective does; hands out NaN-filled memory so that
    a buffer the partition forgets to zero shows up in the results."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[int, ...], object]] = []  # type: ignore[assignment]
        self.given: list[object] = []

    def empty(self, shape, dtype):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.calls.append((shape, dtype))
        t = torch.full(shape, float("nan"), dtype=dtype)
        self.given.append(t)
        return t

    def is_registered(self, tensor) -> bool:
        return any(tensor.data_ptr() == g.data_ptr() for g in self.given)


def reference_collective(prog) -> None:
    """What the host collective does to the program's current communication tensors."""
    coll = HostCollective()
    if prog.comm_kind == "all_reduce":
        coll.all_reduce(prog.comm_tensor, None, None)
    else:
        getattr(coll, prog.comm_kind)(prog.comm_output, prog.comm_tensor, None, None)


def seed_inputs(prog, seed: int) -> None:
    """All-gather / reduce-scatter inputs are not written by the ops: give them data."""
    if prog.comm_kind == "all_reduce":
        return
    g = torch.Generator().manual_seed(seed)
    for step in range(2):
        buf = prog._buffers[step]
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))


def buffers(prog) -> list[object]:
    return [*prog._buffers, *prog._comm_outputs]


@pytest.mark.parametrize(("cp", "name"), CASES)
def test_backend_empty_is_asked_for_every_communication_buffer(cp, name):
    part = runnable_partitions(tiny_workload(cp), [name])[name]
    coll = AllocatingCollective()
    prog = part.build(device="cpu", seed=3, collective=coll)
    plain = part.build(device="cpu", seed=3)
    # Inputs first, then outputs: a fixed order, the same on every rank.
    assert coll.calls == [(tuple(b.shape), b.dtype) for b in buffers(plain)]
    assert [b.data_ptr() for b in buffers(prog)] == [t.data_ptr() for t in coll.given]
    assert all(coll.is_registered(b) for b in buffers(prog))
    assert coll.is_registered(prog.comm_tensor)
    if prog.comm_output is not None:
        assert coll.is_registered(prog.comm_output)
    # Zeroed as torch.zeros would be, and the materialising run wrote the same data.
    for a, b in zip(buffers(prog), buffers(plain)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("cp", "name"), CASES)
def test_executed_results_do_not_change_with_backend_buffers(cp, name):
    part = runnable_partitions(tiny_workload(cp), [name])[name]
    slots = [part.slots[0].name, part.slots[-1].name, None]
    for slot in slots:
        coll = AllocatingCollective()
        progs = {"empty": part.build(device="cpu", seed=5, collective=coll),
                 "zeros": part.build(device="cpu", seed=5, collective=HostCollective())}
        ref = part.build(device="cpu", seed=5)
        for p in (*progs.values(), ref):
            seed_inputs(p, 11)
        executors = {"empty": TorchExecutor(collective=coll, streams=RecordingStreamBackend()),
                     "zeros": TorchExecutor(collective=HostCollective(),
                                            streams=RecordingStreamBackend())}
        for _ in range(3):  # three steps: the double buffers flip
            for key, prog in progs.items():
                executors[key].run_partition(prog.ops, prog.op_names, prog.comm_tensor,
                                             ScheduleConfig(1980, 8, slot),
                                             comm_kind=prog.comm_kind,
                                             comm_output=prog.comm_output)
                prog.advance()
            ref.run_plain()
            reference_collective(ref)
            ref.advance()
        for key, prog in progs.items():
            for a, b in zip(buffers(prog), buffers(ref)):
                assert torch.equal(a, b), f"{name} slot={slot} ({key}): result differs"
        assert all(coll.is_registered(b) for b in buffers(progs["empty"]))
    assert any(b.abs().sum() > 0 for b in buffers(ref))


def test_backend_without_empty_gets_plain_zeros():
    part = runnable_partitions(tiny_workload(), ["fwd_mlp"])["fwd_mlp"]
    coll = HostCollective()
    prog = part.build(device="cpu", seed=1, collective=coll)
    assert not hasattr(coll, "empty")
    assert prog.comm_tensor.shape == (128, 256) and not prog.comm_tensor.any()


def test_empty_on_another_device_or_dtype_is_refused():
    class WrongDtype(AllocatingCollective):
        def empty(self, shape, dtype):
            return super().empty(shape, torch.float32)

    part = runnable_partitions(tiny_workload(), ["fwd_mlp"])["fwd_mlp"]
    with pytest.raises(ValueError, match="build it on the backend's device"):
        part.build(device="cpu", seed=1, collective=WrongDtype())


class CPUPartition(RunnableTransformerPartition):
    """Builds on the CPU whatever device the caller asks for (the runner asks for none)."""

    def build(self, *, device=None, seed=0, collective=None):
        return super().build(device="cpu", seed=seed, collective=collective)


def test_profiler_runner_builds_with_the_executors_backend():
    wl = tiny_workload()
    base = runnable_partitions(wl, ["fwd_attn"])["fwd_attn"]
    part = CPUPartition(base.partition, wl)
    coll = AllocatingCollective()
    ex = TorchExecutor(collective=coll, streams=RecordingStreamBackend())
    runner = TorchPartitionRunner(ex, seed=2)
    step = runner.prepare(part, ScheduleConfig(1980, 8, "qkv"))
    prog = runner.program(part)
    assert len(coll.calls) == 2  # both all-reduce buffers, once (programs are cached)
    assert coll.is_registered(prog.comm_tensor) and coll.is_registered(prog.output)
    ref = part.build(seed=2)
    for _ in range(2):
        step()
        ref.run_plain()
        reference_collective(ref)
        ref.advance()
    assert len(coll.calls) == 2
    assert torch.equal(prog.output, ref.output) and torch.equal(prog.comm_tensor, ref.comm_tensor)


# ------------------------------------------------------------------ buffer sizes by dtype


@pytest.mark.parametrize(("dtype_bytes", "dtype"), [(2, "float32"), (2, "float16"),
                                                    (4, "float32"), (4, "bfloat16")])
@pytest.mark.parametrize(("cp", "name"), CASES)
def test_buffers_keep_the_models_element_count_in_any_dtype(dtype_bytes, dtype, cp, name):
    """CommOp bytes count the workload's elements (``dtype_bytes`` each); the buffers hold
    that many elements whatever dtype the kernels run in, so the output op still writes
    the buffer and data reaches the collective."""
    ref_wl = tiny_workload(cp)
    wl = Workload(model=ref_wl.model, parallelism=ref_wl.parallelism, microbatch_size=2,
                  seq_len=128, nanobatches=2, dtype_bytes=dtype_bytes)
    ref = runnable_partitions(ref_wl, [name])[name].build(device="cpu", seed=4)
    coll = AllocatingCollective()
    part = runnable_partitions(wl, [name], dtype=dtype)[name]
    prog = part.build(device="cpu", seed=4, collective=coll)
    assert [tuple(b.shape) for b in buffers(prog)] == [tuple(b.shape) for b in buffers(ref)]
    assert all(b.dtype == getattr(torch, dtype) for b in buffers(prog))
    assert [s for s, _ in coll.calls] == [tuple(b.shape) for b in buffers(ref)]
    assert prog.writer == ref.writer
    if prog.writer is not None:  # the materialising run wrote real data into the buffer
        assert prog.output.shape == (part.dims.t, part.dims.h)
        assert prog.output.abs().sum() > 0 and torch.isfinite(prog.output).all()
        prog.advance()
        prog.run_plain()  # the other buffer, next step
        assert prog.output.abs().sum() > 0


def test_float32_all_reduce_carries_the_output_through_the_collective():
    part = runnable_partitions(tiny_workload(), ["fwd_mlp"], dtype="float32")["fwd_mlp"]
    prog = part.build(device="cpu", seed=6, collective=HostCollective())
    ex = TorchExecutor(collective=HostCollective(), streams=RecordingStreamBackend())
    for _ in range(2):
        ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor,
                         ScheduleConfig(1980, 8, "gate"), comm_kind=prog.comm_kind)
        prog.advance()
    # step 1 reduced what step 0's down wrote: twice the down GEMM of the same inputs
    ctx = prog.state
    down = torch.matmul(ctx["a"], ctx["Wd"])
    assert down.abs().sum() > 0 and torch.allclose(prog.output, GROUP * down)
    assert prog.writer == "down"


# ------------------------------------------------------------------ who writes the buffer


# The all-reduce types of the TP=2 x CP=2 workload and the op that writes their buffer.
# fwd_attn_in_ar and bwd_attn_out_ar pair a segment's first nanobatch with the *previous*
# segment's last all-reduce (kareus.model.partition): its input is produced by that
# segment's output op (down, up_dgrad), which is not one of their ops.
CP_AR_WRITERS = {"fwd_attn_out_ar": "out_proj", "fwd_mlp": "down", "fwd_attn_in_ar": None,
                 "bwd_mlp": "up_dgrad", "bwd_attn_out_ar": None, "bwd_attn_in_ar": "qkv_dgrad"}
CROSS_PRODUCER = {"fwd_attn_in_ar": "fwd_mlp", "bwd_attn_out_ar": "bwd_mlp"}


def test_the_op_producing_the_all_reduce_input_writes_the_buffer():
    wl = tiny_workload(cp=2)
    parts = runnable_partitions(wl)
    ar = {n for n, p in parts.items() if p.comm_op.kind.value == "all_reduce"}
    assert ar == set(CP_AR_WRITERS)
    for name, writer in CP_AR_WRITERS.items():
        assert parts[name].build(device="cpu", seed=1).writer == writer, name


@pytest.mark.parametrize("name", sorted(CROSS_PRODUCER))
def test_cross_segment_all_reduce_has_no_writer_by_design(name):
    """The collective of these types reduces the previous segment's output: the op that
    produces it runs in that segment's type, so no op of theirs writes the buffer."""
    parts = runnable_partitions(tiny_workload(cp=2))
    part, before = parts[name], parts[CROSS_PRODUCER[name]]
    producer = CP_AR_WRITERS[CROSS_PRODUCER[name]]
    assert part.comm_op == before.comm_op  # the same collective
    assert producer in [o.name for o in before.compute_ops]
    assert producer not in [o.name for o in part.compute_ops]
    # Alone (profiling), the buffer stays zero: finite under the repeated in-place sum.
    prog = part.build(device="cpu", seed=2)
    ex = TorchExecutor(collective=HostCollective(), streams=RecordingStreamBackend())
    for _ in range(4):
        ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor,
                         ScheduleConfig(1980, 8, prog.op_names[0]), comm_kind=prog.comm_kind)
        prog.advance()
    assert not any(b.any() for b in buffers(prog))


@pytest.mark.parametrize("name", sorted(CROSS_PRODUCER))
def test_in_a_chain_the_cross_segment_all_reduce_reduces_real_data(name):
    """As in a training loop: the previous segment's program writes its output, then this
    type's collective reduces that tensor beside this type's ops."""
    parts = runnable_partitions(tiny_workload(cp=2))
    first = parts[CROSS_PRODUCER[name]].build(device="cpu", seed=3)
    second = parts[name].build(device="cpu", seed=4)
    ex = TorchExecutor(collective=HostCollective(), streams=RecordingStreamBackend())
    ex.run_partition(first.ops, first.op_names, first.comm_tensor,
                     ScheduleConfig(1980, 8, None), comm_kind=first.comm_kind)
    first.advance()
    pending = first.comm_tensor  # the buffer the previous segment just wrote
    written = pending.clone()
    assert written.abs().sum() > 0
    ex.run_partition(second.ops, second.op_names, pending,
                     ScheduleConfig(1980, 8, second.op_names[0]), comm_kind=second.comm_kind)
    assert torch.equal(pending, written * GROUP)


def test_grouped_attention_reads_kv_groups_in_place_and_matches_the_copy():
    # _sdpa hands grouped K/V to the kernel (enable_gqa) instead of copying each group
    # per query head; the result and the gradients must equal the copied version's.
    from kareus.exec._transformer_ops import _sdpa

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 32, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 32, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 32, 8, generator=g, requires_grad=True)
    out = _sdpa(torch, q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), is_causal=True)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
    # Causal: the first position attends to itself only.
    torch.testing.assert_close(out[:, :, 0], v.repeat_interleave(3, dim=1)[:, :, 0])


def test_query_key_norm_partitions_run_the_fused_norm_and_rope():
    # a Qwen3-shaped layer (qk-norm, eps 1e-6): the attention-input partitions run the
    # per-head norms fused with RoPE in RoPE's place (KernelSet.qk_norm_rope and its
    # backward), normalising each query and key head over head_dim with the model's eps
    from kareus.exec.kernels import get_kernels

    wl = tiny_workload()
    wl = wl.with_(model=attrs.evolve(wl.model, qk_norm=True, norm_eps=1e-6))
    parts = runnable_partitions(wl, ["fwd_attn", "bwd_attn"])
    fwd, bwd = parts["fwd_attn"], parts["bwd_attn"]
    names = [op.name for op in fwd.partition.compute_ops]
    assert names[names.index("qkv") + 1] == "qk_norm_rope" and "rope" not in names
    back = [op.name for op in bwd.partition.compute_ops]
    assert back[back.index("attn_core_bwd") + 1:back.index("qkv_dgrad")] == [
        "qk_norm_rope_bwd"]
    prog = fwd.build(device="cpu", seed=3)
    prog.run_plain()
    ctx = prog.state  # the ops' tensors
    m = wl.model
    heads, kvh, d = m.heads // 2, m.kv_heads // 2, m.head_dim
    # the queries attention reads: each head normalised (float32 statistics), then rotated
    pre = ctx["qkv"].float()
    x = pre[:, :heads * d].reshape(-1, d)
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * ctx["w_q_norm"].float()
    qkv_n = pre.clone()
    qkv_n[:, :heads * d] = normed.view(pre.shape[0], -1)
    want_q, _ = get_kernels("reference").rope(qkv_n, ctx["cos"].float(), ctx["sin"].float(),
                                             heads=heads, kv_heads=kvh)
    got_q = ctx["q"].transpose(1, 2).float()
    assert torch.allclose(got_q, want_q, rtol=2e-2, atol=2e-2)
    v = pre.view(*got_q.shape[:2], heads + 2 * kvh, d)[:, :, heads + kvh:]
    assert torch.equal(ctx["v"].transpose(1, 2).float(), v)  # values untouched
    bprog = bwd.build(device="cpu", seed=3)
    bprog.run_plain()  # the fused backward runs too, and gives the norm weights' gradients
    assert bprog.state["dw_q_norm"].shape == (d,) and bprog.state["dw_k_norm"].shape == (d,)
    assert bprog.state["dqkv"].shape == (pre.shape[0], (heads + 2 * kvh) * d)


def test_a_qkv_bias_is_refused_by_the_runnable_partitions():
    from kareus.errors import WorkloadError

    wl = tiny_workload()
    wl = wl.with_(model=attrs.evolve(wl.model, qkv_bias=True))
    with pytest.raises(WorkloadError, match="runnable partitions does not compute qkv_bias"):
        runnable_partitions(wl, ["fwd_attn"])["fwd_attn"]


# ------------------------------------------------------------------ sequence parallelism


#: The TP collective's writer of each sequence-parallel type (TP=2 x CP=2): the norms write
#: the all-gathers' inputs (on the sequence shard), the output projections and the input
#: gradients the reduce-scatters'; a type whose collective comes from the segment before
#: it, or runs over CP (K/V), has none.
SP_WRITERS = {"fwd_attn_norm_ag": "attn_norm", "fwd_attn_out_rs": "out_proj",
              "fwd_mlp_norm_ag": "mlp_norm", "fwd_mlp_rs": "down", "bwd_mlp": "up_dgrad",
              "bwd_mlp_norm_ag": "mlp_norm_bwd", "bwd_attn_in_tp_rs": "qkv_dgrad",
              "bwd_attn_norm_ag": "attn_norm_bwd"}


def test_sequence_parallel_types_run_and_their_producers_write_the_buffers():
    wl = tiny_workload(cp=2)
    wl = wl.with_(parallelism=Parallelism(tp=2, cp=2, sp=True))
    parts = runnable_partitions(wl, dtype="float32")
    d = next(iter(parts.values())).dims
    assert (d.sp, d.ts) == (2, d.t // 2)
    ex = TorchExecutor(collective=HostCollective(), streams=RecordingStreamBackend())
    for name, part in parts.items():
        prog = part.build(device="cpu", seed=7)
        assert prog.writer == SP_WRITERS.get(name), name
        assert prog.comm_group == part.partition.comm_group
        for _ in range(2):
            ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor,
                             ScheduleConfig(1980, 8, prog.op_names[0]),
                             comm_kind=prog.comm_kind, comm_output=prog.comm_output,
                             comm_group=prog.comm_group)
            prog.advance()
        if prog.writer is not None:  # both inputs written (build's run and step 1)
            assert all(b.abs().sum() > 0 for b in prog._buffers), name
    # a norm's output is the all-gather's input: the shard's normed tokens
    prog = parts["fwd_attn_norm_ag"].build(device="cpu", seed=8)
    ctx = prog.state
    want = torch.nn.functional.rms_norm(ctx["x"], (d.h,), ctx["w_attn_norm"], d.eps)
    torch.testing.assert_close(prog.output.view(d.ts, d.h), want)  # build ran it once

"""The work outside partitions as real kernels, so that a tuning run on GPUs measures it.

Each microbatch computation also runs work that belongs to no partition
([`OutsideWork`][kareus.model.OutsideWork]): the embedding on the first pipeline stage,
the final norm, LM head and loss on the last, their backward passes, and the vocabulary-
parallel all-reduce, all sequential (nothing overlaps them). The iteration composer needs
its time and energy at every clock a plan may use, so the NVML profiler runs it as a
program: ``RunnableOutsideWork`` builds, at the workload's per-rank microbatch
shapes, one kernel per op of the work (cuBLAS GEMMs, the kernel set's RMSNorm, PyTorch's
embedding, softmax cross-entropy and index_add) followed by its collectives on the
executor's backends, and [`TorchPartitionRunner`][kareus.profilers.TorchPartitionRunner] runs it as a
plain step (no launch slot: the configuration only sets the clock). A memory-bound op
without a kernel of its own here (an optimizer step, say) runs as a device copy that
moves the op's bytes (read and written once). Collectives over another group than the
executor's (data-parallel reductions, pipeline sends) cannot run in one stage's group:
they are left out and listed in ``RunnableOutsideWork.left_out``. The iteration's gradient
reduction of a job with CP > 1 and DP = 1 is the CP group's (``cp_grad_reduce_scatter``,
``cp_param_all_gather``): it runs on the executor's CP backend.

torch is imported inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kareus._logging import get_logger
from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.exec._executor_role import Executor
from kareus.exec._partition_program import PartitionProgram, RunnablePartition, _comm_zeros
from kareus.model.ops import CommOp, ComputeOp
from kareus.model.partition import OutsideWork
from kareus.model.workload import Workload

__all__ = ["OUTSIDE_OPS", "RunnableOutsideWork"]

_log = get_logger(__name__)

#: The ops of outside work this module has kernels for (the names the partition builder uses).
OUTSIDE_OPS = ("embedding", "final_norm", "lm_head", "loss", "loss_bwd", "lm_head_dgrad",
               "lm_head_wgrad", "final_norm_bwd", "embedding_bwd")


class RunnableOutsideWork(RunnablePartition):
    """One stage's outside work of one phase, runnable on a GPU.

    Args:
        work: The work (from [`build_partitions`][kareus.model.build_partitions]'s ``outside``).
        workload: The workload it was built from (its per-rank microbatch shapes).
        comm_sms: SMs of its collectives (``None``: the executor's default collective,
            NCCL's own CTA count).
        dtype: torch dtype name of activations and weights (default ``"bfloat16"``).
        kernels: The kernel set of the norms (as for
            [`RunnableTransformerPartition`][kareus.exec.RunnableTransformerPartition]).
        name: Its name in logs (default ``"outside"``).

    Raises:
        ValueError: the work holds an op this module has no kernel for.
    """

    def __init__(self, work: OutsideWork, workload: Workload, *, comm_sms: int | None = None,
                 dtype: str | None = None, kernels: Any = None,
                 name: str = "outside") -> None:
        if not isinstance(work, OutsideWork):
            raise ArgumentTypeError(f"work must be an OutsideWork, got {type(work).__name__}")
        if not isinstance(workload, Workload):
            raise ArgumentTypeError(f"workload must be a Workload, got {type(workload).__name__}")
        unknown = [op.name for op in work.ops
                   if op.name not in OUTSIDE_OPS and op.kind.compute_bound]
        if unknown and not workload.chained_layers:
            raise ArgumentError("a workload of unchained layers (chained_layers=False) costs "
                                "each layer's bare computation as outside work, which the GPU "
                                f"path does not run yet (ops {sorted(set(unknown))}): measure "
                                "it on the emulator, or tune the chained workload")
        if unknown:
            raise ArgumentError(f"no kernel for the compute-bound outside ops {unknown}; known: "
                             f"{OUTSIDE_OPS} (memory-bound ones run as copies of their bytes)")
        self.work = work
        self.workload = workload
        self.comm_sms = None if comm_sms is None else int(comm_sms)
        self.dtype = "bfloat16" if dtype is None else str(dtype)
        self.kernels = kernels
        self._name = str(name)
        #: Collectives and sends of the work this program does not run (another group).
        self.left_out: list[str] = []

    @property
    def name(self) -> str:
        """Its name in logs."""
        return self._name

    @property
    def compute_ops(self) -> tuple[ComputeOp, ...]:
        """The work's computation ops."""
        return self.work.ops

    @property
    def comm_op(self) -> CommOp:
        """The work's first collective.

        Raises:
            ValueError: the work has none.
        """
        if not self.work.comms:
            raise ArgumentError("this outside work has no collective")
        return self.work.comms[0]

    @property
    def overlappable(self) -> bool:
        """Never: outside work runs sequentially."""
        return False

    @property
    def group_gpus(self) -> int:
        """GPUs of one stage (TP x CP)."""
        p = self.workload.parallelism
        return p.tp * p.cp

    def build(self, *, device: Any = None, seed: int = 0,  # noqa: C901 - builds each kind of outside work in turn
              collective: Any = None) -> PartitionProgram:
        """Allocate inputs and weights on ``device`` and return the program: one callable
        per op, then one per collective (each on the current stream, in order).

        Args:
            device: A CUDA device (default: the current one).
            seed: Seed of the random inputs and weights.
            collective: The executor (its ``run_collective`` runs the collectives and its
                ``empty`` allocates their buffers), or a collective backend.
        """
        import torch

        from kareus.exec.kernels import get_kernels

        dev = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        dtype = getattr(torch, self.dtype)
        wl = self.workload
        m, p = wl.model, wl.parallelism
        t = wl.microbatch_size * wl.seq_len // p.cp
        ts = t // (p.tp if p.sequence_parallel else 1)  # the final norm's tokens (the shard)
        h = m.hidden
        v = -(-m.vocab // p.tp)
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        ks = get_kernels(self.kernels)

        def rnd(*shape: int, scale: float = 1.0) -> Any:
            return (torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32)
                    * scale).to(dtype)

        ctx: dict[str, Any] = {
            "ids": torch.randint(0, v, (t,), generator=gen, device=dev),
            "labels": torch.randint(0, v, (t,), generator=gen, device=dev),
            "table": rnd(v, h), "w_norm": rnd(h, scale=0.1).add_(1.0),
            "W": rnd(h, v, scale=h ** -0.5), "x": rnd(t, h), "dy": rnd(t, h),
            "d_embedded": rnd(t, h), "xs": rnd(ts, h), "dys": rnd(ts, h),
        }
        if ts == t:  # without sequence parallelism the final norm sees every token
            ctx["xs"], ctx["dys"] = ctx["x"], ctx["dy"]
        rows = torch.arange(t, device=dev)

        def op(name: str) -> Callable[[], Any]:
            if name == "embedding":
                return lambda: ctx.__setitem__("x", torch.nn.functional.embedding(
                    ctx["ids"], ctx["table"]))
            if name == "final_norm":
                if ts != t:  # on the sequence shard; the LM head reads the gathered tokens
                    return lambda: ctx.__setitem__("xns", ks.rms_norm(ctx["xs"],
                                                                      ctx["w_norm"]))
                return lambda: ctx.__setitem__("xn", ks.rms_norm(ctx["x"], ctx["w_norm"]))
            if name == "lm_head":
                return lambda: ctx.__setitem__("logits", ks.matmul(ctx["xn"], ctx["W"]))
            if name == "loss":
                return lambda: ctx.__setitem__("loss", torch.nn.functional.cross_entropy(
                    ctx["logits"].float(), ctx["labels"]))

            if name == "loss_bwd":
                def loss_bwd() -> None:
                    d = torch.softmax(ctx["logits"], -1, dtype=torch.float32)
                    d[rows, ctx["labels"]] -= 1.0
                    ctx["dlogits"] = d.div_(t).to(dtype)
                return loss_bwd
            if name == "lm_head_dgrad":
                return lambda: ctx.__setitem__("dy", ks.matmul(ctx["dlogits"], ctx["W"].t()))
            if name == "lm_head_wgrad":
                return lambda: ctx.__setitem__("dW", ks.matmul(ctx["xn"].t(), ctx["dlogits"]))
            if name == "final_norm_bwd":
                def norm_bwd() -> None:
                    ctx["dx"], ctx["dw_norm"] = ks.rms_norm_bwd(ctx["dys"], ctx["xs"],
                                                                ctx["w_norm"])
                return norm_bwd
            if name != "embedding_bwd":  # a memory-bound op of no kernel here: its bytes
                nbytes = max(int(by_name[name].bytes_moved) // 2, 16)
                src = _random_bytes(torch, nbytes, gen, dev)
                dst = torch.empty_like(src)
                return lambda: dst.copy_(src)

            # Its input is the gradient arriving from the first layer's backward (a
            # static tensor of the build), never an output of this program: a captured
            # graph must read only what outlives it (the final norm's ``dx`` of the
            # previous step was replaced, and freed, by the next capture, and a replay
            # read freed memory: an illegal memory access on 1x H200).
            def embedding_bwd() -> None:
                ctx["dtable"].zero_()
                ctx["dtable"].index_add_(0, ctx["ids"], ctx["d_embedded"])
            return embedding_bwd

        # Inputs the first op of a phase reads when the ops before it are elsewhere.
        names = [o.name for o in self.work.ops]
        by_name = {o.name: o for o in self.work.ops}
        if "embedding_bwd" in names:
            ctx["dtable"] = torch.zeros_like(ctx["table"])
        if ("lm_head_dgrad" in names or "lm_head_wgrad" in names or "loss_bwd" in names
                or ts != t):  # the LM head's input (gathered, under sequence parallelism)
            ctx["xn"] = ks.rms_norm(ctx["x"], ctx["w_norm"])
            ctx["logits"] = ks.matmul(ctx["xn"], ctx["W"])
        ops = [op(n) for n in names]
        for k, comm in enumerate(self.work.comms):
            # The ranks of the group the comm would run over here (the CP group's for a
            # ``cp_`` collective, such as the iteration's gradient reduction at DP = 1);
            # 1: the loopback stand-in.
            world = _group_world_size(collective, comm)
            if world is None:
                self.left_out.append(f"{comm.name} (a group of {comm.group_size}, none here)")
                continue
            if world not in (1, comm.group_size):
                self.left_out.append(f"{comm.name} (a group of {comm.group_size}, not this "
                                     f"group of {world})")
                continue
            ops.append(_comm_op(torch, comm, collective, self.comm_sms, wl.dtype_bytes, dev,
                                dtype))
            names.append(f"{comm.name}#{k}" if comm.name in names else comm.name)
        if getattr(self.work, "p2p_bytes", 0):
            self.left_out.append("the pipeline send (another stage)")
        if self.left_out:
            _log.warning("outside work measured without %s", "; ".join(self.left_out))
        prog = PartitionProgram(op_names=names, ops=ops, comm_kind=None,
                                buffers=[None, None], state=ctx)
        with torch.no_grad():
            prog.run_plain()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return prog

    def __repr__(self) -> str:
        return f"RunnableOutsideWork({[o.name for o in self.work.ops]}, {len(self.work.comms)} comms)"


#: Elements one call of a random fill may cover: some of CUDA's distribution kernels have
#: indexed with 32 bits and left large int8 outputs unfilled (pytorch/pytorch#141544); an
#: optimizer step's stand-in is several GB (7.6 GB for qwen3-1.7b at TP=4), so it is filled
#: as 64-bit words in chunks that stay far below 2**31 elements.
_FILL_CHUNK = 1 << 28


def _random_bytes(torch: Any, nbytes: int, gen: Any, device: Any) -> Any:
    """``nbytes`` random bytes on ``device``, filled as 64-bit words in chunks of
    ``_FILL_CHUNK`` elements (each call's indices fit 32 bits whatever the size)."""
    out = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
    words = int(nbytes) // 8
    view = out[: words * 8].view(torch.int64)
    for i in range(0, words, _FILL_CHUNK):
        view[i:i + _FILL_CHUNK].random_(generator=gen)
    if words * 8 < int(nbytes):
        out[words * 8:].random_(0, 256, generator=gen)
    return out


def _world_size(collective: Any) -> int:
    """Ranks of the group the executor's (or backend's) collectives run over (1 if unknown)."""
    backend = getattr(collective, "collective", collective)
    try:
        return int(backend.world_size)
    except (AttributeError, TypeError, ValueError):
        return 1


def _comm_group(comm: CommOp) -> str | None:
    """A collective's group, from its name (``tp_...``, ``cp_...``): under sequence
    parallelism the TP group runs all-gathers and reduce-scatters too, and the iteration's
    gradient reduction at DP = 1 is the CP group's (``None``: routed by kind)."""
    return next((x for x in ("tp", "cp") if comm.name.startswith(x + "_")), None)


def _group_world_size(collective: Any, comm: CommOp) -> int | None:
    """Ranks of the group ``comm`` runs over here. Where the executor's collective routes
    by group (a ``GroupedCollective``: it has ``for_group``), the backend of the comm's
    named group, or of its kind's group when it names none (all-reduces: TP; all-gathers,
    reduce-scatters: CP); ``None`` when there is no such backend (a degree of 1). Else the
    executor's (``_world_size``)."""
    backend = getattr(collective, "collective", collective)
    route = getattr(backend, "for_group", None)
    if not callable(route):
        return _world_size(collective)
    group = _comm_group(comm)
    try:
        target = route(group) if group is not None else backend.backend_for(comm.kind.value)
        return int(target.world_size)
    except ArgumentError:  # no backend of that group here
        return None


def _comm_op(torch: Any, comm: CommOp, collective: Any, sms: int | None, model_bytes: int,
             device: Any, dtype: Any) -> Callable[[], Any]:
    """One collective of the work, run on the current stream through the executor's backend
    for ``sms`` (or through ``collective`` itself when it is a backend)."""
    n = int(comm.bytes) // int(model_bytes)
    g = comm.group_size
    kind = comm.kind.value
    group = _comm_group(comm)

    def buf(numel: int) -> Any:  # registered with the group that runs it, where it can
        return _comm_zeros(torch, collective, (numel,), device, dtype, kind, group)

    if kind == "all_reduce":
        tensors: tuple[Any, ...] = (buf(n),)
    elif kind == "all_gather":  # bytes = the gathered output
        tensors = (buf(n // g * g), buf(n // g))
    else:
        tensors = (buf(n // g), buf(n // g * g))
    if isinstance(collective, Executor):  # any executor runs it (Executor.run_collective)
        ex = collective
        if kind == "all_reduce":
            return lambda: ex.run_collective(kind, tensors[0], sms=sms, partition=comm.name,
                                             group=group)
        return lambda: ex.run_collective(kind, tensors[1], tensors[0], sms=sms,
                                         partition=comm.name, group=group)
    pick = getattr(collective, "backend_for", None)
    backend = pick(sms) if callable(pick) else collective
    route = getattr(backend, "for_group", None)
    if group is not None and callable(route):
        backend = route(group)
    if backend is None:
        raise ArgumentError("outside work with a collective needs an executor or a backend "
                         "(build(collective=...))")

    def run() -> None:
        stream = torch.cuda.current_stream()
        if kind == "all_reduce":
            backend.all_reduce(tensors[0], stream, sms)
        else:
            getattr(backend, kind)(tensors[0], tensors[1], stream, sms)
    return run

"""Partitions: one communication kernel beside a run of computation it does not depend on.

A training iteration repeats a few patterns. With nanobatching, the collective of
nanobatch *i* overlaps the computation of the next piece of work in stream order:
nanobatch *i+1* of the same layer segment, or nanobatch 1 of the next segment. A
[`Partition`][kareus.model.Partition] is that pair: ``comm_op`` plus the ``compute_ops`` it may
overlap. Partitions of the same *type* (same computation, same collective) share one
configuration, so the search runs once per type.

Launch slots: the communication kernel can start together with any computation op
(``ScheduleConfig.launch_slot`` names the op), or after all of them (sequential).
Each GEMM or attention op opens its own slot; consecutive memory-bound ops share the
slot of the first of them, since launching between them changes little but costs
bandwidth contention.

[`build_partitions`][kareus.model.build_partitions] derives every partition type of a
[`Workload`][kareus.model.Workload], how many instances each pipeline stage runs per microbatch
forward and backward, and the work outside partitions (embedding, LM head and loss). All FLOPs and
bytes are per rank.

Modelling choices (documented in docs/architecture.md): where a stage's layers run as one
chain (``Workload.chained_layers``, the default), the chain is treated as cyclic, so the
first computation of a stage is paired with the last collective of the stage (one exposed
collective and one bare computation per stage and microbatch are counted as one overlapped
pair); residual additions are omitted; with full recomputation the backward pass of each
layer re-runs its forward, collectives included, so backward computations also hold
forward partition types.

Where each layer runs as its own planned layer (``chained_layers=False``: torchtitan's
``Trainer``, which wraps every block in FSDP; Megatron-Core layers left unchained), no
pair crosses a layer boundary. Each layer's computation is then what the runtime runs for
one layer (``_layer_pieces``: its forward, or its backward after the recomputed forward
under full recomputation; under sequence parallelism a dense layer's backward opens with
the all-gather of its output's gradient and leaves its input's gradient sharded; a mixture
of experts' is ``moe_decoder_layer``'s: its forward ends with the un-permutation after the
combine, which its recomputed forward does not re-run, and its backward reads and leaves
the gradients on the sequence shard), cut at its collectives into pieces, each nanobatch
of a piece beside the collective of the unit before it in that layer
(``_unchained_units``). What has nothing before it runs bare (the layer's first unit; the
ops after the last collective, the input norm's backward or a mixture of experts'
un-permutation, of the later nanobatches) and a collective with nothing after it runs
exposed (a dense layer's forward's last; under sequence parallelism the output gradient's
all-gathers of the first ``n - 1`` nanobatches, which no op follows; a mixture-of-experts
layer exposes none, its last collective having the first nanobatch's tail beside it):
both are costed per layer as work outside partitions
(``PartitionSet.outside``, at the computation's clock; the exposed collectives at their
own CTA count, as the runtime runs them for such a workload). A computation of one
nanobatch is the same either way (each collective after its own ops).

The model's layer features change the op lists: with ``qk_norm`` the per-head query/key
norms run fused with RoPE, so ``rope`` is ``qk_norm_rope`` and ``rope_bwd`` is
``qk_norm_rope_bwd`` (one memory-bound kernel each, in RoPE's launch slot, named after it;
costed with its minimum HBM traffic: q and k, the norm weights and the cos/sin tables read,
q and k written, and in the backward dQ, dK, dV and the pre-norm q and k read, dQKV and
the weights' gradients written); a QKV bias is added in the ``qkv`` GEMM's
epilogue and its gradient reduced in ``qkv_wgrad``'s (no op of its own, no new slot); tied
embeddings change no op of a microbatch (the LM head's weight gradient is written into the
embedding's gradient instead of a matrix of its own) but change the parameters, so the
optimizer step, and with PP > 1 add the tied gradient's all-reduce between the end stages
(``iteration_work``).

Under sequence parallelism (``Parallelism.sequence_parallel``: ``sp`` at TP > 1) the layer
runs ``decoder_layer(phase, sp=True)``: the TP all-reduces are TP all-gathers (before the
QKV and gate/up projections, and of the output gradients in the backward) and
reduce-scatters (after the output and down projections, and of the input gradients), each
of the rank's ``tokens x hidden`` activation (``CommOp.bytes``: the gathered output, the
scattered input); the norms (with the residual additions fused into them) run on the
rank's sequence shard, ``tokens / TP``. The norms then sit in segments of their own, so
the partition types are ``{phase}_{segment}`` with the segments of that op order
(``attn_norm``, ``attn_in``, ``attn_out`` or ``attn``, ``mlp_norm``, ``mlp``), suffixed by
the collective they overlap when a segment overlaps more than one: its kind (``_ag``,
``_rs``), or its group and kind (``_tp_ag``, ``_cp_ag``) where a TP and a CP collective of
one kind meet (CP > 1). Selective recomputation (``recompute="selective"``) re-runs the
attention core's forward in the backward, right before ``out_dgrad``: one more attention
op in that segment, costed as the forward's.

A microbatch of one sequence splits into nanobatches along the sequence
(``Workload.sequence_split``, CP = 1): chunk ``i`` of ``n`` holds ``c = seq_len / n``
tokens, and its causal attention reads the keys and values of chunks ``0..i``, so it does
``(i + 1/2) c^2`` query-key pairs of work (the chunks add up to the whole sequence's half
score matrix) while every other op is the same in every chunk. A segment holding attention
is then one partition type per chunk (suffixed ``_c{i}``). The forward runs the chunks in
order (a chunk's attention needs the earlier chunks' K and V) and the backward in reverse
(a chunk's attention backward adds to the earlier chunks' dK and dV, which their QKV
backward reads), which decides which chunk overlaps the collective of the segment before.

Packed documents whose attention is masked (``Workload.document_tokens``, CP = 1) cost the
attention that runs: the causal halves of the documents' squares
([`document_pairs`][kareus.model.document_pairs]) instead of the whole sequence's, forward
and backward (and selective recomputation's re-run); every other op is unchanged.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Sequence

import attrs

from kareus.errors import ArgumentError, ArgumentTypeError, WorkloadError
from kareus.model.decoder import ATTENTION_SEGMENT, decoder_layer, moe_decoder_layer
from kareus.model.documents import document_pairs
from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
from kareus.model.workload import Workload

__all__ = [
    "ADAM_BYTES_PER_PARAM",
    "ADAM_FLOPS_PER_PARAM",
    "GPUS_PER_NODE",
    "LaunchSlot",
    "OpPartition",
    "OutsideWork",
    "Partition",
    "PartitionSet",
    "TransformerPartition",
    "build_partitions",
    "grad_reduction_crosses_node",
    "pipeline_sends_cross_node",
    "iteration_work",
    "launch_slots",
    "stage_params_per_rank",
]

PHASES = ("fwd", "bwd")


def _compute_ops(ops: Iterable[ComputeOp]) -> tuple[ComputeOp, ...]:
    return tuple(ops)


def _comm_ops(ops: Iterable[CommOp]) -> tuple[CommOp, ...]:
    return tuple(ops)


@attrs.frozen(kw_only=True)
class LaunchSlot:
    """A point where the communication kernel may be launched.

    Attributes:
        name: Name of the op the communication starts with (the slot's first op).
        index: Position of that op in ``Partition.compute_ops``.
        op_names: Every op that belongs to the slot (consecutive memory-bound ops share one).
        compute_bound: Whether the slot's first op is a GEMM or attention op.
        arithmetic_intensity: FLOPs per byte of the slot's first op.
    """

    name: str
    index: int
    op_names: tuple[str, ...]
    compute_bound: bool
    arithmetic_intensity: float


def launch_slots(ops: Sequence[ComputeOp]) -> tuple[LaunchSlot, ...]:
    """The launch slots of an ordered run of computation ops.

    Every compute-bound op opens a slot; a memory-bound op opens one only if the op
    before it is compute-bound (or it is the first op).
    """
    groups: list[list[int]] = []
    for i, op in enumerate(ops):
        if op.compute_bound or i == 0 or ops[i - 1].compute_bound:
            groups.append([i])
        else:
            groups[-1].append(i)
    return tuple(
        LaunchSlot(name=ops[g[0]].name, index=g[0], op_names=tuple(ops[i].name for i in g),
                   compute_bound=ops[g[0]].compute_bound,
                   arithmetic_intensity=ops[g[0]].arithmetic_intensity)
        for g in groups
    )


class Partition(abc.ABC):
    """One communication kernel and the computation kernels it may overlap.

    Subclass it to describe your own pattern; the emulator and the search need only
    ``name``, ``compute_ops`` and ``comm_op``. ``slots`` and ``overlappable`` have defaults.
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The partition type's name, unique within a workload (e.g. ``"fwd_attn"``)."""

    @property
    @abc.abstractmethod
    def compute_ops(self) -> tuple[ComputeOp, ...]:
        """The computation kernels, in stream order."""

    @property
    @abc.abstractmethod
    def comm_op(self) -> CommOp:
        """The communication kernel."""

    @property
    def overlappable(self) -> bool:
        """Whether the communication may run beside the computation (False: sequential only)."""
        return True

    @property
    def group_gpus(self) -> int:
        """GPUs that run this partition: the scope of its measurements (default: the
        collective's group; a transformer stage's TP x CP GPUs for built partitions)."""
        return self.comm_op.group_size

    @property
    def slots(self) -> tuple[LaunchSlot, ...]:
        """The launch slots (empty when the partition is not overlappable)."""
        return launch_slots(self.compute_ops) if self.overlappable else ()

    def slot(self, name: str) -> LaunchSlot:
        """The slot called ``name``; raises ``KeyError`` if there is none."""
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def flops(self) -> float:
        """FLOPs of the computation ops together (per rank)."""
        return float(sum(op.flops for op in self.compute_ops))

    @property
    def compute_bytes(self) -> float:
        """HBM bytes of the computation ops together (per rank)."""
        return float(sum(op.bytes_moved for op in self.compute_ops))

    def __repr__(self) -> str:
        slots = ", ".join(s.name for s in self.slots) or "sequential only"
        return (f"{type(self).__name__}({self.name!r}: {len(self.compute_ops)} ops, "
                f"{self.flops / 1e9:.1f} GFLOP, {self.comm_op.kind.value} "
                f"{self.comm_op.bytes / 2**20:.1f} MiB x{self.comm_op.group_size}; slots: {slots})")


@attrs.frozen(kw_only=True, repr=False)
class OpPartition(Partition):
    """A partition given directly by its ops: the simplest way to describe your own."""

    name: str  # type: ignore[misc]
    compute_ops: tuple[ComputeOp, ...] = attrs.field(converter=_compute_ops)  # type: ignore[misc]
    comm_op: CommOp  # type: ignore[misc]
    overlappable: bool = True  # type: ignore[misc]

    def __attrs_post_init__(self) -> None:
        if not self.compute_ops:
            raise ArgumentError(f"partition {self.name!r} needs at least one computation op")
        names = [op.name for op in self.compute_ops]
        if len(set(names)) != len(names):
            raise ArgumentError(f"partition {self.name!r}: op names must be unique, got {names}")


@attrs.frozen(kw_only=True, repr=False)
class TransformerPartition(OpPartition):
    """A partition of a transformer layer, as built by [`build_partitions`][kareus.model.build_partitions].

    Attributes:
        phase: ``"fwd"`` or ``"bwd"``.
        segment: The layer segment whose computation it holds (``"attn"``, ``"mlp"``, ...).
        stage_gpus: GPUs of the pipeline stage that run it (TP x CP); ``None`` = the
            collective's group. Sets [`group_gpus`][kareus.model.TransformerPartition.group_gpus],
            the scope of its measurements.
        comm_group: The parallel group its collective runs over (``"tp"``, ``"cp"``, or
            ``"ep"``: a mixture of experts' all-to-all, whose ranks span data-parallel
            replicas, so ``stage_gpus`` need not hold them; ``""``: not said). Under sequence parallelism with CP, a TP and a CP collective
            may be of one kind; the runtime tells them apart by it.
    """

    phase: str = "fwd"
    segment: str = ""
    stage_gpus: int | None = None
    comm_group: str = ""

    @property
    def group_gpus(self) -> int:
        """``stage_gpus`` when given, else the collective's group."""
        return self.comm_op.group_size if self.stage_gpus is None else int(self.stage_gpus)


#: GPUs per node the builder assumes when it decides which traffic crosses nodes (the
#: 8-GPU NVLink nodes of the reference evaluation: DGX A100 / H100 / H200 class machines).
GPUS_PER_NODE = 8


def _nonneg_float(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and value >= 0):
        raise ArgumentError(f"OutsideWork.{attribute.name} must be a number >= 0, got {value!r}")


def _names(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ArgumentTypeError(f"OutsideWork.comms_in_node must be a sequence of collective "
                                f"names, got {value!r:.60}")
    return tuple(value)


@attrs.frozen(kw_only=True)
class OutsideWork:
    """Work that is not part of any partition, run sequentially.

    Per microbatch computation (``PartitionSet.outside``): the embedding, final norm,
    LM head and loss, their vocabulary-parallel all-reduces, and the pipeline send of the
    computation's output to the next stage (forward) or of its input gradient to the
    previous one (backward). Per iteration (``PartitionSet.iteration``): the optimizer
    step and the gradient reduction over the DP x CP ranks.

    Attributes:
        ops: Computation ops, per rank.
        comms: Collectives run after them without overlap (e.g. vocab-parallel all-reduces,
            the gradient reduction over DP x CP).
        comms_cross_node: Whether ``comms`` cross nodes (then the inter-node network, not
            NVLink, limits them).
        p2p_bytes: Bytes this rank sends to a neighbouring pipeline stage after ``ops`` and
            ``comms`` (0: none); the matching receive runs at the same time.
        p2p_cross_node: Whether the pipeline send crosses nodes.
        comms_in_node: Names of those ``comms`` whose group lies inside one node (NVLink)
            although ``comms_cross_node`` is set: a job over several nodes whose collectives
            do not all span them (the iteration's gradient reduction over a CP group of one
            node beside the tied embedding's all-reduce between end stages on two nodes,
            ``iteration_work``). Empty (the default): ``comms_cross_node`` says it for every
            collective. Shown in the work's ``repr`` only when not empty.
    """

    ops: tuple[ComputeOp, ...] = attrs.field(converter=_compute_ops, factory=tuple)
    comms: tuple[CommOp, ...] = attrs.field(converter=_comm_ops, factory=tuple)
    comms_cross_node: bool = False
    p2p_bytes: float = attrs.field(default=0.0, validator=_nonneg_float)
    p2p_cross_node: bool = False
    comms_in_node: tuple[str, ...] = attrs.field(converter=_names, factory=tuple, repr=False)

    def __attrs_post_init__(self) -> None:
        names = {c.name for c in self.comms}
        unknown = [n for n in self.comms_in_node if n not in names]
        if unknown:
            raise ArgumentError(f"OutsideWork.comms_in_node names {unknown}, which are not "
                                f"among its comms {sorted(names)}")

    def __repr__(self) -> str:
        # attrs's repr of the other fields, unchanged when ``comms_in_node`` is empty: the
        # repr keys measurements (the emulator's noise, output folders), so work that never
        # sets the field keeps the keys it had before the field existed.
        fields = [f"{a.name}={getattr(self, a.name)!r}" for a in attrs.fields(type(self))
                  if a.name != "comms_in_node"]
        if self.comms_in_node:
            fields.append(f"comms_in_node={self.comms_in_node!r}")
        return f"{type(self).__name__}({', '.join(fields)})"

    def crosses_node(self, comm: CommOp) -> bool:
        """Whether ``comm`` (one of ``comms``) crosses nodes: ``comms_cross_node``, unless
        ``comms_in_node`` names it."""
        return self.comms_cross_node and comm.name not in self.comms_in_node

    @property
    def empty(self) -> bool:
        """Whether there is nothing to run."""
        return not self.ops and not self.comms and not self.p2p_bytes

    @property
    def flops(self) -> float:
        """FLOPs of the computation ops together (per rank)."""
        return float(sum(op.flops for op in self.ops))


@attrs.frozen(kw_only=True)
class PartitionSet:
    """Everything a workload's microbatch computations are made of.

    Attributes:
        workload: The workload it was built from.
        types: Partition types by name.
        counts: ``counts[phase][type]`` = instances one stage runs per microbatch (the same on
            every stage, since layers are spread evenly).
        outside: ``outside[(stage, phase)]`` = the work outside partitions.
        iteration: Work once per iteration after the pipeline flush, per GPU of the stage
            with the most parameters (every stage runs it at the same time): the optimizer
            step and the gradient reduction over DP x CP (``iteration_work``).
    """

    workload: Workload
    types: dict[str, Partition]
    counts: dict[str, dict[str, int]]
    outside: dict[tuple[int, str], OutsideWork]
    iteration: OutsideWork = attrs.field(factory=OutsideWork)

    def __getitem__(self, name: str) -> Partition:
        return self.types[name]

    def __iter__(self) -> Iterator[Partition]:
        return iter(self.types.values())

    def __len__(self) -> int:
        return len(self.types)

    @property
    def names(self) -> list[str]:
        """The partition type names, in build order."""
        return list(self.types)

    def computation_flops(self, stage: int, phase: str) -> float:
        """FLOPs one rank of ``stage`` executes for one microbatch's ``phase``."""
        total = sum(self.types[t].flops * c for t, c in self.counts[phase].items())
        return total + self.outside[(stage, phase)].flops

    def model_flops_per_gpu_iteration(self) -> float:
        """Model FLOPs per GPU per iteration: 3x forward, recomputation not counted.

        Averaged over the pipeline stages (each stage's GPUs do their stage's share). Of a
        mixture of experts with routing imbalance, the mean rank's FLOPs (balanced
        routing): the partitions hold the busiest rank's, which is not model work.
        """
        wl = self.workload
        if wl.routing_imbalance != 1:
            return build_partitions(wl.with_(routing_imbalance=1.0)
                                    ).model_flops_per_gpu_iteration()
        pp = wl.parallelism.pp
        fwd_partitions = sum(self.types[t].flops * c for t, c in self.counts["fwd"].items())
        total = sum(3.0 * (fwd_partitions + self.outside[(s, "fwd")].flops) for s in range(pp))
        return total * wl.num_microbatches / pp

    def __repr__(self) -> str:
        lines = [f"PartitionSet({self.workload.describe()})"]
        for name, p in self.types.items():
            c = {ph: self.counts[ph].get(name, 0) for ph in PHASES}
            lines.append(f"  {p!r}  x{c['fwd']} fwd, x{c['bwd']} bwd per microbatch")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- builder


@attrs.frozen
class _Segment:
    name: str
    ops: tuple[ComputeOp, ...]
    comm: CommOp | None
    group: str = ""  # the collective's group ("tp", "cp"), "" without one


class _Shapes:
    """Per-rank shapes of one nanobatch (or one microbatch, with ``parts=1``); with
    ``chunk``, of chunk ``chunk`` of a microbatch of one sequence split along the sequence
    into ``parts`` (``Workload.sequence_split``)."""

    # mixture-of-experts shapes, set by ``_moe_shapes`` for an MoE model only
    tm: int
    k: int
    experts: int
    local: int
    fe: int
    fs: int
    rd: int
    rows: float
    group_rows: float
    sort: bool

    def __init__(self, wl: Workload, parts: int, chunk: int | None = None) -> None:
        m, p = wl.model, wl.parallelism
        self.d = wl.dtype_bytes
        if chunk is None:
            self.b = wl.microbatch_size // parts  # sequences
            self.sq = wl.seq_len // p.cp  # query tokens per sequence on this rank
            self.sk = wl.seq_len  # key tokens per sequence after the CP all-gather
            # causal attention, load-balanced over CP ranks: half the score matrix; with
            # packed documents masked (CP = 1), the causal halves of the documents'
            # squares (kareus.model.documents)
            self.pairs = (0.5 * self.sq * self.sk if wl.document_tokens is None
                          else document_pairs(wl.seq_len, wl.document_tokens))
        else:  # one sequence (CP = 1), its chunk ``chunk`` of ``parts``
            self.b = 1
            self.sq = wl.seq_len // parts
            # its queries read the keys of its own chunk and of every earlier one: the
            # earlier chunks' whole (chunk x sq x sq) block and half of its own square, as
            # the half score matrix of a whole sequence counts (the chunks' sum is it)
            self.sk = (chunk + 1) * self.sq
            self.pairs = (chunk + 0.5) * self.sq * self.sq
        self.t = self.b * self.sq  # tokens on this rank
        # tokens the norms (and the residual additions fused into them) see: the rank's
        # sequence shard under sequence parallelism, else all of them
        self.tn = self.t // p.tp if p.sequence_parallel else self.t
        self.sp = p.sequence_parallel
        self.recompute = wl.recompute
        self.h = m.hidden
        self.q = m.heads // p.tp * m.head_dim
        self.kv = m.kv_heads // p.tp * m.head_dim
        self.f = m.ffn // p.tp
        self.v = m.vocab // p.tp if m.vocab % p.tp == 0 else -(-m.vocab // p.tp)
        self.heads = m.heads // p.tp
        self.head_dim = m.head_dim
        self.qk_norm = m.qk_norm
        self.qkv_bias = m.qkv_bias
        self.moe = m.moe
        if m.moe is not None:
            _moe_shapes(self, wl)

    def gemm(self, name: str, m: int, k: int, n: int, *, bias_add: bool = False,
             bias_grad: bool = False) -> ComputeOp:
        """An (m x k) @ (k x n) GEMM: reads both operands, writes the result once.

        ``bias_add``: the epilogue adds a bias of ``n`` values to every output row (``m x n``
        additions, the bias read). ``bias_grad``: the epilogue also sums the ``k x n`` operand
        over its ``k`` rows, the gradient of such a bias (``k x n`` additions, ``n`` values
        written); the operand is read by the GEMM already.
        """
        flops = 2.0 * m * k * n
        moved = (m * k + m * n + k * n) * self.d
        if bias_add:
            flops += m * n
            moved += n * self.d
        if bias_grad:
            flops += k * n
            moved += n * self.d
        return ComputeOp(name=name, kind=OpKind.GEMM, flops=flops, bytes_moved=moved)

    def mem(self, name: str, kind: OpKind, elems_moved: float, flops_per_elem: float = 1.0
            ) -> ComputeOp:
        return ComputeOp(name=name, kind=kind, flops=flops_per_elem * elems_moved,
                         bytes_moved=elems_moved * self.d)

    def attention(self, name: str, backward: bool) -> ComputeOp:
        # Causal attention: 4 FLOPs per (query, key) pair and head dimension (QK^T, PV),
        # over the pairs the causal mask leaves (``pairs``); K and V of the keys it reads.
        fwd_flops = 4.0 * self.b * self.pairs * self.heads * self.head_dim
        kv_elems = 2 * self.b * self.sk * self.kv
        if backward:
            return ComputeOp(name=name, kind=OpKind.ATTENTION, flops=2.5 * fwd_flops,
                             bytes_moved=(4 * self.t * self.q + 2 * kv_elems) * self.d)
        return ComputeOp(name=name, kind=OpKind.ATTENTION, flops=fwd_flops,
                         bytes_moved=(2 * self.t * self.q + kv_elems) * self.d)


def _layer_ops(phase: str, s: _Shapes) -> dict[str, ComputeOp]:
    """Every op of a decoder layer's ``phase``, costed at the shapes ``s``, by name."""
    t, h, q, kv, f = s.t, s.h, s.q, s.kv, s.f
    tn = s.tn  # the norms' tokens (t / TP under sequence parallelism)
    # qk-norm: each query and key head RMS-normalised over head_dim before RoPE (Qwen3), run
    # fused with RoPE, one memory-bound kernel per phase (KernelSet.qk_norm_rope and
    # qk_norm_rope_bwd), in RoPE's place. Its bytes are the op's minimum traffic: forward,
    # q and k of the QKV projection's output read, the two norm weights (head_dim each) and
    # the cos/sin tables (seq x head_dim each) read, the normalised and rotated q and k
    # written; backward, dQ, dK, dV, the pre-norm q and k, the weights and the tables read,
    # the packed dQKV (dV copied into place) and the weights' float32 gradients written.
    # FLOPs per element of q and k: forward 4 for the norm (square and sum, scale by the
    # reciprocal RMS and by the weight) and 3 for the rotation; backward 9 and 3 (as the
    # separate norm and RoPE ops counted them).
    hd = s.head_dim
    tables = 2 * s.sq * hd  # cos and sin of this rank's positions
    qk_norm_rope = ComputeOp(name="qk_norm_rope", kind=OpKind.ROPE,
                             flops=7.0 * t * (q + kv),
                             bytes_moved=(2 * t * (q + kv) + 2 * hd + tables) * s.d)
    qk_norm_rope_bwd = ComputeOp(
        name="qk_norm_rope_bwd", kind=OpKind.ROPE, flops=12.0 * t * (q + kv),
        bytes_moved=(t * (q + 2 * kv) + t * (q + kv) + 2 * hd + tables
                     + t * (q + 2 * kv)) * s.d + 2 * hd * 4)
    ops: tuple[ComputeOp, ...]
    if phase == "fwd":
        ops = (s.mem("attn_norm", OpKind.NORM, 2 * tn * h, 2.0),
               s.gemm("qkv", t, h, q + 2 * kv, bias_add=s.qkv_bias),
               (qk_norm_rope if s.qk_norm
                else s.mem("rope", OpKind.ROPE, 2 * t * (q + kv), 1.5)),
               s.attention("attn_core", backward=False), s.gemm("out_proj", t, q, h),
               s.mem("mlp_norm", OpKind.NORM, 2 * tn * h, 2.0), s.gemm("gate", t, h, f),
               s.gemm("up", t, h, f), s.mem("swiglu", OpKind.ACTIVATION, 3 * t * f, 2.0),
               s.gemm("down", t, f, h))
        return {op.name: op for op in ops}
    # RoPE's backward rotates dQ and dK back and also carries dV into the packed dQKV the
    # QKV GEMM's backward reads (autograd's concatenation of the three, fused into the
    # one kernel): its bytes count dV's read and write; its FLOPs are the rotation's.
    # With qk-norm the fused backward (above) runs in its place. A QKV bias's gradient (dQKV summed over the
    # tokens) is reduced in the weight-gradient GEMM's epilogue, which reads dQKV anyway.
    rope_bwd = ComputeOp(name="rope_bwd", kind=OpKind.ROPE, flops=1.5 * 2 * t * (q + kv),
                         bytes_moved=2 * t * (q + 2 * kv) * s.d)
    ops = (s.mem("attn_norm_bwd", OpKind.NORM, 3 * tn * h, 3.0),
           s.gemm("down_dgrad", t, h, f), s.gemm("down_wgrad", f, t, h),
           s.mem("swiglu_bwd", OpKind.ACTIVATION, 5 * t * f, 3.0),
           s.gemm("gate_dgrad", t, f, h), s.gemm("up_dgrad", t, f, h),
           s.gemm("gate_wgrad", h, t, f), s.gemm("up_wgrad", h, t, f),
           s.mem("mlp_norm_bwd", OpKind.NORM, 3 * tn * h, 3.0),
           # selective recomputation re-runs the attention core's forward (the same
           # kernel, the same work) before the output projection's backward reads its output
           *((s.attention("attn_core", backward=False),) if s.recompute == "selective" else ()),
           s.gemm("out_dgrad", t, h, q), s.gemm("out_wgrad", q, t, h),
           s.attention("attn_core_bwd", backward=True),
           qk_norm_rope_bwd if s.qk_norm else rope_bwd,
           s.gemm("qkv_dgrad", t, q + 2 * kv, h),
           s.gemm("qkv_wgrad", h, t, q + 2 * kv, bias_grad=s.qkv_bias))
    return {op.name: op for op in ops}


def _moe_shapes(s: _Shapes, wl: Workload) -> None:
    """The mixture-of-experts shapes of one rank (``kareus.model.moe``): ``tm`` tokens
    routed by this rank (its sequence shard under sequence parallelism), ``rows`` token
    rows its experts receive (``tm x top-k``, times ``Workload.routing_imbalance`` on the
    busiest expert-parallel rank, whose load every rank waits for), ``local`` experts of
    width ``fe``, and ``group_rows`` tokens per local expert (the mean over them)."""
    moe = wl.model.moe
    assert moe is not None
    ep = wl.parallelism.ep
    s.tm = s.tn
    s.k = moe.experts_per_token
    s.experts = moe.experts
    s.local = moe.experts // ep
    s.fe = moe.expert_ffn
    s.fs = moe.shared_experts * moe.shared_expert_ffn  # the shared experts side by side
    s.rd = moe.router_dtype_bytes
    s.rows = wl.routing_imbalance * s.tm * s.k
    s.group_rows = s.rows / s.local
    # Megatron-Core sorts the received tokens by local expert (and back) when an EP rank
    # holds more than one expert
    s.sort = ep > 1 and s.local > 1


def _moe_ops(phase: str, s: _Shapes) -> dict[str, ComputeOp]:
    """The MoE block's ops of ``phase`` (``kareus.model.decoder.moe_decoder_layer``), by
    name. Per rank, with ``tm`` routed tokens, ``r`` received rows, ``E`` experts, ``k``
    top-k, ``fe`` the expert width, ``d`` the activation and ``rd`` the router dtype's bytes:

    * ``router``: GEMM ``tm x h @ h x E`` (its input's cast to the router dtype fused into
      it); ``router_topk``: softmax over the ``E`` logits and the top-k (reads the logits,
      writes the probabilities kept for the backward, the top-k values and int64 indices;
      5 FLOPs per logit); ``permute``: each token copied to its ``k`` rows (reads
      ``tm x h``, writes ``tm k x h`` and reads the int64 row map);
    * ``expert_sort`` / ``expert_unsort``: the received rows reordered by local expert and
      back (read and write ``r x h`` each);
    * ``expert_gate_up``, ``expert_down``: grouped GEMMs over the ``E / ep`` local experts
      (gate and up as one ``r x h @ h x 2fe``, then ``r x fe @ fe x h``), each expert's
      weight read once; ``expert_swiglu`` as the dense layer's SwiGLU on ``r x fe``;
    * ``unpermute``: each token's ``k`` rows weighted by their probabilities and summed
      (reads ``tm k x h`` and the probabilities, writes ``tm x h``; with shared experts it
      also reads and adds their output);
    * shared experts: the dense layer's SwiGLU MLP of width ``shared_experts x
      shared_expert_ffn`` on the ``tm`` tokens;

    and their backward: each GEMM's data and weight gradient (a grouped GEMM's weight
    gradient reads the token rows and writes each expert's weight gradient), the SwiGLU
    backward, ``unpermute_bwd`` (reads the output gradient, the expert outputs and the
    probabilities, writes the rows' gradients and the probabilities' gradients),
    ``permute_bwd`` (sums each token's ``k`` row gradients), ``router_topk_bwd`` (the
    softmax's backward over the ``E`` logits), ``router_dgrad`` / ``router_wgrad``.
    """
    h, tm, k, E, fe, d, rd = s.h, s.tm, s.k, s.experts, s.fe, s.d, s.rd
    r, L = s.rows, s.local
    fs = s.fs
    ew = OpKind.ELEMENTWISE

    def grouped(name: str, flops: float, token_elems: float, weight_elems: float) -> ComputeOp:
        # token-side operands and output, plus each local expert's weight read (or its
        # gradient written) once
        return ComputeOp(name=name, kind=OpKind.GEMM, flops=flops,
                         bytes_moved=(token_elems + L * weight_elems) * d,
                         group_rows=s.group_rows)

    def mem(name: str, kind: OpKind, nbytes: float, flops: float) -> ComputeOp:
        return ComputeOp(name=name, kind=kind, flops=flops, bytes_moved=nbytes)

    ops: list[ComputeOp] = []
    if phase == "fwd":
        ops += [ComputeOp(name="router", kind=OpKind.GEMM, flops=2.0 * tm * h * E,
                          bytes_moved=tm * h * d + (h * E + tm * E) * rd),
                mem("router_topk", ew, 2 * tm * E * rd + tm * k * (rd + 8), 5.0 * tm * E),
                mem("permute", ew, (tm + tm * k) * h * d + tm * k * 8, 0.0)]
        if fs:
            ops += [s.gemm("shared_gate", tm, h, fs), s.gemm("shared_up", tm, h, fs),
                    s.mem("shared_swiglu", OpKind.ACTIVATION, 3 * tm * fs, 2.0),
                    s.gemm("shared_down", tm, fs, h)]
        if s.sort:
            ops += [mem("expert_sort", ew, 2 * r * h * d, 0.0),
                    mem("expert_unsort", ew, 2 * r * h * d, 0.0)]
        ops += [grouped("expert_gate_up", 2.0 * r * h * 2 * fe, r * h + r * 2 * fe, h * 2 * fe),
                s.mem("expert_swiglu", OpKind.ACTIVATION, 3 * r * fe, 2.0),
                grouped("expert_down", 2.0 * r * fe * h, r * fe + r * h, fe * h),
                mem("unpermute", ew, (tm * k * h + tm * h + (tm * h if fs else 0)) * d
                    + tm * k * rd, 2.0 * tm * k * h + (tm * h if fs else 0))]
        return {op.name: op for op in ops}
    ops += [mem("unpermute_bwd", ew, (tm * h + 2 * tm * k * h) * d + 2 * tm * k * rd,
                3.0 * tm * k * h)]
    if s.sort:
        ops += [mem("expert_unsort_bwd", ew, 2 * r * h * d, 0.0),
                mem("expert_sort_bwd", ew, 2 * r * h * d, 0.0)]
    if fs:
        ops += [s.gemm("shared_down_dgrad", tm, h, fs), s.gemm("shared_down_wgrad", fs, tm, h),
                s.mem("shared_swiglu_bwd", OpKind.ACTIVATION, 5 * tm * fs, 3.0),
                s.gemm("shared_gate_dgrad", tm, fs, h), s.gemm("shared_up_dgrad", tm, fs, h),
                s.gemm("shared_gate_wgrad", h, tm, fs), s.gemm("shared_up_wgrad", h, tm, fs)]
    ops += [grouped("expert_down_dgrad", 2.0 * r * h * fe, r * h + r * fe, h * fe),
            grouped("expert_down_wgrad", 2.0 * r * fe * h, r * fe + r * h, fe * h),
            s.mem("expert_swiglu_bwd", OpKind.ACTIVATION, 5 * r * fe, 3.0),
            grouped("expert_gate_up_dgrad", 2.0 * r * 2 * fe * h, r * 2 * fe + r * h, 2 * fe * h),
            grouped("expert_gate_up_wgrad", 2.0 * h * r * 2 * fe, r * h + r * 2 * fe, h * 2 * fe),
            mem("permute_bwd", ew, (tm * k + tm) * h * d, 1.0 * tm * k * h),
            mem("router_topk_bwd", ew, 2 * tm * E * rd + tm * k * rd, 4.0 * tm * E),
            ComputeOp(name="router_dgrad", kind=OpKind.GEMM, flops=2.0 * tm * E * h,
                      bytes_moved=(tm * E + E * h) * rd + tm * h * d),
            ComputeOp(name="router_wgrad", kind=OpKind.GEMM, flops=2.0 * h * tm * E,
                      bytes_moved=tm * h * d + (tm * E + h * E) * rd)]
    return {op.name: op for op in ops}


#: The dense MLP's ops, which a mixture-of-experts layer does not run.
_DENSE_MLP_OPS = ("gate", "up", "swiglu", "down", "down_dgrad", "down_wgrad", "swiglu_bwd",
                  "gate_dgrad", "up_dgrad", "gate_wgrad", "up_wgrad")


def _layer_comms(wl: Workload, s: _Shapes) -> dict[tuple[str, str], CommOp | None]:
    """A layer's collectives by ``(kind, group)`` (``None`` where the group has one GPU).

    ``CommOp.bytes`` follows its convention (the emulator moves ``bus_bytes`` of it): an
    all-reduce's tensor, an all-gather's gathered output, a reduce-scatter's input. So the
    TP all-reduce and, under sequence parallelism, the TP all-gather (of the normed input
    or the output gradient) and reduce-scatter (of the output projections' partial sums or
    the input gradients) all name the rank's whole ``tokens x hidden`` activation; the CP
    ones the K and V of the whole sequence."""
    p = wl.parallelism
    act = s.t * s.h * s.d
    kv_bytes = 2 * s.b * s.sk * s.kv * s.d
    tp = p.tp > 1
    cp = p.cp > 1
    return {
        ("all_reduce", "tp"): (CommOp(name="tp_all_reduce", kind=CommKind.ALL_REDUCE,
                                      bytes=act, group_size=p.tp) if tp else None),
        ("all_gather", "tp"): (CommOp(name="tp_all_gather", kind=CommKind.ALL_GATHER,
                                      bytes=act, group_size=p.tp) if tp else None),
        ("reduce_scatter", "tp"): (CommOp(name="tp_reduce_scatter",
                                          kind=CommKind.REDUCE_SCATTER, bytes=act,
                                          group_size=p.tp) if tp else None),
        ("all_gather", "cp"): (CommOp(name="cp_all_gather_kv", kind=CommKind.ALL_GATHER,
                                      bytes=kv_bytes, group_size=p.cp) if cp else None),
        ("reduce_scatter", "cp"): (CommOp(name="cp_reduce_scatter_dkv",
                                          kind=CommKind.REDUCE_SCATTER, bytes=kv_bytes,
                                          group_size=p.cp) if cp else None),
        # a mixture of experts' dispatch and combine (forward and backward): the token rows
        # the busiest EP rank receives, of which (EP-1)/EP cross its links (``bus_bytes``)
        ("all_to_all", "ep"): (CommOp(name="ep_all_to_all", kind=CommKind.ALL_TO_ALL,
                                      bytes=s.rows * s.h * s.d, group_size=p.ep)
                               if s.moe is not None and p.ep > 1 else None),
    }


def _layer_segments(wl: Workload, phase: str, s: _Shapes) -> list[_Segment]:
    """A layer's segments in the op order of ``kareus.model.decoder`` (its TP layout,
    query/key norm and recomputation policy; seen as a cycle: the backward's input-norm
    backward opens its MLP segment), each op costed here. Without a CP collective the two
    attention segments are one (``ATTENTION_SEGMENT``); a segment whose collective does not
    run (TP = 1) keeps ``comm=None`` for ``_normalise``."""
    p = wl.parallelism
    comms = _layer_comms(wl, s)
    ops = _layer_ops(phase, s)
    if s.moe is None:
        layer = decoder_layer(phase, qk_norm=s.qk_norm, sp=s.sp, recompute=s.recompute)
    else:  # the MoE block in place of the dense MLP
        ops = {n: op for n, op in ops.items() if n not in _DENSE_MLP_OPS} | _moe_ops(phase, s)
        layer = moe_decoder_layer(phase, qk_norm=s.qk_norm, sp=s.sp, recompute=s.recompute,
                                  shared_experts=s.fs > 0, sort_tokens=s.sort)
    unknown = sorted(set(layer.op_names) ^ set(ops))
    if unknown:  # the op order and the costs name the same ops
        raise AssertionError(f"decoder ops without a cost or not in the op order: {unknown}")
    out: list[_Segment] = []
    merge: tuple[ComputeOp, ...] = ()
    for seg in layer.cyclic_segments():
        seg_ops = merge + tuple(ops[n] for n in seg.op_names)
        c = seg.collective
        if c.group == "cp" and p.cp == 1:
            merge = seg_ops  # no CP collective: one attention segment with the next
            continue
        name = ATTENTION_SEGMENT if merge else seg.name
        out.append(_Segment(name, seg_ops, comms[(c.kind, c.group)],
                            c.group if comms[(c.kind, c.group)] is not None else ""))
        merge = ()
    return out


def _normalise(segments: list[_Segment]) -> list[_Segment]:
    """Rotate the cyclic segment list so it ends with a collective, then merge every
    segment without a collective into the one after it."""
    if all(seg.comm is None for seg in segments):
        return []
    while segments[-1].comm is None:
        segments = [segments[-1], *segments[:-1]]
    out: list[_Segment] = []
    pending: list[_Segment] = []
    for seg in segments:
        if seg.comm is None:
            pending.append(seg)
            continue
        if pending:
            ops = tuple(op for p in pending for op in p.ops) + seg.ops
            name = "_".join([p.name for p in pending] + [seg.name])
            seg = _Segment(name, ops, seg.comm, seg.group)
            pending = []
        out.append(seg)
    return out


def _chains(wl: Workload, segs: dict[str, list[_Segment]]) -> list[tuple[str, str, str]]:
    """The chains of segments one stage runs per microbatch computation, as
    ``(phase counted in, phase of the segments, phase whose last collective the chain's
    first segment overlaps)``: the forward pass chains forward layers (layer ``l+1``'s first
    segment overlaps layer ``l``'s last collective), the backward pass backward layers; with
    full recomputation the backward also runs each layer's forward right before its
    backward, so in it the recomputed forward's first segment overlaps the last collective
    of the backward of the layer above, and the backward's first segment the recomputed
    forward's last one. (With TP > 1 without sequence parallelism both phases end with the
    TP all-reduce, so this pairs as the forward pass does; at TP = 1 the runtime's units of
    a recomputed stack mix both phases' ops and run sequentially, so the forward pass's
    pairing is kept.)"""
    if wl.recompute != "full":
        return [("fwd", "fwd", "fwd"), ("bwd", "bwd", "bwd")]
    if wl.parallelism.tp == 1 and wl.model.moe is None:
        return [("fwd", "fwd", "fwd"), ("bwd", "bwd", "bwd"), ("bwd", "fwd", "fwd")]
    return [("fwd", "fwd", "fwd"), ("bwd", "bwd", "fwd"), ("bwd", "fwd", "bwd")]


def _type_name(phase: str, segment: str, comm: CommOp, group: str,
               overlapped: set[tuple[CommKind, str]]) -> str:
    """A partition type's name: ``{phase}_{segment}``, and when the segment overlaps more
    than one collective, the collective's kind (``_ar``, ``_ag``, ``_rs``), or its group and
    kind (``_tp_rs``, ``_cp_rs``) when two of them are of one kind (under sequence
    parallelism with CP, a TP and a CP all-gather or reduce-scatter). Names depend on the
    layer's structure only (never on message sizes), so they are stable for a workload."""
    name = f"{phase}_{segment}"
    if len(overlapped) == 1:
        return name
    if len({kind for kind, _ in overlapped}) == len(overlapped):
        return f"{name}_{comm.kind.short}"
    return f"{name}_{group}_{comm.kind.short}"


#: ``(phase counted in, type phase, segment, the collective it overlaps, its group,
#: instances per layer, its chunk when the segment's work depends on it)``
_Pair = tuple[str, str, _Segment, CommOp, str, int, int | None]


def _overlap_pairs(wl: Workload, segs_of: dict[str, list[list[_Segment]]]) -> list[_Pair]:
    """Every (computation, collective) pair one stage runs per microbatch computation: each
    nanobatch of a segment beside the collective of the nanobatch before it in stream
    order (``_chains``); along the sequence (``Workload.sequence_split``), a segment whose
    work depends on the chunk (its attention) in one pair per chunk."""
    n = wl.nanobatches
    segs = {phase: segs_of[phase][0] for phase in PHASES}
    pairs: list[_Pair] = []

    def units(phase: str, j: int, which: Sequence[int]) -> list[tuple[_Segment, int, int | None]]:
        """``(segment, instances, chunk label)`` of segment ``j``'s nanobatches ``which``
        (positions in the order they run)."""
        if not which:
            return []
        same = all(segs_of[phase][c][j].ops == segs[phase][j].ops
                   for c in range(len(segs_of[phase])))
        if same:
            return [(segs[phase][j], len(which), None)]
        # forward in chunk order (a chunk's attention reads the earlier chunks' K and V);
        # backward in reverse (a chunk's attention backward adds to the earlier chunks'
        # dK and dV, which their QKV backward reads)
        order = list(range(n)) if phase == "fwd" else list(reversed(range(n)))
        return [(segs_of[phase][order[i]][j], 1, order[i]) for i in which]

    for counted, phase, prev_last in _chains(wl, segs):
        chain = segs[phase]
        m = len(chain)
        for j, seg in enumerate(chain):
            assert seg.comm is not None
            if n == 1:
                pairs.append((counted, phase, seg, seg.comm, seg.group, 1, None))
                continue
            # nanobatches 2..n overlap the collective of the one before them
            for unit, k, c in units(phase, j, range(1, n)):
                pairs.append((counted, phase, unit, seg.comm, seg.group, k, c))
            if j + 1 < m:  # the next segment's first nanobatch overlaps its last one's
                for unit, k, c in units(phase, j + 1, [0]):
                    pairs.append((counted, phase, unit, seg.comm, seg.group, k, c))
        if n > 1:  # the first segment's first nanobatch overlaps the collective before it
            last = segs[prev_last][-1]
            assert last.comm is not None
            for unit, k, c in units(phase, 0, [0]):
                pairs.append((counted, phase, unit, last.comm, last.group, k, c))
    return pairs


#: The piece name of a layer's tail (the ops after its last collective) by its ops.
_TAIL_NAMES: dict[tuple[str, ...], str] = {("attn_norm_bwd",): "attn_norm", ("unpermute",): "moe_unpermute"}


def _piece_ops(phase: str, s: _Shapes) -> dict[str, ComputeOp]:
    """Every op of the layer's ``phase`` (``_layer_ops``, the MoE block's in place of the
    dense MLP's for a mixture-of-experts model), by name."""
    ops = _layer_ops(phase, s)
    if s.moe is None:
        return ops
    return {n: op for n, op in ops.items() if n not in _DENSE_MLP_OPS} | _moe_ops(phase, s)


def _layer_pieces(wl: Workload, phase: str, s: _Shapes) -> list[tuple[str, _Segment]]:
    """One layer's ``phase`` computation as a planned layer of its own runs it (the runtime's
    ``stack_stream`` of one layer, cut at its collectives), as ``(phase of its ops, piece)``:
    each piece a run of ops and the collective after it (``comm=None`` for the ops after the
    last collective: the backward's input-norm backward, a mixture of experts' forward
    un-permutation). The backward re-runs the forward first under full recomputation (a
    mixture of experts' up to its combine: the un-permutation's output is read by no
    backward op); under sequence parallelism a dense layer's backward opens with the
    all-gather of its output's gradient (a piece without ops) and ends without gathering
    its input's (the framework's layer below does), while a mixture of experts' backward
    reads its output's gradient on the sequence shard and leaves its input's there (no
    all-gather at either end). The layer is ``moe_decoder_layer`` for a mixture-of-experts
    model (its shared experts and the expert sort as ``_layer_segments`` chooses them), else
    ``decoder_layer``. A collective over a group of one GPU does not run: its ops join the
    next piece."""
    p = wl.parallelism
    comms = _layer_comms(wl, s)
    sp = s.sp
    moe = s.moe is not None
    if moe:
        fwd, bwd = (moe_decoder_layer(ph, qk_norm=s.qk_norm, sp=sp, recompute=wl.recompute,
                                      shared_experts=s.fs > 0, sort_tokens=s.sort)
                    for ph in PHASES)
    else:
        fwd, bwd = (decoder_layer("fwd", qk_norm=s.qk_norm, sp=sp),
                    decoder_layer("bwd", qk_norm=s.qk_norm, sp=sp, recompute=wl.recompute))
    # (phase of the ops, the layer's phase, whether its tail runs: not the recomputed
    # forward's, as the runtime's ``stack_stream`` runs it)
    run = [("fwd", fwd, phase == "fwd")] if phase == "fwd" or wl.recompute == "full" else []
    if phase == "bwd":
        run.append(("bwd", bwd, True))
    gathers = phase == "bwd" and sp and not moe  # the dense layer's output-gradient gathers
    raw: list[tuple[str, str, tuple[str, ...], tuple[str, str] | None]] = []
    if gathers:
        raw.append(("bwd", "dy", (), ("all_gather", "tp")))
    for ph, layer, tail in run:
        for seg in layer.segments:
            c = seg.collective
            raw.append((ph, seg.name, seg.op_names, (c.kind, c.group)))
        if tail and layer.tail:
            raw.append((ph, _TAIL_NAMES[layer.tail], layer.tail, None))
    if gathers:
        ph, name, names, _ = raw[-1]  # the input gradient's all-gather: the layer below's
        raw[-1] = (ph, name, names, None)
    ops = {ph: _piece_ops(ph, s) for ph in {ph for ph, _, _ in run}}
    out: list[tuple[str, _Segment]] = []
    held: list[tuple[str, str, tuple[str, ...]]] = []  # ops whose collective does not run
    for ph, name, names, key in raw:
        comm = comms[key] if key is not None else None
        if key is not None and comm is None:
            held.append((ph, name, names))
            continue
        if held and {h[0] for h in held} != {ph}:
            raise WorkloadError(
                f"{wl.model.name}: unchained layers (chained_layers=False) at TP={p.tp} with "
                "full recomputation run the recomputed forward's ops and the backward's in "
                "one unit, which kareus does not model: use chained layers or TP > 1")
        seg_names = [h[1] for h in held] + [name]
        label = (ATTENTION_SEGMENT if sorted(seg_names) == ["attn_in", "attn_out"]
                 else "_".join(seg_names))
        seg_ops = tuple(ops[ph][o] for h in held for o in h[2]) + tuple(
            ops[ph][o] for o in names)
        out.append((ph, _Segment(label, seg_ops, comm, key[1] if comm is not None and key
                                 else "")))
        held = []
    if held:  # ops after the last collective that runs
        ph = held[0][0]
        out.append((ph, _Segment("_".join(h[1] for h in held),
                                 tuple(ops[ph][o] for h in held for o in h[2]), None)))
    return out


def _unchained_units(wl: Workload, chunks: Sequence[int | None]
                     ) -> tuple[list[_Pair], dict[str, tuple[ComputeOp, ...]],
                                dict[str, tuple[CommOp, ...]]]:
    """What one planned layer of its own runs per microbatch computation, nanobatched
    (``Workload.chained_layers=False``), as the runtime schedule runs its pieces: the unit
    (piece ``j``, nanobatch ``i``) beside the collective of the unit before it in stream
    order (``(j, i-1)``, or ``(j-1, n-1)`` for ``i = 0``). So the layer's first unit runs
    bare (nothing before it in the layer), a piece without ops leaves the collective
    before it exposed, and the last collective runs exposed after everything.

    Returns:
        The overlapped pairs (as ``_overlap_pairs``, one instance per layer each), and per
        phase one layer's bare computation (its ops) and exposed collectives."""
    n = wl.nanobatches
    pieces_of = {phase: [_layer_pieces(wl, phase, _Shapes(wl, n, c)) for c in chunks]
                 for phase in PHASES}
    pairs: list[_Pair] = []
    bare: dict[str, tuple[ComputeOp, ...]] = {}
    exposed: dict[str, tuple[CommOp, ...]] = {}
    for counted in PHASES:
        per_chunk = pieces_of[counted]
        base = per_chunk[0]
        b_ops: list[ComputeOp] = []
        e_comms: list[CommOp] = []
        pending: tuple[CommOp, str] | None = None
        for j, (ph, seg) in enumerate(base):
            same = all(pc[j][1].ops == seg.ops for pc in per_chunk)
            for i in range(n):
                # forward ops in chunk order, backward ops last chunk first (``_overlap_pairs``)
                c = i if ph == "fwd" else n - 1 - i
                unit = seg if same else per_chunk[c][j][1]
                if pending is None:
                    b_ops += unit.ops
                elif unit.ops:
                    pairs.append((counted, ph, unit, pending[0], pending[1], 1,
                                  None if same else c))
                else:
                    e_comms.append(pending[0])
                pending = (seg.comm, seg.group) if seg.comm is not None else None
        if pending is not None:
            e_comms.append(pending[0])
        bare[counted] = tuple(b_ops)
        exposed[counted] = tuple(e_comms)
    return pairs, bare, exposed


def build_partitions(workload: Workload) -> PartitionSet:
    """Partition types, per-microbatch instance counts and outside work of a workload.

    Raises:
        WorkloadError: the workload has no collective to schedule (TP = CP = 1).
    """
    wl = workload
    p = wl.parallelism
    n = wl.nanobatches
    if p.tp == 1 and p.cp == 1 and p.ep == 1:
        raise WorkloadError(
            f"{wl.model.name}: with TP=1 and CP=1 no layer has a collective to overlap; "
            "kareus needs tensor or context parallelism (set tp >= 2 or cp >= 2)"
            + ("" if wl.model.moe is None else ", or expert parallelism (ep >= 2)"))
    L = wl.layers_per_stage
    types: dict[str, TransformerPartition] = {}
    counts: dict[str, dict[str, int]] = {ph: {} for ph in PHASES}

    # the layer's segments per chunk: one list, or, along the sequence, one per chunk (only
    # the attention ops' costs differ between them)
    chunks: list[int | None] = list(range(n)) if wl.sequence_split else [None]
    outside = _outside_work(wl)
    if wl.chained_layers or n == 1:
        segs_of = {phase: [_normalise(_layer_segments(wl, phase, _Shapes(wl, n, c)))
                           for c in chunks] for phase in PHASES}
        pairs = _overlap_pairs(wl, segs_of)
    else:
        pairs, bare, exposed = _unchained_units(wl, chunks)
        outside = {key: attrs.evolve(work, ops=work.ops + bare[key[1]] * L,
                                     comms=work.comms + exposed[key[1]] * L)
                   for key, work in outside.items()}
    overlapped: dict[tuple[str, str], set[tuple[CommKind, str]]] = {}
    for _, phase, seg, comm, group, _, _ in pairs:
        overlapped.setdefault((phase, seg.name), set()).add((comm.kind, group))
    for counted, phase, seg, comm, group, k, c in pairs:
        name = _type_name(phase, seg.name, comm, group, overlapped[(phase, seg.name)])
        if c is not None:
            name += f"_c{c}"
        if name not in types:
            types[name] = TransformerPartition(name=name, compute_ops=seg.ops, comm_op=comm,
                                               overlappable=n > 1, phase=phase,
                                               segment=seg.name, stage_gpus=p.tp * p.cp,
                                               comm_group=group)
        counts[counted][name] = counts[counted].get(name, 0) + k * L

    return PartitionSet(workload=wl, types=dict(types), counts=counts,
                        outside=outside, iteration=iteration_work(wl))


def stage_params_per_rank(wl: Workload) -> float:
    """Parameters one rank of the pipeline stage with the most parameters holds: its
    layers' weights split over TP (norm weights replicated,
    [`ModelArch.layer_params_per_rank`][kareus.model.ModelArch.layer_params_per_rank]), plus
    the embedding on the first stage and the LM head and final norm on the last (each split
    over TP).

    Tied embeddings are one matrix where the embedding and the LM head share a stage
    (PP = 1). With PP > 1 the last stage keeps its own copy of the tied matrix for the LM
    head (Megatron-LM's layout: the copies stay equal because their gradients are summed,
    ``iteration_work``), so each end stage holds one
    matrix either way."""
    m, p = wl.model, wl.parallelism
    layers = wl.layers_per_stage * m.layer_params_per_rank(p.tp, p.ep)
    embed = m.vocab * m.hidden / p.tp
    if p.pp == 1:
        return layers + (1 if m.tied_embeddings else 2) * embed + m.hidden
    return layers + embed + m.hidden  # the first (embedding) or last (LM head) stage


#: Optimizer step bytes per parameter (mixed-precision Adam as Megatron-LM runs it): read
#: the fp32 gradient, fp32 master weight and the two fp32 moments (16 B), write the master
#: weight, the moments and the bf16 weight (14 B).
ADAM_BYTES_PER_PARAM = 30.0
#: FLOPs per parameter of the Adam update (moments, bias corrections, square root, divide,
#: weight decay; about a dozen elementwise operations).
ADAM_FLOPS_PER_PARAM = 12.0


def grad_reduction_crosses_node(wl: Workload) -> bool:
    """Whether a gradient-reduction group of the workload (the ``DP x CP`` ranks that hold
    one TP rank's shard of one pipeline stage) spans more than one node
    (``GPUS_PER_NODE`` GPUs a node), with the ranks laid out as the workload's
    ``Parallelism.rank_order`` says (``Parallelism.global_rank``).

    Under Megatron-Core's default order (``tp-cp-ep-dp-pp``) a stage's replicas sit next to
    each other, so the group of a ``TP x CP x DP`` block within one node stays there; under
    ``--use-tp-pp-dp-mapping`` (``tp-cp-ep-pp-dp``) the replicas of a stage lie ``TP x CP x
    PP`` ranks apart. A CP group alone (DP = 1) stays inside the ``TP x CP`` block of its
    stage in both.
    """
    p = wl.parallelism
    for tp in range(p.tp):
        for pp in range(p.pp):
            nodes = {p.global_rank(tp=tp, cp=cp, dp=dp, pp=pp) // GPUS_PER_NODE
                     for cp in range(p.cp) for dp in range(p.dp)}
            if len(nodes) > 1:
                return True
    return False


def pipeline_sends_cross_node(wl: Workload) -> bool:
    """Whether any pipeline send of the workload (the same TP, CP and DP coordinates on
    neighbouring stages) crosses nodes, with the ranks laid out as
    ``Parallelism.rank_order`` says: under the default order (``tp-cp-ep-dp-pp``) the
    neighbouring stage lies ``TP x CP x DP`` ranks away, under ``tp-cp-ep-pp-dp``
    ``TP x CP``. The emulator costs every send at the slowest link a send takes."""
    p = wl.parallelism
    for pp in range(p.pp - 1):
        for dp in range(p.dp):
            for cp in range(p.cp):
                for tp in range(p.tp):
                    a = p.global_rank(tp=tp, cp=cp, dp=dp, pp=pp)
                    b = p.global_rank(tp=tp, cp=cp, dp=dp, pp=pp + 1)
                    if a // GPUS_PER_NODE != b // GPUS_PER_NODE:
                        return True
    return False


def iteration_work(wl: Workload, *, distributed_optimizer: bool = True) -> OutsideWork:
    """The work once per iteration after the pipeline flush, per GPU of the largest stage.

    * Gradient reduction over the ``DP x CP`` ranks that hold the same weights when
      ``DP x CP > 1``: every data-parallel replica and every context-parallel rank computes
      gradients of the same weights from different tokens, and Megatron-Core reduces them
      over its ``dp_cp`` group (its distributed optimizer shards over that group too). With
      the distributed optimizer (default), a reduce-scatter of the fp32 gradients and,
      after the step, an all-gather of the bf16 weights over the group; without it, an
      all-reduce of the fp32 gradients. Named for the group: ``dp_*`` at CP = 1,
      ``cp_*`` at DP = 1 (the CP group itself, which a stage's runnable outside work
      runs on), ``dp_cp_*`` otherwise. Across nodes when the group spans more than one
      node (``grad_reduction_crosses_node``: a CP group alone stays in its stage's node;
      with DP > 1 the group crosses nodes when the job does).
    * The Adam step over the parameters this rank updates (all of its stage's, or
      ``1 / (DP x CP)`` of them with the distributed optimizer): ``ADAM_BYTES_PER_PARAM``
      of HBM traffic and ``ADAM_FLOPS_PER_PARAM`` per parameter, one memory-bound op.

    * With tied embeddings and PP > 1, an all-reduce of the tied matrix's fp32 gradient
      (``vocab / TP x hidden``) between the first stage (its embedding's gradient) and the
      last (its LM head's), so that both copies take the same step (Megatron-LM's embedding
      group, two GPUs); across nodes when the job spans more than one node.

    * A mixture-of-experts model's routed experts are not replicated over DP but over the
      expert-data-parallel group of ``tp x cp x dp / ep`` ranks (``kareus.model.moe``):
      their gradients are reduced (and their step divided) over that group, the rest of
      the parameters over DP x CP as above (``_expert_iteration_work``).

    Assumptions (engineering estimates, stated in docs/emulator.md): gradients kept and
    reduced in fp32 (Megatron-LM's ``--bf16`` turns on
    ``--accumulate-allreduce-grads-in-fp32``), no gradient-reduction overlap with the
    backward pass (Megatron-LM's ``--overlap-grad-reduce`` is off by default).
    """
    if wl.model.moe is not None:
        return _expert_iteration_work(wl, distributed_optimizer=distributed_optimizer)
    p, m = wl.parallelism, wl.model
    n = stage_params_per_rank(wl)
    comms: list[CommOp] = []
    share = n
    group = p.dp * p.cp  # Megatron-Core's dp_cp group
    prefix = "dp" if p.cp == 1 else "cp" if p.dp == 1 else "dp_cp"
    if group > 1:
        if distributed_optimizer:
            comms = [CommOp(name=f"{prefix}_grad_reduce_scatter", kind=CommKind.REDUCE_SCATTER,
                            bytes=int(4 * n), group_size=group),
                     CommOp(name=f"{prefix}_param_all_gather", kind=CommKind.ALL_GATHER,
                            bytes=int(2 * n), group_size=group)]
            share = n / group
        else:
            comms = [CommOp(name=f"{prefix}_grad_all_reduce", kind=CommKind.ALL_REDUCE,
                            bytes=int(4 * n), group_size=group)]
    cross = p.world_size > GPUS_PER_NODE
    in_node = ([c.name for c in comms] if cross and comms and not grad_reduction_crosses_node(wl)
               else [])
    if m.tied_embeddings and p.pp > 1:
        # After the gradient reduction, before the step (and so before the weights'
        # all-gather of the distributed optimizer).
        v_local = -(-m.vocab // p.tp)
        tied = CommOp(name="embedding_grad_all_reduce", kind=CommKind.ALL_REDUCE,
                      bytes=4 * v_local * m.hidden, group_size=2)
        comms.insert(1 if group > 1 else 0, tied)
    step = ComputeOp(name="optimizer_step", kind=OpKind.ELEMENTWISE,
                     flops=ADAM_FLOPS_PER_PARAM * share,
                     bytes_moved=ADAM_BYTES_PER_PARAM * share)
    return OutsideWork(ops=(step,), comms=tuple(comms), comms_cross_node=cross,
                       comms_in_node=in_node)


def _expert_iteration_work(wl: Workload, *, distributed_optimizer: bool) -> OutsideWork:
    """``iteration_work`` of a mixture-of-experts model: the routed experts' gradients
    reduced over the expert-data-parallel group (``tp x cp x dp / ep`` ranks), every other
    parameter's over DP x CP (Megatron-Core's ``dp_cp`` group, named as ``iteration_work``
    names it, inside a node where ``grad_reduction_crosses_node`` says so; the expert group
    across nodes when the job spans more than one); each reduction as ``iteration_work``
    says (distributed optimizer:
    reduce-scatter of fp32 gradients, all-gather of bf16 weights, the step over the rank's
    share; else an all-reduce)."""
    p, m = wl.parallelism, wl.model
    assert m.moe is not None
    n = stage_params_per_rank(wl)
    experts = wl.layers_per_stage * m.moe.expert_params_per_rank(m.hidden, ep=p.ep)
    prefix = "dp" if p.cp == 1 else "cp" if p.dp == 1 else "dp_cp"
    groups = ((prefix, n - experts, p.dp * p.cp), ("edp", experts, p.tp * p.cp * p.dp // p.ep))
    reduce: list[CommOp] = []
    gather: list[CommOp] = []
    share = 0.0
    for name, params, size in groups:
        if size == 1:
            share += params
            continue
        if distributed_optimizer:
            reduce.append(CommOp(name=f"{name}_grad_reduce_scatter",
                                 kind=CommKind.REDUCE_SCATTER, bytes=int(4 * params),
                                 group_size=size))
            gather.append(CommOp(name=f"{name}_param_all_gather", kind=CommKind.ALL_GATHER,
                                 bytes=int(2 * params), group_size=size))
            share += params / size
        else:
            reduce.append(CommOp(name=f"{name}_grad_all_reduce", kind=CommKind.ALL_REDUCE,
                                 bytes=int(4 * params), group_size=size))
            share += params
    if m.tied_embeddings and p.pp > 1:
        v_local = -(-m.vocab // p.tp)
        reduce.append(CommOp(name="embedding_grad_all_reduce", kind=CommKind.ALL_REDUCE,
                             bytes=4 * v_local * m.hidden, group_size=2))
    step = ComputeOp(name="optimizer_step", kind=OpKind.ELEMENTWISE,
                     flops=ADAM_FLOPS_PER_PARAM * share,
                     bytes_moved=ADAM_BYTES_PER_PARAM * share)
    cross = p.world_size > GPUS_PER_NODE
    in_node = ([c.name for c in (*reduce, *gather) if c.name.startswith(prefix + "_")]
               if cross and not grad_reduction_crosses_node(wl) else [])
    return OutsideWork(ops=(step,), comms=(*reduce, *gather), comms_cross_node=cross,
                       comms_in_node=in_node)


def _outside_work(wl: Workload) -> dict[tuple[int, str], OutsideWork]:
    """The work of one microbatch computation outside the layers, per stage and phase.

    The embedding (first stage) and the final norm, LM head and loss (last stage), with
    their TP collectives, as Megatron-LM runs them: without sequence parallelism the
    vocab-parallel embedding's output is all-reduced (forward) and so is the LM head's
    input gradient (backward). Under sequence parallelism the embedding's output is
    reduce-scattered onto the sequence shards instead (its backward all-gather is the
    bottom layer's last collective, ``kareus.model.decoder``); the final norm runs on the
    shard and its output is all-gathered before the LM head; backward, the LM head's input
    gradient is reduce-scattered, the final norm's backward runs on the shard and its
    output gradient is all-gathered for the top layer's MLP backward (which reads the whole
    sequence). The collectives run after the ops here (no overlap, and in the emulator a
    sequential run costs the same in either order)."""
    p = wl.parallelism
    s = _Shapes(wl, 1)
    t, h, v = s.t, s.h, s.v
    tn = s.tn
    act = t * h * s.d
    sp = s.sp
    ar = (CommOp(name="tp_all_reduce_vocab", kind=CommKind.ALL_REDUCE, bytes=act,
                 group_size=p.tp) if p.tp > 1 else None)
    rs = (CommOp(name="tp_reduce_scatter_vocab", kind=CommKind.REDUCE_SCATTER, bytes=act,
                 group_size=p.tp) if sp else None)
    ag = (CommOp(name="tp_all_gather_final_norm", kind=CommKind.ALL_GATHER, bytes=act,
                 group_size=p.tp) if sp else None)
    out: dict[tuple[int, str], OutsideWork] = {}
    # Pipeline sends: the stage's output activations (forward) or input gradients
    # (backward) of one microbatch, bf16, split over the TP ranks (each sends its 1/TP
    # share, gathered on the other side: Megatron-LM's scatter-gather of pipeline tensors;
    # under sequence parallelism the share is the rank's sequence shard).
    # Stages sit on different nodes as the rank order lays them out.
    p2p = t * h * s.d / p.tp
    cross = pipeline_sends_cross_node(wl)
    for stage in range(p.pp):
        fwd_ops: list[ComputeOp] = []
        bwd_ops: list[ComputeOp] = []
        fwd_comms: list[CommOp] = []
        bwd_comms: list[CommOp] = []
        if stage == 0:
            fwd_ops.append(s.mem("embedding", OpKind.EMBEDDING, 2 * t * h, 0.0001))
            bwd_ops.append(s.mem("embedding_bwd", OpKind.EMBEDDING, 3 * t * h, 1.0))
            if rs is not None:
                fwd_comms.append(rs)
            elif ar is not None:
                fwd_comms.append(ar)
        if stage == p.pp - 1:
            # With tied embeddings the LM head multiplies by the embedding's matrix, and
            # lm_head_wgrad writes into that matrix's gradient: the same kernels and bytes.
            fwd_ops += [s.mem("final_norm", OpKind.NORM, 2 * tn * h, 2.0),
                        s.gemm("lm_head", t, h, v),
                        s.mem("loss", OpKind.LOSS, 3 * t * v, 4.0)]
            bwd_ops += [s.mem("loss_bwd", OpKind.LOSS, 2 * t * v, 2.0),
                        s.gemm("lm_head_dgrad", t, v, h), s.gemm("lm_head_wgrad", h, t, v),
                        s.mem("final_norm_bwd", OpKind.NORM, 3 * tn * h, 3.0)]
            if sp:
                assert ag is not None and rs is not None
                fwd_comms.append(ag)
                bwd_comms += [rs, ag]
            elif ar is not None:
                bwd_comms.append(ar)
        out[(stage, "fwd")] = OutsideWork(ops=fwd_ops, comms=fwd_comms,
                                          p2p_bytes=p2p if stage < p.pp - 1 else 0.0,
                                          p2p_cross_node=cross)
        out[(stage, "bwd")] = OutsideWork(ops=bwd_ops, comms=bwd_comms,
                                          p2p_bytes=p2p if stage > 0 else 0.0,
                                          p2p_cross_node=cross)
    return out

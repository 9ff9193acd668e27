"""The decoder schedule: which op runs in which partition, and how each is configured.

The one schedule of a decoder stack that kareus runs, in its own training loop
([`TrainingLoop`][kareus.exec.train.TrainingLoop]) and inside a framework's model
([`PlanApplier`][kareus.integrations.PlanApplier]).

A microbatch computation of a decoder stack is one stream of ops with collectives between
them ([`stack_stream`][kareus.exec.schedule.stack_stream]): each layer's ops and collectives in
the order of [`kareus.model.DECODER_LAYER`][kareus.model.DECODER_LAYER] (the one place that
writes it, which the partition model costs too), the forward from the bottom layer up, the
backward from the top layer down, each layer's ``attn_norm_bwd`` (the layer's tail: it needs
the all-reduced input gradient) opening the next layer's backward, as in
[`build_partitions`][kareus.model.build_partitions]. With full recomputation the backward of
each layer first re-runs its forward, collectives included.

[`pieces`][kareus.exec.schedule.pieces] cuts that stream at its collectives: a
[`Piece`][kareus.exec.schedule.Piece] is a run of ops and the collective after them. The three
schedules (``SCHEDULES``) run the pieces of one computation through an
[`Executor`][kareus.exec.Executor] ([`run_computation`][kareus.exec.schedule.run_computation]):

* ``"sequential"`` (Megatron-LM without overlap): the whole microbatch; each piece's
  collective right after its ops, exposed, with the collective's own CTA count;
* ``"nanobatching"`` (the default overlap): the microbatch cut into ``n`` nanobatches; the
  unit (piece ``j``, nanobatch ``i``) runs while the collective of the unit before it in
  stream order runs on the side stream (``(j, i-1)``, or ``(j-1, n-1)`` for ``i = 0``),
  launched with the unit's first op, with the collective's own CTA count;
* ``"kareus"``: the same chain, each unit under the plan's configuration of its partition
  type (launch slot and SM count; the clock is set per computation by the caller).

The partition type of a unit is the type whose ops hold the unit's ops (equal, or a prefix
or suffix at the ends of the stack) and whose collective is the one the unit overlaps
([`match_type`][kareus.exec.schedule.match_type]); the first piece of the stack is a suffix of
its type (the layer below it starts the chain) and the last a prefix. A slot that falls before
the unit's first op launches with that op; one after its last op runs sequentially
([`clip_slot`][kareus.exec.schedule.clip_slot]). The last collective of a computation overlaps
nothing: it runs exposed with the SM count of its cyclic partner type (the first piece's type
with that collective), as the partition model pairs it in a chain; for layers run one by one
(``Workload.chained_layers=False``, ``exposed_default``) with its own CTA count, as the
partition model costs it there (outside work).

A mixture-of-experts model's layers are ``kareus.model.decoder.moe_decoder_layer``'s
(``stack_stream(..., ep=, moe=)``): their dispatch and combine all-to-alls over the EP group
(and those of the gradients) are collectives of the stream like the others, whose split
sizes ``comm_args`` gives when they are launched (the routing decided them); a sequential
all-to-all is named after its piece's ops, which make its tensors.

Every rank runs the same pieces in the same order, so every rank issues the same
collectives in the same order; nothing here depends on timing. Pure Python (no torch).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kareus.errors import ArgumentError, PlanError, UnknownSlotError
from kareus.exec._executor_role import Executor
from kareus.model.decoder import (
    NOT_READ_BY_BACKWARD,
    LayerPhase,
    decoder_layer,
    moe_decoder_layer,
)
from kareus.model.partition import TransformerPartition
from kareus.model.workload import RECOMPUTE_POLICIES, recompute_policy

__all__ = [
    "SCHEDULES",
    "Comm",
    "DefaultConfig",
    "Op",
    "Piece",
    "TypeShape",
    "clip_slot",
    "match_type",
    "pieces",
    "run_computation",
    "sp_backward_stream",
    "stack_stream",
    "type_shapes",
]

SCHEDULES = ("sequential", "nanobatching", "kareus")
"""The schedules a decoder stack runs under, in report order: the two baselines, then kareus."""


@attrs.frozen
class Op:
    """One computation op of the stack: its name (an op of
    [`DECODER_LAYER`][kareus.model.DECODER_LAYER], as the partitions name it) and its layer."""

    name: str
    layer: int


@attrs.frozen
class Comm:
    """One collective of the stack.

    Attributes:
        kind: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or ``"all_to_all"``
            (a mixture of experts' dispatch and combine).
        name: The tensor it acts on (a
            [`LayerCollective.tensor`][kareus.model.LayerCollective]: ``"attn_out"``,
            ``"kv"``, ``"dispatch"``, ...).
        layer: Its layer.
        group: The parallel group it runs over, ``"tp"``, ``"cp"`` or ``"ep"`` (a
            [`LayerCollective.group`][kareus.model.LayerCollective]): under sequence
            parallelism with CP a TP and a CP collective may be of one kind; the
            executor's collective backend runs it over that group.
    """

    kind: str
    name: str
    layer: int
    group: str = "tp"


@attrs.frozen
class Piece:
    """A run of ops and the collective after them (``None`` at the end of the stack)."""

    ops: tuple[Op, ...]
    comm: Comm | None

    @property
    def op_names(self) -> tuple[str, ...]:
        """The ops' names, in stream order."""
        return tuple(op.name for op in self.ops)


@attrs.frozen
class TypeShape:
    """What [`match_type`][kareus.exec.schedule.match_type] needs of a partition type: its
    ops' names, collective kind and the collective's group (``None``: not known, any)."""

    op_names: tuple[str, ...]
    comm_kind: str
    comm_group: str | None = None


@attrs.frozen
class DefaultConfig:
    """A baseline configuration: the collective with its own CTA count.

    ``comm_sms=None`` makes [`TorchExecutor`][kareus.exec.TorchExecutor] use its
    ``default_collective`` (another [`Executor`][kareus.exec.Executor] sees ``sms`` ``None`` in
    its ``launch_collective``); ``launch_slot=None`` is sequential.
    """

    launch_slot: str | None = None
    comm_sms: None = None
    backend: None = None

    @property
    def sequential(self) -> bool:
        """Whether the collective runs after all the ops."""
        return self.launch_slot is None


def _layer(phase: LayerPhase, layer: int, tp: int, cp: int, ep: int = 1) -> list[Op | Comm]:
    """One layer's segments of ``phase`` (not its tail): ops, then the collective, when its
    group has more than one GPU."""
    sizes = {"tp": tp, "cp": cp, "ep": ep}
    out: list[Op | Comm] = []
    for seg in phase.segments:
        out += [Op(n, layer) for n in seg.op_names]
        c = seg.collective
        if sizes[c.group] > 1:
            out.append(Comm(c.kind, c.tensor, layer, c.group))
    return out


def stack_stream(phase: str, layers: int, *, tp: int, cp: int,
                 recompute: bool | str, qk_norm: bool = False,
                 sp: bool = False, ep: int = 1, moe: Any = None) -> list[Op | Comm]:
    """The ops and collectives of one microbatch computation of ``layers`` layers, in order.

    Args:
        phase: ``"fwd"`` or ``"bwd"``.
        layers: Transformer layers of the stage.
        tp: Tensor-parallel degree (``> 1``: all-reduces).
        cp: Context-parallel degree (``> 1``: K/V all-gather, dK/dV reduce-scatter).
        recompute: The recomputation policy (``"full"``: the backward re-runs each layer's
            forward first, less the down projection when TP = CP = 1
            (``kareus.model.decoder.NOT_READ_BY_BACKWARD``); ``"selective"``: the attention core only, inside the layer's
            backward; ``"none"``), or ``True``/``False`` for ``"full"``/``"none"``.
        qk_norm: The model normalises queries and keys per head (the layer's ops of
            ``decoder_layer(phase, qk_norm=True)``).
        sp: The sequence-parallel layout (``decoder_layer(phase, sp=True)``).
        ep: Expert-parallel degree (``> 1``: the MoE layer's dispatch and combine
            all-to-alls run).
        moe: The model's [`MoEArch`][kareus.model.MoEArch] (``None``: a dense MLP): the
            layers of ``moe_decoder_layer`` (shared experts when it has them; the received
            tokens sorted by local expert when an EP rank holds more than one, at EP > 1).
            The forward's tail, the un-permutation after the combine, opens the next
            layer's forward (layer ``l``'s ``unpermute`` right before layer ``l+1``'s
            ``attn_norm``; the top layer's last). Full recomputation re-runs each layer's
            forward up to its combine: the un-permutation's output (the layer's) is read
            by no backward op.

    Returns:
        [`Op`][kareus.exec.schedule.Op] and [`Comm`][kareus.exec.schedule.Comm] items. Backward: layer
        ``l``'s ``attn_norm_bwd`` comes right before layer ``l-1``'s ``down_dgrad`` (after ``l-1``'s
        recomputed forward); layer 0's is last. The embedding, final norm, LM head and loss are
        outside the stack.
    """
    if phase not in ("fwd", "bwd"):
        raise ArgumentError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
    if layers < 1 or tp < 1 or cp < 1:
        raise ArgumentError(f"layers, tp and cp must be >= 1, got {layers}, {tp}, {cp}")
    policy = recompute_policy(recompute)
    if policy not in RECOMPUTE_POLICIES:
        raise ArgumentError(f"recompute must be one of {RECOMPUTE_POLICIES} or a bool, "
                            f"got {recompute!r:.40}")
    if ep < 1 or (ep > 1 and moe is None):
        raise ArgumentError(f"ep={ep} needs the model's mixture of experts (moe=)")
    if moe is None:
        fwd = decoder_layer("fwd", qk_norm=qk_norm, sp=sp)
        bwd = decoder_layer("bwd", qk_norm=qk_norm, sp=sp, recompute=str(policy))
    else:
        kw = {"qk_norm": qk_norm, "sp": sp, "shared_experts": moe.shared_experts > 0,
              "sort_tokens": ep > 1 and moe.experts // ep > 1}
        fwd = moe_decoder_layer("fwd", **kw)
        bwd = moe_decoder_layer("bwd", recompute=str(policy), **kw)
    out: list[Op | Comm] = []
    if phase == "fwd":
        for layer in range(layers):
            if layer > 0:
                out += [Op(n, layer - 1) for n in fwd.tail]
            out += _layer(fwd, layer, tp, cp, ep)
        return out + [Op(n, layers - 1) for n in fwd.tail]
    # full recomputation re-runs each layer's forward, less what no backward op reads
    # where the layer has no collective (``NOT_READ_BY_BACKWARD``)
    skip = NOT_READ_BY_BACKWARD if tp == cp == 1 and moe is None else ()
    for layer in reversed(range(layers)):
        if policy == "full":
            out += [x for x in _layer(fwd, layer, tp, cp, ep)
                    if not (isinstance(x, Op) and x.name in skip)]
        if layer < layers - 1:
            out += [Op(n, layer + 1) for n in bwd.tail]
        out += _layer(bwd, layer, tp, cp, ep)
    out += [Op(n, 0) for n in bwd.tail]
    return out


def sp_backward_stream(stream: Sequence[Op | Comm], layers: int, *,
                       gather_input_grad: bool = True) -> list[Op | Comm]:
    """A sequence-parallel backward stream of ``layers`` layers as it runs at TP > 1.

    Under sequence parallelism every layer's backward reads the whole sequence's output
    gradient (its down projection's), while what arrives from above is this rank's shard:
    the layer above's input gradient, all-gathered by that layer's last collective
    (``"mlp_out_grad"``), or, for the top layer of the stack, the LM head's (Megatron-LM
    reduce-scatters the head's input gradient to the sequence shard) or the framework's
    layer above. So the stack opens with that all-gather (``Comm("all_gather",
    "mlp_out_grad", layers, "tp")``), a collective of the stack: it overlaps the first
    ops of the next nanobatch as the others do.

    Args:
        stream: ``stack_stream("bwd", layers, ..., sp=True)``.
        layers: Its layers.
        gather_input_grad: Keep the stack's last collective, the all-gather of layer 0's
            input gradient (for the embedding's backward, which reads every token);
            ``False`` when the caller takes the sharded input gradient (a planned layer,
            whose framework gathers it in the layer below).

    Returns:
        The stream with the all-gather first (and without the last one).
    """
    out: list[Op | Comm] = [Comm("all_gather", "mlp_out_grad", layers, "tp"), *stream]
    last = out[-1]
    if (not gather_input_grad and isinstance(last, Comm) and last.kind == "all_gather"
            and last.name == "mlp_out_grad"):
        out.pop()
    return out


def pieces(stream: Sequence[Op | Comm]) -> list[Piece]:
    """Cut a stream at its collectives: each [`Piece`][kareus.exec.schedule.Piece] ends with one (the last may not)."""
    out: list[Piece] = []
    ops: list[Op] = []
    for item in stream:
        if isinstance(item, Comm):
            out.append(Piece(tuple(ops), item))
            ops = []
        else:
            ops.append(item)
    if ops:
        out.append(Piece(tuple(ops), None))
    return out


def type_shapes(partition_set: Any) -> dict[str, TypeShape]:
    """[`TypeShape`][kareus.exec.schedule.TypeShape] of every type of a [`PartitionSet`][kareus.model.PartitionSet]."""
    return {name: TypeShape(tuple(op.name for op in p.compute_ops), p.comm_op.kind.value,
                            p.comm_group or None if isinstance(p, TransformerPartition)
                            else None)
            for name, p in partition_set.types.items()}


def _find(sub: tuple[str, ...], seq: tuple[str, ...]) -> int:
    for k in range(len(seq) - len(sub) + 1):
        if seq[k:k + len(sub)] == sub:
            return k
    return -1


def match_type(types: Mapping[str, TypeShape], op_names: Sequence[str],
               comm_kind: str, comm_group: str | None = None) -> tuple[str, int] | None:
    """The partition type a unit runs as: ``(type name, offset of the unit's ops in it)``.

    The type's collective must be ``comm_kind`` (over ``comm_group``, when both the type and
    the caller name a group) and its ops must hold ``op_names`` as a contiguous run; a type
    with exactly those ops wins, then the one with the fewest ops. ``None`` when no type
    fits.
    """
    names = tuple(op_names)
    best: tuple[int, str, int] | None = None
    for name, shape in types.items():
        if shape.comm_kind != comm_kind or not names:
            continue
        if comm_group is not None and shape.comm_group not in (None, comm_group):
            continue
        k = _find(names, shape.op_names)
        if k < 0:
            continue
        rank = 0 if shape.op_names == names else len(shape.op_names)
        if best is None or rank < best[0]:
            best = (rank, name, k)
    return None if best is None else (best[1], best[2])


def clip_slot(slot: str | None, type_ops: Sequence[str], offset: int,
              op_names: Sequence[str]) -> str | None:
    """A type's launch slot applied to a unit holding ``op_names`` at ``offset`` of its ops.

    The slot itself when the unit holds it; the unit's first op when the slot comes before
    it; ``None`` (sequential) when the slot comes after the unit's last op.
    """
    if slot is None:
        return None
    if slot not in type_ops:
        raise UnknownSlotError(f"launch slot {slot!r} is not an op of the type ({list(type_ops)})")
    k = list(type_ops).index(slot)
    if offset <= k < offset + len(op_names):
        return slot
    return op_names[0] if k < offset else None


# ------------------------------------------------------------------ running a computation


def _plan_config(plan_config_of: Callable[[str], Any], types: Mapping[str, TypeShape],
                 op_names: tuple[str, ...], comm: Comm,
                 partner: str | None) -> tuple[str, Any]:
    comm_kind = comm.kind
    hit = match_type(types, op_names, comm_kind, comm.group)
    if hit is None:  # no type holds these ops: sequential, with the partner's SM count
        key = partner if partner is not None else next(
            (n for n, s in types.items() if s.comm_kind == comm_kind
             and s.comm_group in (None, comm.group)), None)
        if key is None:
            raise ArgumentError(f"no partition type has a {comm_kind} collective")
        return key, attrs.evolve(plan_config_of(key), launch_slot=None)
    key, offset = hit
    cfg = plan_config_of(key)
    slot = clip_slot(cfg.launch_slot, types[key].op_names, offset, op_names)
    return key, (cfg if slot == cfg.launch_slot else attrs.evolve(cfg, launch_slot=slot))


_CHUNK_SUFFIX = re.compile(r"_c\d+$")


def _config_of_kind(config_of: Callable[[str], Any], shapes: Mapping[str, TypeShape],
                    comm: Comm, key: str) -> tuple[str, Any]:
    """``(type, configuration)`` for a collective no type's ops hold (an opening collective,
    e.g. the all-gather of the output gradient a backward under sequence parallelism starts
    with): the first type of its kind and group that the computation's choice configures
    (a plan's choice names only its phase's types, so a type of the other phase is
    skipped); ``config_of(key)``'s error where none is."""
    first: PlanError | None = None
    for name, sh in shapes.items():
        if sh.comm_kind == comm.kind and sh.comm_group in (None, comm.group):
            try:
                return name, config_of(name)
            except PlanError as exc:
                first = first or exc
    if first is not None:
        raise first
    return key, config_of(key)


def _communicate(part: Any, comm: Comm, args: tuple[Any, ...]) -> None:
    """Name ``comm`` as the partition's collective, from ``comm_args``'s ``(tensor, output)``
    or, for an all-to-all, ``(tensor, output, splits)``."""
    tensor, output, *rest = args
    if comm.kind == "all_to_all":
        if not rest:
            raise ArgumentError(f"comm_args gave no splits for all-to-all {comm.name!r}: "
                                "return (tensor, output, (output_splits, input_splits))")
        part.communicate(tensor, kind=comm.kind, output=output, group=comm.group,
                         splits=rest[0])
    else:
        part.communicate(tensor, kind=comm.kind, output=output, group=comm.group)


def run_computation(executor: Executor, stack: Sequence[Piece], *, schedule: str, nanobatches: int,  # noqa: C901 - one branch per schedule, checked up front; they share the enqueue helpers
                    run_op: Callable[[Op, int], Any],
                    comm_args: Callable[[Comm, int], tuple[Any, ...]],
                    types: Mapping[str, TypeShape] | None = None,
                    plan_config_of: Callable[[str], Any] | None = None,
                    sequential_config_of: Callable[[str], Any] | None = None,
                    chunk_of: Callable[[str, int], int] | None = None,
                    exposed_default: bool = False,
                    ) -> list[tuple[str, Any]]:
    """Enqueue one microbatch computation's stack under ``schedule`` through ``executor``.

    Args:
        executor: An [`Executor`][kareus.exec.Executor]; under ``"kareus"``, call this
            inside its ``microbatch(...)`` scope.
        stack: The computation's pieces ([`pieces`][kareus.exec.schedule.pieces] of
            [`stack_stream`][kareus.exec.schedule.stack_stream]).
        schedule: One of ``SCHEDULES``.
        nanobatches: Parts the microbatch is cut into (1 for ``"sequential"``; with 1,
            every schedule runs sequentially: the ops after a collective read it).
        run_op: ``(op, nanobatch) -> None``: enqueue one op of one nanobatch.
        comm_args: ``(comm, nanobatch) -> (tensor, output)``: the collective's tensor (and
            output tensor for all-gather / reduce-scatter, else ``None``); for an
            all-to-all ``(tensor, output, (output_splits, input_splits))``, the splits
            known when it is launched (a mixture of experts' routing ran before).
        types: Partition types by name ([`type_shapes`][kareus.exec.schedule.type_shapes]); needed by
            ``"kareus"`` and used to name the partitions of the baselines.
        plan_config_of: ``type name -> ScheduleConfig`` of the current computation
            (``"kareus"`` only; e.g. ``plan_config(plan, name, executor.current)``).
        sequential_config_of: ``"sequential"`` only: ``type name -> configuration`` of
            each piece's collective (a plan's computation run unsplit: its SM count,
            launched after the piece's ops); ``None`` = the collective's own CTA count.
        chunk_of: Nanobatches along the sequence (``Workload.sequence_split``): ``(first
            op name, nanobatch as run) -> chunk`` of a unit, so that a unit whose type is
            one per chunk (``{name}_c{chunk}``, its attention's cost) runs as its chunk's
            type; ``None``: no per-chunk types.
        exposed_default: ``"kareus"``: a collective that overlaps nothing (the
            computation's last, or one before a piece without ops) runs with its own CTA
            count (the executor's default collective, ``DefaultConfig``), as the partition
            model costs the exposed collectives of layers run one by one
            (``Workload.chained_layers=False``: outside work); ``False`` (default): with
            the SM count of its cyclic partner type, as a chain's is costed.

    Returns:
        ``(partition key, configuration)`` of every partition run, in order.
    """
    if schedule not in SCHEDULES:
        raise ArgumentError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "sequential" and nanobatches != 1:
        raise ArgumentError("the sequential schedule runs whole microbatches: nanobatches=1")
    if nanobatches < 1:
        raise ArgumentError(f"nanobatches must be >= 1, got {nanobatches}")
    if schedule == "kareus" and (types is None or plan_config_of is None):
        raise ArgumentError("the kareus schedule needs types and plan_config_of")
    if nanobatches == 1 and schedule != "sequential":
        # One nanobatch: the ops after a collective read its result, so nothing can run
        # beside it (pairing a piece's ops with the collective before them, as the
        # nanobatches after the first do, would let them read it while it runs). Every
        # schedule then runs as the sequential one does, which is what the partition model
        # costs at one nanobatch (each segment with its own collective, not overlappable);
        # under a plan each collective takes its type's configuration (SM count).
        if schedule == "kareus" and sequential_config_of is None:
            sequential_config_of = plan_config_of
        schedule = "sequential"
    shapes = dict(types or {})
    ran: list[tuple[str, Any]] = []
    by_chunk: dict[int, dict[str, TypeShape]] = {}

    def shapes_of(piece: Piece, nb: int) -> dict[str, TypeShape]:
        """The types a unit can run as: without those of the other chunks."""
        if chunk_of is None or not piece.ops:
            return shapes
        c = chunk_of(piece.op_names[0], nb)
        if c not in by_chunk:
            by_chunk[c] = {k: v for k, v in shapes.items()
                           if _CHUNK_SUFFIX.search(k) is None or k.endswith(f"_c{c}")}
        return by_chunk[c]

    def ops_of(piece: Piece, nb: int, part: Any = None) -> None:
        for op in piece.ops:
            if part is None:
                run_op(op, nb)
            else:
                part.op(op.name, run_op, op, nb)

    def launch(key: str, cfg: Any, comm: Comm, nb: int, piece: Piece | None,
               ops_nb: int) -> None:
        names = piece.op_names if piece is not None else ()
        with executor.partition(key, config=cfg, op_names=names) as part:
            if comm.kind == "all_to_all" and piece is not None:
                # after its ops (launch_slot None: it starts as the scope closes): they
                # make its tensors, whose sizes follow the routing
                ops_of(piece, ops_nb, part)
                _communicate(part, comm, comm_args(comm, nb))
            else:
                _communicate(part, comm, comm_args(comm, nb))
                if piece is not None:
                    ops_of(piece, ops_nb, part)
        ran.append((key, cfg))

    def key_for(op_names: tuple[str, ...], comm: Comm,
                among: Mapping[str, TypeShape] | None = None) -> str:
        among = shapes if among is None else among
        hit = match_type(among, op_names, comm.kind, comm.group) if among else None
        return hit[0] if hit is not None else f"{comm.kind}:{'+'.join(op_names) or 'tail'}"

    if schedule == "sequential":
        for piece in stack:
            if piece.comm is None:
                ops_of(piece, 0)
                continue
            key = key_for(piece.op_names, piece.comm)
            cfg: Any = DefaultConfig(None)
            if sequential_config_of is not None:
                if key not in shapes:  # no type holds these ops (an opening collective)
                    key, found = _config_of_kind(sequential_config_of, shapes, piece.comm,
                                                 key)
                else:
                    found = sequential_config_of(key)
                cfg = attrs.evolve(found, launch_slot=None)
            launch(key, cfg, piece.comm, 0, piece, 0)
        return ran

    partner: dict[tuple[str, str], str] = {}
    first = next((piece for piece in stack if piece.ops), None)  # not an opening collective
    if first is not None and schedule == "kareus":
        for kind, group in (("all_reduce", "tp"), ("all_gather", "tp"),
                            ("reduce_scatter", "tp"), ("all_reduce", "cp"),
                            ("all_gather", "cp"), ("reduce_scatter", "cp"),
                            ("all_to_all", "ep")):
            hit = match_type(shapes_of(first, 0), first.op_names, kind, group)
            if hit is not None:
                partner[(kind, group)] = hit[0]
    pending: tuple[Comm, int] | None = None
    for piece in stack:
        for nb in range(nanobatches):
            if pending is None:
                ops_of(piece, nb)
            else:
                comm, cnb = pending
                mine = shapes_of(piece, nb)
                if schedule == "kareus" and exposed_default and not piece.ops:
                    key, cfg = key_for((), comm), DefaultConfig(None)
                elif schedule == "kareus":
                    assert plan_config_of is not None
                    key, cfg = _plan_config(plan_config_of, mine, piece.op_names, comm,
                                            partner.get((comm.kind, comm.group)))
                else:
                    key, cfg = key_for(piece.op_names, comm, mine), DefaultConfig(
                        piece.op_names[0] if piece.ops else None)
                args = comm_args(comm, cnb)
                with executor.partition(key, config=cfg, op_names=piece.op_names) as part:
                    _communicate(part, comm, args)
                    ops_of(piece, nb, part)
                ran.append((key, cfg))
            pending = (piece.comm, nb) if piece.comm is not None else None
    if pending is not None:  # the last collective: nothing left to overlap
        comm, cnb = pending
        if schedule == "kareus" and not exposed_default:
            assert plan_config_of is not None
            key, cfg = _plan_config(plan_config_of, shapes, (), comm,
                                    partner.get((comm.kind, comm.group)))
        else:
            key, cfg = key_for((), comm), DefaultConfig(None)
        launch(key, cfg, comm, cnb, None, 0)
    return ran

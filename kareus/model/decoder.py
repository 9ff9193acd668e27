"""The decoder layer's op order: which ops a layer runs, in stream order, and where its
collectives sit.

This is the one place that writes it. A Llama-shaped decoder layer (RMSNorm, grouped-query
attention with RoPE, SwiGLU MLP) under tensor parallelism (TP, Megatron-LM's layout: an
all-reduce after the row-parallel output and down projections, and after the input
gradients of the column-parallel QKV and gate/up projections) and context parallelism (CP:
K and V all-gathered before attention, their gradients reduce-scattered after it) runs,
per layer and nanobatch::

    forward:  attn_norm qkv rope            | CP all-gather of K/V ("kv")
              attn_core out_proj            | TP all-reduce ("attn_out")
              mlp_norm gate up swiglu down  | TP all-reduce ("mlp_out")
    backward: down_dgrad down_wgrad swiglu_bwd gate_dgrad up_dgrad gate_wgrad up_wgrad
                                            | TP all-reduce ("mlp_in_grad")
              mlp_norm_bwd out_dgrad out_wgrad attn_core_bwd
                                            | CP reduce-scatter of dK/dV ("kv_grad")
              rope_bwd qkv_dgrad qkv_wgrad  | TP all-reduce ("attn_in_grad")
              attn_norm_bwd

A [`LayerSegment`][kareus.model.LayerSegment] is a run of ops and the collective after them
(the collective acts on a tensor one of its ops completes); a
[`LayerPhase`][kareus.model.LayerPhase] is one phase's segments in order, plus the ops after
its last collective (``tail``): the input norm's backward needs the all-reduced input
gradient, so it runs after the layer's last collective, in stream order beside the next
layer down's MLP backward. The residual additions run inside the norms that consume the
all-reduced tensors (fused), so they are no ops of their own. A collective over a group of
one GPU (TP = 1, CP = 1) does not run; the segments on its two sides are then one.

Who reads it:

* the partition model ([`build_partitions`][kareus.model.build_partitions]) cuts a stage's
  cyclic chain of segments into partition types and costs each op (FLOPs, bytes): it
  takes its op names and their order from here ([`LayerPhase.cyclic_segments`][kareus.model.LayerPhase.cyclic_segments]);
* the runtime schedule (``kareus.exec.schedule``) strings layers into the stream of one
  microbatch computation (recomputation, the tail's place between layers) and runs it under
  a plan, in the training loop and in the framework adapters; its collectives' buffers
  and the runnable partitions' output ops come from here too.

**Sequence parallelism** (SP, Megatron-LM's ``sequence_parallel``, torchtitan's
``enable_sequence_parallel``) is the other TP layout: between the TP regions each rank holds
a shard of the sequence (``tokens / TP``), so the norms (and the residual additions fused
into them) run on the shard; each TP all-reduce becomes a reduce-scatter after the
row-parallel output projections and an all-gather of the normed input before the
column-parallel input projections (``decoder_layer(phase, sp=True)``)::

    forward:  attn_norm                     | TP all-gather ("attn_in")
              qkv rope                      | CP all-gather of K/V ("kv")
              attn_core out_proj            | TP reduce-scatter ("attn_out")
              mlp_norm                      | TP all-gather ("mlp_in")
              gate up swiglu down           | TP reduce-scatter ("mlp_out")
    backward: down_dgrad down_wgrad swiglu_bwd gate_dgrad up_dgrad gate_wgrad up_wgrad
                                            | TP reduce-scatter ("mlp_in_grad")
              mlp_norm_bwd                  | TP all-gather ("attn_out_grad")
              out_dgrad out_wgrad attn_core_bwd
                                            | CP reduce-scatter of dK/dV ("kv_grad")
              rope_bwd qkv_dgrad qkv_wgrad  | TP reduce-scatter ("attn_in_grad")
              attn_norm_bwd                 | TP all-gather ("mlp_out_grad")

The backward's last all-gather collects the layer's input gradient (sharded, as its input
was) for the MLP backward of the layer below, which reads the whole sequence; there is no
tail. The weight gradients of the column-parallel projections read the all-gathered inputs
of the forward (kept, or recomputed with the forward; kareus does not all-gather them a
second time in the backward as Megatron-LM may). Each TP collective moves the layer's
``tokens x hidden`` activation, as the all-reduce it replaces did, in half the bus traffic.

**Query/key normalisation** (``qk_norm``, Qwen3's per-head RMSNorm of the queries and keys
before RoPE) runs fused with RoPE, in either layout: the layer's ``rope`` becomes
``qk_norm_rope`` and its ``rope_bwd`` ``qk_norm_rope_bwd`` (``decoder_layer(phase,
qk_norm=True)``; one kernel each, ``KernelSet.qk_norm_rope`` / ``qk_norm_rope_bwd``), the
op the CP all-gather of K/V waits for included.

**Mixture of experts** (``ModelArch.moe``, ``kareus.model.moe``): the MLP is a router,
experts and the expert-parallel all-to-alls over the EP group (``moe_decoder_layer``). The
layer computes Megatron-Core's all-to-all dispatcher with expert tensor parallelism 1, so
its MoE block runs no TP collective: at TP = 1 (no SP)::

    forward:  attn_norm qkv rope            | CP all-gather of K/V ("kv")
              attn_core out_proj            | (TP all-reduce: TP = 1, does not run)
              mlp_norm router router_topk permute
                                            | EP all-to-all ("dispatch")
              [shared_gate shared_up shared_swiglu shared_down]
              expert_sort expert_gate_up expert_swiglu expert_down expert_unsort
                                            | EP all-to-all ("combine")
              unpermute                     (tail)
    backward: unpermute_bwd                 | EP all-to-all ("combine_grad")
              expert_unsort_bwd [shared_down_dgrad ... shared_up_wgrad]
              expert_down_dgrad expert_down_wgrad expert_swiglu_bwd expert_gate_up_dgrad
              expert_gate_up_wgrad expert_sort_bwd
                                            | EP all-to-all ("dispatch_grad")
              permute_bwd router_topk_bwd router_dgrad router_wgrad mlp_norm_bwd
              out_dgrad out_wgrad attn_core_bwd
                                            | CP reduce-scatter of dK/dV ("kv_grad")
              rope_bwd qkv_dgrad qkv_wgrad  | (TP all-reduce: TP = 1, does not run)
              attn_norm_bwd                 (tail)

and under sequence parallelism (required at TP > 1, as Megatron-Core requires it with MoE)
the attention half is the sequence-parallel layer's, and the MoE block runs on the rank's
sequence shard: ``mlp_norm ... permute`` follow the attention's reduce-scatter directly,
and the backward's ``permute_bwd ... mlp_norm_bwd`` end with the all-gather of the output
gradient ("attn_out_grad") before ``out_dgrad``. The layer's input gradient stays on the
shard (the MoE block below reads the shard), so the backward ends with the tail
``attn_norm_bwd``, no all-gather. ``expert_sort`` / ``expert_unsort`` (and their backward)
reorder the received tokens by local expert and back (Megatron-Core's ``sort_chunks_by_idxs``):
they run only when an EP rank holds more than one expert and EP > 1. The shared experts'
ops (bracketed) run only with shared experts: after the dispatch is launched, beside it in
stream order (they do not read its output).

So the emulator costs exactly the ops the layer runs, in the order it runs them. Pure data;
no torch.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping

import attrs

from kareus.errors import ArgumentError

__all__ = [
    "ATTENTION_SEGMENT",
    "DECODER_LAYER",
    "LayerCollective",
    "LayerPhase",
    "LayerSegment",
    "QK_NORM_OPS",
    "SELECTIVE_RECOMPUTE",
    "NOT_READ_BY_BACKWARD",
    "SP_DECODER_LAYER",
    "decoder_layer",
    "layer_collectives",
    "moe_decoder_layer",
]

_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_GROUPS = ("tp", "cp", "ep")


def _names(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(names)


@attrs.frozen
class LayerCollective:
    """One collective of a decoder layer.

    Attributes:
        kind: ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"`` (a
            [`CommKind`][kareus.model.CommKind] value).
        tensor: The tensor it acts on: ``"attn_out"``, ``"mlp_out"`` (forward all-reduces,
            or reduce-scatters under sequence parallelism), ``"kv"`` (K/V all-gather),
            ``"mlp_in_grad"``, ``"attn_in_grad"`` (backward all-reduces, or reduce-scatters),
            ``"kv_grad"`` (dK/dV reduce-scatter); under sequence parallelism also
            ``"attn_in"``, ``"mlp_in"`` (forward all-gathers of the normed inputs) and
            ``"attn_out_grad"``, ``"mlp_out_grad"`` (backward all-gathers of the output
            gradients).
        group: The parallel group it runs over: ``"tp"``, ``"cp"`` or ``"ep"`` (it does not
            run when that group has one GPU). The EP collectives of a mixture-of-experts
            layer are all-to-alls: ``"dispatch"`` and ``"combine"`` forward,
            ``"combine_grad"`` and ``"dispatch_grad"`` backward.
        producer: The op that completes its input tensor (the last op to write it).
    """

    kind: str
    tensor: str
    group: str
    producer: str

    def __attrs_post_init__(self) -> None:
        if self.kind not in _KINDS or self.group not in _GROUPS:
            raise ArgumentError(f"a layer collective is one of {_KINDS} over one of {_GROUPS}, "
                                f"got {self.kind!r} over {self.group!r}")


@attrs.frozen
class LayerSegment:
    """A run of a layer's ops and the collective after them.

    Attributes:
        name: The segment's name (``"attn_in"``, ``"attn_out"``, ``"mlp"``): partition
            types are named after the segments whose ops they hold.
        op_names: Its ops, in stream order.
        collective: The collective that runs after them, on a tensor one of them completes.
    """

    name: str
    op_names: tuple[str, ...] = attrs.field(converter=_names)
    collective: LayerCollective

    def __attrs_post_init__(self) -> None:
        if self.collective.producer not in self.op_names:
            raise ArgumentError(f"segment {self.name!r}: the producer "
                                f"{self.collective.producer!r} of its collective is not one "
                                f"of its ops {self.op_names}")


@attrs.frozen
class LayerPhase:
    """One phase (forward or backward) of a decoder layer: its segments, then its tail.

    Attributes:
        phase: ``"fwd"`` or ``"bwd"``.
        segments: The segments, in stream order.
        tail: Ops that run after the last collective (the backward's ``attn_norm_bwd``).
    """

    phase: str
    segments: tuple[LayerSegment, ...]
    tail: tuple[str, ...] = attrs.field(converter=_names, default=())

    @property
    def op_names(self) -> tuple[str, ...]:
        """Every op of the phase, in stream order (the tail last)."""
        return tuple(n for seg in self.segments for n in seg.op_names) + self.tail

    @property
    def collectives(self) -> tuple[LayerCollective, ...]:
        """The collectives, in stream order."""
        return tuple(seg.collective for seg in self.segments)

    def cyclic_segments(self) -> tuple[LayerSegment, ...]:
        """The segments of a stage's chain of layers seen as a cycle, as the partition model
        cuts it: the tail (run after one layer's last collective) opens the first segment
        (of the layer below, or of the layer itself in the cycle)."""
        if not self.tail:
            return self.segments
        first, *rest = self.segments
        return (attrs.evolve(first, op_names=self.tail + first.op_names), *rest)


def _ar(tensor: str, producer: str) -> LayerCollective:
    return LayerCollective("all_reduce", tensor, "tp", producer)


def _ag(tensor: str, producer: str) -> LayerCollective:
    return LayerCollective("all_gather", tensor, "tp", producer)


def _rs(tensor: str, producer: str) -> LayerCollective:
    return LayerCollective("reduce_scatter", tensor, "tp", producer)


DECODER_LAYER: Mapping[str, LayerPhase] = types.MappingProxyType({
    "fwd": LayerPhase("fwd", (
        LayerSegment("attn_in", ("attn_norm", "qkv", "rope"),
                     LayerCollective("all_gather", "kv", "cp", "rope")),
        LayerSegment("attn_out", ("attn_core", "out_proj"), _ar("attn_out", "out_proj")),
        LayerSegment("mlp", ("mlp_norm", "gate", "up", "swiglu", "down"),
                     _ar("mlp_out", "down")),
    )),
    "bwd": LayerPhase("bwd", (
        # gate_dgrad writes the input gradient and up_dgrad adds its product in place
        LayerSegment("mlp", ("down_dgrad", "down_wgrad", "swiglu_bwd", "gate_dgrad",
                             "up_dgrad", "gate_wgrad", "up_wgrad"),
                     _ar("mlp_in_grad", "up_dgrad")),
        LayerSegment("attn_out", ("mlp_norm_bwd", "out_dgrad", "out_wgrad", "attn_core_bwd"),
                     LayerCollective("reduce_scatter", "kv_grad", "cp", "attn_core_bwd")),
        LayerSegment("attn_in", ("rope_bwd", "qkv_dgrad", "qkv_wgrad"),
                     _ar("attn_in_grad", "qkv_dgrad")),
    ), tail=("attn_norm_bwd",)),
})
"""The decoder layer's two phases by name (``"fwd"``, ``"bwd"``), read-only: the op order of
the module docstring, the one place it is written."""

SP_DECODER_LAYER: Mapping[str, LayerPhase] = types.MappingProxyType({
    "fwd": LayerPhase("fwd", (
        LayerSegment("attn_norm", ("attn_norm",), _ag("attn_in", "attn_norm")),
        LayerSegment("attn_in", ("qkv", "rope"),
                     LayerCollective("all_gather", "kv", "cp", "rope")),
        LayerSegment("attn_out", ("attn_core", "out_proj"), _rs("attn_out", "out_proj")),
        LayerSegment("mlp_norm", ("mlp_norm",), _ag("mlp_in", "mlp_norm")),
        LayerSegment("mlp", ("gate", "up", "swiglu", "down"), _rs("mlp_out", "down")),
    )),
    "bwd": LayerPhase("bwd", (
        LayerSegment("mlp", ("down_dgrad", "down_wgrad", "swiglu_bwd", "gate_dgrad",
                             "up_dgrad", "gate_wgrad", "up_wgrad"),
                     _rs("mlp_in_grad", "up_dgrad")),
        LayerSegment("mlp_norm", ("mlp_norm_bwd",), _ag("attn_out_grad", "mlp_norm_bwd")),
        LayerSegment("attn_out", ("out_dgrad", "out_wgrad", "attn_core_bwd"),
                     LayerCollective("reduce_scatter", "kv_grad", "cp", "attn_core_bwd")),
        LayerSegment("attn_in", ("rope_bwd", "qkv_dgrad", "qkv_wgrad"),
                     _rs("attn_in_grad", "qkv_dgrad")),
        LayerSegment("attn_norm", ("attn_norm_bwd",), _ag("mlp_out_grad", "attn_norm_bwd")),
    )),
})
"""The decoder layer under sequence parallelism, by phase: the second op order of the module
docstring (no tail: the backward ends with the all-gather of the input gradient)."""

ATTENTION_SEGMENT = "attn"
"""The name of the attention segments as one, when no CP collective runs between them
(``attn_in`` and ``attn_out`` forward, ``attn_out`` and ``attn_in`` backward)."""


#: Query/key normalisation (per-head RMSNorm of the queries and keys before RoPE, as Qwen3
#: does) runs fused with RoPE, one kernel per phase (``KernelSet.qk_norm_rope`` and
#: ``qk_norm_rope_bwd``): per phase, the op it replaces and the fused op's name. Forward,
#: ``qk_norm_rope`` normalises and rotates q and k of the QKV projection's output in place
#: of ``rope`` (and completes the K the CP all-gather sends); backward,
#: ``qk_norm_rope_bwd`` rotates dQ and dK back and runs the norms' backward in place of
#: ``rope_bwd``, writing the projection's output gradient and the norm weights' gradients.
QK_NORM_OPS: Mapping[str, tuple[str, str]] = types.MappingProxyType({
    "fwd": ("rope", "qk_norm_rope"),
    "bwd": ("rope_bwd", "qk_norm_rope_bwd"),
})


#: Selective recomputation (Megatron-LM's ``--recompute-granularity selective``, its
#: ``core_attn`` module): the backward re-runs the attention core's forward (the op named
#: first) right before the op named second, since the attention output is not kept (the
#: output projection's weight gradient and the attention backward read it); every other
#: activation is kept, and no collective runs again.
SELECTIVE_RECOMPUTE: tuple[str, str] = ("attn_core", "out_dgrad")


#: The forward ops whose results no backward op reads: the down projection (its output is
#: the layer's output, which the layer above reads; its backward reads the SwiGLU output and
#: the output's gradient). Full recomputation skips them where the layer runs no collective
#: (TP = CP = 1, where no partition is planned, as ``torch.compile``'s partitioner drops
#: them from a checkpointed block's recomputation): 21% of a recomputed layer's forward
#: FLOPs at hidden 2048, FFN 6144, 4096-token sequences (bench/recompute_policy.py's
#: shapes), about 5% of a step with full recomputation. With collectives the recomputed
#: forward is the forward phase its partitions are costed and scheduled as, the output's
#: collective after the down projection included.
NOT_READ_BY_BACKWARD: tuple[str, ...] = ("down",)


def _replace(layer: LayerPhase, op: str, by: str) -> LayerPhase:
    """``layer`` with op ``op`` renamed ``by`` wherever it is named (its segment's ops, the
    collective it produces the tensor of, the tail)."""
    segments = []
    for seg in layer.segments:
        if op in seg.op_names:
            c = seg.collective
            seg = attrs.evolve(
                seg, op_names=tuple(by if n == op else n for n in seg.op_names),
                collective=attrs.evolve(c, producer=by) if c.producer == op else c)
        segments.append(seg)
    return attrs.evolve(layer, segments=tuple(segments),
                        tail=tuple(by if n == op else n for n in layer.tail))


def _insert(layer: LayerPhase, before_or_after: str, anchor: str,
            extra: tuple[str, ...]) -> LayerPhase:
    segments = []
    for seg in layer.segments:
        if anchor in seg.op_names:
            i = seg.op_names.index(anchor) + (1 if before_or_after == "after" else 0)
            seg = attrs.evolve(seg, op_names=(*seg.op_names[:i], *extra, *seg.op_names[i:]))
        segments.append(seg)
    return attrs.evolve(layer, segments=tuple(segments))


def decoder_layer(phase: str, *, qk_norm: bool = False, sp: bool = False,
                  recompute: str = "full") -> LayerPhase:
    """The decoder layer's ``phase`` (``"fwd"`` or ``"bwd"``); with ``qk_norm``, the layer of
    a model that normalises queries and keys per head (RoPE and its backward replaced by the
    fused ops of ``QK_NORM_OPS``, ``qk_norm_rope`` and ``qk_norm_rope_bwd``); with ``sp``,
    the sequence-parallel layout (``SP_DECODER_LAYER``); with ``recompute="selective"``, the backward holds the
    recomputed attention core (``SELECTIVE_RECOMPUTE``). Full recomputation re-runs the
    forward phase before the backward phase (the runtime schedule strings it; without
    ``NOT_READ_BY_BACKWARD`` where the layer has no collective), so it changes no phase's
    ops; nor does ``"none"``."""
    _check_phase_and_policy(phase, recompute)
    return _with_features((SP_DECODER_LAYER if sp else DECODER_LAYER)[phase], phase,
                          qk_norm=qk_norm, recompute=recompute)


def _check_phase_and_policy(phase: str, recompute: str) -> None:
    if phase not in DECODER_LAYER:
        raise ArgumentError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
    if recompute not in ("none", "selective", "full"):
        raise ArgumentError(f"recompute must be 'none', 'selective' or 'full', "
                            f"got {recompute!r:.40}")


def _with_features(layer: LayerPhase, phase: str, *, qk_norm: bool,
                   recompute: str) -> LayerPhase:
    """``layer`` with the model's features applied: the query/key norms fused into RoPE's
    op, and selective recomputation's attention core before the backward's ``out_dgrad``."""
    if qk_norm:
        op, fused = QK_NORM_OPS[phase]
        layer = _replace(layer, op, fused)
    if recompute == "selective" and phase == "bwd":
        op, before = SELECTIVE_RECOMPUTE
        layer = _insert(layer, "before", before, (op,))
    return layer


def layer_collectives(*, tp: int = 2, cp: int = 2,
                      sp: bool = False) -> tuple[LayerCollective, ...]:
    """The collectives one layer runs at TP ``tp`` and CP ``cp`` (``sp``: sequence-parallel
    layout): forward then backward, each in stream order (those over a group of one GPU
    left out)."""
    sizes = {"tp": int(tp), "cp": int(cp)}
    layer = SP_DECODER_LAYER if sp else DECODER_LAYER
    return tuple(c for phase in ("fwd", "bwd") for c in layer[phase].collectives
                 if sizes[c.group] > 1)


# ----------------------------------------------------------------------------- MoE layer


def _a2a(tensor: str, producer: str) -> LayerCollective:
    return LayerCollective("all_to_all", tensor, "ep", producer)


#: The MoE block's ops by name: router and permutation before the dispatch, the experts
#: between the all-to-alls, the un-permutation after the combine (``moe_decoder_layer``).
_MOE_ROUTE = ("mlp_norm", "router", "router_topk", "permute")
_MOE_SHARED = ("shared_gate", "shared_up", "shared_swiglu", "shared_down")
_MOE_SHARED_BWD = ("shared_down_dgrad", "shared_down_wgrad", "shared_swiglu_bwd",
                   "shared_gate_dgrad", "shared_up_dgrad", "shared_gate_wgrad",
                   "shared_up_wgrad")
_MOE_ROUTE_BWD = ("permute_bwd", "router_topk_bwd", "router_dgrad", "router_wgrad",
                  "mlp_norm_bwd")


def _moe_experts(shared: bool, sort: bool) -> tuple[str, ...]:
    return ((*_MOE_SHARED,) if shared else ()) + (("expert_sort",) if sort else ()) + (
        "expert_gate_up", "expert_swiglu", "expert_down") + (("expert_unsort",) if sort else ())


def _moe_experts_bwd(shared: bool, sort: bool) -> tuple[str, ...]:
    return (("expert_unsort_bwd",) if sort else ()) + ((*_MOE_SHARED_BWD,) if shared else ()) + (
        "expert_down_dgrad", "expert_down_wgrad", "expert_swiglu_bwd", "expert_gate_up_dgrad",
        "expert_gate_up_wgrad") + (("expert_sort_bwd",) if sort else ())


def _moe_layer(phase: str, *, sp: bool, shared: bool, sort: bool) -> LayerPhase:
    experts = _moe_experts(shared, sort)
    experts_bwd = _moe_experts_bwd(shared, sort)
    if phase == "fwd":
        attention = SP_DECODER_LAYER["fwd"].segments[:3] if sp else DECODER_LAYER["fwd"].segments[:2]
        return LayerPhase("fwd", (
            *attention,
            LayerSegment("moe_route", _MOE_ROUTE, _a2a("dispatch", "permute")),
            LayerSegment("moe_experts", experts, _a2a("combine", experts[-1])),
        ), tail=("unpermute",))
    head = (LayerSegment("moe_unpermute", ("unpermute_bwd",), _a2a("combine_grad", "unpermute_bwd")),
            LayerSegment("moe_experts", experts_bwd,
                         _a2a("dispatch_grad", experts_bwd[-1])))
    if sp:
        return LayerPhase("bwd", (
            *head,
            LayerSegment("moe_route", _MOE_ROUTE_BWD, _ag("attn_out_grad", "mlp_norm_bwd")),
            LayerSegment("attn_out", ("out_dgrad", "out_wgrad", "attn_core_bwd"),
                         LayerCollective("reduce_scatter", "kv_grad", "cp", "attn_core_bwd")),
            LayerSegment("attn_in", ("rope_bwd", "qkv_dgrad", "qkv_wgrad"),
                         _rs("attn_in_grad", "qkv_dgrad")),
        ), tail=("attn_norm_bwd",))
    return LayerPhase("bwd", (
        *head,
        LayerSegment("attn_out", (*_MOE_ROUTE_BWD, "out_dgrad", "out_wgrad", "attn_core_bwd"),
                     LayerCollective("reduce_scatter", "kv_grad", "cp", "attn_core_bwd")),
        LayerSegment("attn_in", ("rope_bwd", "qkv_dgrad", "qkv_wgrad"),
                     _ar("attn_in_grad", "qkv_dgrad")),
    ), tail=("attn_norm_bwd",))


def moe_decoder_layer(phase: str, *, qk_norm: bool = False, sp: bool = False,
                      recompute: str = "full", shared_experts: bool = False,
                      sort_tokens: bool = True) -> LayerPhase:
    """The mixture-of-experts decoder layer's ``phase`` (``"fwd"`` or ``"bwd"``), the op
    order of the module docstring: the attention half of ``decoder_layer`` (``sp``: the
    sequence-parallel layout), the MoE block in place of the MLP. ``shared_experts``: the
    shared experts' ops run beside the dispatch; ``sort_tokens``: the received tokens are
    sorted by local expert and back (an EP rank with more than one expert, EP > 1);
    ``qk_norm`` and ``recompute`` as ``decoder_layer`` takes them."""
    _check_phase_and_policy(phase, recompute)
    return _with_features(_moe_layer(phase, sp=sp, shared=shared_experts, sort=sort_tokens),
                          phase, qk_norm=qk_norm, recompute=recompute)

"""A Llama-shaped decoder, one rank's shard, whose every op is a partition op.

[`DecoderShard`][kareus.exec.train.DecoderShard] holds this rank's part of a decoder built from a
model's dimensions ([`ModelArch`][kareus.model.ModelArch]): ``layers`` transformer layers
(RMSNorm, grouped-query attention with RoPE, SwiGLU MLP, residuals), a vocabulary-parallel
embedding and LM head, and a final RMSNorm; random initialisation from a seed (std 0.02,
output projections scaled by ``1/sqrt(2 layers)``), weights in bf16 with fp32 master
copies and AdamW on them.

Tensor parallelism splits heads and the MLP's hidden units over the TP group as
Megatron-LM does (QKV and gate/up column-parallel, output and down projections
row-parallel, an all-reduce after each); context parallelism uses Megatron-Core's
load-balanced layout ([`cp_positions`][kareus.model.cp_positions]: every sequence cut into
2 x CP chunks, rank ``r`` holding chunks ``r`` and ``2 CP - 1 - r``, concatenated), applies
RoPE at each token's global position, all-gathers K and V before attention (ordered by
position, then one causal piece per chunk: ``kareus.exec._cp_attention``) and
reduce-scatters their gradients after it; the weight gradients are summed over the CP
group before the optimizer step.

The forward and backward are written op by op, in the names of the partition model
(``attn_norm``, ``qkv``, ..., ``qkv_wgrad``; ``kareus.model.partition``; a model with
per-head query/key norms runs them fused with RoPE, ``qk_norm_rope`` and
``qk_norm_rope_bwd``: ``KernelSet.qk_norm_rope``), each op on
the kernels of a ``KernelSet`` (fused Triton kernels on a GPU
by default, cuBLAS GEMMs with weight gradients accumulated in place, SDPA attention), so
that the decoder schedule ([`kareus.exec.schedule`][kareus.exec.schedule]) can put every collective where a
plan says. [`DecoderShard.run_op`][kareus.exec.train.DecoderShard.run_op] runs one op of one
nanobatch; the residual additions run inside the norm ops that consume the all-reduced tensors. The
collectives' tensors come from a fixed pool allocated up front through the backend's
``empty`` when it has one (registered buffers for the own kernels).

The loss is the mean cross-entropy of next-token prediction over every token of the
iteration, computed vocabulary-parallel (max, sum of exponentials and target logit
all-reduced over TP).

**Nanobatches along the sequence** (``Workload.sequence_split``: a microbatch of one
sequence in ``n > 1`` nanobatches, CP = 1, without sequence parallelism): nanobatch ``j`` is
tokens ``[j c, (j + 1) c)`` (``c = seq_len / n``), rotated at those absolute positions; its
attention takes its own queries over the keys and values of chunks ``0..j`` of the layer
(kept from the earlier chunks' RoPE op), causal aligned to the lower right (query ``i``
sees keys ``0 .. j c + i``: ``kareus.exec._cp_attention``'s pieces). The backward runs the
chunks last first (``chunk``: the schedule's ``i``-th nanobatch is chunk ``n - 1 - i``;
the forward that full recomputation re-runs keeps the forward's order), and chunk ``j``'s
attention backward adds its dK and dV of chunks ``0..j-1`` to theirs before their
``rope_bwd`` runs: ``kareus.model.partition``'s op order, whose per-chunk types
(``fwd_attn_c0``, ...) each unit runs as. Full recomputation needs a collective between
the recomputed forward and the backward (TP or CP > 1): refused at TP = CP = 1.

**Sequence parallelism** (``sp=True`` at TP > 1, Megatron-LM's ``--sequence-parallel``; the
op order of ``decoder_layer(phase, sp=True)``): between the TP regions each TP rank holds
its shard of every sequence of a nanobatch, positions ``[r sq/TP, (r+1) sq/TP)`` of each
(``sq`` = the CP-local length), laid out ``[sequences, sq/TP, hidden]`` as rows; the norms
(with the residual additions fused in) run on the shard. The normed input is all-gathered
over TP before the QKV and gate/up GEMMs, and the output and down projections'
results are reduce-scattered; the backward mirrors it (reduce-scatter of the input gradients
of the QKV and gate/up GEMMs, all-gather of the output gradients before ``out_dgrad`` and
``down_dgrad``, the input gradient all-gathered last for the layer below or the embedding).
A gathered tensor lists the ranks' shards one after another (``[TP, sequences, sq/TP]``
token order): the GEMMs and the SwiGLU are row-wise and run in that order, and RoPE
(with the query/key norms fused into it) and attention, which need each sequence in order,
reorder it
(a copy, only when a nanobatch holds more than one sequence). The weight gradients of the
QKV and gate/up GEMMs read the gathered inputs of the forward: kept (without
recomputation: a copy per layer, since the gather buffer is the next layer's) or
recomputed with the forward. As Megatron-LM does, the embedding's output is
reduce-scattered to the shard (instead of all-reduced), the final norm runs on the shard and
its output is all-gathered before the LM head, whose input gradient is reduce-scattered; the
backward opens with the all-gather of the top layer's output gradient (a collective of the
stack, through the executor: ``sp_backward_stack``). The norm weights' gradients are
summed over TP before the optimizer step (each rank's shard of tokens gave part of them).

**Mixture of experts** (``arch.moe``): each layer's MLP is the MoE block of
``kareus.model.decoder.moe_decoder_layer``, its ops written in ``kareus.exec.train._moe``
(mixed in): the router, top-k, permutation with the count exchange over the EP group, the
experts between the dispatch and combine all-to-alls (whose tensors are the layer's
activations, sized by the routing: ``comm_args`` gives their splits), the un-permutation
as the forward's tail (it opens the next layer's stream), the shared experts. The experts'
weights sit after every other weight in the flat buffers (``n_dense``), so the optimizer
step sums their gradients over the expert-data-parallel group and the rest over CP. Under
sequence parallelism the MoE block reads and writes the sequence shard: no TP collective
around it, the top layer's output gradient and layer 0's input gradient stay sharded (the
embedding's backward gathers the latter outside the stack).

torch is imported inside the functions that need it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kareus.errors import ArgumentError, WorkloadError
from kareus.exec._cp_attention import (
    attention_pieces,
    chunk_piece,
    cp_attention,
    cp_attention_bwd,
    order_kv,
    scatter_kv_grad,
)
from kareus.exec._executor_role import Executor
from kareus.exec.model_check import refuse_uncomputed
from kareus.exec.schedule import Comm, Op
from kareus.exec.train._moe import MOE_COMMS, MOE_KEPT, MoEBlock, moe_layout
from kareus.model.context_parallel import cp_positions
from kareus.model.decoder import layer_collectives, moe_decoder_layer
from kareus.model.workload import RECOMPUTE_POLICIES, ModelArch, recompute_policy

__all__ = ["DecoderShard"]

_LAYER_PARAMS = ("w_attn_norm", "Wqkv", "Wo", "w_mlp_norm", "Wg", "Wu", "Wd")

KEPT_FOR_BACKWARD: dict[str, frozenset[str]] = {
    "full": frozenset({"x_in"}),
    "none": frozenset({"x_in", "xn", "qkv_pre", "graph", "attn", "x_mid", "xn2", "g", "u",
                       "a"}),
    "selective": frozenset({"x_in", "xn", "qkv_pre", "q", "x_mid", "xn2", "g", "u", "a"}),
}
"""What a layer's backward reads of its forward, per recomputation policy (names of the
per-layer, per-nanobatch activations): ``"full"`` keeps the input and re-runs the rest;
``"none"`` keeps the input, both norms' outputs, the input of the fused query/key norm
and RoPE (``qkv_pre``, the QKV projection's output, qk-norm models), the attention's
saved state (queries, keys, values, output and softmax statistics: ``graph``) and its
output in the output projection's
layout (``attn``, a view of the same memory on the fused kernels), the residual sum
(``x_mid``), the gate and up projections and the SwiGLU output; ``"selective"`` keeps
the same but the attention's output and statistics, holding instead what its
recomputation reads: the queries (``q``), and the keys and values, this rank's (``k``,
``v``; along the sequence views of the layer's whole ``kvbuf``) without CP, every chunk's as gathered, by position (``kvs``) under CP, so that no
collective runs again (the two are added by ``DecoderShard`` per CP size)."""
_KEPT = KEPT_FOR_BACKWARD
_KEPT_NO_CP = frozenset({"k", "v", "kvbuf"})
_KEPT_CP = frozenset({"kvs"})
#: Names of the backward's own ops and collectives (the rest are forward ops, which the
#: backward runs again under recomputation).
_BACKWARD_SUFFIXES = ("_bwd", "_dgrad", "_wgrad", "_grad")


def _group_backend(c: Any, kind: str, group: str) -> Any:
    """The backend of ``c`` that runs a collective of ``kind`` over ``group`` (``c``'s own
    when it serves one group)."""
    pick = getattr(c, "for_group", None)
    if callable(pick):
        try:
            return pick(group)
        except ValueError:  # no backend for that group
            return None
    route = getattr(c, "backend_for", None)
    return route(kind) if callable(route) else c


class DecoderShard(MoEBlock):
    """One rank's shard of a Llama-shaped decoder, run op by op (with a mixture-of-experts
    block in place of the MLP for a model with ``arch.moe``: ``kareus.exec.train._moe``).

    Args:
        arch: Model dimensions (hidden size, heads, KV heads, head dim, FFN, vocabulary).
        layers: Transformer layers to build (default: ``arch.layers``).
        microbatch_size: Sequences per microbatch.
        seq_len: Tokens per sequence (whole sequence; CP ranks hold ``seq_len / cp``: two
            of its ``2 cp`` chunks, ``cp_positions``).
        num_microbatches: Microbatches per iteration (the loss is their mean).
        groups: [`ParallelGroups`][kareus.exec.train.ParallelGroups] of this rank.
        backend: Where the partitions' collective buffers come from: an object with
            ``backend_for(kind)`` ([`GroupedCollective`][kareus.exec.train.GroupedCollective]) or
            an [`Executor`][kareus.exec.Executor] (its ``empty(shape, dtype, kind=...)``), or a
            list of them, the first that is an executor or whose backend offers
            ``empty(shape, dtype)`` allocating (registered memory, which every backend can
            run on); ``None`` = plain tensors.
        nanobatch_counts: The nanobatch counts the loop will run (buffers for each).
        recompute: The recomputation policy (``Workload.recompute``): ``"full"`` (or
            ``True``: the forward keeps only each layer's input and the backward re-runs
            the layer's forward, its collectives included), ``"selective"`` (every
            activation is kept except the attention core's output and its softmax
            statistics; the backward re-runs the attention core forward right before
            ``out_dgrad``, where ``decoder_layer("bwd", recompute="selective")`` puts it;
            no collective runs again: under CP the gathered keys and values are kept) or
            ``"none"`` (or ``False``: every activation is kept, the backward runs no
            forward op).
        sp: Sequence parallelism (at TP > 1; a no-op at TP = 1): see the module docstring.
        kernels: A ``KernelSet`` or name; ``None`` = default.
        device: Torch device (default: the current CUDA device).
        dtype: Torch dtype name of weights and activations (default ``"bfloat16"``).
        seed: Seed of the weights.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    def __init__(self, *, arch: ModelArch, layers: int | None = None, microbatch_size: int,
                 seq_len: int, num_microbatches: int, groups: Any, backend: Any = None,
                 nanobatch_counts: tuple[int, ...] = (1, 2), recompute: bool | str = True,
                 kernels: Any = None, device: Any = None, dtype: str = "bfloat16",
                 seed: int = 0, lr: float = 3e-4, weight_decay: float = 0.01,
                 sp: bool = False) -> None:
        import torch

        from kareus.exec.kernels import get_kernels

        refuse_uncomputed(arch, where="kareus's training loop",
                          computes=frozenset({"qk_norm", "norm_eps", "moe"}))
        tp, cp = groups.tp_size, groups.cp_size
        self.layers = arch.layers if layers is None else int(layers)
        if self.layers < 1:
            raise ArgumentError(f"layers must be >= 1, got {self.layers}")
        for what, num, den in (("heads", arch.heads, tp), ("kv_heads", arch.kv_heads, tp),
                               ("ffn", arch.ffn, tp),
                               ("seq_len", seq_len, 2 * cp if cp > 1 else 1)):
            if num % den:
                raise WorkloadError(f"{what}={num} is not divisible by {den} (TP={tp}, CP={cp})")
        for n in nanobatch_counts:
            along = microbatch_size == 1 and n > 1  # one sequence: split along it
            if n < 1 or (microbatch_size % n and not along):
                raise WorkloadError(f"microbatch_size={microbatch_size} does not split into "
                                    f"{n} nanobatches")
            if along and (cp > 1 or (sp and tp > 1) or seq_len % n):
                raise WorkloadError(
                    f"nanobatches along the sequence (microbatch_size=1, nanobatches={n}) "
                    "run at CP=1 without sequence parallelism, on a seq_len divisible by "
                    f"the nanobatches (got CP={cp}, sp={bool(sp) and tp > 1}, "
                    f"seq_len={seq_len}): use nanobatches=1 or a larger microbatch")
        self.backend = backend
        self.torch = torch
        self._shard_dims(arch, groups, int(microbatch_size), seq_len // cp, sp=sp)
        self.num_microbatches = int(num_microbatches)
        policy = recompute_policy(recompute)
        if policy not in RECOMPUTE_POLICIES:
            raise WorkloadError(f"recompute must be one of {', '.join(RECOMPUTE_POLICIES)}, "
                                f"got {recompute!r:.40}")
        self._set_policy(str(policy))
        self.v_local = -(-arch.vocab // tp)
        self.v0 = groups.tp_rank * self.v_local
        self.ks = get_kernels(kernels)
        self.torch = torch
        self.device = (torch.device("cuda", torch.cuda.current_device()) if device is None
                       else torch.device(device))
        self.dtype = getattr(torch, dtype)
        self.seed = int(seed)
        self._build_params(torch)
        self._init_optimizer(lr, weight_decay)
        self._build_rope(torch)
        self._pool: dict[tuple[str, int, int], tuple[Any, Any]] = {}
        for n in sorted(set(nanobatch_counts), reverse=True):
            self._alloc_pool(torch, n)
        self.loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        self.act: dict[tuple[int, int], dict[str, Any]] = {}
        self.head: dict[str, Any] = {}
        #: Along the sequence: the layer's keys and values of the whole sequence
        #: (``[2, 1, seq, kv_heads, head_dim]``, each chunk's RoPE op writing its part) by
        #: (layer, chunk) whose part is written, which the later chunks' attention reads, and
        #: the earlier chunks' dK, dV that the later chunks' attention backward gave (with
        #: how many chunks gave them).
        self._kv_chunks: dict[tuple[int, int], Any] = {}
        self._dkv_from_later: dict[tuple[int, int], tuple[Any, int]] = {}
        self.n = 1
        self.phase = "fwd"

    def _set_policy(self, policy: str) -> None:
        """The recomputation policy: ``policy`` (``"none"``, ``"selective"``, ``"full"``),
        and ``recompute``, whether the backward re-runs whole layers (``"full"``)."""
        self.policy = policy
        self.recompute = policy == "full"
        self._kept_names = _KEPT[policy] | (_KEPT_CP if policy == "selective" and self.cp > 1
                                            else _KEPT_NO_CP if policy == "selective"
                                            else frozenset())
        if self.moe is not None and policy != "full":  # the MoE block's (``MOE_KEPT``)
            self._kept_names = self._kept_names | MOE_KEPT

    def kept(self, a: dict[str, Any]) -> dict[str, Any]:
        """Of one layer's activations of one nanobatch after its forward, those its backward
        reads under the policy (``KEPT_FOR_BACKWARD``)."""
        return {k: v for k, v in a.items() if k in self._kept_names}

    # ------------------------------------------------------------------ parameters
    def _shard_dims(self, arch: ModelArch, groups: Any, microbatch_size: int,
                    seq_local: int, *, sp: bool = False, dp: int | None = None) -> None:
        """This rank's dimensions: TP/CP coordinates, tokens, and its share of the heads and
        the MLP (what every op reads). ``dp``: the data-parallel replicas, where the groups
        do not hold a DP group (a planned layer's: the framework reduces the gradients)."""
        self.arch, self.groups = arch, groups
        self.tp, self.cp, self.r = groups.tp_size, groups.cp_size, groups.cp_rank
        #: Data-parallel replicas (each on its own microbatches; the loss is their mean).
        self.dp = int(getattr(groups, "dp_size", 1)) if dp is None else int(dp)
        #: Whether the sequence-parallel layout runs (``sp`` at TP > 1).
        self.sp = bool(sp) and self.tp > 1
        if self.sp and seq_local % self.tp:
            raise WorkloadError(f"sequence parallelism at TP={self.tp} needs each rank's "
                                f"seq_len / CP = {seq_local} tokens per sequence divisible "
                                "by TP")
        self.mbs, self.sq = microbatch_size, seq_local
        self.seq = seq_local * self.cp
        if self.cp > 1 and seq_local % 2:
            raise WorkloadError(f"seq_len={self.seq} is not divisible by 2 x CP = "
                                f"{2 * self.cp} (Megatron-Core's load-balanced chunks)")
        #: The causal attention pieces of this rank's two chunks (CP > 1).
        self.pieces = attention_pieces(seq_local, self.cp, self.r) if self.cp > 1 else ()
        self.h, self.hd = arch.hidden, arch.head_dim
        self.heads, self.kvh = arch.heads // self.tp, arch.kv_heads // self.tp
        self.f = arch.ffn // self.tp
        self.q, self.kv = self.heads * self.hd, self.kvh * self.hd
        self.eps, self.qk_norm = arch.norm_eps, arch.qk_norm
        #: The model's mixture of experts (``None``: a dense MLP).
        self.moe = arch.moe
        if self.moe is not None:
            moe_layout(self.moe, tp=self.tp, cp=self.cp, ep=groups.ep_size, sp=self.sp,
                       dp=self.dp)
            self._moe_dims()
        elif groups.ep_size > 1:
            raise WorkloadError(f"EP={groups.ep_size} needs a mixture-of-experts model")

    def _shapes(self) -> dict[str, tuple[tuple[int, ...], float, bool]]:
        """name -> (shape, init std (0: ones), sharded over TP)."""
        h, std = self.h, 0.02
        out_std = std / math.sqrt(2 * self.layers)
        per_layer: dict[str, tuple[tuple[int, ...], float, bool]] = {
            "w_attn_norm": ((h,), 0.0, False),
            "Wqkv": ((h, self.q + 2 * self.kv), std, True),
            "Wo": ((self.q, h), out_std, True),
            "w_mlp_norm": ((h,), 0.0, False),
            "Wg": ((h, self.f), std, True), "Wu": ((h, self.f), std, True),
            "Wd": ((self.f, h), out_std, True)}
        if self.moe is not None:  # the MoE block in place of the MLP (experts: _expert_shapes)
            for k in ("Wg", "Wu", "Wd"):
                del per_layer[k]
            per_layer |= self._moe_shapes()
        if self.qk_norm:  # one RMSNorm weight over head_dim for every query and key head
            per_layer["w_q_norm"] = ((self.hd,), 0.0, False)
            per_layer["w_k_norm"] = ((self.hd,), 0.0, False)
        shapes: dict[str, tuple[tuple[int, ...], float, bool]] = {
            "emb": ((self.v_local, h), std, True)}
        for layer in range(self.layers):
            for k, v in per_layer.items():
                shapes[f"l{layer}.{k}"] = v
        shapes["w_final"] = ((h,), 0.0, False)
        if not self.arch.tied_embeddings:  # tied: the output layer is the embedding's transpose
            shapes["Wlm"] = ((h, self.v_local), std, True)
        return shapes

    def _lm_weight(self) -> Any:
        """The output layer's weight ``(hidden, vocab shard)``: its own, or, with tied
        embeddings, the embedding matrix transposed (one parameter, both gradients)."""
        if self.arch.tied_embeddings:
            return self.params["emb"].t()
        return self.params["Wlm"]

    def _out_std(self) -> float:
        """The initial std of the output projections (``Wo``, ``Wd``, the experts' down
        projections): ``0.02 / sqrt(2 layers)``."""
        return 0.02 / math.sqrt(2 * self.layers)

    def _build_params(self, torch: Any) -> None:
        """Every weight in one flat buffer (bf16, with fp32 masters): the dense ones first,
        then this rank's experts (``n_dense`` elements in; their gradients are summed over
        the expert-data-parallel group, the others' over CP)."""
        shapes = self._shapes()
        experts = ({f"l{layer}.{k}": v for layer in range(self.layers)
                    for k, v in self._expert_shapes().items()} if self.moe is not None else {})
        total = (sum(math.prod(s) for s, _, _ in shapes.values())
                 + sum(math.prod(s) for s, _ in experts.values()))
        self.master = torch.empty(total, device=self.device, dtype=torch.float32)
        self.flat = torch.empty(total, device=self.device, dtype=self.dtype)
        self.flat_grad = torch.zeros(total, device=self.device, dtype=self.dtype)
        self.params: dict[str, Any] = {}
        self.grads: dict[str, Any] = {}
        off = 0
        for name, (shape, std, sharded) in shapes.items():
            n = math.prod(shape)
            m = self.master[off:off + n].view(shape)
            if std == 0.0:
                m.fill_(1.0)
            else:
                g = torch.Generator(device=self.device)
                key = sum(ord(c) * 131 ** i for i, c in enumerate(name)) % (2 ** 31)
                g.manual_seed(self.seed * 1_000_003 + key * 17 + (self.groups.tp_rank
                                                                  if sharded else 0))
                m.copy_(torch.randn(shape, generator=g, device=self.device) * std)
            self.params[name] = self.flat[off:off + n].view(shape)
            self.grads[name] = self.flat_grad[off:off + n].view(shape)
            off += n
        #: Elements of the flat buffers before the experts' weights.
        self.n_dense = off
        for name, (shape, std) in experts.items():
            n = math.prod(shape)
            m = self.master[off:off + n].view(shape)
            for e in range(shape[0]):  # each expert from its global index
                g = torch.Generator(device=self.device)
                label = f"{name}.{self.first_expert + e}"
                key = sum(ord(c) * 131 ** i for i, c in enumerate(label)) % (2 ** 31)
                g.manual_seed(self.seed * 1_000_003 + key * 17)
                m[e].copy_(torch.randn(shape[1:], generator=g, device=self.device) * std)
            self.params[name] = self.flat[off:off + n].view(shape)
            self.grads[name] = self.flat_grad[off:off + n].view(shape)
            off += n
        self.flat.copy_(self.master)
        self.initial_master = self.master.clone()

    def _init_optimizer(self, lr: float, weight_decay: float) -> None:
        torch = self.torch
        self.master_param = torch.nn.Parameter(self.master, requires_grad=False)
        self.master_param.grad = torch.zeros_like(self.master)
        self._opt_args = {"lr": float(lr), "weight_decay": float(weight_decay),
                          "betas": (0.9, 0.95), "eps": 1e-8}
        self.optimizer = self._new_optimizer()

    def _new_optimizer(self) -> Any:
        torch = self.torch
        kw: dict[str, Any] = dict(self._opt_args)
        if self.device.type == "cuda":
            kw["fused"] = True
        return torch.optim.AdamW([self.master_param], **kw)

    @property
    def num_params(self) -> int:
        """Parameters of this rank's shard."""
        return int(self.master.numel())

    def reset(self) -> None:
        """Weights back to their initial values and a fresh optimizer (same seed)."""
        with self.torch.no_grad():
            self.master.copy_(self.initial_master)
            self.flat.copy_(self.master)
            self.flat_grad.zero_()
        self.optimizer = self._new_optimizer()

    def W(self, layer: int, name: str) -> Any:
        """Weight ``name`` of layer ``layer``."""
        return self.params[f"l{layer}.{name}"]

    def G(self, layer: int, name: str) -> Any:
        """Gradient buffer of weight ``name`` of layer ``layer``."""
        return self.grads[f"l{layer}.{name}"]

    # ------------------------------------------------------------------ buffers
    #: RoPE base frequency (Llama 3's); a subclass or an integration may set its model's.
    rope_base: float = 500000.0
    #: RoPE inverse frequencies ([head_dim / 2] floats) when the model scales them (Llama
    #: 3.1's long-context scaling); ``None``: ``rope_base ** (-2i / head_dim)``.
    rope_inv_freq: Any = None

    def _build_rope(self, torch: Any) -> None:
        if self.rope_inv_freq is not None:
            inv = torch.as_tensor(self.rope_inv_freq, dtype=torch.float32).to(self.device)
            if inv.shape != (self.hd // 2,):
                raise ArgumentError(f"rope_inv_freq must hold head_dim / 2 = {self.hd // 2} "
                                    f"frequencies, got shape {tuple(inv.shape)}")
        else:
            inv = 1.0 / (float(self.rope_base) ** (torch.arange(
                0, self.hd, 2, device=self.device, dtype=torch.float32) / self.hd))
        # each token at its global position (this rank's two chunks)
        pos = torch.tensor(self.positions(), device=self.device, dtype=torch.float32)
        ang = torch.outer(pos, inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.cos, self.sin = ang.cos().to(self.dtype), ang.sin().to(self.dtype)

    def positions(self) -> list[int]:
        """The global positions of this rank's tokens of a sequence, in its order
        (``cp_positions``: its two chunks with CP, the whole sequence without)."""
        return cp_positions(self.seq, self.cp, self.r)

    def comms(self) -> list[tuple[str, str]]:
        """``(name, kind)`` of the collectives of one layer."""
        return [(name, kind) for name, kind, _ in self._comms()]

    def _comms(self) -> list[tuple[str, str, str]]:
        """``(name, kind, group)`` of the TP and CP collectives of one layer, TP's first
        (the pool's buffers; a mixture of experts' all-to-alls take the layer's
        activations)."""
        if self.moe is not None:
            sizes = {"tp": self.tp, "cp": self.cp, "ep": 1}
            ours = tuple(c for ph in ("fwd", "bwd")
                         for c in moe_decoder_layer(ph, sp=self.sp).collectives
                         if sizes[c.group] > 1)
        else:
            ours = layer_collectives(tp=self.tp, cp=self.cp, sp=self.sp)  # in order
        return [(c.tensor, c.kind, c.group) for group in ("tp", "cp") for c in ours
                if c.group == group]

    def _alloc_pool(self, torch: Any, n: int) -> None:
        t = self.mbs * self.sq // n
        cands = ([] if self.backend is None else list(self.backend)
                 if isinstance(self.backend, (list, tuple)) else [self.backend])
        for name, kind, group in self._comms():
            owners = [c if isinstance(c, Executor) else _group_backend(c, kind, group)
                      for c in cands if c is not None]
            backend = next((b for b in owners if isinstance(b, Executor)
                            or callable(getattr(b, "empty", None))), None)
            shapes: tuple[tuple[int, ...], tuple[int, ...] | None]
            if kind == "all_reduce":
                shapes = ((t, self.h), None)
            elif group == "tp":  # sequence parallelism: shard <-> every shard, in rank order
                ts = t // self.tp
                shapes = (((ts, self.h), (self.tp, ts, self.h)) if kind == "all_gather"
                          else ((self.tp, ts, self.h), (ts, self.h)))
            elif kind == "all_gather":  # local K and V -> every chunk's K and V
                shapes = ((2, t * self.kv), (self.cp, 2, t * self.kv))
            else:  # every chunk's dK, dV -> this chunk's
                shapes = ((self.cp, 2, t * self.kv), (2, t * self.kv))
            for i in range(n):
                bufs = tuple(None if s is None else self._zeros(torch, backend, s, kind, group)
                             for s in shapes)
                self._pool[(name, n, i)] = bufs  # type: ignore[assignment]

    def _zeros(self, torch: Any, backend: Any, shape: tuple[int, ...],
               kind: str = "all_reduce", group: str | None = None) -> Any:
        if isinstance(backend, Executor):
            if group is not None and self.sp:
                return backend.empty(shape, self.dtype, kind=kind, group=group).zero_()
            return backend.empty(shape, self.dtype, kind=kind).zero_()
        empty = getattr(backend, "empty", None)
        if callable(empty):
            return empty(shape, self.dtype).zero_()
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    def pool_buffers(self) -> list[Any]:
        """Every communication buffer (for checks that they are registered)."""
        return [t for pair in self._pool.values() for t in pair if t is not None]

    def comm_args(self, comm: Comm, nb: int) -> tuple[Any, ...]:
        """``(tensor, output)`` of collective ``comm`` of nanobatch ``nb`` (a mixture of
        experts' all-to-all: ``(tensor, output, (output_splits, input_splits))``)."""
        if comm.name in MOE_COMMS:
            return self.moe_comm_args(comm.name, comm.layer, self.chunk(comm.name, nb))
        return self._pool[(comm.name, self.n, self.chunk(comm.name, nb))]

    def _buf(self, name: str, nb: int) -> Any:
        """The tensor an op writes for collective ``name`` (its input)."""
        return self._pool[(name, self.n, nb)][0]

    def _reduced(self, name: str, layer: int, nb: int) -> Any:
        """The result of collective ``name`` (or the op's plain result without one)."""
        key = (name, self.n, nb)
        if key in self._pool:
            inp, out = self._pool[key]
            return inp if out is None else out
        return self.act[(layer, nb)][name]

    def _out(self, name: str, layer: int, nb: int) -> tuple[Any, bool]:
        """Where an op writes the input of collective ``name``: a pool buffer, or None."""
        key = (name, self.n, nb)
        if key not in self._pool:
            return None, False
        buf = self._pool[key][0]  # [TP, tokens / TP, hidden] under sequence parallelism
        return buf.view(-1, buf.shape[-1]), True

    # ------------------------------------------------------------------ computations
    def begin(self, phase: str, nanobatches: int, tokens: Any = None,
              labels: Any = None) -> None:
        """Start a computation: ``"fwd"`` takes this rank's ``tokens`` and ``labels``
        ([microbatch_size, seq_len / cp] int64: with CP, the tokens at this rank's
        ``positions()``) and runs the embedding; ``"bwd"`` runs the
        loss's backward, the LM head's and the final norm's."""
        if phase not in ("fwd", "bwd"):
            raise ArgumentError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
        if nanobatches < 1 or (self.mbs % nanobatches
                               and not (self.mbs == 1 and self.sq % nanobatches == 0)):
            raise ArgumentError(f"{self.mbs} sequences do not split into {nanobatches} "
                                "nanobatches")
        if self.pool_buffers() and not any(k[1] == nanobatches for k in self._pool):
            raise ArgumentError(f"no buffers for {nanobatches} nanobatches: pass it in "
                                "nanobatch_counts")
        if (self.mbs == 1 and nanobatches > 1 and self.policy == "full"
                and self.tp == self.cp == 1):
            raise ArgumentError(
                "full recomputation along the sequence (microbatch_size=1, nanobatches="
                f"{nanobatches}) needs TP or CP > 1: without a collective the backward's "
                "pieces cannot run the recomputed forward in chunk order (use nanobatches=1)")
        self.phase, self.n = phase, nanobatches
        if phase == "fwd":
            self._kv_chunks, self._dkv_from_later = {}, {}
        with self.torch.no_grad():
            if phase == "fwd":
                if tokens is None or labels is None:
                    raise ArgumentError("the forward computation needs tokens and labels")
                self.act = {}
                self.head = {"tokens": tokens.reshape(-1), "labels": labels.reshape(-1)}
                self._embed()
            else:
                split = 1 + max((i for _, i in self.act), default=0)
                if split != nanobatches and self.policy != "full":
                    raise ArgumentError(
                        f"the forward ran in {split} nanobatch(es), the backward in "
                        f"{nanobatches}: with recompute {self.policy!r} a microbatch's "
                        "backward runs in its forward's nanobatches (the activations are "
                        "kept per nanobatch)")
                self._head_bwd()

    def finish(self) -> None:
        """End a computation: ``"fwd"`` runs the final norm, the LM head and the loss
        (added to ``loss_sum``); ``"bwd"`` runs the embedding's backward."""
        with self.torch.no_grad():
            if self.phase == "fwd":
                self._head_fwd()
            else:
                self._embed_bwd()
                self.act = {}
                self.head = {}
                self._kv_chunks, self._dkv_from_later = {}, {}

    def rows(self, nb: int) -> slice:
        """Token rows of nanobatch ``nb`` in a whole-microbatch ``[tokens, hidden]`` tensor of
        this rank's residual stream (its sequence shard's tokens under sequence
        parallelism)."""
        t = self.mbs * self.sq // self.n // (self.tp if self.sp else 1)
        return slice(nb * t, (nb + 1) * t)

    # ------------------------------------------------------------------ along the sequence
    @property
    def seq_split(self) -> bool:
        """Whether the current computation splits its one sequence into ``n`` chunks
        (``Workload.sequence_split``: microbatch_size 1, nanobatches > 1): nanobatch ``j``
        holds tokens ``[j c, (j + 1) c)``, ``c = seq_len / n``."""
        return self.mbs == 1 and self.n > 1

    def _nb_shape(self) -> tuple[int, int]:
        """``(sequences, tokens per sequence)`` of one nanobatch."""
        if self.seq_split:
            return 1, self.sq // self.n
        return self.mbs // self.n, self.sq

    def chunk(self, name: str, nb: int) -> int:
        """The nanobatch an op or collective named ``name`` works on when the schedule
        runs it as its ``nb``-th: ``nb`` itself, but along the sequence the backward runs
        the chunks last first (a chunk's attention backward adds to the earlier chunks'
        dK and dV, which their ``rope_bwd`` reads: ``kareus.model.partition``'s op
        order), the forward recomputed by ``"full"`` recomputation first first (a chunk's
        attention reads the earlier chunks' keys and values)."""
        if not self.seq_split or self.phase == "fwd":
            return nb
        if self.policy == "full" and not name.endswith(_BACKWARD_SUFFIXES):
            return nb
        return self.n - 1 - nb

    # ------------------------------------------------------------------ sequence parallelism
    def _gathered(self, name: str, nb: int) -> Any:
        """The result of TP all-gather ``name`` as ``[tokens, hidden]`` (rank-order tokens)."""
        out = self._pool[(name, self.n, nb)][1]
        return out.view(-1, out.shape[-1])

    def _to_seq_order(self, x: Any) -> Any:
        """Rows of a gathered nanobatch from rank order (``[TP, sequences, sq/TP]``) to
        sequence order (``[sequences, sq]``): a copy when the nanobatch holds more than one
        sequence, ``x`` itself otherwise (the two orders are then one)."""
        b = self.mbs // self.n
        if not self.sp or b == 1:
            return x
        c = x.shape[-1]
        return x.view(self.tp, b, self.sq // self.tp, c).transpose(0, 1).reshape(-1, c)

    def _to_rank_order(self, x: Any) -> Any:
        """The inverse of ``_to_seq_order``."""
        b = self.mbs // self.n
        if not self.sp or b == 1:
            return x
        c = x.shape[-1]
        return x.view(b, self.tp, self.sq // self.tp, c).transpose(0, 1).reshape(-1, c)

    def _sp_micro(self, x: Any, *, to_ranks: bool) -> Any:
        """A whole microbatch ``[tokens, hidden]`` from sequence order to rank-major order
        ``[TP, nanobatches, sequences, sq/TP]`` (``to_ranks``; contiguous, for the reduce-
        scatter that leaves each rank its shards) or back (from an all-gather's output)."""
        b, st, h = self.mbs // self.n, self.sq // self.tp, x.shape[-1]
        if to_ranks:
            return x.view(self.n, b, self.tp, st, h).permute(2, 0, 1, 3, 4).contiguous()
        return x.view(self.tp, self.n, b, st, h).permute(1, 2, 0, 3, 4).reshape(-1, h)

    def _embed(self) -> None:
        ids = self.head["tokens"] - self.v0
        valid = (ids >= 0) & (ids < self.v_local)
        x0 = self.params["emb"][ids.clamp(0, self.v_local - 1)]
        x0.mul_(valid.unsqueeze(1).to(x0.dtype))
        if self.sp:  # the sum over the vocabulary shards, each rank its sequence shard
            full = self._sp_micro(x0, to_ranks=True)
            x0 = self.torch.empty(full.shape[1:], device=self.device, dtype=self.dtype)
            self.groups.reduce_scatter(x0, full, group="tp")
            x0 = x0.view(-1, self.h)
        else:
            self.groups.all_reduce(x0, group="tp")
        self.head["x0"], self.head["ids"], self.head["valid"] = x0, ids, valid

    def _head_fwd(self) -> None:
        torch, ks = self.torch, self.ks
        top = self.layers - 1
        rows = self.rows(self.n - 1).stop
        xf = torch.empty(rows, self.h, device=self.device, dtype=self.dtype)
        for i in range(self.n):
            a = self.act[(top, i)]
            torch.add(a["x_mid"], self._reduced("mlp_out", top, i), out=xf[self.rows(i)])
        xn = ks.rms_norm(xf, self.params["w_final"], self.eps)
        if self.sp:  # the final norm on the shard, its output gathered for the LM head
            full = torch.empty(self.tp, *xn.shape, device=self.device, dtype=self.dtype)
            self.groups.all_gather(full, xn, group="tp")
            xn = self._sp_micro(full, to_ranks=False)
        logits = ks.matmul(xn, self._lm_weight()).float()
        if self.v_local * self.tp > self.arch.vocab:  # padding columns of the last shard
            pad = (torch.arange(self.v_local, device=self.device) + self.v0) >= self.arch.vocab
            logits.masked_fill_(pad, float("-inf"))
        m = logits.max(dim=1).values
        self.groups.all_reduce(m, group="tp", op="max")
        lid = self.head["labels"] - self.v0
        lvalid = (lid >= 0) & (lid < self.v_local)
        lidc = lid.clamp(0, self.v_local - 1)
        tgt = logits.gather(1, lidc.unsqueeze(1)).squeeze(1) * lvalid
        logits.sub_(m.unsqueeze(1)).exp_()
        pack = torch.stack((logits.sum(dim=1), tgt))
        self.groups.all_reduce(pack, group="tp")
        s, tgt = pack[0], pack[1]
        # the mean over every token of the iteration, every data-parallel replica's
        n_tokens = self.num_microbatches * self.mbs * self.seq * self.dp
        loss_local = (s.log() + m - tgt).sum() / n_tokens
        cp_loss = loss_local.clone()
        self.groups.all_reduce(cp_loss, group="cp")  # every CP rank reports the whole loss
        if self.dp > 1:  # and every replica
            self.groups.all_reduce(cp_loss, group="dp")
        self.loss_sum.add_(cp_loss)
        logits.div_(s.unsqueeze(1))
        rows = torch.arange(logits.shape[0], device=self.device)
        logits[rows, lidc] -= lvalid.to(logits.dtype)
        self.head.update(xf=xf, xn=xn, dlogits=logits.mul_(1.0 / n_tokens).to(self.dtype))
        for key, a in list(self.act.items()):  # what the backward reads only
            self.act[key] = self.kept(a)

    def _head_bwd(self) -> None:
        ks, hd = self.ks, self.head
        dxn = ks.matmul(hd["dlogits"], self._lm_weight().t())
        if self.arch.tied_embeddings:  # the output layer's gradient, transposed, into emb's
            ks.matmul(hd["dlogits"].t(), hd["xn"], out=self.grads["emb"], accumulate=True)
        else:
            ks.matmul(hd["xn"].t(), hd["dlogits"], out=self.grads["Wlm"], accumulate=True)
        if self.sp:  # summed over the vocabulary shards, each rank its sequence shard
            full = self._sp_micro(dxn, to_ranks=True)
            dxn = self.torch.empty(full.shape[1:], device=self.device, dtype=dxn.dtype)
            self.groups.reduce_scatter(dxn, full, group="tp")
            dxn = dxn.view(-1, self.h)
        else:
            self.groups.all_reduce(dxn, group="tp")
        dxf, dw = self._norm_bwd(dxn, hd["xf"], self.params["w_final"])
        self.grads["w_final"].add_(dw.to(self.dtype))
        top = self.layers - 1
        for i in range(self.n):
            if self.sp and self.moe is None:  # the stack's first collective gathers it
                self._buf("mlp_out_grad", i).view(-1, self.h).copy_(dxf[self.rows(i)])
            else:
                self.act.setdefault((top, i), {})["dy"] = dxf[self.rows(i)]
        hd["dlogits"] = hd["xn"] = hd["xf"] = None

    def _embed_bwd(self) -> None:
        torch = self.torch
        dx0 = torch.empty(self.mbs * self.sq, self.h, device=self.device, dtype=self.dtype)
        t = self.mbs * self.sq // self.n
        for i in range(self.n):
            if self.sp and self.moe is not None:  # on the shard (the MoE block reads it)
                shard = self.act[(0, i)]["dx_in"]
                full = self.torch.empty(self.tp, *shard.shape, device=self.device,
                                        dtype=shard.dtype)
                self.groups.all_gather(full, shard, group="tp")
                dx0[i * t:(i + 1) * t] = self._to_seq_order(full.view(-1, self.h))
            elif self.sp:  # layer 0's input gradient, gathered by the stack's last collective
                dx0[i * t:(i + 1) * t] = self._to_seq_order(self._gathered("mlp_out_grad", i))
            else:
                dx0[self.rows(i)] = self.act[(0, i)]["dx_in"]
        # Rows of tokens outside this shard's vocabulary add zeros (to a clamped row):
        # no boolean indexing, whose result size the host must read (a synchronisation,
        # which a CUDA graph cannot capture).
        valid = self.head["valid"]
        ids = self.head["ids"].clamp(0, self.v_local - 1)
        self.grads["emb"].index_add_(0, ids, dx0.mul_(valid.unsqueeze(1).to(dx0.dtype)))

    def _norm_bwd(self, dy: Any, x: Any, w: Any) -> tuple[Any, Any]:
        dx, dw = self.ks.rms_norm_bwd(dy, x, w, self.eps)
        if dw is None:  # a kernel set without the weight gradient: computed here
            from kareus.exec.kernels.base import rms_norm_weight_grad

            dw = rms_norm_weight_grad(dy, x, self.eps)
        return dx, dw

    # ------------------------------------------------------------------ the ops
    def run_op(self, op: Op, nb: int) -> None:
        """Enqueue op ``op`` of nanobatch ``nb`` of the current computation."""
        fn: Callable[[int, dict[str, Any], int], None] = getattr(self, "_op_" + op.name)
        nb = self.chunk(op.name, nb)
        a = self.act.setdefault((op.layer, nb), {})
        if op.name == "attn_core" and (self.phase == "bwd" or self.policy == "none"):
            with self.torch.enable_grad():  # keeps the attention's state for attn_core_bwd
                fn(op.layer, a, nb)  # (a framework may run the forward without grad)
            return
        with self.torch.no_grad():
            fn(op.layer, a, nb)

    def _recomputing(self) -> bool:
        return self.phase == "bwd"

    def _op_attn_norm(self, layer: int, a: dict[str, Any], nb: int) -> None:
        w = self.W(layer, "w_attn_norm")
        if not self._recomputing():
            if layer == 0:
                a["x_in"] = self.head["x0"][self.rows(nb)]
            else:  # the residual addition and the norm in one pass
                prev = self.act[(layer - 1, nb)]
                a["x_in"], a["xn"] = self.ks.add_rms_norm(
                    prev["x_mid"], self._reduced("mlp_out", layer - 1, nb), w, self.eps)
                # the layer below keeps what its backward reads only
                self.act[(layer - 1, nb)] = self.kept(prev)
                self._to_gather("attn_in", a, "xn", nb)
                return
        a["xn"] = self.ks.rms_norm(a["x_in"], w, self.eps)
        self._to_gather("attn_in", a, "xn", nb)

    def _to_gather(self, name: str, a: dict[str, Any], key: str, nb: int) -> None:
        """Sequence parallelism: the shard ``a[key]`` into the input of TP all-gather
        ``name``."""
        if self.sp:
            self._buf(name, nb).view(-1, self.h).copy_(a.pop(key))

    def _input(self, name: str, a: dict[str, Any], key: str, nb: int) -> Any:
        """The normed input ``a[key]`` of a column-parallel GEMM; under sequence parallelism
        the result of all-gather ``name`` (kept as ``a[key]`` for the weight gradient: a
        copy without recomputation, since the next layer gathers into the same buffer)."""
        if self.sp and key not in a:
            g = self._gathered(name, nb)
            a[key] = g if self.recompute else g.clone()
        return a[key]

    def _op_qkv(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["qkv"] = self.ks.matmul(self._input("attn_in", a, "xn", nb), self.W(layer, "Wqkv"))

    def _rope_tables(self, nb: int) -> tuple[Any, Any]:
        """The cos/sin tables RoPE reads for nanobatch ``nb`` (``[seq, head_dim]``, position
        ``p`` in row ``p``): the shared ones; along the sequence the chunk's rows (its
        tokens' absolute positions)."""
        if self.seq_split:
            c = self.sq // self.n
            return self.cos[nb * c:(nb + 1) * c], self.sin[nb * c:(nb + 1) * c]
        return self.cos, self.sin

    def _op_rope(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self._attention_inputs(layer, a, nb, qk_norm=False)

    def _op_qk_norm_rope(self, layer: int, a: dict[str, Any], nb: int) -> None:
        """Qwen3's attention input: each query and key head RMS-normalised over head_dim
        with its weight, then rotated, in one kernel (``KernelSet.qk_norm_rope``); the
        projection's output is kept for the backward (``qkv_pre``, which reads the pre-norm
        queries and keys; the values are read through it as well)."""
        self._attention_inputs(layer, a, nb, qk_norm=True)

    def _attention_inputs(self, layer: int, a: dict[str, Any], nb: int, *,
                          qk_norm: bool) -> None:
        """The queries, keys and values of the packed QKV (``_op_rope``, and
        ``_op_qk_norm_rope`` with ``qk_norm``), in sequence order; under CP this chunk's K
        and V packed for the all-gather; along the sequence the chunk's K and V kept for the
        later chunks' attention."""
        b, sq = self._nb_shape()
        qkv = self._to_seq_order(a["qkv"])
        cos, sin = self._rope_tables(nb)
        if qk_norm:
            a["qkv_pre"] = qkv
            q, k = self.ks.qk_norm_rope(qkv, self.W(layer, "w_q_norm"),
                                        self.W(layer, "w_k_norm"), cos, sin,
                                        heads=self.heads, kv_heads=self.kvh, eps=self.eps)
        else:
            q, k = self.ks.rope(qkv, cos, sin, heads=self.heads, kv_heads=self.kvh)
        v = qkv.view(b, sq, self.heads + 2 * self.kvh, self.hd)[
            :, :, self.heads + self.kvh:]
        # (per-token tables return one sequence of the nanobatch's tokens: a view back)
        a["q"] = q.reshape(b, sq, self.heads, self.hd)
        a["k"] = k.reshape(b, sq, self.kvh, self.hd)
        a["v"] = v
        if self.seq_split:  # into the layer's K/V of the whole sequence, chunk by chunk
            buf = (self._kv_chunks.get((layer, 0)) if nb else
                   self.torch.empty((2, b, self.sq, self.kvh, self.hd), device=self.device,
                                    dtype=self.dtype))
            if buf is None:
                raise RuntimeError(f"layer {layer}'s chunk {nb} ran before its chunk 0 "
                                   "(nanobatches along the sequence run in order)")
            # written through .data: the earlier chunks' attention saved views of this
            # buffer for its backward, and a write into a later chunk's part (other memory)
            # must not count as a change of what they saved (autograd's version counter)
            part = slice(nb * sq, (nb + 1) * sq)
            buf.data[0, :, part].copy_(a["k"])
            buf.data[1, :, part].copy_(v)
            a["k"], a["v"], a["kvbuf"] = buf[0, :, part], buf[1, :, part], buf
            self._kv_chunks[(layer, nb)] = buf
        if self.cp > 1:  # this chunk's K and V, packed for the all-gather
            loc = self._buf("kv", nb).view(2, b, self.sq, self.kvh, self.hd)
            loc[0].copy_(a["k"])
            loc[1].copy_(v)

    def _op_attn_core(self, layer: int, a: dict[str, Any], nb: int) -> None:
        b, sq = self._nb_shape()
        q = a["q"].transpose(1, 2)
        keep = self.torch.is_grad_enabled()  # keep what attn_core_bwd needs
        if self.seq_split:
            o = self._chunk_attention(layer, a, nb, q, keep=keep)
        elif self.cp > 1:  # every chunk's K and V by position, then one causal piece per chunk
            kv = a.get("kvs")  # selective recomputation: the gathered K, V kept
            if kv is None:
                kv = order_kv(self._reduced("kv", layer, nb), cp=self.cp, b=b, sq=self.sq,
                              kvh=self.kvh, hd=self.hd)
                if self.policy == "selective":  # the backward's attention core reads them
                    a["kvs"] = kv
            o, saved = cp_attention(self.ks, q, kv[0].transpose(1, 2), kv[1].transpose(1, 2),
                                    self.pieces, keep=keep)
            if keep:
                a["graph"] = saved
        else:
            k, v = a["k"].transpose(1, 2), a["v"].transpose(1, 2)
            if keep:
                a["graph"] = self.ks.attention_fwd(q, k, v)
                o = a["graph"].output
            else:
                o = self.ks.attention(q, k, v)
        a["attn"] = self._to_rank_order(o.detach().transpose(1, 2).reshape(b * sq, self.q))

    def _chunk_attention(self, layer: int, a: dict[str, Any], j: int, q: Any, *,
                         keep: bool) -> Any:
        """Along the sequence: chunk ``j``'s queries over the keys and values of chunks
        ``0..j`` of the layer, causal aligned to the lower right (query ``i`` sees the keys
        up to ``j c + i``: ``chunk_piece``); with ``keep``, its saved state as ``graph``."""
        c = self.sq // self.n
        try:
            buf = [self._kv_chunks[(layer, i)] for i in range(j + 1)][0]
        except KeyError:
            raise RuntimeError(f"layer {layer}'s chunk {j} attention ran before an earlier "
                               "chunk's keys and values (nanobatches along the sequence run "
                               "in order)") from None
        kv = buf[:, :, :(j + 1) * c]  # a view: the keys and values are held once
        o, saved = cp_attention(self.ks, q, kv[0].transpose(1, 2), kv[1].transpose(1, 2),
                                chunk_piece(c, j), keep=keep)
        if keep:
            a["graph"] = saved
        # the last reader of the layer's keys and values: the last chunk's attention in
        # the forward (and in the forward that full recomputation re-runs), the first
        # chunk's in selective recomputation's backward (which runs the chunks last first)
        last = 0 if self.phase == "bwd" and self.policy == "selective" else self.n - 1
        if j == last and not (self.phase == "fwd" and self.policy == "selective"):
            for i in range(self.n):
                self._kv_chunks.pop((layer, i), None)
        return o

    def _op_out_proj(self, layer: int, a: dict[str, Any], nb: int) -> None:
        out, pooled = self._out("attn_out", layer, nb)
        y = self.ks.matmul(a["attn"], self.W(layer, "Wo"), out=out)
        if not pooled:
            a["attn_out"] = y
        if self.policy == "selective":  # not kept: the backward re-runs the attention core
            del a["attn"]

    def _op_mlp_norm(self, layer: int, a: dict[str, Any], nb: int) -> None:
        if self.moe is not None:
            self._moe_mlp_norm(layer, a, nb)
            return
        a["x_mid"], a["xn2"] = self.ks.add_rms_norm(
            a["x_in"], self._reduced("attn_out", layer, nb), self.W(layer, "w_mlp_norm"),
            self.eps)
        self._to_gather("mlp_in", a, "xn2", nb)

    def _op_gate(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["g"] = self.ks.matmul(self._input("mlp_in", a, "xn2", nb), self.W(layer, "Wg"))

    def _op_up(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["u"] = self.ks.matmul(self._input("mlp_in", a, "xn2", nb), self.W(layer, "Wu"))

    def _op_swiglu(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["a"] = self.ks.swiglu(a["g"], a["u"])

    def _op_down(self, layer: int, a: dict[str, Any], nb: int) -> None:
        out, pooled = self._out("mlp_out", layer, nb)
        y = self.ks.matmul(a["a"], self.W(layer, "Wd"), out=out)
        if not pooled:
            a["mlp_out"] = y

    # backward
    def _dy(self, a: dict[str, Any], nb: int) -> Any:
        """The gradient of the layer's output as the down projection sees it: under
        sequence parallelism the all-gather of the layer above's input gradient (or of the
        LM head's, the stack's first collective)."""
        return self._gathered("mlp_out_grad", nb) if self.sp else a["dy"]

    def _op_down_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["da"] = self.ks.matmul(self._dy(a, nb), self.W(layer, "Wd").t())

    def _op_down_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self.ks.matmul(a["a"].t(), self._dy(a, nb), out=self.G(layer, "Wd"), accumulate=True)

    def _op_swiglu_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["dg"], a["du"] = self.ks.swiglu_bwd(a["da"], a["g"], a["u"])

    def _op_gate_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        out, pooled = self._out("mlp_in_grad", layer, nb)
        d = self.ks.matmul(a["dg"], self.W(layer, "Wg").t(), out=out)
        if not pooled:
            a["mlp_in_grad"] = d

    def _op_up_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        out, pooled = self._out("mlp_in_grad", layer, nb)  # gate_dgrad's product
        if not pooled:
            out = a["mlp_in_grad"]
        self.ks.matmul(a["du"], self.W(layer, "Wu").t(), out=out, accumulate=True)

    def _op_gate_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self.ks.matmul(self._input("mlp_in", a, "xn2", nb).t(), a["dg"],
                       out=self.G(layer, "Wg"), accumulate=True)

    def _op_up_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self.ks.matmul(self._input("mlp_in", a, "xn2", nb).t(), a["du"],
                       out=self.G(layer, "Wu"), accumulate=True)

    def _op_mlp_norm_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        if self.moe is not None:
            self._moe_mlp_norm_bwd(layer, a, nb)
            return
        dres = (self._buf("mlp_out_grad", nb).view(-1, self.h) if self.sp else a["dy"])
        a["dx_mid"] = self.ks.rms_norm_bwd_add(
            self._reduced("mlp_in_grad", layer, nb), a["x_mid"], self.W(layer, "w_mlp_norm"),
            dres, self.G(layer, "w_mlp_norm"), self.eps)
        if self.sp:  # the shard, for the all-gather before out_dgrad (and the residual's)
            buf = self._buf("attn_out_grad", nb).view(-1, self.h)
            a["dx_mid"] = buf.copy_(a["dx_mid"])

    def _dx_mid(self, a: dict[str, Any], nb: int) -> Any:
        """The gradient of the attention block's output as the output projection sees it
        (gathered under sequence parallelism)."""
        return self._gathered("attn_out_grad", nb) if self.sp else a["dx_mid"]

    def _op_out_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["dattn"] = self.ks.matmul(self._dx_mid(a, nb), self.W(layer, "Wo").t())

    def _op_out_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self.ks.matmul(a["attn"].t(), self._dx_mid(a, nb), out=self.G(layer, "Wo"),
                       accumulate=True)

    def _op_attn_core_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        b, sq = self._nb_shape()
        saved = a.pop("graph")
        do = self._to_seq_order(a["dattn"]).view(b, sq, self.heads, self.hd).transpose(1, 2)
        if self.seq_split:
            self._chunk_attention_bwd(layer, a, nb, do, saved)
        elif self.cp > 1:  # every chunk's dK, dV, packed for the reduce-scatter
            a["dq"], dkv = cp_attention_bwd(do, saved, self.pieces, keys=self.seq)
            scatter_kv_grad(dkv, self._buf("kv_grad", nb), cp=self.cp, b=b, sq=self.sq,
                            kvh=self.kvh, hd=self.hd)
        else:
            a["dq"], a["dk"], a["dv"] = self.ks.attention_bwd(do, saved)

    def _chunk_attention_bwd(self, layer: int, a: dict[str, Any], j: int, do: Any,
                             saved: Any) -> None:
        """Along the sequence: chunk ``j``'s attention backward. Its dK and dV cover chunks
        ``0..j``: its own part, plus what every later chunk gave it (their backward ran
        first), is the chunk's; the earlier chunks' parts are kept for theirs."""
        c = self.sq // self.n
        a["dq"], dkv = cp_attention_bwd(do, saved, chunk_piece(c, j), keys=(j + 1) * c)
        own = dkv[:, :, j * c:]
        given, count = self._dkv_from_later.pop((layer, j), (None, 0))
        if count != self.n - 1 - j:
            raise RuntimeError(f"layer {layer}'s chunk {j} attention backward ran before the "
                               "later chunks' (nanobatches along the sequence run the "
                               "backward last first)")
        if given is not None:
            own.add_(given)
        for i in range(j):
            part = dkv[:, :, i * c:(i + 1) * c]
            prev, k = self._dkv_from_later.get((layer, i), (None, 0))
            self._dkv_from_later[(layer, i)] = (part if prev is None else prev.add_(part),
                                                k + 1)
        a["dk"], a["dv"] = own[0].transpose(1, 2), own[1].transpose(1, 2)

    def _attention_grads(self, layer: int, a: dict[str, Any], nb: int
                         ) -> tuple[Any, Any, Any]:
        """``(dq, dk, dv)`` of this rank's tokens, ``[batch, seq, heads, head_dim]`` (dK and
        dV reduce-scattered under CP); with per-token tables (``_rope_tables``), one
        sequence of the nanobatch's tokens."""
        b, sq = self._nb_shape()
        if self.cp > 1:
            loc = self._reduced("kv_grad", layer, nb).view(2, b, sq, self.kvh, self.hd)
            dk, dv = loc[0], loc[1]
        else:
            dk, dv = a["dk"].transpose(1, 2), a["dv"].transpose(1, 2)
        dq = a["dq"].transpose(1, 2)
        seq = self._rope_tables(nb)[0].shape[0]
        if seq != sq:
            dq, dk, dv = (g.reshape(-1, seq, *g.shape[2:]) for g in (dq, dk, dv))
        return dq, dk, dv

    def _op_rope_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        dq, dk, dv = self._attention_grads(layer, a, nb)
        cos, sin = self._rope_tables(nb)
        a["dqkv"] = self._to_rank_order(self.ks.rope_bwd(dq, dk, dv, cos, sin))

    def _op_qk_norm_rope_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        """The backward of ``_op_qk_norm_rope`` in one kernel (``KernelSet.qk_norm_rope_bwd``):
        dQ and dK rotated back and through the norms into the projection's output gradient
        (packed with dV); the norm weights' gradients accumulate (each TP rank holds part of
        them: its heads)."""
        dq, dk, dv = self._attention_grads(layer, a, nb)
        cos, sin = self._rope_tables(nb)
        dqkv, dwq, dwk = self.ks.qk_norm_rope_bwd(
            dq, dk, dv, a["qkv_pre"], self.W(layer, "w_q_norm"), self.W(layer, "w_k_norm"),
            cos, sin, eps=self.eps)
        a["dqkv"] = self._to_rank_order(dqkv)
        self.G(layer, "w_q_norm").add_(dwq.to(self.dtype))
        self.G(layer, "w_k_norm").add_(dwk.to(self.dtype))

    def _op_qkv_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        out, pooled = self._out("attn_in_grad", layer, nb)
        d = self.ks.matmul(a["dqkv"], self.W(layer, "Wqkv").t(), out=out)
        if not pooled:
            a["attn_in_grad"] = d

    def _op_qkv_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self.ks.matmul(self._input("attn_in", a, "xn", nb).t(), a["dqkv"],
                       out=self.G(layer, "Wqkv"), accumulate=True)

    def _op_attn_norm_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        dx_in = self.ks.rms_norm_bwd_add(
            self._reduced("attn_in_grad", layer, nb), a["x_in"], self.W(layer, "w_attn_norm"),
            a["dx_mid"], self.G(layer, "w_attn_norm"), self.eps)
        if self.sp and self.moe is None:  # for the all-gather of the layer below's output grad
            dx_in = self._buf("mlp_out_grad", nb).view(-1, self.h).copy_(dx_in)
        if layer > 0:
            self.act[(layer - 1, nb)]["dy"] = dx_in
            self.act[(layer, nb)] = {}
        else:
            self.act[(0, nb)] = {"dx_in": dx_in}

    # ------------------------------------------------------------------ the step
    def zero_grad(self) -> None:
        """Zero the gradient buffers and the loss of the iteration."""
        self.flat_grad.zero_()
        self.loss_sum.zero_()

    def optimizer_step(self) -> None:
        """Sum gradients over CP ranks (and the query/key norms' over TP ranks, whose heads
        each saw part of them, and under sequence parallelism the other norms' over TP
        ranks, whose sequence shards each saw part of them; a mixture of experts' router
        and shared experts' over TP too, and its experts' over the expert-data-parallel
        group instead of CP), then AdamW on the fp32 masters; bf16 weights follow."""
        with self.torch.no_grad():
            if self.qk_norm and self.tp > 1:  # each TP rank's heads gave part of these
                for layer in range(self.layers):
                    for name in ("w_q_norm", "w_k_norm"):
                        self.groups.all_reduce(self.G(layer, name), group="tp")
            if self.sp:  # each TP rank's sequence shard gave part of the norms' gradients
                for layer in range(self.layers):
                    for name in ("w_attn_norm", "w_mlp_norm"):
                        self.groups.all_reduce(self.G(layer, name), group="tp")
                self.groups.all_reduce(self.grads["w_final"], group="tp")
            if self.moe is not None and self.tp > 1:  # replicated over TP, fed by shards
                for layer in range(self.layers):
                    for name in self._moe_shapes():
                        self.groups.all_reduce(self.G(layer, name), group="tp")
            # the dense weights' over CP and DP; the experts' over the ranks that hold them
            self.groups.all_reduce(self.flat_grad[:self.n_dense], group="cp")
            if self.dp > 1:
                self.groups.all_reduce(self.flat_grad[:self.n_dense], group="dp")
            if self.n_dense < self.flat_grad.numel():
                self.groups.all_reduce(self.flat_grad[self.n_dense:], group="edp")
            self.master_param.grad.copy_(self.flat_grad)
            self.optimizer.step()
            self.flat.copy_(self.master)

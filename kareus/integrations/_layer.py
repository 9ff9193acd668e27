"""A decoder layer of any PyTorch model, run by kareus's partition programs under a plan.

kareus's own training loop ([`TrainingLoop`][kareus.exec.train.TrainingLoop]) owns its model.
Most people train with a framework that owns theirs (Megatron-Core, torchtitan, a
hand-written tensor-parallel model); what kareus has to offer them is the *schedule* of each
decoder layer: its ops cut into nanobatches, each collective launched at the plan's slot with
the plan's SM count beside the computation that does not depend on it, the plan's clock per
microbatch computation. This module lends that schedule to someone else's layer:

* [`PlanApplier`][kareus.integrations.PlanApplier] holds what every layer of one model
  shares: the [`Workload`][kareus.model.Workload] the plan was made for (the model's
  dimensions, the microbatch shape, TP/CP), the job's groups (the framework's own
  ``torch.distributed`` groups: [`TorchParallelGroups.from_groups`][kareus.exec.train.TorchParallelGroups.from_groups]),
  the executors (a [`TorchExecutor`][kareus.exec.TorchExecutor] on capped NCCL communicators
  by default, any [`Executor`][kareus.exec.Executor] given), the schedule
  (``"kareus"`` under a plan, or the baselines ``"sequential"`` and ``"nanobatching"``) and
  the microbatch scope ([`microbatch`][kareus.integrations.PlanApplier.microbatch]) that
  names the computation whose configuration applies and requests its clock.
* [`PlannedLayer`][kareus.integrations.PlannedLayer] (``applier.layer()``) is a
  ``torch.nn.Module`` without parameters: ``layer(x, weights)`` takes the layer's input
  ``[batch, seq / CP, hidden]`` (``[batch, seq / (CP x TP), hidden]`` under sequence
  parallelism) and the framework's weights in kareus's layout
  (``kareus.integrations.LAYER_WEIGHTS``, and the query/key norm weights of a ``qk_norm``
  model: [`layer_weights`][kareus.integrations.layer_weights]; built with the
  differentiable helpers of ``kareus.integrations``) and returns the layer's output, differentiable in both: the weight
  gradients flow back into the framework's parameters by autograd.

**Mixture of experts** (``ModelArch.moe``): the layer's MLP is the MoE block the training
loop computes (``kareus.exec.train``'s ``DecoderShard`` MoE ops: router, top-k, the token
count exchange, permutation, the dispatch and combine all-to-alls over the EP group of the
applier's groups at the plan's slots, grouped SwiGLU experts, un-permutation), its weights
the router and this rank's experts in place of ``Wg``, ``Wu``, ``Wd``
([`moe_weight_names`][kareus.integrations.moe_weight_names]). It runs eagerly
(``graphs=True`` is refused: the rows each rank sends are known only after the routing, on
the host), its EP ranks folded over TP, CP and the data-parallel replicas as the framework
made its EP group (each replica runs its own microbatches; the all-to-alls carry every
replica's tokens to their experts); the router's and shared experts' gradients come back as
this rank's part, the experts' as this rank's experts' (every replica's tokens routed to
them), for the framework's reductions.

The forward runs the layer's forward stream ([`stack_stream`][kareus.exec.schedule.stack_stream]
of one layer) through the executor and keeps for the backward what the workload's
recomputation policy (``Workload.recompute``) says
([`KEPT_FOR_BACKWARD`][kareus.exec.train.KEPT_FOR_BACKWARD]); the backward runs the backward
ops, each in the partition the plan schedules, and re-runs what was not kept:

* ``"full"``: the forward keeps the layer's input only (one ``tokens x hidden`` tensor per
  layer); the backward re-runs the forward first, its collectives included (where the
  layer has none, TP = CP = 1, without the down projection, whose output no backward op
  reads: ``kareus.model.decoder.NOT_READ_BY_BACKWARD``);
* ``"selective"`` (Megatron-Core's default selective recomputation, its ``core_attn``):
  everything but the attention core's output and softmax statistics is kept; the
  backward re-runs the attention core forward alone, right before ``out_dgrad``, and no
  collective (under CP the gathered keys and values are kept);
* ``"none"``: every activation the backward reads is kept; the backward runs no forward op.

Eager, what the forward keeps is saved for the backward through autograd
(``ctx.save_for_backward``): it is freed as soon as the backward has run, even where the
framework keeps the layer's output (and so its autograd node) longer, and it passes
through ``torch.autograd.graph.saved_tensors_hooks`` like any saved tensor.

Per layer and token of this rank, in elements of the compute dtype (``h`` hidden, ``q``
and ``kv`` the query and key/value widths and ``f`` the FFN width on this TP rank), the
forward keeps ``h`` (full); ``4 h + 2 q + 3 kv + 3 f`` (selective: the input, both norms'
outputs, the residual sum, the QKV projection, whose values the attention reads in place,
the rotated queries and keys, the gate, up and SwiGLU outputs; under CP the rotated
queries and every chunk's keys and values as gathered, ``2 cp kv``, instead of the
projection and the local keys, and a qk-norm model then also keeps the projection, before
its norms, ``q + 2 kv``, which the fused norm-and-RoPE backward reads (without CP it is the
projection kept anyway)); none adds the attention output (``q``; under CP each causal piece's output beside
the whole one, ``2 q``; under sequence parallelism with more than one sequence per
computation also its copy in the gathered order, ``q``) and its softmax statistics
(``heads`` fp32 values). ``kareus.model.memory.kept_activation_bytes``
counts it for a workload (tests/integrations/test_layer_memory.py checks the two agree).
The ops are the same code as the training loop's decoder, on the production kernels.

**What a layer boundary costs.** kareus's own loop chains layers: the forward all-reduce of
one layer's MLP output runs beside the next layer's attention-input ops. A planned layer is
one autograd node, and what runs between two nodes belongs to the framework, so the first
unit of each layer's computation runs bare (nothing of the layer before it) and its last
collective (the forward MLP output's all-reduce of its last nanobatch; under sequence
parallelism also the all-gathers of the output gradient's first nanobatches, before the
backward's first ops) runs exposed, as Megatron-LM runs every collective; the other
collectives overlap as planned. A workload made for such layers
(``Workload.chained_layers=False``) costs exactly that (``kareus.model.partition``), and
its exposed collectives run with their own CTA count, as it costs them; under a workload
of chained layers they run with the SM count of the partition type they pair with in the
chain. [`PlannedStack`][kareus.integrations.PlannedStack] runs consecutive layers as one
node and chains them as the loop does (refused for a workload of unchained layers).

**Sequence parallelism** (``workload.parallelism.sp`` at TP > 1, Megatron-Core's
``sequence_parallel=True``, torchtitan's ``enable_sequence_parallel``): a layer's input and
output are this rank's sequence shard, ``[batch, seq / (CP x TP), hidden]`` (TP rank ``t``
holds the ``t``-th of TP equal runs of each sequence's tokens on this CP rank, in their
order there; the layout Megatron-Core passes between its layers as ``[s / TP, b, h]``); the
layer all-gathers its normed inputs over TP before its QKV and gate/up GEMMs and
reduce-scatters after its output and down projections (``DecoderShard``'s sequence
parallelism). Its backward opens with the all-gather of its output's gradient and returns
the sharded gradient of its input (the framework's layer below gathers it, as Megatron's
does). The norm weights' gradients are this rank's part (its shard's tokens): the
framework sums them over TP as it does for its own layers (Megatron-Core's
``sequence_parallel`` parameter attribute; a DTensor's partial gradient in torchtitan).

**Context parallelism** uses Megatron-Core's load-balanced layout
([`cp_positions`][kareus.model.cp_positions]): each sequence is cut into 2 x CP chunks and
CP rank ``r`` holds chunks ``r`` and ``2 CP - 1 - r``; the layer's input on that rank is
its two chunks concatenated (``seq / CP`` tokens, as Megatron-Core's
``get_batch_on_this_cp_rank`` leaves them), RoPE rotates each token by its global position,
the keys and values are all-gathered over the CP group before attention (ordered by
position; one causal piece per chunk) and their gradients reduce-scattered after it. Feed
each CP rank its chunks in that layout (``megatron.core.utils.get_batch_on_this_cp_rank``
does; for other data, index the sequence by ``cp_positions(seq_len, cp, rank)``).

**CUDA graphs.** On a CUDA device each computation is replayed from a CUDA graph of the
applier's own by default (``kareus.integrations._graphed``: static buffers around the
captured program, the backward reading what its forward kept in place), so a small model's
GPU is not held back by the host; ``graphs=False`` launches eagerly; on the CPU it is eager.
Inside someone else's capture (the framework's step capture, your own ``torch.cuda.graph``)
the layers launch their kernels into that capture instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kareus._logging import get_logger
from kareus.compose.plan import Plan
from kareus.errors import (
    ArgumentError,
    ArgumentTypeError,
    GraphCaptureError,
    PlanError,
    WorkloadError,
)
from kareus.exec import Executor
from kareus.exec.plan_lookup import plan_config, plan_nanobatches
from kareus.exec.schedule import (
    SCHEDULES,
    Piece,
    TypeShape,
    pieces,
    run_computation,
    sp_backward_stream,
    stack_stream,
    type_shapes,
)
from kareus.exec.train import DecoderShard, ParallelGroups, refuse_uncomputed
from kareus.integrations._graphed import (
    KeptInputs,
    capture_in_progress,
    computation_signature,
)
from kareus.integrations._kept import KeptActivations
from kareus.integrations._weights import QK_NORM_WEIGHTS, layer_weights
from kareus.model.workload import Workload

__all__ = ["PlanApplier", "PlannedLayer", "PlannedStack"]

_log = get_logger(__name__)

#: Partitions recorded by an applier with ``record=True`` before the oldest are dropped.
RECORD_KEPT = 4096


class _LayerProgram(DecoderShard):
    """One layer's ops on weights lent per call (the training loop's decoder ops).

    Inherits the op code of [`DecoderShard`][kareus.exec.train.DecoderShard] and replaces
    what that class owns (parameters, optimizer, embedding, head) with weights and gradient
    buffers set before each computation; the constructor sets only what the ops read, so it
    does not call ``DecoderShard.__init__``.
    """

    def __init__(self, *, workload: Workload, groups: ParallelGroups, backend: Any,
                 microbatch_size: int, seq_local: int, nanobatch_counts: Sequence[int],
                 kernels: Any, device: Any, dtype: Any, rope_base: float,
                 rope_inv_freq: Any = None, layers: int = 1) -> None:
        import torch

        from kareus.exec.kernels import get_kernels

        self.layers, self.backend = int(layers), backend
        self._shard_dims(workload.model, groups, int(microbatch_size), int(seq_local),
                         sp=workload.parallelism.sequence_parallel,
                         dp=workload.parallelism.dp)
        self.num_microbatches = 1
        self._set_policy(workload.recompute)
        self.ks, self.torch = get_kernels(kernels), torch
        self.device, self.dtype = torch.device(device), dtype
        self.rope_base, self.rope_inv_freq = float(rope_base), rope_inv_freq
        self._build_rope(torch)
        self._tok_inv = self._inv_freq()  # on the device now: never copied inside a capture
        self._pool: dict[tuple[str, int, int], tuple[Any, Any]] = {}
        for n in sorted(set(nanobatch_counts), reverse=True):
            if self.mbs % n == 0 or (self.mbs == 1 and self.sq % n == 0):  # or along it
                self._alloc_pool(torch, n)
        self.act: dict[tuple[int, int], dict[str, Any]] = {}
        self.head: dict[str, Any] = {}
        self.n, self.phase = 1, "fwd"
        self.weights: list[dict[str, Any]] = []
        self.wgrads: list[dict[str, Any]] = []

    def W(self, layer: int, name: str) -> Any:
        """The lent weight ``name`` of layer ``layer``."""
        return self.weights[layer][name]

    # ------------------------------------------------ RoPE at the batch's positions
    #: Per-token RoPE tables ``[batch * seq, head_dim]`` of the current call (packed
    #: documents: positions that restart at each document), or None (positions
    #: ``0 .. seq - 1`` of every sequence: the shared tables).
    tok_cos: Any = None
    tok_sin: Any = None
    _tok_inv: Any = None
    #: The packed documents of the current call where attention masks them (a
    #: ``kareus.exec.kernels.DocumentMask``: a document starts where its position is 0;
    #: built once per call, its masks shared by every layer), or None (causal over the
    #: whole sequence).
    doc_mask: Any = None

    def _inv_freq(self) -> Any:
        """The RoPE inverse frequencies on the device (float32, ``head_dim / 2``)."""
        torch = self.torch
        if self.rope_inv_freq is not None:
            return torch.as_tensor(self.rope_inv_freq, dtype=torch.float32).to(self.device)
        return 1.0 / (float(self.rope_base) ** (torch.arange(
            0, self.hd, 2, device=self.device, dtype=torch.float32) / self.hd))

    def _tok_rows(self, nb: int) -> slice:
        """Rows of nanobatch ``nb`` in the per-token tables: its sequences' tokens, whole
        (under sequence parallelism RoPE runs after the all-gather, on whole sequences)."""
        t = self.mbs // self.n * self.sq
        return slice(nb * t, (nb + 1) * t)

    def set_positions(self, positions: Any, *, documents: Any = False) -> None:
        """Rotate by ``positions`` (``[batch, seq]`` token positions of this call) instead
        of ``0 .. seq - 1``; ``None`` goes back to the shared tables. ``documents``: the
        attention masks the documents too (each token attends to the earlier tokens of
        its own document only: torchtitan's ``block_causal``); a ``DocumentMask`` of
        these positions is used as given (built once per batch: ``PlanApplier.run``)."""
        if positions is None:
            self.tok_cos = self.tok_sin = self.doc_mask = None
            return
        torch = self.torch
        from kareus.exec.kernels import DocumentMask

        if isinstance(documents, DocumentMask):
            self.doc_mask = documents
        else:
            self.doc_mask = (DocumentMask(positions.to(self.device)) if documents else None)
        inv = self._tok_inv
        pos = positions.reshape(-1).to(device=self.device, dtype=torch.float32)
        ang = torch.outer(pos, inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.tok_cos, self.tok_sin = ang.cos().to(self.dtype), ang.sin().to(self.dtype)

    def _rope_tables(self, nb: int) -> tuple[Any, Any]:
        """The shared tables, or with packed-document positions this nanobatch's per-token
        tables: the kernels take ``seq = cos.shape[0]``, so its tokens rotate as one
        sequence of per-token tables (RoPE, and the query/key norms fused with it, are
        per token); the decoder's ops view the results back to ``[batch, seq, ...]``."""
        if self.tok_cos is None:  # (along the sequence: the chunk's rows)
            return super()._rope_tables(nb)
        rows = self._tok_rows(nb)
        return self.tok_cos[rows], self.tok_sin[rows]

    def _op_attn_core(self, layer: int, a: dict[str, Any], nb: int) -> None:
        if self.doc_mask is None:
            super()._op_attn_core(layer, a, nb)
            return
        # packed documents masked: causal within each document (CP = 1: refused in run);
        # the kernel set runs it block-sparse on a GPU (FlexAttention), with the dense
        # mask on SDPA elsewhere (kareus.exec.kernels._documents)
        b = self.mbs // self.n
        mask = self.doc_mask.rows(nb * b, (nb + 1) * b)
        q, k, v = (a[n].transpose(1, 2) for n in ("q", "k", "v"))
        if self.torch.is_grad_enabled():  # keep what attn_core_bwd needs
            a["graph"] = self.ks.attention_fwd(q, k, v, mask=mask)
            o = a["graph"].output
        else:
            o = self.ks.attention(q, k, v, mask=mask)
        a["attn"] = self._to_rank_order(o.detach().transpose(1, 2).reshape(b * self.sq,
                                                                            self.q))

    def G(self, layer: int, name: str) -> Any:
        """The gradient buffer of weight ``name`` of layer ``layer`` in the current backward."""
        return self.wgrads[layer][name]


class PlanApplier:
    """What every planned layer of one model shares: plan, workload, groups, executors.

    Args:
        workload: What the plan was made for: the model's dimensions (``hidden``,
            ``heads``, ``kv_heads``, ``head_dim``, ``ffn``), the microbatch (``microbatch_size``
            sequences of ``seq_len`` tokens), TP and CP, the nanobatch count of the
            baseline, the recomputation policy (``recompute``: what a layer keeps for its
            backward; see the module docstring).
        groups: This rank's TP and CP groups: a
            [`ParallelGroups`][kareus.exec.train.ParallelGroups], typically
            ``TorchParallelGroups.from_groups(tp=..., cp=...)`` of the framework's groups.
        plan: The plan to apply (``kareus optimize``'s ``plan.json``:
            ``kareus.compose.Plan.load``); ``None`` runs a baseline.
        schedule: ``"kareus"`` (the default with a plan), ``"nanobatching"`` or
            ``"sequential"`` (the default without one): see ``kareus.exec.schedule.SCHEDULES``.
        executor: The executor applying the plan; default: a
            [`TorchExecutor`][kareus.exec.TorchExecutor] with ``collective``, eager.
        baseline: The executor of the baselines; default: a ``TorchExecutor`` with
            ``default_collective``.
        collective: The SM-capped collective backend (default: NCCL communicators capped at
            each of the plan's SM counts on a GPU, the groups' own collectives on the CPU,
            the loopback stand-in with ``LoopbackGroups``).
        default_collective: The collectives with their own CTA count (default: the groups'
            own, ``ProcessGroupCollective``).
        frequency: The executor's clock trigger (``FrequencyTrigger``); default none: the
            plan's clocks are not requested.
        stage: The pipeline stage of this rank (a plan sets configurations per stage; a
            plan of PP stages is applied by an applier per stage, each with its own).
        kernels: The kernel set of the ops (``kareus.exec.kernels``); default per device.
        streams: The executors' ``StreamBackend`` (default: CUDA streams on a GPU; on a
            machine without one, ``RecordingStreamBackend``, which runs everything in host
            order).
        rope_base: The model's RoPE base frequency.
        rope_inv_freq: The model's RoPE inverse frequencies (``head_dim / 2`` values, for
            position ``p`` and pair ``i`` the angle ``p * rope_inv_freq[i]``) when it scales
            them (Llama 3.1's long-context scaling); ``None``: from ``rope_base``.
        eps: The model's RMSNorm epsilon: it must be the workload's ``norm_eps``.
        record: Keep the partitions run (``partitions_run``), for checking a schedule.
        graphs: Replay each computation from a CUDA graph of its own
            (``kareus.integrations._graphed``: captured on first use per phase, depth and
            plan choice), so that a small model's GPU is not held back by the host.
            ``None`` (default): on where the executors can capture (a CUDA device), eager
            on the CPU; the choice is logged once. ``False``: eager launches. Whatever
            this says, a layer that runs while the current CUDA stream is being captured
            (the framework's step capture, your own ``torch.cuda.graph``) launches its
            kernels into that capture (no graph of its own, no replay), and tensors on
            the CPU run eagerly.
        whole_step_capture: An enclosing capture, where there is one, holds every
            microbatch computation of the step in its own place (your own
            ``torch.cuda.graph`` around the whole step), so a plan may give each
            computation its own configuration and clock. ``False`` (default): a framework
            may replay one capture for every microbatch (torchtitan's
            ``training.disable_cuda_graphs = False`` captures one forward-backward and
            replays it per gradient-accumulation step), so inside a capture a plan whose
            computations of this stage and phase differ is refused.
        start: Agree on the plan with every rank now (``Executor.start``: a collective
            call; pass ``False`` and call [`start`][kareus.integrations.PlanApplier.start]
            yourself where every rank reaches it).

    Raises:
        WorkloadError: TP or CP do not match the groups, or dimensions do not divide.
        PlanError: the plan was made for another workload, or names a backend not given.
    """

    def __init__(self, *, workload: Workload, groups: ParallelGroups, plan: Plan | None = None,
                 schedule: str | None = None, executor: Executor | None = None,
                 baseline: Executor | None = None, collective: Any = None,
                 default_collective: Any = None, frequency: Any = None, stage: int = 0,
                 kernels: Any = None, streams: Any = None, rope_base: float = 500000.0,
                 rope_inv_freq: Any = None, eps: float = 1e-5, record: bool = False,
                 graphs: bool | None = None, whole_step_capture: bool = False,
                 start: bool = True) -> None:
        if not isinstance(workload, Workload):
            raise ArgumentTypeError(f"workload must be a kareus.Workload, got "
                                    f"{type(workload).__name__}")
        if not isinstance(groups, ParallelGroups):
            raise ArgumentTypeError("groups must be a kareus.exec.train.ParallelGroups (e.g. "
                                    "TorchParallelGroups.from_groups(tp=..., cp=...)), got "
                                    f"{type(groups).__name__}")
        if plan is not None and not isinstance(plan, Plan):
            raise ArgumentTypeError(f"plan must be a kareus.compose.Plan, got "
                                    f"{type(plan).__name__}")
        planned = plan is not None or (isinstance(executor, Executor)
                                       and executor.plan is not None)
        schedule = schedule if schedule is not None else ("kareus" if planned
                                                          else "sequential")
        if schedule not in SCHEDULES:
            raise ArgumentError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if schedule == "kareus" and not planned:
            raise PlanError("the kareus schedule applies a plan: pass plan= (a Plan, e.g. "
                            "Plan.load(PATH) of an optimize run's plan.json) or run a baseline "
                            "schedule")
        refuse_uncomputed(workload.model, where="kareus's planned layer",
                          computes=frozenset({"norm_eps", "qk_norm", "moe"}))
        _check_workload(workload, groups)
        if workload.model.moe is not None and graphs:
            raise ArgumentError("graphs=True: a mixture-of-experts layer runs eagerly (the "
                                "rows each rank sends and receives are known only after the "
                                "routing, on the host, and a CUDA graph fixes them at "
                                "capture); pass graphs=False or leave it None")
        if abs(float(eps) - workload.model.norm_eps) > 1e-12 * max(1.0, float(eps)):
            raise ArgumentError(f"the model's RMSNorm uses eps={eps:g}, the workload's model "
                                f"{workload.model.norm_eps:g} (norm_eps): make the workload "
                                "from the model's own config")
        if not 0 <= int(stage) < workload.parallelism.pp:
            raise ArgumentError(f"stage must be this rank's pipeline stage, 0 .. "
                                f"{workload.parallelism.pp - 1} (PP={workload.parallelism.pp}), "
                                f"got {stage}")
        self.workload, self.groups, self.schedule = workload, groups, schedule
        #: The names of one layer's weights, in the order the planned layers take them.
        self.weight_names: tuple[str, ...] = layer_weights(workload.model.qk_norm,
                                                           workload.model.moe)
        self.stage, self.kernels, self.rope_base = int(stage), kernels, float(rope_base)
        self.rope_inv_freq = rope_inv_freq
        self.record = bool(record)
        self.partitions_run: list[tuple[str, str, Any]] = []
        self._programs: dict[tuple[Any, ...], _LayerProgram] = {}
        self._build_types()
        self.plan: Plan | None
        self.executor: Executor | None
        self.baseline: Executor
        self.whole_step_capture = bool(whole_step_capture)
        #: Signatures of computations run outside any capture (``_graphed.computation_signature``):
        #: what an enclosing capture may take without setting anything up inside it; each
        #: with its number (the graphed runner's key for it).
        self._warmed: dict[tuple[Any, ...], int] = {}
        # resolved below; a mixture of experts runs eagerly (checked above)
        self.graphs = workload.model.moe is None and (graphs is None or bool(graphs))
        self._build_executors(plan, executor, baseline, collective, default_collective,
                              frequency, streams)
        capturing = [ex for ex in (self.baseline, self.executor) if ex is not None]
        if graphs is None and workload.model.moe is None:
            self.graphs = all(ex.graphs for ex in capturing)
            _log.info("kareus planned layers: %s", (
                "own CUDA graphs per computation, eager into an enclosing capture "
                "(graphs=False: eager)" if self.graphs else
                "eager launches (no CUDA device, or executors given without graphs), "
                "into an enclosing capture where there is one"))
        elif self.graphs:
            for ex in capturing:
                if not ex.graphs:
                    raise ArgumentError(
                        f"graphs=True, but {type(ex).__name__}.graphs is False (no CUDA "
                        "device, or an executor given without graphs): pass graphs=False "
                        "or executors that capture")
        self._runner: Any = None
        self._started = False
        #: Per plan (the current one), per computation ``(stage, microbatch, phase)``:
        #: ``_computation_choice``'s answer; and a number per plan choice seen.
        self._choices: tuple[Plan, dict[tuple[int, int, str], Any]] | None = None
        self._choice_tokens: dict[Any, int] = {}
        if start:
            self.start()

    # ------------------------------------------------------------------ set-up
    def _build_types(self) -> None:
        from kareus.model.partition import build_partitions

        wl = self.workload
        self.has_comm = wl.parallelism.tp * wl.parallelism.cp * wl.parallelism.ep > 1
        self.types: dict[str, TypeShape] = (type_shapes(build_partitions(wl))
                                            if self.has_comm else {})
        self.unsplit_types: dict[str, TypeShape] = (
            type_shapes(build_partitions(wl.with_(nanobatches=1)))
            if self.has_comm and wl.nanobatches > 1 else self.types)
        self._stacks: dict[tuple[str, int], list[Piece]] = {}

    def _stack(self, phase: str, layers: int) -> list[Piece]:
        """The pieces of ``layers`` consecutive layers' forward or backward (the backward
        re-running what the recomputation policy does not keep)."""
        key = (phase, layers)
        if key not in self._stacks:
            p = self.workload.parallelism
            moe = self.workload.model.moe
            stream = stack_stream(phase, layers, tp=p.tp, cp=p.cp,
                                  recompute=self.workload.recompute,
                                  qk_norm=self.workload.model.qk_norm, sp=p.sequence_parallel,
                                  ep=p.ep, moe=moe)
            # gather dy first; dx stays a shard (an MoE layer's backward reads dy on the
            # shard: no all-gather)
            if phase == "bwd" and p.sequence_parallel and moe is None:
                stream = sp_backward_stream(stream, layers, gather_input_grad=False)
            self._stacks[key] = pieces(stream)
        return self._stacks[key]

    def _build_executors(self, plan: Plan | None, executor: Executor | None,
                         baseline: Executor | None, collective: Any, default_collective: Any,
                         frequency: Any, streams: Any) -> None:
        import torch

        from kareus.exec.executor import RecordingStreamBackend, TorchExecutor
        from kareus.exec.train import (
            check_plan_splits,
            check_plan_types,
            check_plan_workload,
            given_plan,
        )

        plan = given_plan(plan, executor, baseline)
        if plan is not None:
            check_plan_workload(plan, self.workload, one_stage=False)
            check_plan_splits(plan, self.workload)
            if self.has_comm:
                check_plan_types(plan, self.workload, self.types, self.unsplit_types,
                                 {int(plan.nanobatches(key)) for key in plan.assignment})
        self.plan = plan
        need_default = baseline is None or (plan is not None and executor is None)
        if self.has_comm and need_default and (default_collective is None
                                               or (collective is None and plan is not None)):
            default, capped = self._default_collectives(plan)
            default_collective = default_collective or default
            collective = collective or capped
        if not self.has_comm:  # no collective runs: a stand-in the executors never call
            from kareus.exec.train import LoopbackGroupCollective

            default_collective = collective = LoopbackGroupCollective(group_size=1)
        # Graphs on a CUDA device only (a fake stream backend's "graphs" replay nothing);
        # self.graphs is True here for graphs=None too (on where the device captures)
        capture = (self.graphs and torch.cuda.is_available()
                   and (streams is None or bool(streams.supports_graphs)))
        if streams is None and not torch.cuda.is_available():
            streams = RecordingStreamBackend()  # no streams: host order
        shared = None
        # one pool shared only when nothing but the layers' inputs is kept (they live
        # outside it); kept activations lie in their forward graph's own pool (_graphed)
        if streams is None and capture and self.workload.recompute == "full":
            from kareus.integrations._graphed import shared_pool_streams

            shared = shared_pool_streams  # one memory pool for each executor's graphs
        if baseline is None:
            baseline = TorchExecutor(collective=default_collective,
                                     streams=streams if shared is None else shared(),
                                     default_collective=default_collective,
                                     graphs=capture)

        def make(p: Plan) -> Executor:  # also another frontier point's (retarget)
            return TorchExecutor(plan=p, collective=collective, frequency=frequency,
                                 default_collective=default_collective,
                                 streams=streams if shared is None else shared(),
                                 graphs=capture)

        self._make_plan_executor = make if executor is None else None
        if plan is not None and executor is None:
            executor = make(plan)
        self.baseline, self.executor = baseline, executor

    def _default_collectives(self, plan: Plan | None) -> tuple[Any, Any]:
        """``(own CTA count, SM-capped)`` backends over the groups."""
        import torch

        from kareus.exec.collectives import ProcessGroupCollective
        from kareus.exec.train import GroupedCollective, LoopbackGroups, make_collectives

        groups = self.groups
        if isinstance(groups, LoopbackGroups):  # one process stands in for the group
            capped, default, _ = make_collectives(groups, backend="loopback")
            return default, capped
        if torch.cuda.is_available():
            caps = tuple(sorted({int(c.comm_sms) for cs in (plan.partition_configs().values()
                                                           if plan is not None else ())
                                 for c in cs if getattr(c, "comm_sms", None)}))
            capped, default, _ = make_collectives(groups, backend="nccl_capped", caps=caps)
            return default, capped
        # On the CPU there is no SM to cap: the groups' own collectives (gloo) run both.
        sides = {g: (ProcessGroupCollective(group=groups.group(g))  # type: ignore[attr-defined]
                     if groups.size(g) > 1 else None) for g in ("tp", "cp", "ep")}
        own = GroupedCollective(**sides)
        return own, own

    def start(self) -> None:
        """Agree with every rank on the plan (the executor compares digests: a collective
        call, so every rank of the job calls it, in the same place). Idempotent."""
        if not self._started and self.executor is not None:
            self.executor.start()
        self._started = True

    # ------------------------------------------------------------------ the user's hooks
    def layer(self) -> PlannedLayer:
        """A planned layer of this model (every layer of the model can share one)."""
        return PlannedLayer(self)

    def stack(self, layers: int) -> PlannedStack:
        """``layers`` consecutive planned layers as one autograd node, so that the
        collectives chain across their boundaries as the plan composes them (see
        [`PlannedStack`][kareus.integrations.PlannedStack])."""
        return PlannedStack(self, layers)

    @contextlib.contextmanager
    def microbatch(self, microbatch: int, phase: str) -> Iterator[None]:
        """Around one microbatch computation of this rank's stage: its forward (``"fwd"``:
        the model's forward of microbatch ``microbatch``) or its backward (``"bwd"``: the
        ``backward()`` of its loss). Inside, the planned layers apply the plan's
        configuration of that computation, and its clock is requested at the start.

        Needed under the ``"kareus"`` schedule (a plan sets configurations per
        computation); the baselines ignore it. The framework adapters enter it from the
        pipeline schedule's steps.
        """
        ex = self._executor()
        if self.schedule != "kareus":
            yield None
            return
        if not self._started and capture_in_progress():
            raise PlanError("the planned layers' first microbatch scope is inside a CUDA "
                            "graph capture, where the ranks cannot compare the plan's "
                            "digest: call applier.start() (or run a step) before the "
                            "capture")
        self.start()
        with ex.microbatch(self.stage, int(microbatch), phase):
            yield None

    def measure(self, **kwargs: Any) -> Any:
        """A context manager that measures iterations of your loop and compares them with
        the plan's prediction (a [`PlanCheck`][kareus.workflow.PlanCheck]: call
        ``check.step()`` after each iteration; ``check.report`` after the block). Keyword
        arguments go to ``PlanCheck`` (``warmup``, ``tolerance``, ``meter`` ...).

        Raises:
            PlanError: the applier runs no plan.
        """
        from kareus.workflow.verification import PlanCheck

        if self.plan is None:
            raise PlanError("applier.measure() compares with a plan's prediction: build the "
                            "applier with plan=")
        return PlanCheck(self.plan, workload=self.workload, **kwargs)

    def retarget(self, *, deadline_s: float | None = None,
                 energy_budget_j: float | None = None, stage_slowdown: Any = None,
                 frontier: Any = None, executor_for: Any = None, decide: Any = None) -> Plan:
        """Move to the iteration frontier's point that meets a new target, now: call it
        between iterations (outside [`microbatch`][kareus.integrations.PlanApplier.microbatch]),
        at the same iteration on every rank (rank 0 decides, the default process group
        follows). Arguments as
        [`TrainingLoop.retarget`][kareus.exec.train.TrainingLoop.retarget]
        (``stage_slowdown`` that differs between the stages of a PP > 1 job is refused:
        the frontier's points are whole-job plans). Each point's executor is built once
        and kept; the graphed runner's graphs are keyed by the plan's choice, so a point
        used before replays them.

        Raises:
            PlanError: no plan, or called inside a microbatch computation.
        """
        from kareus.exec.retarget import FrontierSwitch, Target

        target = Target(deadline_s=deadline_s, energy_budget_j=energy_budget_j,
                        stage_slowdown=stage_slowdown)
        if self.executor is None or self.plan is None:
            raise PlanError("retarget moves a running plan along its frontier: build the "
                            "applier with plan=")
        if self.executor.current is not None:
            raise PlanError("retarget between iterations, not inside applier.microbatch()")
        switch = getattr(self, "frontier_switch", None)
        if switch is not None and frontier is not None:
            switch.use(frontier)  # the points built so far are kept
        if switch is None:
            make = executor_for or self._make_plan_executor
            if frontier is None or make is None:
                raise ArgumentError("retarget needs frontier=IterationFrontier.load("
                                    "'OUT/frontier.json') once (and executor_for= when the "
                                    "applier was given its executor)")
            switch = self.frontier_switch = FrontierSwitch(
                frontier, current=self.executor, make_executor=make,
                check=self._check_plan, decide=decide)
        plan = switch.choose(target, stages=self.workload.parallelism.pp)
        if plan.digest != self.plan.digest:
            ex = switch.executor(plan)
            ex.start()  # every rank compares the new plan's digest (collective)
            self.executor, self.plan = ex, plan
        return plan

    def _check_plan(self, plan: Plan) -> None:
        from kareus.exec.train import check_plan_types, check_plan_workload

        check_plan_workload(plan, self.workload, one_stage=False)
        if self.has_comm:
            check_plan_types(plan, self.workload, self.types, self.unsplit_types,
                             {int(plan.nanobatches(key)) for key in plan.assignment})

    # ------------------------------------------------------------------ running a layer
    def _executor(self) -> Executor:
        ex = self.executor if self.schedule == "kareus" else self.baseline
        if ex is None:
            raise PlanError("the kareus schedule applies a plan: none was given")
        return ex

    def _computation(self, phase: str) -> tuple[int, bool]:
        """``(nanobatches, unsplit under a plan)`` of the current computation."""
        n, unsplit, _ = self._computation_choice(phase)
        return n, unsplit

    def _computation_choice(self, phase: str) -> tuple[int, bool, int | None]:
        """``(nanobatches, unsplit under a plan, the plan's choice for it)`` of the current
        computation; the choice as a number, the same for equal choices (of any plan this
        applier ran: a retarget's too), ``None`` under a baseline. Looked up in the plan
        once per computation and plan, then kept (a planned layer asks on every call)."""
        wl = self.workload
        if self.schedule == "sequential":
            return 1, False, None
        if self.schedule == "nanobatching":
            return wl.nanobatches, False, None
        ex, plan = self._executor(), self.plan
        assert plan is not None
        current = ex.current
        if current is None:
            raise PlanError("a planned layer ran outside a microbatch computation: in "
                            "Megatron-Core, run the training step inside "
                            "kareus.integrations.megatron.wrap_schedule(applier) (torchtitan: "
                            "wrap_trainer); in your own loop, wrap each microbatch's forward "
                            "in applier.microbatch(mb, 'fwd') and its backward in "
                            "applier.microbatch(mb, 'bwd')")
        if current[2] != phase:
            raise PlanError(f"a planned layer's {phase} ran inside applier.microbatch(..., "
                            f"{current[2]!r}): wrap the forward in 'fwd' and the backward "
                            "in 'bwd'")
        cache = self._choices
        if cache is None or cache[0] is not plan:  # a retarget's plan: looked up anew
            cache = self._choices = (plan, {})
        hit = cache[1].get(current)
        if hit is None:
            hit = cache[1][current] = self._look_up_choice(plan, current)
        return hit

    def _look_up_choice(self, plan: Plan, current: tuple[int, int, str]
                        ) -> tuple[int, bool, int | None]:
        from kareus.exec.plan_lookup import computation_key

        n = plan_nanobatches(plan, *current)
        key = computation_key(*current)
        index = plan.assignment.get(key, key)
        # the choice itself (frequency, nanobatches, every configuration and SM count),
        # not its index: another plan (a retarget) may hold another choice at that index
        choice = (plan.choices[index] if isinstance(index, int)
                  and 0 <= index < len(plan.choices) else index)
        token = self._choice_tokens.setdefault(choice, len(self._choice_tokens))
        return n, n == 1 and self.workload.nanobatches > 1, token

    def program(self, x: Any, layers: int = 1) -> _LayerProgram:
        """The program of ``layers`` consecutive layers for inputs shaped like ``x`` (one per
        shape and depth, shared by every layer or stack of that depth).

        Raises:
            WorkloadError: ``x`` is not ``[batch, seq / CP, hidden]`` of the workload
                (``[batch, seq / (CP x TP), hidden]`` under sequence parallelism; under the
                kareus schedule: the plan's exact microbatch shape; otherwise a batch that
                splits into the nanobatches, or one sequence that does, at CP = 1 without
                sequence parallelism: nanobatches along the sequence).
        """
        wl = self.workload
        p = wl.parallelism
        shard = f"seq / (CP x TP) = seq / {p.cp * p.tp}" if p.sequence_parallel else "seq / CP"
        if x.dim() != 3 or x.shape[2] != wl.model.hidden:
            raise WorkloadError(f"a planned layer takes [batch, {shard}, hidden="
                                f"{wl.model.hidden}], got {tuple(x.shape)}")
        b, s = int(x.shape[0]), int(x.shape[1])
        if p.sequence_parallel:  # the sequence shard: the CP chunk's length / TP
            s *= p.tp
        seq_local = wl.seq_len // p.cp
        if self.schedule == "kareus" and (b, s) != (wl.microbatch_size, seq_local):
            div = p.tp if p.sequence_parallel else 1
            raise WorkloadError(f"the plan was made for microbatches of {wl.microbatch_size} x "
                                f"{seq_local // div} tokens per rank ([batch, {shard}, "
                                f"hidden]), the layer got {b} x {s // div}: make the plan for "
                                "this shape (a Workload with microbatch_size= and seq_len= of "
                                "this batch)")
        key = (b, s, x.dtype, str(x.device), int(layers))
        prog = self._programs.get(key)
        if prog is None:
            counts = {1, wl.nanobatches}
            if self.plan is not None:
                counts |= {c.nanobatches for c in self.plan.choices
                           if c.nanobatches is not None}
            along = b == 1 and wl.nanobatches > 1  # one sequence: split along it
            if self.schedule != "sequential" and b % wl.nanobatches and not along:
                raise WorkloadError(f"a batch of {b} sequences does not split into "
                                    f"{wl.nanobatches} nanobatches")
            if self.schedule != "sequential" and along and (
                    p.cp > 1 or (p.sequence_parallel and p.tp > 1) or s % wl.nanobatches):
                raise WorkloadError(
                    f"nanobatches along the sequence (one sequence, nanobatches="
                    f"{wl.nanobatches}) run at CP=1 without sequence parallelism, on a "
                    f"sequence the nanobatches divide (got CP={p.cp}, seq={s}): use "
                    "nanobatches=1 or a larger batch")
            prog = _LayerProgram(workload=wl, groups=self.groups,
                                 # registered communication buffers on a GPU
                                 backend=(self._executor() if self.has_comm
                                          and x.device.type == "cuda" else None),
                                 microbatch_size=b, seq_local=s, nanobatch_counts=sorted(counts),
                                 kernels=self.kernels, device=x.device, dtype=x.dtype,
                                 rope_base=self.rope_base,
                                 rope_inv_freq=self.rope_inv_freq, layers=layers)
            self._programs[key] = prog
        return prog

    def run(self, phase: str, x: Any, weights: Sequence[Sequence[Any]], dy: Any = None,
            inputs: Sequence[Any] | None = None, positions: Any = None,
            documents: bool = False) -> tuple[Any, list[Any]]:
        """Run the forward (``dy=None``) or backward of ``len(weights)`` consecutive layers
        on detached tensors.

        Args:
            phase: ``"fwd"`` or ``"bwd"``.
            x: The first layer's input ``[batch, seq / CP, hidden]`` (the sequence shard
                ``[batch, seq / (CP x TP), hidden]`` under sequence parallelism).
            weights: Per layer, its weights in ``weight_names`` order.
            dy: Backward: the gradient of the last layer's output.
            inputs: Backward: what the forward kept (what it returned second): under full
                recomputation the inputs of layers ``1 ..``, ``[tokens, hidden]`` each
                (``x``'s tokens); otherwise its ``KeptActivations``.
            positions: ``[batch, seq]`` token positions for RoPE where they are not
                ``0 .. seq - 1`` in every sequence (packed documents, positions restarting
                at each one; CP = 1; under sequence parallelism the whole sequences'
                positions, as RoPE runs after the all-gather); None: ``0 .. seq - 1``.
                Attention stays causal over the whole sequence unless ``documents``.
            documents: Attention masks the packed documents of ``positions`` (a document
                starts where its position is 0; each token attends to the earlier tokens
                of its own document: torchtitan's FlexAttention / VarlenAttention
                ``block_causal``), exactly: block-sparse on FlexAttention on a GPU (the
                tiles no document pair connects are skipped), through SDPA with the
                dense boolean mask elsewhere (the kernel set's ``documents_backend``;
                ``kareus.exec.kernels.DocumentMask``). Under a plan the workload must say
                so (``Workload.document_tokens``: the plan then costs the attention
                within documents).

        Returns:
            Forward: ``(output, kept)``, ``kept`` the inputs of layers ``1 ..`` under full
            recomputation (from the applier's own graphs a ``KeptInputs``), otherwise the
            activations kept (``KeptActivations``); the backward takes it as ``inputs``;
            backward:
            ``(gradient of x, the weight gradients of every layer, layer by layer in
            ``weight_names`` order)``.
        """
        if positions is None:
            documents = False  # positions 0 .. seq - 1: one document per sequence
        if positions is not None:
            if self.workload.parallelism.cp != 1:
                raise WorkloadError("packed-document positions are supported at CP=1 only")
            b, s = int(x.shape[0]), int(x.shape[1])
            if self.workload.parallelism.sequence_parallel:  # whole sequences' positions
                s *= self.workload.parallelism.tp
            if tuple(positions.shape) not in ((b, s), (1, s)):
                raise WorkloadError(f"positions of shape {tuple(positions.shape)} for a "
                                    f"batch of {b} x {s} tokens: pass [batch, seq]")
            given = positions
            positions = positions.expand(b, s)
            if b == 1 and self.schedule != "sequential" and self.workload.nanobatches > 1:
                raise WorkloadError("packed-document positions are not supported with "
                                    "nanobatches along the sequence (one sequence, "
                                    f"nanobatches={self.workload.nanobatches}): use "
                                    "nanobatches=1 or a larger batch")
            if documents:
                if self.schedule == "kareus" and self.workload.document_tokens is None:
                    raise PlanError("the planned layers mask packed documents, but the plan "
                                    "was costed for causal attention over whole sequences: "
                                    "make the plan for a workload with document_tokens= "
                                    "(kareus optimize --document-tokens)")
                documents = self._document_mask(given, positions, x.device)
        if capture_in_progress():
            # Someone captures the stream (the framework's step, the user's graph): the
            # kernels, events and collectives go into that capture; no graph of our own
            if isinstance(inputs, KeptInputs) or (isinstance(inputs, KeptActivations)
                                                  and inputs.slot is not None):
                raise GraphCaptureError("a planned layer's backward runs inside a CUDA graph "
                                        "capture, its forward ran outside any: capture "
                                        "forward and backward together")
            self._check_enclosing(phase, x, weights, inputs)
        else:
            number = self._signature_number(phase, x, weights, inputs)
            # packed-document positions change per batch: such calls run eagerly (a graph
            # of our own would keep the first batch's RoPE tables)
            if positions is None and self._own_graphs(x):
                return self._graphs_runner().run(phase, x, weights, dy, inputs,
                                                 number=number)
        if isinstance(inputs, KeptInputs):  # a graphed forward's, run eagerly backward
            inputs = inputs.tensors()
        result, ran = self._run_eager(phase, x, weights, dy, inputs, positions=positions,
                                      documents=documents)
        self._record(phase, ran)
        return result

    def _document_mask(self, given: Any, positions: Any, device: Any) -> Any:
        """The ``DocumentMask`` of ``positions`` (``given`` expanded), built once per batch:
        kept for the next call with the same positions tensor, unchanged since (its
        version counter), which every layer of one forward (and its backward) passes.
        Inside a CUDA graph capture it is built every call, in the capture (a mask built
        outside would be replayed with the batch it was built for)."""
        from kareus.exec.kernels import DocumentMask

        if capture_in_progress():
            return DocumentMask(positions.to(device))
        last = self._last_documents
        if (last is not None and last[0]() is given and last[1] == given._version
                and last[2] == (tuple(positions.shape), str(device))):
            return last[3]
        import weakref

        docs = DocumentMask(positions.to(device))
        try:
            ref = weakref.ref(given)
        except TypeError:  # not weakly referable: not kept
            return docs
        self._last_documents = (ref, given._version, (tuple(positions.shape), str(device)),
                                docs)
        return docs

    #: The packed documents' mask built last: ``(weak reference to the positions, their
    #: version, (shape, device), DocumentMask)`` (``_document_mask``).
    _last_documents: Any = None
    def _signature_number(self, phase: str, x: Any, weights: Sequence[Sequence[Any]],
                          inputs: Any) -> int:
        """The computation's ``computation_signature``, recorded as run outside any
        capture, as a number (one per distinct signature; hashed once per call)."""
        key = computation_signature(self, phase, x, weights, inputs)
        return self._warmed.setdefault(key, len(self._warmed))

    def _own_graphs(self, x: Any) -> bool:
        """Whether this call replays a graph of its own: graphs on, and the tensors on the
        device the executor captures (a CUDA graph holds no CPU work: tensors on the CPU
        run eagerly, on a GPU machine too)."""
        if not self.graphs:
            return False
        if x.device.type == "cuda":
            return True
        from kareus.exec import TorchStreamBackend

        streams = getattr(self._executor(), "streams", None)
        return not isinstance(streams, TorchStreamBackend)

    def _check_enclosing(self, phase: str, x: Any, weights: Sequence[Sequence[Any]],
                         inputs: Sequence[Any] | None) -> None:
        """Refuse, in one line, what an enclosing capture cannot take: set-up (buffers,
        communicators, kernels' first launches, the plan's digest exchange) that has not
        happened outside it, and a plan whose microbatch computations differ when the
        capture may be replayed for every microbatch."""
        if self.plan is not None and self.schedule == "kareus" and not self._started:
            raise PlanError("a planned layer runs inside a CUDA graph capture before the "
                            "ranks compared the plan's digest: call applier.start() before "
                            "the capture")
        if computation_signature(self, phase, x, weights, inputs) not in self._warmed:
            raise GraphCaptureError(
                f"a planned layer's {phase} of {len(weights)} layer(s) on {tuple(x.shape)} "
                "runs inside a CUDA graph capture before it ever ran outside one (its "
                "buffers, communicators and kernels are set up on the first run, which a "
                "capture cannot hold): run the step once before capturing it (torchtitan "
                "and Megatron-Core do a warm-up step; with torch.cuda.graph, warm up on a "
                "side stream first)")
        if self.schedule == "kareus" and not self.whole_step_capture:
            plan = self.plan
            assert plan is not None
            from kareus.exec.plan_lookup import computation_key

            mine = {v for k, v in plan.assignment.items()
                    if k.startswith(f"s{self.stage}.") and k.endswith(f".{phase}")}
            if len(mine) > 1:
                current = self._executor().current
                raise PlanError(
                    f"the plan gives this stage's {phase} computations {len(mine)} different "
                    "choices (configurations, nanobatches or clocks), but this capture "
                    f"(at {computation_key(*current) if current else phase}) may be "
                    "replayed for every microbatch (torchtitan's step capture is): make a "
                    "plan with one choice per phase, turn the framework's capture off "
                    "(torchtitan: training.disable_cuda_graphs), or, if your capture holds "
                    "the whole step, PlanApplier(whole_step_capture=True)")

    def graph_memory(self) -> Any:
        """What this applier's own CUDA graphs hold: a ``GraphMemory`` (graphs kept, how
        many lend their outputs, their static buffers' bytes); zeros before any graph."""
        from kareus.integrations._graphed import GraphMemory

        if self._runner is None:
            return GraphMemory(graphs=0, lending=0, static_bytes=0)
        return self._runner.memory()

    def _graphs_runner(self) -> Any:
        if self._runner is None:
            from kareus.integrations._graphed import GraphedRunner

            self._runner = GraphedRunner(self)
        return self._runner

    def _record(self, phase: str, ran: Sequence[tuple[str, Any]]) -> None:
        if self.record:
            self.partitions_run += [(phase, key, cfg) for key, cfg in ran]
            del self.partitions_run[:-RECORD_KEPT]

    def _run_eager(self, phase: str, x: Any, weights: Sequence[Sequence[Any]], dy: Any,
                   inputs: Any, kept_out: Sequence[Any] | None = None,
                   positions: Any = None, documents: Any = False,
                   out_bufs: Sequence[Any] | None = None
                   ) -> tuple[tuple[Any, Any], list[tuple[str, Any]]]:
        """``run``'s work, enqueued as it goes; also returns the partitions run. A forward
        writes the kept inputs into ``kept_out`` when given (a graph's static buffers;
        full recomputation only); ``positions``: RoPE positions of packed documents (see
        ``run``). ``out_bufs``: where the results go (a graph's static outputs, which
        the graphed runner lends to autograd): a forward's output ``[tokens, hidden]``;
        a backward's input gradient ``[tokens, hidden]`` then every layer's weight
        gradients in ``weight_names`` order (zeroed here, then accumulated into over the
        nanobatches)."""
        import torch

        depth = len(weights)
        prog = self.program(x, depth)
        ex = self._executor()
        n, unsplit = self._computation(phase)
        b, s, h = x.shape
        x2 = x.reshape(b * s, h)
        top = depth - 1
        names = self.weight_names
        prog.weights = [dict(zip(names, ws, strict=True)) for ws in weights]
        prog.phase, prog.n = phase, n
        if phase == "fwd":
            prog.act, prog.head, prog.wgrads = {}, {"x0": x2}, []
        else:
            dy2 = dy.reshape(b * s, h)
            if prog.policy != "full":  # what the forward kept, as it kept it
                if not isinstance(inputs, KeptActivations):
                    raise ArgumentError(f"the backward under recompute={prog.policy!r} "
                                        "takes what the forward kept (its second result)")
                prog.act = inputs.for_backward(depth, n)
            else:
                prog.act = self._inputs_kept(prog, x2, inputs, depth, n)
            for i in range(n):
                if prog.sp and prog.moe is None:  # the stack's first collective's input
                    prog._buf("mlp_out_grad", i).view(-1, h).copy_(dy2[prog.rows(i)])
                else:
                    prog.act[(top, i)]["dy"] = dy2[prog.rows(i)]
            prog.head = {}
            if out_bufs is None:
                prog.wgrads = [{name: torch.zeros_like(w) for name, w in ws.items()}
                               for ws in prog.weights]
            else:
                given = iter(out_bufs[1:])
                prog.wgrads = [{name: next(given).zero_() for name in ws}
                               for ws in prog.weights]
        self._along_sequence(prog)
        stack = self._stack(phase, depth)
        prog.set_positions(positions, documents=documents)
        try:
            if unsplit:
                plan = self.plan
                assert plan is not None
                ran = run_computation(
                    ex, stack, schedule="sequential", nanobatches=1,
                    run_op=prog.run_op, comm_args=prog.comm_args, types=self.unsplit_types,
                    sequential_config_of=lambda key: plan_config(plan, key, ex.current))
            else:
                ran = run_computation(
                    ex, stack, schedule=self.schedule, nanobatches=n,
                    run_op=prog.run_op, comm_args=prog.comm_args, types=self.types,
                    plan_config_of=(None if self.schedule != "kareus" else
                                    lambda key: plan_config(self.plan, key,  # type: ignore[arg-type]
                                                            ex.current)),
                    chunk_of=prog.chunk if prog.seq_split else None,
                    exposed_default=not self.workload.chained_layers)
            if phase == "fwd":
                out = torch.empty_like(x2) if out_bufs is None else out_bufs[0]
                for i in range(n):
                    torch.add(prog.act[(top, i)]["x_mid"], prog._reduced("mlp_out", top, i),
                              out=out[prog.rows(i)])
                if prog.policy != "full":
                    kept_acts = KeptActivations({key: prog.kept(a)
                                                 for key, a in prog.act.items()},
                                                depth=depth, nanobatches=n)
                    return (out.view(b, s, h), kept_acts), ran
                kept_inputs = []
                for layer in range(1, depth):
                    xin = torch.empty_like(x2) if kept_out is None else kept_out[layer - 1]
                    for i in range(n):
                        xin[prog.rows(i)] = prog.act[(layer, i)]["x_in"]
                    kept_inputs.append(xin)
                return (out.view(b, s, h), kept_inputs), ran
            dx = torch.empty_like(x2) if out_bufs is None else out_bufs[0]
            for i in range(n):
                dx[prog.rows(i)] = prog.act[(0, i)]["dx_in"]
            return ((dx.view(b, s, h), [g[name] for g in prog.wgrads for name in names]),
                    ran)
        finally:
            prog.act, prog.head, prog.weights, prog.wgrads = {}, {}, [], []
            prog._kv_chunks, prog._dkv_from_later = {}, {}
            prog.set_positions(None)

    @staticmethod
    def _along_sequence(prog: _LayerProgram) -> None:
        """The chunks' state of nanobatches along the sequence for the computation about to
        run (``DecoderShard``'s module docstring): none yet, but under selective
        recomputation's backward the chunks' kept keys and values, which the attention
        core re-run reads.

        Raises:
            ArgumentError: full recomputation along the sequence at TP = CP = 1.
        """
        prog._kv_chunks, prog._dkv_from_later = {}, {}
        if not prog.seq_split:
            return
        if prog.policy == "full" and prog.tp == prog.cp == 1:
            raise ArgumentError(
                f"full recomputation along the sequence (one sequence, nanobatches={prog.n}) "
                "needs TP or CP > 1: without a collective the backward cannot run the "
                "recomputed forward in chunk order (use nanobatches=1)")
        if prog.phase == "bwd" and prog.policy == "selective":
            prog._kv_chunks = {key: a["kvbuf"] for key, a in prog.act.items()}

    @staticmethod
    def _inputs_kept(prog: _LayerProgram, x2: Any, inputs: Any, depth: int,
                     n: int) -> dict[tuple[int, int], dict[str, Any]]:
        """Full recomputation's backward state: each layer's input, by nanobatch."""
        kept = [x2, *(inputs or [])]
        if len(kept) != depth:
            raise ArgumentError(f"the backward of {depth} layers takes the inputs of "
                                f"layers 1 .. {depth - 1}, got {len(kept) - 1}")
        return {(layer, i): {"x_in": kept[layer][prog.rows(i)]}
                for layer in range(depth) for i in range(n)}


def _check_workload(workload: Workload, groups: ParallelGroups) -> None:
    p, arch = workload.parallelism, workload.model
    if (groups.tp_size, groups.cp_size) != (p.tp, p.cp):
        raise WorkloadError(f"the groups are TP={groups.tp_size} x CP={groups.cp_size}; the "
                            f"workload asks for TP={p.tp} x CP={p.cp}")
    if groups.ep_size != p.ep:
        raise WorkloadError(f"the groups' expert-parallel group has {groups.ep_size} ranks, "
                            f"the workload asks for EP={p.ep}: pass the EP group "
                            "(TorchParallelGroups.from_groups(ep=...))")
    for what, num, den in (("heads", arch.heads, p.tp), ("kv_heads", arch.kv_heads, p.tp),
                           ("ffn", arch.ffn, p.tp),
                           ("seq_len", workload.seq_len, 2 * p.cp if p.cp > 1 else 1)):
        if num % den:
            raise WorkloadError(f"{what}={num} is not divisible by {den} (TP={p.tp}, "
                                f"CP={p.cp}{'; 2 x CP chunks' if what == 'seq_len' else ''})")
    if p.sequence_parallel and (workload.seq_len // p.cp) % p.tp:
        raise WorkloadError(f"sequence parallelism at TP={p.tp} needs each rank's seq_len / "
                            f"CP = {workload.seq_len // p.cp} tokens per sequence divisible "
                            "by TP")


class PlannedLayer:
    """One decoder layer under a [`PlanApplier`][kareus.integrations.PlanApplier]'s schedule.

    Call it as ``layer(x, weights)``: ``x`` is the layer's input ``[batch, seq / CP,
    hidden]`` (with CP, this rank's two load-balanced chunks of each sequence, concatenated:
    [`cp_positions`][kareus.model.cp_positions]; under sequence parallelism this rank's
    shard of that, ``[batch, seq / (CP x TP), hidden]``: TP rank ``t`` holds the ``t``-th of
    TP equal runs of those tokens, as Megatron-Core scatters its ``[seq, batch, hidden]``),
    ``weights`` the layer's weights
    in kareus's layout (a mapping by the names of the applier's ``weight_names`` or a
    sequence in that order: ``LAYER_WEIGHTS``' seven (a mixture of experts: the MoE
    block's weights in place of the MLP's), and the query and key norm weights
    ``w_q_norm``, ``w_k_norm`` when the workload's model has ``qk_norm``; see
    [`layer_weights`][kareus.integrations.layer_weights]; built from the framework's
    parameters with the differentiable helpers of ``kareus.integrations``); it returns the layer's output (the input plus attention and
    MLP, both residuals included), differentiable in ``x`` and every weight.

    The autograd node keeps for the backward what the workload's recomputation policy
    says (``Workload.recompute``: the layer's input under ``"full"``; all but the attention
    core's output and statistics under ``"selective"``; every activation the backward
    reads under ``"none"``; the memory per layer and token is in the module docstring).

    A ``torch.nn.Module`` is made on first use (``as_module()``) so that this class imports
    without torch; it holds no parameters (the framework's module keeps them).
    """

    def __init__(self, applier: PlanApplier) -> None:
        if not isinstance(applier, PlanApplier):
            raise ArgumentTypeError(f"applier must be a PlanApplier, got "
                                    f"{type(applier).__name__}")
        self.applier = applier

    def __call__(self, x: Any, weights: Mapping[str, Any] | Sequence[Any], *,
                 positions: Any = None, documents: bool = False) -> Any:
        """The layer's output for input ``x`` under ``weights`` (see the class);
        ``positions``: ``[batch, seq]`` RoPE positions of packed documents (see
        [`PlanApplier.run`][kareus.integrations.PlanApplier.run]), None for ``0 .. seq -
        1``; ``documents``: attention masks those documents (each attends to itself)."""
        ws = _ordered(weights, self.applier.weight_names)
        if x.dtype != ws[1].dtype:
            raise ArgumentError(f"the layer's input is {x.dtype} and its weights "
                                f"{ws[1].dtype}: pass both in the compute dtype")
        return _function().apply(self.applier, 1, positions, bool(documents), x, *ws)


class PlannedStack:
    """Consecutive decoder layers under a [`PlanApplier`][kareus.integrations.PlanApplier]'s
    schedule, as one autograd node.

    A [`PlannedLayer`][kareus.integrations.PlannedLayer] is one node per layer, so the last
    collective of each layer's forward runs exposed (what runs between two nodes is the
    framework's). A stack of ``layers`` layers runs their forward and backward as kareus's
    own loop does, each layer's forward ops and collectives chained into the next layer's
    (the all-reduce of one layer's MLP output beside the next layer's attention-input
    ops): only the stack's own last collective runs exposed. It keeps for the backward what
    ``layers`` planned layers keep under the workload's recomputation policy (full: each
    layer's input; selective: all but each attention core's output and statistics; none:
    every activation the backward reads; see the module docstring for the memory).

    Call it as ``stack(x, weights)`` with ``weights`` a sequence of ``layers`` layers'
    weights (each as [`PlannedLayer`][kareus.integrations.PlannedLayer] takes them); it
    returns the last layer's output, differentiable in ``x`` and every weight. Use it where
    your model runs its layers back to back (a hand-written model's loop over blocks).
    """

    def __init__(self, applier: PlanApplier, layers: int) -> None:
        if not isinstance(applier, PlanApplier):
            raise ArgumentTypeError(f"applier must be a PlanApplier, got "
                                    f"{type(applier).__name__}")
        if int(layers) < 1:
            raise ArgumentError(f"a planned stack has at least one layer, got {layers}")
        if int(layers) > 1 and not applier.workload.chained_layers:
            raise WorkloadError(f"a stack of {int(layers)} layers chains them, but the "
                                "workload's layers are unchained (chained_layers=False: its "
                                "plan costs each layer run on its own): run each layer with "
                                "applier.layer(), or make the workload with "
                                "chained_layers=True")
        self.applier, self.layers = applier, int(layers)

    def __call__(self, x: Any, weights: Sequence[Mapping[str, Any] | Sequence[Any]], *,
                 positions: Any = None, documents: bool = False) -> Any:
        """The last layer's output for input ``x`` (see the class; ``positions`` and
        ``documents`` as [`PlannedLayer`][kareus.integrations.PlannedLayer] takes them)."""
        per_layer = [_ordered(w, self.applier.weight_names) for w in weights]
        if len(per_layer) != self.layers:
            raise ArgumentError(f"this stack has {self.layers} layers, got the weights of "
                                f"{len(per_layer)}")
        if any(x.dtype != ws[1].dtype for ws in per_layer):
            raise ArgumentError(f"the stack's input is {x.dtype} and some weights are not: "
                                "pass all in the compute dtype")
        flat = [w for ws in per_layer for w in ws]
        return _function().apply(self.applier, self.layers, positions, bool(documents), x,
                                 *flat)


def _ordered(weights: Mapping[str, Any] | Sequence[Any], names: Sequence[str]) -> list[Any]:
    """``weights`` (by name or in order) as a list in the order of ``names``."""
    if isinstance(weights, Mapping):
        if weights.keys() == set(names):  # the usual case, in one comparison
            return [weights[n] for n in names]
        missing = [n for n in names if n not in weights]
        extra = sorted(set(weights) - set(names))
        if missing or extra:
            qk = set(QK_NORM_WEIGHTS)
            why = (" (the workload's model has no qk_norm)" if set(extra) & qk
                   else " (the workload's model has qk_norm)" if set(missing) & qk else "")
            raise ArgumentError(f"a planned layer's weights are {list(names)}; missing "
                                f"{missing}, unknown {extra}{why}")
        return [weights[n] for n in names]
    ws = list(weights)
    if len(ws) != len(names):
        raise ArgumentError(f"a planned layer takes {len(names)} weights ({list(names)}), "
                            f"got {len(ws)}")
    return ws


_FUNCTION: Any = None


def _function() -> Any:
    """The autograd function of a planned layer (defined on first use: torch is lazy)."""
    global _FUNCTION
    if _FUNCTION is not None:
        return _FUNCTION
    import torch

    class PlannedLayerFunction(torch.autograd.Function):
        """Forward and backward of one layer through a PlanApplier's executor."""

        @staticmethod
        def forward(ctx: Any, applier: PlanApplier, layers: int, positions: Any,
                    documents: bool, x: Any, *weights: Any) -> Any:
            out, inputs = applier.run("fwd", x.detach().contiguous(),
                                      _per_layer(weights, layers, len(applier.weight_names)),
                                      positions=positions, documents=documents)
            ctx.applier, ctx.layers, ctx.positions = applier, layers, positions
            ctx.documents = documents
            ctx.weights = len(weights)
            # What the backward reads. Eager: autograd holds it (saved for backward), so it
            # is freed as soon as the backward has run, whoever keeps this node (a
            # framework keeps the output, and so the node, until later), and it passes
            # through saved-tensor hooks; full recomputation keeps the inputs of layers 1 ..,
            # otherwise KeptActivations. From graphs of the applier's own: the forward
            # graph's buffers, lent (their slot is freed by the backward).
            kept: list[Any] = []
            ctx.kept_layout, ctx.inputs = None, inputs
            if isinstance(inputs, KeptActivations) and inputs.slot is None:
                kept, ctx.kept_layout = inputs.pack()
                ctx.inputs = None
            elif isinstance(inputs, list):
                kept, ctx.kept_layout, ctx.inputs = inputs, "inputs", None
            ctx.save_for_backward(x, *weights, *kept)
            return out

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            x, *saved = ctx.saved_tensors
            weights, kept = saved[:ctx.weights], saved[ctx.weights:]
            inputs = ctx.inputs
            if ctx.kept_layout == "inputs":
                inputs = kept
            elif ctx.kept_layout is not None:
                inputs = KeptActivations.unpack(ctx.kept_layout, kept)
            elif not isinstance(inputs, KeptActivations):  # graphs, full recomputation:
                ctx.inputs = None  # freed now (kept activations: their slot is released)
            # The attention's backward reads what its forward saved under autograd
            with torch.enable_grad():
                dx, dws = ctx.applier.run("bwd", x.detach().contiguous(),
                                          _per_layer(weights, ctx.layers,
                                                     len(ctx.applier.weight_names)),
                                          dy=dy.contiguous(),
                                          inputs=inputs, positions=ctx.positions,
                                          documents=ctx.documents)
            return (None, None, None, None, dx, *dws)

    def _per_layer(weights: Sequence[Any], layers: int, k: int) -> list[list[Any]]:
        # No copies: the 2-D weights only feed GEMMs, which take a transposed view's layout
        # (a framework's [out, in] weight as [in, out]); their gradient buffers take the
        # same strides, so the gradient flows back without a copy either.
        ws = [w.detach() for w in weights]
        return [ws[i * k:(i + 1) * k] for i in range(layers)]

    _FUNCTION = PlannedLayerFunction
    return _FUNCTION

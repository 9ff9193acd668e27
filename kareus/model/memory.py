"""Does a workload fit in its GPUs' memory? A per-GPU estimate, checked before any work.

A workload that cannot be trained on its GPUs must be refused before minutes of searching,
not reported with an iteration time. ``estimate_memory`` counts, per GPU of each
pipeline stage (the largest stage is the one that matters):

- **weights** in bf16 (2 bytes per parameter) and **gradients** in fp32 (4 bytes: Megatron-LM
  accumulates and reduces gradients in fp32 buffers under ``--bf16``, its ``main_grad``, the
  gradients ``kareus.model.partition.iteration_work`` reduce-scatters); tied
  embeddings are one matrix on a single stage, a copy on each end stage with PP > 1;
- **optimizer state**: fp32 master weights and Adam's two moments (12 bytes per parameter),
  sharded over the DP x CP ranks that hold the same weights, as Megatron-LM's distributed
  optimizer does (its ``dp_cp`` group; the same shard the iteration's Adam step updates,
  ``kareus.model.partition.iteration_work``);
- **activations** of the microbatches in flight (1F1B: stage ``s`` of ``p`` holds up to
  ``p - s`` microbatches; GPipe: all of them), per the workload's recomputation policy, as
  kareus's layer keeps them (``kept_activation_bytes``; a test counts the bytes its
  planned layers hand autograd against these figures; elements of the workload's
  ``dtype_bytes``, 2 for bf16): ``"full"`` keeps each layer's input, plus one layer's full
  activations while it is recomputed; ``"none"`` keeps every tensor a layer's backward
  reads: both norms' inputs (the residual stream) and outputs
  (the projections' inputs), the QKV projection's output (the attention reads the values
  in place in it, so all of it stays), the rotated queries and keys, the attention output
  with FlashAttention's per-head log-sum-exp, and the SwiGLU gate, up and product; with
  per-head query/key norms also the projection's output before them (the norms' input);
  under CP the rotated queries and every chunk's keys and values as gathered (no
  collective runs again in the backward) instead of the QKV projection and the local
  keys, and each causal piece's output beside the whole output; under sequence
  parallelism with more than one sequence per microbatch, the output also in the
  gathered tokens' order the output projection reads. This is the per-layer
  accounting of Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models" (MLSys 2023), for grouped-query attention, RoPE, a SwiGLU MLP and
  flash attention (no attention-score matrices). ``"selective"`` keeps all of those but the
  attention core's output and statistics (recomputed in the backward), plus one layer's
  while it is recomputed. The projections' tensors are sharded over TP; the norms' inputs
  (the residual stream) are replicated on every TP rank, or sharded with the sequence
  under sequence parallelism; the normed inputs of the QKV and gate/up projections are
  whole on every rank in both layouts (under sequence parallelism kareus keeps the
  all-gathered tensor for the weight gradients rather than gathering it again). CP shards
  the sequence;
- the **logits** of one microbatch on the last stage in fp32 (the loss is computed there).

A mixture-of-experts model (``ModelArch.moe``) holds ``experts / ep`` experts per rank, and
their optimizer state is sharded over the expert-data-parallel group (``tp x cp x dp / ep``
ranks, ``kareus.model.moe``); in place of the SwiGLU gate, up and product a layer keeps, per
token routed by the rank, the router's probabilities (``experts`` values of the router
dtype), the ``top-k`` permuted input rows and expert output rows, and the experts' gate, up
and product (``3 x expert_ffn`` each of ``top-k x routing_imbalance`` rows), plus the
shared experts' gate, up and product.

The CUDA context, the allocator's fragmentation and communication buffers are not counted,
so a workload this check passes may still not fit: the check refuses only what surely
does not.
"""

from __future__ import annotations

import attrs

from kareus.errors import WorkloadError
from kareus.model.gpu import GPUSpec
from kareus.model.workload import Workload

__all__ = ["MemoryEstimate", "check_memory", "estimate_memory", "kept_activation_bytes"]

_GIB = 1024**3


@attrs.frozen(kw_only=True)
class MemoryEstimate:
    """Bytes one GPU of a pipeline stage holds at its peak.

    Attributes:
        stage: The pipeline stage (the one with the largest total).
        weights_bytes: bf16 weights.
        grads_bytes: fp32 gradients (the training job's ``main_grad`` buffers).
        optimizer_bytes: fp32 master weights and Adam moments, sharded over DP x CP.
        activations_bytes: Saved activations of the microbatches in flight, the working set
            of one recomputed layer, and (last stage) one microbatch's fp32 logits.
    """

    stage: int
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float

    @property
    def total_bytes(self) -> float:
        """Weights, gradients, optimizer state and activations together, in bytes."""
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + \
            self.activations_bytes

    def describe(self) -> str:
        """One line, in GiB."""
        return (f"{self.total_bytes / _GIB:,.1f} GiB per GPU on stage {self.stage} (weights "
                f"{self.weights_bytes / _GIB:,.1f}, gradients {self.grads_bytes / _GIB:,.1f}, "
                f"optimizer states {self.optimizer_bytes / _GIB:,.1f}, activations "
                f"{self.activations_bytes / _GIB:,.1f})")


@attrs.frozen
class _SavedBytes:
    """Bytes one layer saves for its backward per token of the rank's sequence (CP applied,
    TP not yet), without recomputation, by how TP shards them."""

    residual: float  # the norms' inputs: replicated over TP, sharded under SP
    gathered: float  # the normed inputs of the column-parallel projections: whole
    sharded: float  # the projections' outputs and what follows them: 1/TP
    attention_core: float  # of ``sharded``: the attention output and statistics

    def per_rank(self, tp: int, sp: bool) -> float:
        """Bytes per token on one rank."""
        return self.residual / (tp if sp else 1) + self.gathered + self.sharded / tp


def _saved_bytes_per_token(wl: Workload) -> _SavedBytes:
    """What one layer of kareus's keeps for its backward, per token, without recomputation
    (the module docstring): tensors of ``dtype_bytes`` per element (2: bf16), fp32 per-head
    statistics."""
    m, cp, d = wl.model, wl.parallelism.cp, wl.dtype_bytes
    hq, hkv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    lse = 4 * m.heads  # FlashAttention's log-sum-exp, fp32, per head and query token
    if cp == 1:
        # the QKV projection (the values read in place in it), the rotated queries and keys
        sharded = d * (hq + 2 * hkv) + d * (hq + hkv)
        core = d * hq + lse  # the attention output and its statistics
        p = wl.parallelism
        if p.sequence_parallel and wl.microbatch_size > 1:
            # the output projection reads the output in the gathered (rank) order, a copy
            # when a computation holds more than one sequence (an unsplit microbatch)
            core += d * hq
    else:
        # the rotated queries and every chunk's keys and values, gathered by position
        sharded = d * hq + d * 2 * cp * hkv
        core = 2 * d * hq + lse  # each causal piece's output, and the whole output
    # gate, up and their SwiGLU product (a mixture of experts': _moe_saved_bytes_per_token)
    sharded += core + (d * 3 * m.ffn if m.moe is None else 0)
    moe_kept = 0.0 if m.moe is None else _moe_saved_bytes_per_token(wl)
    if m.qk_norm and cp > 1:
        # the fused norm-and-RoPE backward reads the projection's output before the norms
        # (no statistics: it recomputes them): without CP that is the QKV projection kept
        # above; under CP one more tensor
        sharded += d * (hq + 2 * hkv)
    # two norms: each keeps its input (the residual stream) and the projections read
    # their output (QKV, and the gate and up projections)
    return _SavedBytes(residual=2 * d * m.hidden, gathered=2 * d * m.hidden,
                       sharded=float(sharded) + moe_kept, attention_core=float(core))


def _moe_saved_bytes_per_token(wl: Workload) -> float:
    """What a mixture-of-experts block keeps for its backward per token (module docstring).
    Counted with the tensors sharded over TP: under sequence parallelism (required at
    TP > 1) the block runs on the rank's ``1 / TP`` shard of the tokens."""
    moe, d = wl.model.moe, wl.dtype_bytes
    assert moe is not None
    k, h = moe.experts_per_token, wl.model.hidden
    rows = k * wl.routing_imbalance
    return (moe.experts * moe.router_dtype_bytes + 2 * d * k * h
            + d * rows * 3 * moe.expert_ffn
            + d * 3 * moe.shared_experts * moe.shared_expert_ffn)


def _kept_bytes_per_token(wl: Workload) -> tuple[float, float]:
    """``(kept per layer, working set of one recomputed layer)`` per token on one rank,
    by the recomputation policy (module docstring)."""
    p = wl.parallelism
    sp = p.sequence_parallel
    saved = _saved_bytes_per_token(wl)
    everything = saved.per_rank(p.tp, sp)
    if wl.recompute == "full":
        layer_input = wl.dtype_bytes * wl.model.hidden / (p.tp if sp else 1)
        return layer_input, everything
    if wl.recompute == "selective":
        core = saved.attention_core / p.tp
        return everything - core, core
    return everything, 0.0


def kept_activation_bytes(workload: Workload, *, layers: int = 1) -> float:
    """Bytes one rank keeps between the forward and the backward of ``layers`` decoder
    layers of one microbatch, under the workload's recomputation policy (the module
    docstring; what kareus's layers hand autograd, the layers' own input aside): without
    the working set of a recomputed layer, which lives during the backward only.

    Args:
        workload: The training workload (its model, microbatch, TP/CP/SP and ``recompute``).
        layers: Consecutive layers (a stack's; ``"full"`` keeps the inputs of layers
            ``1 ..`` of a stack beside its own input, which its caller holds: counted here
            as every layer's input).
    """
    p = workload.parallelism
    tokens = workload.microbatch_size * workload.seq_len / p.cp
    return float(layers) * _kept_bytes_per_token(workload)[0] * tokens


def estimate_memory(workload: Workload, *, schedule: str = "1f1b") -> MemoryEstimate:
    """The peak memory of one GPU of the fullest pipeline stage (see the module docstring).

    Args:
        workload: The training workload.
        schedule: ``"1f1b"`` (microbatches in flight: ``PP - stage``) or ``"gpipe"`` (all).
    """
    wl, p, m = workload, workload.parallelism, workload.model
    tokens = wl.microbatch_size * wl.seq_len / p.cp
    per_layer = m.layer_params_per_rank(p.tp, p.ep)
    # a mixture of experts' routed experts: their optimizer state is sharded over the
    # expert-data-parallel group, not DP x CP
    experts = (0.0 if m.moe is None
               else wl.layers_per_stage * m.moe.expert_params_per_rank(m.hidden, ep=p.ep))
    edp = p.tp * p.cp * p.dp // p.ep
    kept, working = _kept_bytes_per_token(wl)
    best: MemoryEstimate | None = None
    for stage in range(p.pp):
        params = wl.layers_per_stage * per_layer
        if stage == 0:
            params += m.vocab * m.hidden / p.tp
        if stage == p.pp - 1:
            # The LM head: the embedding's own matrix when tied on one stage; with PP > 1
            # the last stage keeps a copy of the tied matrix.
            tied_here = m.tied_embeddings and p.pp == 1
            params += (0 if tied_here else m.vocab * m.hidden / p.tp) + m.hidden
        inflight = wl.num_microbatches if schedule == "gpipe" else \
            min(p.pp - stage, wl.num_microbatches)
        act = inflight * wl.layers_per_stage * kept * tokens + working * tokens
        if stage == p.pp - 1:
            act += tokens * m.vocab / p.tp * 4
        # the rest over DP x CP (Megatron-Core's dp_cp group)
        dense = p.dp * p.cp
        optimizer = (12 * params / dense if m.moe is None
                     else 12 * ((params - experts) / dense + experts / edp))
        est = MemoryEstimate(stage=stage, weights_bytes=2 * params, grads_bytes=4 * params,
                             optimizer_bytes=optimizer, activations_bytes=act)
        if best is None or est.total_bytes > best.total_bytes:
            best = est
    assert best is not None
    return best


def check_memory(workload: Workload, gpu: GPUSpec, *, schedule: str = "1f1b") -> MemoryEstimate:
    """Refuse a workload that cannot fit in ``gpu``'s memory; return the estimate otherwise.

    Raises:
        WorkloadError: the estimate exceeds the GPU's memory, with the numbers and what to
            change.
    """
    est = estimate_memory(workload, schedule=schedule)
    par = workload.parallelism
    have = gpu.memory_gib * _GIB
    if est.total_bytes > have:
        raise WorkloadError(
            f"{workload.describe()} does not fit on {gpu.name}: it needs at least "
            f"{est.describe()}, the GPU has {gpu.memory_gib:g} GiB; use a smaller "
            f"microbatch size or sequence length, more TP/CP/PP"
            f"{', or recomputation' if workload.recompute != 'full' else ''}"
            f"{', or sequence parallelism' if par.tp > 1 and not par.sp else ''}")
    return est

"""Does a workload fit in its GPUs' memory? A per-GPU estimate, checked before any work.

A workload that cannot be trained on its GPUs must be refused before minutes of searching,
not reported with an iteration time. ``estimate_memory`` counts, per GPU of each
pipeline stage (the largest stage is the one that matters):

- **weights** in bf16 (2 bytes per parameter) and **gradients** in bf16 (2 bytes); tied
  embeddings are one matrix on a single stage, a copy on each end stage with PP > 1;
- **optimizer state**: fp32 master weights and Adam's two moments (12 bytes per parameter),
  sharded over the data-parallel replicas as Megatron-LM's distributed optimizer does;
- **activations** of the microbatches in flight (1F1B: stage ``s`` of ``p`` holds up to
  ``p - s`` microbatches; GPipe: all of them). With full recomputation only each layer's
  bf16 input is kept, plus one layer's full activations while it is recomputed; without
  it, every tensor a layer saves for its backward (norm inputs, QKV, attention output with
  FlashAttention's per-head statistics, the SwiGLU gate, up and product): the per-layer
  accounting of Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models" (MLSys 2023), for grouped-query attention, a SwiGLU MLP and flash
  attention (no attention-score matrices). TP shards every tensor (with sequence
  parallelism), CP shards the sequence;
- the **logits** of one microbatch on the last stage in fp32 (the loss is computed there).

The CUDA context, the allocator's fragmentation and communication buffers are not counted,
so a workload this check passes may still not fit: the check refuses only what surely
does not.
"""

from __future__ import annotations

import attrs

from kareus.errors import WorkloadError
from kareus.model.gpu import GPUSpec
from kareus.model.workload import Workload

__all__ = ["MemoryEstimate", "check_memory", "estimate_memory"]

_GIB = 1024**3


@attrs.frozen(kw_only=True)
class MemoryEstimate:
    """Bytes one GPU of a pipeline stage holds at its peak.

    Attributes:
        stage: The pipeline stage (the one with the largest total).
        weights_bytes: bf16 weights.
        grads_bytes: bf16 gradients.
        optimizer_bytes: fp32 master weights and Adam moments, sharded over DP.
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


def _saved_bytes_per_token(wl: Workload) -> float:
    """Bytes one layer saves for its backward, per token, without recomputation (before TP
    sharding): bf16 tensors, fp32 per-head statistics. With qk-norm the norms keep their
    inputs, the projection's q and k, beside the normalised and rotated ones attention keeps,
    and their per-head reciprocal RMS."""
    m = wl.model
    hq, hkv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    attn = 2 * m.hidden * 2 + 2 * (hq + 2 * hkv) + 2 * hq + 4 * m.heads
    if m.qk_norm:
        attn += 2 * (hq + hkv) + 4 * (m.heads + m.kv_heads)
    mlp = 2 * m.hidden * 2 + 2 * 3 * m.ffn
    return float(attn + mlp)


def estimate_memory(workload: Workload, *, schedule: str = "1f1b") -> MemoryEstimate:
    """The peak memory of one GPU of the fullest pipeline stage (see the module docstring).

    Args:
        workload: The training workload.
        schedule: ``"1f1b"`` (microbatches in flight: ``PP - stage``) or ``"gpipe"`` (all).
    """
    wl, p, m = workload, workload.parallelism, workload.model
    tokens = wl.microbatch_size * wl.seq_len / p.cp
    per_layer = m.layer_params_per_rank(p.tp)
    saved = _saved_bytes_per_token(wl) / p.tp
    full = wl.recompute == "full"
    kept = (2 * m.hidden / p.tp) if full else saved
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
        act = inflight * wl.layers_per_stage * kept * tokens
        if full:
            act += saved * tokens
        if stage == p.pp - 1:
            act += tokens * m.vocab / p.tp * 4
        est = MemoryEstimate(stage=stage, weights_bytes=2 * params, grads_bytes=2 * params,
                             optimizer_bytes=12 * params / p.dp, activations_bytes=act)
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
    have = gpu.memory_gib * _GIB
    if est.total_bytes > have:
        raise WorkloadError(
            f"{workload.describe()} does not fit on {gpu.name}: it needs at least "
            f"{est.describe()}, the GPU has {gpu.memory_gib:g} GiB; use a smaller "
            f"microbatch size or sequence length, more TP/CP/PP"
            f"{', or recomputation' if workload.recompute != 'full' else ''}")
    return est

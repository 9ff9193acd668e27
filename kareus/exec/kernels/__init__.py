"""The one definition of every op a runnable partition runs: fused kernels by default.

What kareus profiles on a GPU must be what people train with: a slow eager formula
makes the computation that hides communication look longer than it is in a real job,
and every overlap gain measured on it overstates what users get. This package holds
each op of a transformer layer once, behind one interface, ``KernelSet``:

=================  ======================================================================
op                 what it computes
=================  ======================================================================
``rms_norm``       ``y = (x * rsqrt(mean(x^2) + eps)).to(dtype) * w`` (Llama's casting)
``rms_norm_bwd``   ``dx`` and ``dw`` of that, from ``dy``, ``x`` and ``w``
``rope``           rotary embedding of q and k, read from the packed QKV projection
``rope_bwd``       the inverse rotation of ``dq`` and ``dk``, packed with ``dv`` into dQKV
``qk_norm_rope``   per-head RMSNorm of q and k (Qwen3), then RoPE: a qk-norm layer's op
                   in RoPE's place (its backward ``qk_norm_rope_bwd``; by default the
                   composition of the ops above, one kernel each in ``"triton"``)
``swiglu``         ``silu(g) * u``
``swiglu_bwd``     ``dg`` and ``du`` of that
``attention``      causal scaled-dot-product attention, grouped K/V read in place
``matmul``         GEMMs on cuBLAS (``torch.matmul``; ``addmm_`` to accumulate)
MoE ops            a mixture of experts' router, top-k, token permutation, sort by local
                   expert, grouped expert GEMMs (``grouped_mm``: ``torch._grouped_mm`` on
                   sm90+ bf16, a GEMM loop elsewhere), un-permutation and their backward
                   (``kareus.exec.kernels._moe``; plain torch in every set)
=================  ======================================================================

Implementations (``get_kernels`` picks one by name):

* ``"triton"`` (the default on a CUDA GPU): kareus's own fused Triton kernels
  (``kareus.exec.kernels._triton``, see there why), one launch per op forward and
  backward (two for RMSNorm backward), launched lean: per input signature the launch
  is worked out once and later calls go straight to the compiled kernel's launcher.
  liger-kernel's RMSNorm and SwiGLU forward are an opt-in
  (``TritonKernels(use_liger=True)``, ``pip install kareus[kernels]``).
* ``"torch"`` (the default without CUDA or Triton): the best plain-torch path:
  ``torch.nn.functional.rms_norm`` and PyTorch's fused RMSNorm backward, single-formula
  RoPE and SwiGLU. Runs on the CPU.
* ``"reference"``: the eager formulas the runnable partitions used before the fused
  kernels (float32 RMSNorm backward, ``rotate_half`` RoPE with ``torch.cat``), kept to
  measure what the fused kernels change.

Attention runs on the SDPA backends in ``KernelSet.sdpa_backends`` order (cuDNN,
then flash, then memory-efficient), GEMMs on cuBLAS, in every implementation. Its forward and
backward are two explicit ops (``attention_forward`` keeps a ``SavedAttention``,
``attention_backward`` reads it; no autograd engine between them, so both capture in a CUDA
graph): every kernel set's ``attention_fwd`` / ``attention_bwd`` run on them, and a caller
with its own mask (the training loop's context-parallel chunks) calls them directly.
Packed documents' block-causal attention (``attention(q, k, v, mask=DocumentMask(positions))``)
runs block-sparse on FlexAttention on a GPU, on SDPA with the dense mask elsewhere
(``kareus.exec.kernels._documents`` says why FlexAttention and not varlen flash).

To run your own kernels, subclass ``KernelSet`` (or one of the classes here) and
pass an instance as ``kernels=`` to
[`RunnableTransformerPartition`][kareus.exec.RunnableTransformerPartition] or
[`runnable_partitions`][kareus.exec.runnable_partitions]; ``register_kernels``
makes it selectable by name (``KAREUS_KERNELS=name`` in the environment picks the
default). ``kareus.exec.kernels.autograd`` wraps any kernel set as differentiable
functions for a model's own training loop.

torch and triton are imported inside the functions that need them.
"""

from __future__ import annotations

from kareus.exec.kernels._attention import SavedAttention, attention_backward, attention_forward
from kareus.exec.kernels._documents import DOCUMENT_BACKENDS, DocumentMask
from kareus.exec.kernels._moe import GROUPED_GEMM_PATHS, TokenPermutation
from kareus.exec.kernels.base import KernelSet, ReferenceKernels, TorchKernels
from kareus.exec.kernels.registry import available_kernels, get_kernels, register_kernels

__all__ = [
    "DOCUMENT_BACKENDS",
    "DocumentMask",
    "GROUPED_GEMM_PATHS",
    "KernelSet",
    "ReferenceKernels",
    "SavedAttention",
    "TokenPermutation",
    "TorchKernels",
    "attention_backward",
    "attention_forward",
    "available_kernels",
    "get_kernels",
    "register_kernels",
]

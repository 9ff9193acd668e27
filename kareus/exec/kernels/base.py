"""The ``KernelSet`` interface and the plain-torch and reference sets.

Layouts (the runnable partitions' and most training stacks'):

* activations are row-major ``[tokens, features]`` (``tokens = batch * seq``);
* the QKV projection's output is packed ``[tokens, (heads + 2 * kv_heads) * head_dim]``;
  ``rope`` reads q and k from it and returns them as ``[batch, seq, heads, head_dim]``
  (attention takes ``.transpose(1, 2)`` of that, a view); ``rope_bwd`` takes the
  attention's gradients in that layout (any strides, last one 1) and writes one packed
  dQKV for the QKV GEMMs' backward;
* ``cos`` / ``sin`` are ``[seq, head_dim]`` with the two halves equal (the Llama / HF
  layout), position ``p`` in row ``p``.
"""

from __future__ import annotations

import abc
from typing import Any

from kareus.errors import ArgumentError
from kareus.exec.kernels import _moe
from kareus.exec.kernels._attention import attention_backward, attention_forward
from kareus.exec.kernels._documents import DOCUMENT_BACKENDS, DocumentMask, document_attention
from kareus.exec.kernels._layout import _split_qkv

__all__ = [
    "KernelSet",
    "ReferenceKernels",
    "TorchKernels",
]

OPS = ("rms_norm", "rms_norm_bwd", "rope", "rope_bwd", "swiglu", "swiglu_bwd", "attention",
       "matmul")

#: The mixture-of-experts ops every kernel set has (``kareus.exec.kernels._moe`` defines
#: them; plain torch by default).
MOE_OPS = ("router", "router_topk", "router_topk_bwd", "router_dgrad", "router_wgrad",
           "permute", "permute_bwd", "expert_sort", "expert_unsort", "grouped_mm",
           "grouped_mm_wgrad", "expert_swiglu", "expert_swiglu_bwd", "unpermute",
           "unpermute_bwd")


class KernelSet(abc.ABC):
    """One implementation of every op of a transformer layer (see the package docstring).

    Subclass it, or one of ``TorchKernels`` / ``TritonKernels``, overriding the ops
    you have your own kernels for. Every method enqueues its work on the current stream
    and returns new tensors (no input is modified, except an ``out=`` / ``dw_out=``
    argument an op accumulates into), so an op can run again and again on the same
    inputs, as a profiling loop does.

    ``add_rms_norm`` and ``rms_norm_bwd_add`` (the residual additions around a norm,
    fused) have defaults built from the other ops; a set with its own fused kernels
    overrides them.

    Attributes:
        name: Short name (``"triton"``, ``"torch"``, ``"reference"``, yours).
        sdpa_backends: ``torch.nn.attention.SDPBackend`` member names, in priority order,
            that ``attention`` may use (the math backend is always the last resort).
        documents_backend: How ``attention`` runs packed documents' block-causal mask (a
            ``DocumentMask``): ``"flex"`` (block-sparse FlexAttention, compiled on a GPU),
            ``"mask"`` (SDPA with the dense boolean mask), or ``None`` (default): flex on a
            CUDA device (heads of 16 and more: its GPU kernel's least), the dense mask
            elsewhere (see ``kareus.exec.kernels._documents``).
        grouped_gemm: How the mixture-of-experts grouped GEMMs run: ``"auto"`` (default:
            ``torch._grouped_mm`` on a CUDA GPU of compute capability 9.0+ in bfloat16, a
            loop of ``torch.matmul`` elsewhere), ``"grouped_mm"`` or ``"loop"``
            (``kareus.exec.kernels._moe``).
    """

    name: str = "custom"
    sdpa_backends: tuple[str, ...] = ("CUDNN_ATTENTION", "FLASH_ATTENTION",
                                      "EFFICIENT_ATTENTION")
    documents_backend: str | None = None
    grouped_gemm: str = "auto"

    @abc.abstractmethod
    def rms_norm(self, x: Any, w: Any, eps: float = 1e-5) -> Any:
        """``(x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype) * w`` over the last dimension."""

    @abc.abstractmethod
    def rms_norm_bwd(self, dy: Any, x: Any, w: Any, eps: float = 1e-5) -> tuple[Any, Any]:
        """Gradients ``(dx, dw)`` of ``rms_norm`` (``dw`` may be ``None`` if not computed)."""

    @abc.abstractmethod
    def rope(self, qkv: Any, cos: Any, sin: Any, *, heads: int,
             kv_heads: int) -> tuple[Any, Any]:
        """Rotate q and k of the packed ``qkv`` ([tokens, (heads + 2 kv_heads) * hd]);
        returns ``(q, k)``, each ``[batch, seq, heads, hd]`` with ``seq = cos.shape[0]``."""

    @abc.abstractmethod
    def rope_bwd(self, dq: Any, dk: Any, dv: Any, cos: Any, sin: Any) -> Any:
        """Rotate ``dq`` and ``dk`` back and pack them with ``dv`` into
        ``[tokens, (heads + 2 kv_heads) * hd]`` (inputs ``[batch, seq, heads, hd]``)."""

    @abc.abstractmethod
    def swiglu(self, g: Any, u: Any) -> Any:
        """``silu(g) * u``."""

    @abc.abstractmethod
    def swiglu_bwd(self, da: Any, g: Any, u: Any) -> tuple[Any, Any]:
        """Gradients ``(dg, du)`` of ``swiglu`` for the output gradient ``da``."""

    # -------------------------------------------------------------- shared defaults
    def add_rms_norm(self, x: Any, r: Any, w: Any, eps: float = 1e-5) -> tuple[Any, Any]:
        """``(s, rms_norm(s, w))`` with ``s = x + r``: a residual addition and the norm
        that reads its sum (a decoder layer's input norms). By default the two ops;
        ``TritonKernels`` runs both in one pass."""
        s = x + r
        return s, self.rms_norm(s, w, eps)

    def rms_norm_bwd_add(self, dy: Any, x: Any, w: Any, dres: Any, dw_out: Any,
                         eps: float = 1e-5) -> Any:
        """``dres + dx`` of ``rms_norm_bwd(dy, x, w)``, with its ``dw`` added into
        ``dw_out`` in place (the residual branch's gradient and the weight gradient's
        accumulation). By default the ops one by one; ``TritonKernels`` fuses them
        into its backward's two launches."""
        dx, dw = self.rms_norm_bwd(dy, x, w, eps)
        if dw is None:  # a set without the weight gradient: computed here
            dw = rms_norm_weight_grad(dy, x, eps)
        dw_out.add_(dw.to(dw_out.dtype))
        return dres + dx

    def qk_norm_rope(self, qkv: Any, wq: Any, wk: Any, cos: Any, sin: Any, *, heads: int,
                     kv_heads: int, eps: float = 1e-6) -> tuple[Any, Any]:
        """Query/key normalisation then RoPE (Qwen3's attention input): each query head of
        the packed ``qkv`` normalised over head_dim with ``wq``, each key head with ``wk``
        (``rms_norm`` semantics), then rotated as ``rope`` rotates; returns ``(q, k)`` in
        ``rope``'s layout. By default the ops one by one (a copy of the packed QKV with
        the normalised heads, then ``rope``); ``TritonKernels`` runs it in one launch."""
        hd = cos.shape[1]
        t = qkv.shape[0]
        nq, nk = heads * hd, kv_heads * hd
        normed = qkv.clone()
        for cols, w in ((slice(0, nq), wq), (slice(nq, nq + nk), wk)):
            x = qkv[:, cols].reshape(-1, hd)
            normed[:, cols] = self.rms_norm(x, w, eps).view(t, -1)
        return self.rope(normed, cos, sin, heads=heads, kv_heads=kv_heads)

    def qk_norm_rope_bwd(self, dq: Any, dk: Any, dv: Any, qkv: Any, wq: Any, wk: Any,
                         cos: Any, sin: Any, *, eps: float = 1e-6) -> tuple[Any, Any, Any]:
        """The backward of ``qk_norm_rope``: ``(dqkv, dwq, dwk)``, the packed gradient of the
        projection's output (``dv`` in its place, as ``rope_bwd`` packs it) and the norm
        weights' gradients (float32). ``qkv`` is the projection's output the forward read.
        By default ``rope_bwd`` then the two norms' backward."""
        hd = cos.shape[1]
        heads, kv_heads = dq.shape[2], dk.shape[2]
        dqkv = self.rope_bwd(dq, dk, dv, cos, sin)
        t = dqkv.shape[0]
        nq, nk = heads * hd, kv_heads * hd
        grads = []
        for cols, w in ((slice(0, nq), wq), (slice(nq, nq + nk), wk)):
            dy = dqkv[:, cols].reshape(-1, hd)
            x = qkv[:, cols].reshape(-1, hd)
            dx, dw = self.rms_norm_bwd(dy, x, w, eps)
            if dw is None:
                dw = rms_norm_weight_grad(dy, x, eps)
            dqkv[:, cols] = dx.view(t, -1)
            grads.append(dw.float())
        return dqkv, grads[0], grads[1]

    def attention(self, q: Any, k: Any, v: Any, mask: Any = None) -> Any:
        """Causal attention of ``q`` [b, heads, s, hd] over grouped ``k``, ``v``
        [b, kv_heads, s_k, hd], on the first of ``sdpa_backends`` that takes it.

        ``mask``: a boolean ``[b, 1, s, s_k]`` (True: attend) in place of the causal mask,
        on which SDPA runs a backend that takes a mask (every score is computed, the
        masked ones dropped); or packed documents' block-causal mask, a ``DocumentMask``
        (each token attends to its own document's earlier tokens), run as
        ``documents_backend`` says (block-sparse FlexAttention on a GPU).

        Grouped K/V are read in place (``enable_gqa``): copying them with
        ``repeat_interleave`` first cost 30% more time on one H200 (0.475 vs 0.364 ms
        for 4 x 12 query heads over 4 K/V heads, 4096 tokens, head dim 128;
        bench/probes/results/sdpa_gqa_probe_h200.json).
        """
        if isinstance(mask, DocumentMask):
            return document_attention(q, k, v, mask, backend=self.document_backend(q),
                                      dense=self.attention)
        with self._sdpa_context():
            return _sdpa(q, k, v, mask)

    def document_backend(self, q: Any) -> str:
        """How ``attention`` runs a ``DocumentMask`` for queries ``q``: ``documents_backend``,
        or by default ``"flex"`` on a CUDA device and ``"mask"`` elsewhere (and for heads
        narrower than 16, which FlexAttention's GPU kernel does not take)."""
        backend = self.documents_backend
        if backend is None:
            return "flex" if q.device.type == "cuda" and q.shape[-1] >= 16 else "mask"
        if backend not in DOCUMENT_BACKENDS:
            raise ArgumentError(f"documents_backend must be one of {DOCUMENT_BACKENDS} or "
                                f"None, got {backend!r}")
        return backend

    def attention_fwd(self, q: Any, k: Any, v: Any, mask: Any = None) -> Any:
        """``attention`` as an explicit op pair: returns a
        ``SavedAttention`` (its ``output`` is the
        attention's output) for ``attention_bwd``.

        The fused op SDPA picks for these inputs (cuDNN or flash) is called directly, so
        the backward needs neither the autograd engine nor its thread: it captures in a
        CUDA graph and costs one dispatch (see ``kareus.exec.kernels._attention``).
        The backend is pinned per input signature (shapes, strides, dtype, device) at
        its first call. With a ``mask`` (see ``attention``; a ``DocumentMask`` too) the
        backward goes through autograd.
        """
        if mask is not None:
            return attention_forward(q, k, v, backend="masked",
                                     fallback=lambda q, k, v: self.attention(q, k, v, mask))
        sig = (tuple(q.shape), tuple(k.shape), tuple(q.stride()), tuple(k.stride()),
               tuple(v.stride()), str(q.dtype), str(q.device))
        cache = self.__dict__.setdefault("_attention_backends", {})
        backend = cache.get(sig)
        if backend is None:
            backend = cache[sig] = (self.attention_backend(q, k, v)
                                    if q.device.type == "cuda" else "math")
        return attention_forward(q, k, v, backend=backend, fallback=self.attention)

    def attention_bwd(self, do: Any, saved: Any) -> tuple[Any, Any, Any]:
        """``(dq, dk, dv)`` of an ``attention_fwd`` for the output gradient ``do``
        (repeatable: the saved state is kept)."""
        return attention_backward(do, saved)

    def attention_backend(self, q: Any, k: Any, v: Any) -> str:
        """Name of the SDPA backend ``attention`` runs for these inputs."""
        import torch

        with self._sdpa_context():
            try:
                idx = torch._fused_sdp_choice(q, k, v, is_causal=True,
                                              enable_gqa=q.shape[1] != k.shape[1])
            except (AttributeError, RuntimeError, TypeError):
                return "unknown"
        from torch.nn.attention import SDPBackend

        for name in ("ERROR", "MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION",
                     "CUDNN_ATTENTION", "OVERRIDEABLE"):
            member = getattr(SDPBackend, name, None)
            if member is not None and int(member) == int(idx):
                return name.lower()
        return f"backend {idx}"

    def _sdpa_context(self) -> Any:
        import contextlib

        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError:  # PyTorch < 2.3
            return contextlib.nullcontext()
        names = [n for n in self.sdpa_backends if hasattr(SDPBackend, n)] + ["MATH"]
        backends = [getattr(SDPBackend, n) for n in dict.fromkeys(names)]
        try:
            return sdpa_kernel(backends, set_priority=True)
        except TypeError:  # PyTorch < 2.6: no priority order
            return sdpa_kernel(backends)

    def matmul(self, a: Any, b: Any, *, out: Any = None, accumulate: bool = False) -> Any:
        """``a @ b`` on cuBLAS, into ``out`` when given; ``accumulate=True`` adds it to
        ``out`` in place (one GEMM with beta=1). Transposed operands are passed as views:
        cuBLAS takes the layout."""
        import torch

        if accumulate:
            if out is None:
                raise ArgumentError("accumulate=True needs out= (the tensor to add into)")
            return out.addmm_(a, b)
        return torch.matmul(a, b, out=out) if out is not None else torch.matmul(a, b)


    # -------------------------------------------------------------- mixture of experts
    # The MoE block's ops (``kareus.exec.kernels._moe`` explains each and the data flow
    # between them and the all-to-alls); plain torch by default, in every set.

    def router(self, x: Any, w: Any, *, dtype: Any = "float32") -> Any:
        """Router logits ``x @ w`` (``[t, h] @ [h, E]``) in the router dtype ``dtype`` (its
        name, ``MoEArch.router_dtype``, or a torch dtype)."""
        return _moe.router(x, w, dtype=dtype)

    def router_topk(self, logits: Any, k: int) -> tuple[Any, Any]:
        """``(probs, indices)`` ``[t, k]``: the top-``k`` experts and the softmax over
        their logits (Megatron-Core's default; Qwen3 MoE's and Mixtral's renormalised
        softmax-then-top-k, equal in exact arithmetic)."""
        return _moe.router_topk(logits, k)

    def router_topk_bwd(self, dprobs: Any, probs: Any, indices: Any, experts: int) -> Any:
        """``dlogits`` ``[t, E]`` of ``router_topk``."""
        return _moe.router_topk_bwd(dprobs, probs, indices, experts)

    def router_dgrad(self, dlogits: Any, w: Any, *, dtype: Any = None) -> Any:
        """``dlogits @ w^T`` in the router dtype, cast to ``dtype`` (a torch dtype)."""
        return _moe.router_dgrad(dlogits, w, dtype=dtype)

    def router_wgrad(self, x: Any, dlogits: Any) -> Any:
        """``x^T @ dlogits`` ``[h, E]`` in the router dtype."""
        return _moe.router_wgrad(x, dlogits)

    def permute(self, x: Any, indices: Any, *, experts: int, ep: int = 1,
                out: Any = None) -> tuple[Any, Any]:
        """``(rows [t k, h], TokenPermutation)``: each token once per chosen expert, by
        global expert (= destination EP rank, then local expert), then token; into
        ``out`` when given."""
        return _moe.permute(x, indices, experts=experts, ep=ep, out=out)

    def permute_bwd(self, drows: Any, perm: Any) -> Any:
        """``dx`` ``[t, h]``: each token's row gradients summed (top-k order)."""
        return _moe.permute_bwd(drows, perm)

    def expert_sort(self, rows: Any, counts: Any, *, out: Any = None) -> Any:
        """Received rows from (source rank, local expert) to (local expert, source rank)
        order; ``counts`` ``[ep, L]`` rows per chunk; into ``out`` when given."""
        return _moe.expert_sort(rows, counts, out=out)

    def expert_unsort(self, rows: Any, counts: Any, *, out: Any = None) -> Any:
        """The inverse of ``expert_sort``; into ``out`` when given."""
        return _moe.expert_unsort(rows, counts, out=out)

    def expert_sort_bwd(self, drows: Any, counts: Any, *, out: Any = None) -> Any:
        """The gradient of ``expert_sort``: ``expert_unsort`` of the gradient."""
        return self.expert_unsort(drows, counts, out=out)

    def expert_unsort_bwd(self, drows: Any, counts: Any, *, out: Any = None) -> Any:
        """The gradient of ``expert_unsort``: ``expert_sort`` of the gradient."""
        return self.expert_sort(drows, counts, out=out)

    def grouped_mm(self, x: Any, w: Any, counts: Any, *, out: Any = None) -> Any:
        """``[r, in] x [G, in, out] -> [r, out]``, each group's rows by its weight
        (``counts``: rows per group, host ints or a tensor, or a ``[ep, G]`` table);
        the data gradient is ``grouped_mm(dy, w.transpose(1, 2), counts)``; into ``out``
        when given."""
        return _moe.grouped_mm(x, w, counts, path=self.grouped_gemm, out=out)

    def grouped_mm_path(self, x: Any, w: Any) -> str:
        """``"grouped_mm"`` or ``"loop"``: how ``grouped_mm(x, w, ...)`` runs (its counts:
        a device tensor for the first, host ints for the loop, keep each free of host
        round trips)."""
        return _moe.grouped_mm_path(x, w, self.grouped_gemm)

    def grouped_mm_wgrad(self, x: Any, dy: Any, counts: Any) -> Any:
        """Each group's ``x_g^T dy_g``: ``[G, in, out]`` (zero for a group without rows)."""
        return _moe.grouped_mm_wgrad(x, dy, counts, path=self.grouped_gemm)

    def expert_swiglu(self, h: Any) -> Any:
        """``silu(gate) * up`` of the fused gate/up output ``[r, 2 fe]`` (gate first)."""
        return _moe.expert_swiglu(self, h)

    def expert_swiglu_bwd(self, da: Any, h: Any) -> Any:
        """``dh`` ``[r, 2 fe]`` of ``expert_swiglu``."""
        return _moe.expert_swiglu_bwd(self, da, h)

    def unpermute(self, rows: Any, probs: Any, perm: Any, *, shared: Any = None) -> Any:
        """``[t, h]``: each token's rows weighted by its probabilities and summed (top-k
        order, float32 or wider, rounded once), plus ``shared``."""
        return _moe.unpermute(rows, probs, perm, shared=shared)

    def unpermute_bwd(self, dout: Any, rows: Any, probs: Any, perm: Any, *,
                      out: Any = None) -> tuple[Any, Any]:
        """``(drows [t k, h], dprobs [t, k])`` of ``unpermute``; ``drows`` into ``out``
        when given."""
        return _moe.unpermute_bwd(dout, rows, probs, perm, out=out)

    def kernel_names(self) -> dict[str, str]:
        """Which kernel each op gets, for reports (attention: see ``attention_backend``)."""
        grouped = {"auto": "torch._grouped_mm on CUDA sm90+ bf16, else a torch.matmul loop",
                   "grouped_mm": "torch._grouped_mm",
                   "loop": "torch.matmul loop (one GEMM per expert)"}.get(
                       self.grouped_gemm, self.grouped_gemm)
        return {"attention": "sdpa(" + " > ".join(b.lower() for b in self.sdpa_backends) + ")",
                "matmul": "cublas (torch.matmul; addmm_ to accumulate)",
                "grouped_mm": grouped, "grouped_mm_wgrad": grouped,
                "expert_swiglu": "this set's swiglu on the gate/up halves",
                "expert_swiglu_bwd": "this set's swiglu_bwd, gate/up packed",
                **{op: "torch formula (moe)" for op in MOE_OPS
                   if op not in ("grouped_mm", "grouped_mm_wgrad", "expert_swiglu",
                                 "expert_swiglu_bwd")}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def rms_norm_weight_grad(dy: Any, x: Any, eps: float = 1e-5) -> Any:
    """``dw`` of ``rms_norm`` (float32), for kernel sets whose ``rms_norm_bwd`` returns
    ``dw=None``: the sum over rows of ``dy`` times the normalised rows, rounded to x's
    dtype as the forward rounds them."""
    import torch

    xf = x.float()
    xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (dy.float() * xhat.to(x.dtype).float()).sum(0)


def _sdpa(q: Any, k: Any, v: Any, mask: Any = None) -> Any:
    import torch

    sdpa = torch.nn.functional.scaled_dot_product_attention
    how: dict[str, Any] = {"is_causal": True} if mask is None else {"attn_mask": mask}
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        try:
            return sdpa(q, k, v, enable_gqa=True, **how)
        except TypeError:  # PyTorch < 2.5: no enable_gqa
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
    return sdpa(q, k, v, **how)


class ReferenceKernels(KernelSet):
    """The eager formulas the runnable partitions ran before the fused kernels.

    Several kernels per op (RMSNorm backward in float32: about ten; RoPE: a
    ``rotate_half`` with ``torch.cat`` per tensor; SwiGLU backward: six), no weight
    gradient in the RMSNorm backward; ``up_dgrad`` accumulates into ``gate_dgrad``'s
    result as in every set. Kept to measure what fused kernels change (on one H200:
    RMSNorm backward 20x, RoPE 15-21x, SwiGLU backward 5x their roofline; docs/kernels.md);
    do not profile with it.
    """

    name = "reference"
    grouped_gemm = "loop"  # one GEMM per expert, in any dtype (float64 too)
    # Attention on the same SDPA backends as the other sets, so that this set differs in
    # the elementwise formulas only. (PyTorch's default dispatch depends on the process's
    # earlier backend choices: on one H200 it ran flash, or for qwen3-1.7b CP=2's 2048
    # queries over 4096 keys the math backend at 3.5 ms; bench/results/op_roofline_h200.json,
    # candidate "reference".)

    def rms_norm(self, x: Any, w: Any, eps: float = 1e-5) -> Any:
        import torch

        fn = getattr(torch.nn.functional, "rms_norm", None)
        if fn is not None:
            return fn(x, (x.shape[-1],), w, eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    def rms_norm_bwd(self, dy: Any, x: Any, w: Any, eps: float = 1e-5) -> tuple[Any, Any]:
        import torch

        xf, g = x.float(), (dy * w).float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        dot = (g * xf).mean(-1, keepdim=True)
        return (r * g - xf * r.pow(3) * dot).to(x.dtype), None

    @staticmethod
    def _rotate(x: Any, cos: Any, sin: Any) -> Any:
        import torch

        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def rope(self, qkv: Any, cos: Any, sin: Any, *, heads: int,
             kv_heads: int) -> tuple[Any, Any]:
        q, k, _ = _split_qkv(qkv, cos.shape[0], heads, kv_heads, cos.shape[1])
        c, s = cos[:, None, :], sin[:, None, :]
        return self._rotate(q, c, s), self._rotate(k, c, s)

    def rope_bwd(self, dq: Any, dk: Any, dv: Any, cos: Any, sin: Any) -> Any:
        import torch

        # RoPE is a rotation: its backward rotates back (sin -> -sin).
        c, s = cos[:, None, :], sin[:, None, :]
        dq, dk = self._rotate(dq, c, -s), self._rotate(dk, c, -s)
        return torch.cat((dq, dk, dv), dim=2).reshape(dq.shape[0] * dq.shape[1], -1)

    def swiglu(self, g: Any, u: Any) -> Any:
        import torch

        return torch.nn.functional.silu(g) * u

    def swiglu_bwd(self, da: Any, g: Any, u: Any) -> tuple[Any, Any]:
        import torch

        s = torch.sigmoid(g)
        silu = g * s
        return da * u * s * (1 + g * (1 - s)), da * silu

    def kernel_names(self) -> dict[str, str]:
        names = super().kernel_names()
        names.update({op: "eager torch formula" for op in OPS[:6]})
        return names


class TorchKernels(KernelSet):
    """The best plain-torch path: runs wherever torch does (the CPU too).

    RMSNorm forward and backward are PyTorch's fused kernels
    (``torch.nn.functional.rms_norm``; ``aten._fused_rms_norm_backward`` where it
    exists, which also gives ``dw``). RoPE and SwiGLU are written as one formula each,
    computed in float32 and rounded once; eager torch still launches a kernel per
    elementwise step, so on a GPU prefer ``"triton"``.
    """

    name = "torch"

    def rms_norm(self, x: Any, w: Any, eps: float = 1e-5) -> Any:
        import torch

        fused = getattr(torch.ops.aten, "_fused_rms_norm", None)
        if fused is not None:
            return fused(x, [x.shape[-1]], w, eps)[0]
        return ReferenceKernels().rms_norm(x, w, eps)

    def rms_norm_bwd(self, dy: Any, x: Any, w: Any, eps: float = 1e-5) -> tuple[Any, Any]:
        import torch

        fwd = getattr(torch.ops.aten, "_fused_rms_norm", None)
        bwd = getattr(torch.ops.aten, "_fused_rms_norm_backward", None)
        if fwd is not None and bwd is not None and x.device.type == "cuda":
            # The forward's per-row 1/rms (what autograd saves); recomputed here so the
            # op needs only x, as every kernel set's does.
            xf = x.float()
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            dx, dw = bwd(dy, x, [x.shape[-1]], rstd, w, [True, True])
            return dx, dw
        xf, dyf, wf = x.float(), dy.float(), w.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        xhat = xf * r
        g = dyf * wf
        dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        return dx.to(x.dtype), (dyf * xhat).sum(0).to(w.dtype)

    @staticmethod
    def _rotate(x: Any, cos: Any, sin: Any, sign: float) -> Any:
        import torch

        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos.float().chunk(2, dim=-1)[0], sign * sin.float().chunk(2, dim=-1)[0]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    def rope(self, qkv: Any, cos: Any, sin: Any, *, heads: int,
             kv_heads: int) -> tuple[Any, Any]:
        q, k, _ = _split_qkv(qkv, cos.shape[0], heads, kv_heads, cos.shape[1])
        c, s = cos[:, None, :], sin[:, None, :]
        return self._rotate(q, c, s, 1.0), self._rotate(k, c, s, 1.0)

    def rope_bwd(self, dq: Any, dk: Any, dv: Any, cos: Any, sin: Any) -> Any:
        import torch

        c, s = cos[:, None, :], sin[:, None, :]
        b, sq = dq.shape[0], dq.shape[1]
        out = torch.empty(b, sq, dq.shape[2] + dk.shape[2] + dv.shape[2], dq.shape[3],
                          dtype=dq.dtype, device=dq.device)
        nq, nk = dq.shape[2], dk.shape[2]
        out[:, :, :nq] = self._rotate(dq, c, s, -1.0)
        out[:, :, nq:nq + nk] = self._rotate(dk, c, s, -1.0)
        out[:, :, nq + nk:] = dv
        return out.view(b * sq, -1)

    def swiglu(self, g: Any, u: Any) -> Any:
        import torch

        gf = g.float()
        return (torch.nn.functional.silu(gf) * u.float()).to(g.dtype)

    def swiglu_bwd(self, da: Any, g: Any, u: Any) -> tuple[Any, Any]:
        import torch

        gf, uf, daf = g.float(), u.float(), da.float()
        s = torch.sigmoid(gf)
        dg = daf * uf * s * (1 + gf * (1 - s))
        return dg.to(g.dtype), (daf * gf * s).to(u.dtype)

    def kernel_names(self) -> dict[str, str]:
        names = super().kernel_names()
        names.update({
            "rms_norm": "torch fused rms_norm (aten._fused_rms_norm)",
            "rms_norm_bwd": "torch fused rms_norm backward (aten._fused_rms_norm_backward)",
            "rope": "torch formula (float32)", "rope_bwd": "torch formula (float32)",
            "swiglu": "torch formula (float32)", "swiglu_bwd": "torch formula (float32)",
        })
        return names

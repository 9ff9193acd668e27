"""The fused kernel set: kareus's own Triton kernels, launched lean.

======================  ====================================================================
op                      kernel
======================  ====================================================================
``rms_norm``            kareus's ``_rms_norm_fwd_kernel`` (liger-kernel's
                        ``LigerRMSNormFunction``, Llama casting, with ``use_liger=True``)
``rms_norm_bwd``        kareus's ``_rms_norm_bwd_kernel`` (dx and dw in one pass)
``add_rms_norm``        kareus's ``_add_rms_norm_fwd_kernel`` (residual sum and norm, one
                        pass)
``rms_norm_bwd_add``    ``_rms_norm_bwd_kernel`` adding the residual's gradient, the dw sum
                        accumulated into the gradient buffer
``rope``                kareus's ``_rope_heads_kernel``: q and k in one launch on a 3-D grid,
                        read in place from the packed QKV
``rope_bwd``            the same kernel: dq and dk rotated back and dv copied, into dQKV
``swiglu``              kareus's ``_swiglu_fwd_kernel`` (liger-kernel's
                        ``LigerSiLUMulFunction`` with ``use_liger=True``)
``swiglu_bwd``          kareus's ``_swiglu_bwd_kernel``
``attention``           SDPA: cuDNN, then flash, then memory-efficient
``matmul``              cuBLAS
======================  ====================================================================

``kareus.exec.kernels._triton`` says why the backward kernels and RoPE are kareus's
own, and how their launches are kept lean (``lean=False`` launches through Triton's own
dispatch on every call instead).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from kareus.exec.kernels.base import KernelSet

__all__ = ["TritonKernels", "liger_version"]


def liger_version() -> str | None:
    """The installed liger-kernel's version, or ``None``."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("liger-kernel")
    except PackageNotFoundError:
        return "unknown"


class TritonKernels(KernelSet):
    """Fused Triton kernels for every elementwise op (needs CUDA and Triton).

    Args:
        use_liger: Use liger-kernel's RMSNorm and SwiGLU forward kernels (default: no,
            kareus's own). liger-kernel is a well-kept library and its kernels are as fast
            on the GPU, but eager training pays its Python launch path on every call: on
            one H200 host 61-117 us per RMSNorm forward and 50-73 us per SwiGLU forward at
            the presets' shapes, against a GPU time of 8-21 us (``bench/launch_cost.py``
            measures both side by side). kareus's lean launches aim at 15 us or less.
        lean: Launch kareus's kernels through their cached compiled launchers (the
            default); ``False`` goes through Triton's dispatch on every call (the plain
            path, for comparison).
    """

    name = "triton"

    def __init__(self, *, use_liger: bool | None = None, lean: bool = True) -> None:
        if use_liger and liger_version() is None:
            raise ImportError("use_liger=True but liger-kernel is not installed; "
                              "pip install 'kareus[kernels]'")
        self.use_liger = bool(use_liger)
        self.lean = bool(lean)
        from kareus.exec.kernels import _triton  # imports triton

        self._k = _triton

    def rms_norm(self, x: Any, w: Any, eps: float = 1e-5) -> Any:
        if self.use_liger:
            import torch
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            with torch.no_grad():  # the op's value; autograd.py wraps the backward
                return LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
        return self._k.rms_norm_fwd(x, w, eps, lean=self.lean)

    def rms_norm_bwd(self, dy: Any, x: Any, w: Any, eps: float = 1e-5) -> tuple[Any, Any]:
        return self._k.rms_norm_bwd(dy, x, w, eps, lean=self.lean)

    def add_rms_norm(self, x: Any, r: Any, w: Any, eps: float = 1e-5) -> tuple[Any, Any]:
        if self.use_liger:
            return super().add_rms_norm(x, r, w, eps)
        return self._k.add_rms_norm_fwd(x, r, w, eps, lean=self.lean)  # type: ignore[no-any-return]

    def rms_norm_bwd_add(self, dy: Any, x: Any, w: Any, dres: Any, dw_out: Any,
                         eps: float = 1e-5) -> Any:
        if dw_out.dtype != w.dtype or dw_out.shape != w.shape or not dw_out.is_contiguous():
            # e.g. a framework's float32 main_grad: rounded through w's dtype as the
            # separate ops round it
            return super().rms_norm_bwd_add(dy, x, w, dres, dw_out, eps)
        return self._k.rms_norm_bwd_add(dy, x, w, dres, dw_out, eps, lean=self.lean)

    def rope(self, qkv: Any, cos: Any, sin: Any, *, heads: int,
             kv_heads: int) -> tuple[Any, Any]:
        return self._k.rope_qkv(qkv, cos, sin, heads=heads, kv_heads=kv_heads, lean=self.lean)

    def rope_bwd(self, dq: Any, dk: Any, dv: Any, cos: Any, sin: Any) -> Any:
        return self._k.rope_bwd(dq, dk, dv, cos, sin, lean=self.lean)

    def qk_norm_rope(self, qkv: Any, wq: Any, wk: Any, cos: Any, sin: Any, *, heads: int,
                     kv_heads: int, eps: float = 1e-6) -> tuple[Any, Any]:
        from kareus.exec.kernels import _triton_head_norm

        return _triton_head_norm.qk_norm_rope_fwd(qkv, wq, wk, cos, sin, heads=heads,
                                                  kv_heads=kv_heads, eps=eps)

    def qk_norm_rope_bwd(self, dq: Any, dk: Any, dv: Any, qkv: Any, wq: Any, wk: Any,
                         cos: Any, sin: Any, *, eps: float = 1e-6) -> tuple[Any, Any, Any]:
        from kareus.exec.kernels import _triton_head_norm

        return _triton_head_norm.qk_norm_rope_bwd(dq, dk, dv, qkv, wq, wk, cos, sin, eps=eps)

    def swiglu(self, g: Any, u: Any) -> Any:
        if self.use_liger:
            import torch
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            with torch.no_grad():
                return LigerSiLUMulFunction.apply(g, u)
        return self._k.swiglu_fwd(g, u, lean=self.lean)

    def swiglu_bwd(self, da: Any, g: Any, u: Any) -> tuple[Any, Any]:
        return self._k.swiglu_bwd(da, g, u, lean=self.lean)

    def kernel_names(self) -> dict[str, str]:
        names = super().kernel_names()
        lig = f"liger-kernel {liger_version()}" if self.use_liger else None
        how = "" if self.lean else ", plain launch"
        names.update({
            "rms_norm": f"{lig} LigerRMSNormFunction" if lig
            else f"kareus triton _rms_norm_fwd_kernel{how}",
            "rms_norm_bwd": f"kareus triton _rms_norm_bwd_kernel{how}",
            "add_rms_norm": f"{lig} LigerRMSNormFunction after a torch add" if lig
            else f"kareus triton _add_rms_norm_fwd_kernel{how}",
            "rms_norm_bwd_add": f"kareus triton _rms_norm_bwd_kernel with the residual "
                                f"gradient, dw accumulated in place{how}",
            "rope": f"kareus triton _rope_heads_kernel (q and k, one launch{how})",
            "rope_bwd": f"kareus triton _rope_heads_kernel (dq, dk, dv into dqkv, one "
                        f"launch{how})",
            "swiglu": f"{lig} LigerSiLUMulFunction" if lig
            else f"kareus triton _swiglu_fwd_kernel{how}",
            "swiglu_bwd": f"kareus triton _swiglu_bwd_kernel{how}",
            "qk_norm_rope": "kareus triton _norm_rope_fwd_kernel (per-head q/k RMSNorm and "
                            "RoPE, one launch, plain launch)",
            "qk_norm_rope_bwd": "kareus triton _norm_rope_bwd_kernel (dq, dk back through "
                                "RoPE and the norms, dv copied; one launch and a reduction "
                                "of the weights' partial gradients, plain launch)",
        })
        return names

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, use_liger={self.use_liger}, "
                f"lean={self.lean})")

"""The fused kernel set: Triton kernels, liger-kernel's where they fit.

=================  ====================================================================
op                 kernel
=================  ====================================================================
``rms_norm``       liger-kernel ``LigerRMSNormFunction`` (Llama casting) when installed,
                   else kareus's ``_rms_norm_fwd_kernel``
``rms_norm_bwd``   kareus's ``_rms_norm_bwd_kernel`` (dx and dw in one pass)
``rope``           kareus's ``_rope_heads_kernel``: q and k in one launch on a 3-D grid,
                   read in place from the packed QKV
``rope_bwd``       the same kernel: dq and dk rotated back and dv copied, into dQKV
``swiglu``         liger-kernel ``LigerSiLUMulFunction`` when installed, else kareus's
                   ``_swiglu_fwd_kernel``
``swiglu_bwd``     kareus's ``_swiglu_bwd_kernel``
``attention``      SDPA: cuDNN, then flash, then memory-efficient
``matmul``         cuBLAS
=================  ====================================================================

:mod:`kareus.exec.kernels._triton` says why the backward kernels and RoPE are kareus's
own. Set ``use_liger=False`` to run kareus's kernels for every op.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from kareus.exec.kernels.base import KernelSet, _split_qkv

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
        use_liger: Use liger-kernel's RMSNorm and SwiGLU forward kernels (default: when
            installed).
    """

    name = "triton"

    def __init__(self, *, use_liger: bool | None = None) -> None:
        have = liger_version() is not None
        if use_liger and not have:
            raise ImportError("use_liger=True but liger-kernel is not installed; "
                              "pip install 'kareus[kernels]'")
        self.use_liger = have if use_liger is None else bool(use_liger)
        from kareus.exec.kernels import _triton  # imports triton

        self._k = _triton

    def rms_norm(self, x: Any, w: Any, eps: float = 1e-5) -> Any:
        if self.use_liger:
            import torch
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            with torch.no_grad():  # the op's value; autograd.py wraps the backward
                return LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
        return self._k.rms_norm_fwd(x, w, eps)

    def rms_norm_bwd(self, dy: Any, x: Any, w: Any, eps: float = 1e-5) -> tuple[Any, Any]:
        return self._k.rms_norm_bwd(dy, x, w, eps)

    def rope(self, qkv: Any, cos: Any, sin: Any, *, heads: int,
             kv_heads: int) -> tuple[Any, Any]:
        q, k, _ = _split_qkv(qkv, cos.shape[0], heads, kv_heads, cos.shape[1])
        return self._k.rope_fwd(q, k, cos, sin)

    def rope_bwd(self, dq: Any, dk: Any, dv: Any, cos: Any, sin: Any) -> Any:
        return self._k.rope_bwd(dq, dk, dv, cos, sin)

    def swiglu(self, g: Any, u: Any) -> Any:
        if self.use_liger:
            import torch
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            with torch.no_grad():
                return LigerSiLUMulFunction.apply(g, u)
        return self._k.swiglu_fwd(g, u)

    def swiglu_bwd(self, da: Any, g: Any, u: Any) -> tuple[Any, Any]:
        return self._k.swiglu_bwd(da, g, u)

    def kernel_names(self) -> dict[str, str]:
        names = super().kernel_names()
        lig = f"liger-kernel {liger_version()}" if self.use_liger else None
        names.update({
            "rms_norm": f"{lig} LigerRMSNormFunction" if lig
            else "kareus triton _rms_norm_fwd_kernel",
            "rms_norm_bwd": "kareus triton _rms_norm_bwd_kernel",
            "rope": "kareus triton _rope_heads_kernel (q and k, one launch)",
            "rope_bwd": "kareus triton _rope_heads_kernel (dq, dk, dv into dqkv, one launch)",
            "swiglu": f"{lig} LigerSiLUMulFunction" if lig
            else "kareus triton _swiglu_fwd_kernel",
            "swiglu_bwd": "kareus triton _swiglu_bwd_kernel",
        })
        return names

"""The kernel sets' conformance suite (kareus.testing.kernels): the torch and reference
sets pass it in float32 and bf16 on the CPU, and it catches a set that gets an op wrong,
fuses the residual norms wrong, or modifies an input."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kareus.exec.kernels import ReferenceKernels, TorchKernels
from kareus.testing import KernelSetConformance, check_kernels


class TestTorchKernelsConformance(KernelSetConformance):
    def make_kernels(self):
        return TorchKernels()


class TestReferenceKernelsConformanceBF16(KernelSetConformance):
    dtype = "bfloat16"

    def make_kernels(self):
        return ReferenceKernels()


class NormOfTheWrongTensor(TorchKernels):
    name = "wrong-fused-norm"

    def add_rms_norm(self, x, r, w, eps=1e-5):
        return x + r, self.rms_norm(x, w, eps)  # the norm of x, not of the sum


class ForgetsTheWeightGradient(TorchKernels):
    name = "no-dw-accumulation"

    def rms_norm_bwd_add(self, dy, x, w, dres, dw_out, eps=1e-5):
        dx, _ = self.rms_norm_bwd(dy, x, w, eps)
        return dres + dx


class SwigluInPlace(TorchKernels):
    name = "in-place"

    def swiglu(self, g, u):
        return g.mul_(torch.sigmoid(g)).mul_(u)


class WrongRope(TorchKernels):
    name = "wrong-rope"

    def rope_bwd(self, dq, dk, dv, cos, sin):  # rotates forward again
        return ReferenceKernels().rope_bwd(dq, dk, dv, cos, -sin)


@pytest.mark.parametrize("ks,check,what", [
    (NormOfTheWrongTensor(), "residual_norms", "add_rms_norm norm"),
    (ForgetsTheWeightGradient(), "residual_norms", "dw accumulated"),
    (SwigluInPlace(), "swiglu", "modified its input"),
    (WrongRope(), "rope", "rope_bwd"),
])
def test_the_suite_names_what_a_wrong_set_gets_wrong(ks, check, what):
    with pytest.raises(AssertionError, match=what) as err:
        check_kernels(ks)
    assert repr(check) in str(err.value)


def test_skipping_a_check():
    check_kernels(NormOfTheWrongTensor(), skip=("residual_norms",))

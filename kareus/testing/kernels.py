"""The conformance suite of kernel sets (``kareus.exec.kernels.KernelSet``).

A kernel set is what the training loop, the planned layers of ``kareus.integrations`` and
the runnable partitions run each op of a decoder layer on; a set of your own (registered
with ``register_kernels``) must compute what the default ones compute. Each check here
runs the set's op on small inputs and compares it with a float64 evaluation of the op's
formula (autograd of it for the backward ops):

* ``rms_norm`` / ``rms_norm_bwd`` (Llama's RMSNorm; ``dw`` may be ``None``),
* ``add_rms_norm`` / ``rms_norm_bwd_add`` (the residual additions around a norm: the sum
  and the norm of the sum; the backward plus the residual gradient, ``dw`` accumulated
  into the buffer given; a set that fuses them must agree with the separate ops),
* ``rope`` / ``rope_bwd`` (rotate-half RoPE of q and k read from the packed QKV, and its
  backward packing dq, dk, dv),
* ``qk_norm_rope`` / ``qk_norm_rope_bwd`` (per-head RMSNorm of the queries and keys, then
  RoPE, as Qwen3's attention input; the backward's packed dQKV and the two norm weights'
  gradients),
* ``swiglu`` / ``swiglu_bwd``,
* ``attention`` (causal, grouped K/V) and ``attention_fwd`` / ``attention_bwd``,
* ``matmul`` (into ``out=``, and accumulating with ``accumulate=True``);

and every check also requires the op to leave its inputs as they were (a runnable
partition runs an op again and again on the same inputs). Tolerances follow the dtype
(``rtol`` default: 1e-4 in float32, 2e-2 in bfloat16: relative norm of the error).

Run it as ``check_kernels(ks)`` or subclass ``KernelSetConformance`` in a ``Test*``
class. Needs torch (imported by the checks); runs on the CPU by default
(``device="cuda"`` for a GPU set).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kareus.testing._suite import _add_tests, _run_checks

__all__ = ["KERNEL_CHECKS", "KernelSetConformance", "check_kernels"]


class _Case:
    """Inputs of one run of the checks: device, dtype, tolerance and a seeded generator."""

    def __init__(self, device: str, dtype: str, rtol: float | None) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.rtol = rtol if rtol is not None else (1e-4 if self.dtype == torch.float32
                                                    else 2e-2)
        self.gen = torch.Generator().manual_seed(0)

    def rnd(self, *shape: int, scale: float = 1.0) -> Any:
        t = self.torch.randn(*shape, generator=self.gen, dtype=self.torch.float64) * scale
        return t.to(device=self.device, dtype=self.dtype)

    def close(self, what: str, got: Any, want: Any, rtol: float | None = None) -> None:
        assert got is not None, f"{what}: None"
        assert tuple(got.shape) == tuple(want.shape), \
            f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        got, want = got.detach(), want.detach()
        err = float((got.double().cpu() - want.double().cpu()).norm()
                    / max(float(want.double().norm()), 1e-30))
        tol = self.rtol if rtol is None else rtol
        assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def _unchanged(what: str, before: list[Any], after: list[Any]) -> None:
    for i, (b, a) in enumerate(zip(before, after)):
        assert bool((b == a).all()), f"{what} modified its input {i}"


def _norm64(x: Any, w: Any, eps: float = 1e-5) -> Any:
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w


def _check_rms_norm(ks: Any, c: _Case) -> None:
    x, w, dy = c.rnd(37, 96), 1 + c.rnd(96, scale=0.1), c.rnd(37, 96)
    keep = [x.clone(), w.clone(), dy.clone()]
    xd, wd = x.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    y = _norm64(xd, wd)
    y.backward(dy.double().cpu())
    c.close("rms_norm", ks.rms_norm(x, w), y.detach())
    _unchanged("rms_norm", keep[:2], [x, w])
    dx, dw = ks.rms_norm_bwd(dy, x, w)
    c.close("rms_norm_bwd dx", dx, xd.grad)
    if dw is not None:
        c.close("rms_norm_bwd dw", dw, wd.grad)
    _unchanged("rms_norm / rms_norm_bwd", keep, [x, w, dy])


def _check_residual_norms(ks: Any, c: _Case) -> None:
    x, r, w = c.rnd(37, 96), c.rnd(37, 96), 1 + c.rnd(96, scale=0.1)
    dy, dres, g0 = c.rnd(37, 96), c.rnd(37, 96), c.rnd(96, scale=0.1)
    keep = [x.clone(), r.clone(), w.clone(), dy.clone(), dres.clone()]
    s, y = ks.add_rms_norm(x, r, w)
    _unchanged("add_rms_norm", keep[:3], [x, r, w])
    c.close("add_rms_norm sum", s, x.double().cpu() + r.double().cpu())
    c.close("add_rms_norm norm", y, _norm64(s.double().cpu(), w.double().cpu()))
    xd, wd = s.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    _norm64(xd, wd).backward(dy.double().cpu())
    acc = g0.clone()
    out = ks.rms_norm_bwd_add(dy, s, w, dres, acc)
    c.close("rms_norm_bwd_add (dres + dx)", out, dres.double().cpu() + xd.grad)
    c.close("rms_norm_bwd_add (dw accumulated)", acc - g0, wd.grad,
            rtol=max(c.rtol, 2 * float(g0.double().norm() / wd.grad.norm()) * c.rtol))
    _unchanged("add_rms_norm / rms_norm_bwd_add", keep, [x, r, w, dy, dres])


def _cos_sin(c: _Case, seq: int, hd: int) -> tuple[Any, Any]:
    torch = c.torch
    inv = 1.0 / 10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    ang = torch.cat((ang, ang), -1)
    return (ang.cos().to(device=c.device, dtype=c.dtype),
            ang.sin().to(device=c.device, dtype=c.dtype))


def _rotate64(x: Any, cos: Any, sin: Any) -> Any:
    import torch

    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _check_rope(ks: Any, c: _Case) -> None:
    b, s, h, kvh, hd = 2, 6, 4, 2, 16
    qkv = c.rnd(b * s, (h + 2 * kvh) * hd)
    cos, sin = _cos_sin(c, s, hd)
    keep = [qkv.clone(), cos.clone(), sin.clone()]
    q, k = ks.rope(qkv, cos, sin, heads=h, kv_heads=kvh)
    _unchanged("rope", keep, [qkv, cos, sin])
    full = qkv.double().cpu().view(b, s, h + 2 * kvh, hd)
    cd, sd = cos.double().cpu()[None, :, None, :], sin.double().cpu()[None, :, None, :]
    c.close("rope q", q, _rotate64(full[:, :, :h], cd, sd))
    c.close("rope k", k, _rotate64(full[:, :, h:h + kvh], cd, sd))
    dq, dk, dv = c.rnd(b, s, h, hd), c.rnd(b, s, kvh, hd), c.rnd(b, s, kvh, hd)
    kept = [dq.clone(), dk.clone(), dv.clone()]
    d = ks.rope_bwd(dq, dk, dv, cos, sin)
    # the adjoint of the rotation: rotate back, i.e. by -sin
    want = c.torch.cat((_rotate64(dq.double().cpu(), cd, -sd),
                        _rotate64(dk.double().cpu(), cd, -sd), dv.double().cpu()), dim=2)
    c.close("rope_bwd", d, want.reshape(b * s, -1))
    _unchanged("rope / rope_bwd", keep + kept, [qkv, cos, sin, dq, dk, dv])


def _check_qk_norm_rope(ks: Any, c: _Case) -> None:
    b, s, h, kvh, hd, eps = 2, 6, 4, 2, 16, 1e-6
    qkv = c.rnd(b * s, (h + 2 * kvh) * hd, scale=3.0)
    wq, wk = 1 + c.rnd(hd, scale=0.1), 1 + c.rnd(hd, scale=0.1)
    cos, sin = _cos_sin(c, s, hd)
    dq, dk, dv = c.rnd(b, s, h, hd), c.rnd(b, s, kvh, hd), c.rnd(b, s, kvh, hd)
    keep = [t.clone() for t in (qkv, wq, wk, cos, sin, dq, dk, dv)]
    xd = qkv.double().cpu().requires_grad_()
    wqd, wkd = wq.double().cpu().requires_grad_(), wk.double().cpu().requires_grad_()
    full = xd.view(b, s, h + 2 * kvh, hd)
    cd, sd = cos.double().cpu()[None, :, None, :], sin.double().cpu()[None, :, None, :]
    qw = _rotate64(_norm64(full[:, :, :h], wqd, eps), cd, sd)
    kw = _rotate64(_norm64(full[:, :, h:h + kvh], wkd, eps), cd, sd)
    ((qw * dq.double().cpu()).sum() + (kw * dk.double().cpu()).sum()
     + (full[:, :, h + kvh:] * dv.double().cpu()).sum()).backward()
    q, k = ks.qk_norm_rope(qkv, wq, wk, cos, sin, heads=h, kv_heads=kvh, eps=eps)
    c.close("qk_norm_rope q", q, qw.detach())
    c.close("qk_norm_rope k", k, kw.detach())
    dqkv, dwq, dwk = ks.qk_norm_rope_bwd(dq, dk, dv, qkv, wq, wk, cos, sin, eps=eps)
    c.close("qk_norm_rope_bwd dqkv", dqkv, xd.grad)
    c.close("qk_norm_rope_bwd dwq", dwq, wqd.grad)
    c.close("qk_norm_rope_bwd dwk", dwk, wkd.grad)
    _unchanged("qk_norm_rope / qk_norm_rope_bwd", keep, [qkv, wq, wk, cos, sin, dq, dk, dv])


def _check_swiglu(ks: Any, c: _Case) -> None:
    torch = c.torch
    g, u, da = c.rnd(33, 40), c.rnd(33, 40), c.rnd(33, 40)
    keep = [g.clone(), u.clone(), da.clone()]
    gd, ud = g.double().cpu().requires_grad_(), u.double().cpu().requires_grad_()
    a = torch.nn.functional.silu(gd) * ud
    a.backward(da.double().cpu())
    c.close("swiglu", ks.swiglu(g, u), a.detach())
    _unchanged("swiglu", keep[:2], [g, u])
    dg, du = ks.swiglu_bwd(da, g, u)
    c.close("swiglu_bwd dg", dg, gd.grad)
    c.close("swiglu_bwd du", du, ud.grad)
    _unchanged("swiglu / swiglu_bwd", keep, [g, u, da])


def _attention64(q: Any, k: Any, v: Any) -> Any:
    import torch

    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), -1) @ v


def _check_attention(ks: Any, c: _Case) -> None:
    b, h, kvh, s, hd = 2, 4, 2, 8, 16
    q, k, v, do = c.rnd(b, h, s, hd), c.rnd(b, kvh, s, hd), c.rnd(b, kvh, s, hd), \
        c.rnd(b, h, s, hd)
    keep = [q.clone(), k.clone(), v.clone(), do.clone()]
    qd, kd, vd = (t.double().cpu().requires_grad_() for t in (q, k, v))
    o = _attention64(qd, kd, vd)
    o.backward(do.double().cpu())
    c.close("attention", ks.attention(q, k, v), o.detach())
    _unchanged("attention", keep[:3], [q, k, v])
    saved = ks.attention_fwd(q, k, v)
    c.close("attention_fwd output", saved.output, o.detach())
    dq, dk, dv = ks.attention_bwd(do, saved)
    c.close("attention_bwd dq", dq, qd.grad)
    c.close("attention_bwd dk", dk, kd.grad)
    c.close("attention_bwd dv", dv, vd.grad)
    _unchanged("attention", keep, [q, k, v, do])


def _check_matmul(ks: Any, c: _Case) -> None:
    a, b = c.rnd(12, 20), c.rnd(20, 8)
    keep = [a.clone(), b.clone()]
    want = a.double().cpu() @ b.double().cpu()
    c.close("matmul", ks.matmul(a, b), want)
    out = c.torch.empty(12, 8, device=c.device, dtype=c.dtype)
    got = ks.matmul(a, b, out=out)
    c.close("matmul out=", out, want)
    assert got is None or got.data_ptr() == out.data_ptr(), "matmul out= returned another tensor"
    acc = c.rnd(12, 8)
    base = acc.double().cpu()
    ks.matmul(a.t().contiguous().t(), b, out=acc, accumulate=True)
    c.close("matmul accumulate=True", acc, base + want)
    _unchanged("matmul", keep, [a, b])


def _check_kernel_names(ks: Any, c: _Case) -> None:
    names = ks.kernel_names()
    assert isinstance(names, dict) and all(isinstance(v, str) for v in names.values()), \
        "kernel_names() must map op names to strings"
    assert isinstance(ks.name, str) and ks.name, "a kernel set needs a name"


#: name -> check(kernel_set, case).
KERNEL_CHECKS: dict[str, Callable[[Any, _Case], None]] = {
    "rms_norm": _check_rms_norm,
    "residual_norms": _check_residual_norms,
    "rope": _check_rope,
    "qk_norm_rope": _check_qk_norm_rope,
    "swiglu": _check_swiglu,
    "attention": _check_attention,
    "matmul": _check_matmul,
    "kernel_names": _check_kernel_names,
}


def check_kernels(ks: Any, *, device: str = "cpu", dtype: str = "float32",
                  rtol: float | None = None, skip: tuple[str, ...] = ()) -> None:
    """Run every kernel-set conformance check on ``ks``.

    Args:
        ks: The kernel set (a ``kareus.exec.kernels.KernelSet``).
        device: Where the inputs are made (``"cuda"`` for a GPU-only set).
        dtype: The inputs' dtype (``"float32"``, ``"bfloat16"``, ...).
        rtol: Largest relative error (norm of the error over the norm of the float64
            result); default 1e-4 in float32, 2e-2 otherwise.
        skip: Names (keys of ``KERNEL_CHECKS``) to skip.

    Raises:
        AssertionError: naming the first check that fails.
    """
    _run_checks("kernel set", KERNEL_CHECKS, skip, ks, _Case(device, dtype, rtol))


class KernelSetConformance:
    """Mix-in: subclass in a ``Test*`` class and implement
    [`make_kernels`][kareus.testing.KernelSetConformance.make_kernels]; pytest then runs one
    test per check. Set ``device``, ``dtype``, ``rtol`` or ``skip_checks`` to change them."""

    skip_checks: tuple[str, ...] = ()
    device: str = "cpu"
    dtype: str = "float32"
    rtol: float | None = None

    def make_kernels(self) -> Any:
        """The kernel set to check (implement it in the subclass)."""
        raise NotImplementedError("implement make_kernels() to return a KernelSet")


_add_tests(KernelSetConformance, KERNEL_CHECKS,
           lambda self: (self.make_kernels(), _Case(self.device, self.dtype, self.rtol)))

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
* ``matmul`` (into ``out=``, and accumulating with ``accumulate=True``),
* the mixture-of-experts ops (``moe``): ``router`` (in float32), ``router_topk`` (the top-k
  experts and the softmax over their logits) and its backward, ``permute`` (rows by
  expert, then token) and ``permute_bwd``, ``expert_sort`` / ``expert_unsort`` (chunks from
  (source rank, local expert) to (local expert, source rank) order and back),
  ``grouped_mm`` / ``grouped_mm_wgrad`` (uneven groups, an empty one),
  ``expert_swiglu`` and its backward, ``unpermute`` and its backward;

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


def _check_moe(ks: Any, c: _Case) -> None:
    torch = c.torch
    t, h, E, k, fe = 11, 32, 4, 2, 16
    x, wr = c.rnd(t, h), c.rnd(h, E, scale=h ** -0.5)
    keep = [x.clone(), wr.clone()]
    x64, wr64 = x.double().cpu(), wr.double().cpu()
    logits = ks.router(x, wr, dtype="float32")
    assert logits.dtype == torch.float32, "router: logits in the router dtype (float32)"
    c.close("router", logits, x64 @ wr64)
    probs, idx = ks.router_topk(logits, k)
    lg = logits.double().cpu().requires_grad_()
    top, idx64 = torch.topk(lg, k, dim=-1)
    p64 = torch.softmax(top, dim=-1)
    assert torch.equal(idx.cpu(), idx64), "router_topk: not the top-k experts, in order"
    c.close("router_topk probs (softmax over the chosen logits)", probs, p64.detach())
    dp = c.rnd(t, k).float()
    p64.backward(dp.double().cpu())
    c.close("router_topk_bwd", ks.router_topk_bwd(dp, probs, idx, E), lg.grad)
    # permutation: rows by expert, then token (Megatron-Core's order)
    rows, perm = ks.permute(x, idx, experts=E, ep=2)
    order = [i for e in range(E) for i in range(t) if e in idx64[i].tolist()]
    assert perm.token_of_row.cpu().tolist() == order, "permute: rows not by expert, then token"
    assert torch.equal(rows.cpu(), x.cpu()[order]), "permute: rows are not the tokens' copies"
    low = sum(1 for i in range(t) for e in idx64[i].tolist() if e < E // 2)
    assert perm.input_splits() == [low, t * k - low], \
        "permute: rows per destination rank (input_splits)"
    drows = c.rnd(t * k, h)
    dx = torch.zeros(t, h, dtype=torch.float64).index_add_(0, torch.tensor(order),
                                                          drows.double().cpu())
    c.close("permute_bwd", ks.permute_bwd(drows, perm), dx)
    # the received chunks by local expert and back
    table = [[2, 0, 1], [1, 3, 0]]
    recv = c.rnd(7, h)
    starts = [[0, 2, 2], [3, 4, 7]]
    want = [r for e in range(3) for s in range(2)
            for r in range(starts[s][e], starts[s][e] + table[s][e])]
    sorted_rows = ks.expert_sort(recv, table)
    assert torch.equal(sorted_rows.cpu(), recv.cpu()[want]), "expert_sort: wrong order"
    assert torch.equal(ks.expert_unsort(sorted_rows, table).cpu(), recv.cpu()), \
        "expert_unsort: not expert_sort's inverse"
    # grouped SwiGLU experts over uneven groups, one empty
    counts = [5, 0, 6]
    xs, w1, w2 = c.rnd(11, h), c.rnd(3, h, 2 * fe, scale=h ** -0.5), c.rnd(3, fe, h)
    dy = c.rnd(11, h)
    keep_e = [xs.clone(), w1.clone(), w2.clone(), dy.clone()]
    x_d, w1_d, w2_d = (v.double().cpu().requires_grad_() for v in (xs, w1, w2))
    bounds = [(0, 5, 0), (5, 11, 2)]
    h1_d = torch.cat([x_d[a:b] @ w1_d[g] for a, b, g in bounds])
    a_d = torch.nn.functional.silu(h1_d[:, :fe]) * h1_d[:, fe:]
    y_d = torch.cat([a_d[a:b] @ w2_d[g] for a, b, g in bounds])
    y_d.backward(dy.double().cpu())
    h1 = ks.grouped_mm(xs, w1, counts)
    c.close("grouped_mm (gate/up)", h1, h1_d.detach())
    a = ks.expert_swiglu(h1)
    c.close("expert_swiglu", a, a_d.detach())
    c.close("grouped_mm (down)", ks.grouped_mm(a, w2, counts), y_d.detach())
    da = ks.grouped_mm(dy, w2.transpose(1, 2), counts)
    dw2 = ks.grouped_mm_wgrad(a, dy, counts)
    c.close("grouped_mm_wgrad (down)", dw2, w2_d.grad)
    assert float(dw2[1].abs().max()) == 0.0, "grouped_mm_wgrad: an empty group's is not zero"
    dh = ks.expert_swiglu_bwd(da, h1)
    c.close("grouped_mm (data gradient)", ks.grouped_mm(dh, w1.transpose(1, 2), counts),
            x_d.grad)
    c.close("grouped_mm_wgrad (gate/up)", ks.grouped_mm_wgrad(xs, dh, counts), w1_d.grad)
    _unchanged("grouped expert ops", keep_e, [xs, w1, w2, dy])
    # the probability-weighted sum back per token
    back, dout = c.rnd(t * k, h), c.rnd(t, h)
    b_d = back.double().cpu().requires_grad_()
    pr_d = probs.double().cpu().requires_grad_()
    rof = perm.row_of.cpu()
    out_d = (b_d[rof] * pr_d.unsqueeze(-1)).sum(1)
    out_d.backward(dout.double().cpu())
    c.close("unpermute", ks.unpermute(back, probs, perm), out_d.detach())
    d_rows, d_probs = ks.unpermute_bwd(dout, back, probs, perm)
    c.close("unpermute_bwd rows", d_rows, b_d.grad)
    c.close("unpermute_bwd probs", d_probs, pr_d.grad)
    _unchanged("moe ops", keep, [x, wr])


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
    "moe": _check_moe,
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

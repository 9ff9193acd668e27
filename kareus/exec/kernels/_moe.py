"""Mixture-of-experts ops: router, top-k, token permutation, grouped expert GEMMs, and
their backward passes (the plain-torch definitions behind ``KernelSet``'s MoE methods).

A mixture-of-experts block (``kareus.model.moe``) on one expert-parallel (EP) rank runs,
per nanobatch of ``t`` tokens, with ``E`` experts, top-``k`` routing, ``ep`` EP ranks and
``L = E / ep`` local experts per rank::

    logits = router(x, w_router)                      [t, E]   in the router dtype
    probs, indices = router_topk(logits, k)           [t, k]   probabilities, expert ids
    rows, perm = permute(x, indices, experts=E, ep=ep)  [t k, h] each token once per choice
        -- all-to-all "dispatch": rows -> received (splits: perm.input_splits() sent,
           the received counts [ep, L] from the other ranks' perm.send_counts)
    xs = expert_sort(received, recv_counts)           rows by local expert, then source rank
    h1 = grouped_mm(xs, w_gate_up, local_counts)      [r, 2 fe] gate | up, per local expert
    a  = expert_swiglu(h1)                            [r, fe]   silu(gate) * up
    y  = grouped_mm(a, w_down, local_counts)          [r, h]
    ys = expert_unsort(y, recv_counts)                back in received order
        -- all-to-all "combine": ys -> back (the splits swapped)
    out = unpermute(back, probs, perm)                [t, h] probability-weighted sum

and the backward the other way round: ``unpermute_bwd`` (row gradients and the
probabilities' gradients), the combine's gradient all-to-all, ``expert_unsort_bwd``
(= ``expert_sort``), the grouped GEMMs' data and weight gradients (``grouped_mm`` with the
transposed weights, ``grouped_mm_wgrad``), ``expert_swiglu_bwd``, ``expert_sort_bwd``
(= ``expert_unsort``), the dispatch's gradient all-to-all, ``permute_bwd`` (each token's
row gradients summed), ``router_topk_bwd`` (the top-k softmax's backward, scattered to the
``E`` logits), ``router_dgrad`` and ``router_wgrad``.

**Router and top-k.** The logits are one GEMM in the router dtype (``MoEArch.router_dtype``;
float32 by default, as Megatron-Core's ``moe_router_dtype="fp32"``: the input and weight
are cast, the product is in that dtype). The top-k takes the ``k`` largest logits and a
softmax over those ``k`` only: Megatron-Core's default score function (``softmax`` with
``moe_router_pre_softmax=False``). That equals Qwen3 MoE's ``softmax`` over all ``E``
logits, then top-k, then division by the chosen probabilities' sum
(``norm_topk_prob=True``), Mixtral's (which always renormalises) and torchtitan's
``TokenChoiceTopKRouter`` with ``score_func="softmax"``, ``route_norm=True`` and
``route_scale=1`` (its gate in float32 as well): the softmax is
monotone, so both choose the same experts, and ``exp(l_i) / S`` divided by
``sum_j exp(l_j) / S`` over the chosen ``j`` is ``exp(l_i) / sum_j exp(l_j)``, the softmax
over the chosen logits (equal in exact arithmetic; the float roundings differ). Ties
between equal logits are broken as ``torch.topk`` breaks them. The softmax is computed in
float32 or the router dtype, whichever is wider (Megatron-Core computes it in float32 and
casts to the router dtype, so a float64 router differs there by float32 rounding).

**Permutation order.** The permuted rows are ordered by global expert, and within an expert
by token (Megatron-Core's ``permute``: the expert-major ``routing_map``'s nonzeros); the
experts of one EP rank are consecutive (rank ``r`` holds experts ``r L ... r L + L - 1``),
so that is the order by destination rank, then local expert, that the all-to-all
dispatcher sends. ``TokenPermutation.send_counts`` is the ``[ep, L]`` table of rows sent
to each (rank, local expert); its row sums are the all-to-all's ``input_splits``
(``TokenPermutation.input_splits()`` reads them to the host, one synchronisation, as
Megatron-Core's dispatcher does).

**Received rows.** Rank ``r`` receives, from each source rank ``s`` in turn, that rank's
rows for its local experts ``0 ... L-1``: chunks in (source, local expert) order.
``expert_sort`` regroups them by local expert, then source rank (Megatron-Core's
``sort_chunks_by_idxs`` with its ``sort_input_by_local_experts`` order), so that each local
expert's rows are contiguous for the grouped GEMM; ``expert_unsort`` is the inverse. Both
take ``counts``, the ``[ep, L]`` table of rows received from each source rank for each
local expert (a host nested list or an integer tensor); with one rank (``ep = 1``) they
are the identity.

**Grouped GEMMs.** ``grouped_mm(x, w, counts)`` multiplies each group's contiguous rows of
``x`` (``counts[g]`` rows for group ``g``, in group order) by ``w[g]`` (weights
``[groups, in, out]``, stored input-major as the runnable partitions store every weight);
``grouped_mm_wgrad(x, dy, counts)`` is each group's ``x_g^T dy_g``, ``[groups, in, out]``
(zero for a group without rows). The data gradient is ``grouped_mm(dy, w.transpose(1, 2),
counts)``. They run on ``torch._grouped_mm`` (one kernel for every group) where it is
the production path, a CUDA GPU of compute capability 9.0 or newer in bfloat16 with
16-byte-aligned rows; otherwise a loop of ``torch.matmul``, one per group with rows
(``KernelSet.grouped_gemm`` forces either; ``grouped_mm_path`` says which runs).
The SwiGLU experts' gate and up projections are one grouped GEMM of width ``2 fe``, gate
first (Megatron-Core's fused ``linear_fc1`` of a gated linear unit: ``chunk(2)``, the first
half through the activation).

**Un-permutation.** ``unpermute(rows, probs, perm)`` sums each token's ``k`` rows weighted
by its probabilities, in top-k order (a fixed order: deterministic, unlike the atomic
``scatter_add`` Megatron-Core uses), in float32 or the router dtype (the wider), rounded
once to the rows' dtype; ``shared`` (the shared experts' output) is added after the
rounding, as Megatron-Core adds it. Megatron-Core 0.16 multiplies the probabilities into
the rows inside its experts (after the activation, before the down projection) and
un-permutes without them: the same sum (the down projection is linear, without bias) with
other roundings, and its probabilities travel through the all-to-alls beside the rows;
kareus keeps them on the routing rank (``unpermute_bwd`` computes their gradient there).

Data-dependent sizes: ``permute`` and the sorts need no host synchronisation (their
sizes are ``t k`` and the received total); the grouped GEMMs' loop path and the splits
read counts on the host. With device counts for the sorts and ``torch._grouped_mm``, and
host counts for the loop, every op captures in a CUDA graph (for counts fixed at capture).
Every op returns new tensors (or writes ``out=`` where it takes one, e.g. an all-to-all's
send buffer); none modifies its inputs.

**The API** (``KernelSet`` methods, every set; ``kareus.exec.kernels.autograd`` has
differentiable ``moe_*`` wrappers of them)::

    router(x, w, *, dtype="float32") -> logits [t, E]
    router_topk(logits, k) -> (probs [t, k], indices [t, k] int64)
    router_topk_bwd(dprobs, probs, indices, experts) -> dlogits [t, E]
    router_dgrad(dlogits, w, *, dtype=None) -> dx [t, h];  router_wgrad(x, dlogits) -> dw [h, E]
    permute(x, indices, *, experts, ep=1, out=None) -> (rows [t k, h], TokenPermutation)
    permute_bwd(drows, perm) -> dx [t, h]
    expert_sort(rows, counts, *, out=None) / expert_unsort(...) -> rows   (counts [ep, L])
    expert_sort_bwd(drows, counts, *, out=None) / expert_unsort_bwd(...) -> drows
    grouped_mm(x, w, counts, *, out=None) -> [r, out]   (w [G, in, out]; counts [G] or [ep, G])
    grouped_mm_wgrad(x, dy, counts) -> dw [G, in, out];  grouped_mm_path(x, w) -> str
    expert_swiglu(h) -> a [r, fe];  expert_swiglu_bwd(da, h) -> dh [r, 2 fe]
    unpermute(rows, probs, perm, *, shared=None) -> out [t, h]
    unpermute_bwd(dout, rows, probs, perm, *, out=None) -> (drows [t k, h], dprobs [t, k])

torch is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kareus.errors import ArgumentError

__all__ = [
    "GROUPED_GEMM_PATHS",
    "TokenPermutation",
    "expert_sort",
    "expert_swiglu",
    "expert_swiglu_bwd",
    "expert_unsort",
    "grouped_mm",
    "grouped_mm_path",
    "grouped_mm_wgrad",
    "permute",
    "permute_bwd",
    "router",
    "router_dgrad",
    "router_topk",
    "router_topk_bwd",
    "router_wgrad",
    "unpermute",
    "unpermute_bwd",
]

#: ``KernelSet.grouped_gemm`` values: ``"auto"`` (``torch._grouped_mm`` where it is the
#: production path, the loop elsewhere), ``"grouped_mm"`` (always ``torch._grouped_mm``,
#: which PyTorch also runs on the CPU for float32 and bfloat16), ``"loop"`` (always the loop).
GROUPED_GEMM_PATHS = ("auto", "grouped_mm", "loop")


@attrs.frozen(eq=False)
class TokenPermutation:
    """Where ``permute`` put each token's copies (tensors on the tokens' device).

    Attributes:
        row_of: ``[t, k]`` int64: the permuted row of token ``i``'s ``j``-th choice.
        token_of_row: ``[t k]`` int64: the token each permuted row copies.
        tokens_per_expert: ``[E]`` int64: rows for each global expert (their order).
        ep: Expert-parallel ranks the experts are spread over (consecutive blocks).
    """

    row_of: Any
    token_of_row: Any
    tokens_per_expert: Any
    ep: int = 1

    @property
    def experts(self) -> int:
        """Global experts ``E``."""
        return int(self.tokens_per_expert.shape[0])

    @property
    def local_experts(self) -> int:
        """Experts per EP rank, ``E / ep``."""
        return self.experts // self.ep

    @property
    def send_counts(self) -> Any:
        """``[ep, L]`` int64 (device): rows sent to each rank's each local expert."""
        return self.tokens_per_expert.view(self.ep, self.local_experts)

    def input_splits(self) -> list[int]:
        """Rows sent to each EP rank, on the host (the dispatch all-to-all's
        ``input_splits``; the combine's ``output_splits``). Synchronises with the device."""
        return [int(c) for c in self.send_counts.sum(1).tolist()]


# ----------------------------------------------------------------------------- router


def _wide(torch: Any, dtype: Any) -> Any:
    """The wider of float32 and ``dtype``: where softmaxes and weighted sums run."""
    return torch.promote_types(dtype, torch.float32)


def router(x: Any, w: Any, *, dtype: Any = "float32") -> Any:
    """Router logits ``x @ w`` in ``dtype`` (``[t, h] @ [h, E] -> [t, E]``; a name of
    ``kareus.model.moe.ROUTER_DTYPES`` or a torch dtype): both operands cast to the router
    dtype first."""
    import torch

    rd = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(rd, torch.dtype) or not rd.is_floating_point:
        raise ArgumentError(f"router dtype must be a floating dtype such as 'float32', got "
                            f"{dtype!r:.40}")
    return torch.matmul(x.to(rd), w.to(rd))


def router_topk(logits: Any, k: int) -> tuple[Any, Any]:
    """``(probs, indices)``, each ``[t, k]``: the ``k`` largest logits' experts (descending)
    and the softmax over those ``k`` logits, in the logits' dtype."""
    import torch

    if not 1 <= k <= logits.shape[-1]:
        raise ArgumentError(f"top-k must be in 1..{logits.shape[-1]} (the experts), got {k}")
    top, indices = torch.topk(logits, k, dim=-1)
    probs = torch.softmax(top.to(_wide(torch, logits.dtype)), dim=-1).to(logits.dtype)
    return probs, indices


def router_topk_bwd(dprobs: Any, probs: Any, indices: Any, experts: int) -> Any:
    """``dlogits`` ``[t, E]`` of ``router_topk`` for the probabilities' gradient ``dprobs``:
    the softmax's backward over the chosen logits (``p * (dp - sum(p dp))``), scattered to
    their experts' columns (the other logits get no gradient: top-k selects)."""
    import torch

    wide = _wide(torch, probs.dtype)
    p, dp = probs.to(wide), dprobs.to(wide)
    dtop = p * (dp - (p * dp).sum(-1, keepdim=True))
    out = torch.zeros(probs.shape[0], experts, dtype=probs.dtype, device=probs.device)
    return out.scatter_(1, indices, dtop.to(probs.dtype))


def router_dgrad(dlogits: Any, w: Any, *, dtype: Any = None) -> Any:
    """The router input's gradient ``dlogits @ w^T`` (in the router dtype), cast to
    ``dtype`` (a torch dtype, the activations'; default: the router dtype)."""
    import torch

    dx = torch.matmul(dlogits, w.to(dlogits.dtype).t())
    return dx if dtype is None else dx.to(dtype)


def router_wgrad(x: Any, dlogits: Any) -> Any:
    """The router weight's gradient ``x^T @ dlogits`` ``[h, E]``, in the router dtype (the
    logits' gradient's)."""
    import torch

    return torch.matmul(x.to(dlogits.dtype).t(), dlogits)


# ------------------------------------------------------------------------ permutation


def permute(x: Any, indices: Any, *, experts: int, ep: int = 1,
            out: Any = None) -> tuple[Any, TokenPermutation]:
    """Copy each token once per chosen expert: ``(rows [t k, h], TokenPermutation)``,
    rows ordered by global expert, then token (see the module docstring); into ``out``
    (a ``[t k, h]`` tensor, e.g. the dispatch's send buffer) when given."""
    import torch

    if experts % ep:
        raise ArgumentError(f"experts ({experts}) must be a multiple of ep ({ep})")
    t, k = indices.shape
    flat = indices.reshape(-1)
    # a stable sort by expert keeps each expert's rows in token order (a token chooses an
    # expert at most once)
    order = torch.argsort(flat, stable=True)
    token_of_row = torch.div(order, k, rounding_mode="floor")
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(order.numel(), device=order.device)
    # rows per expert by a scatter-add (bincount's output size would need the host)
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    perm = TokenPermutation(row_of=row_of.view(t, k), token_of_row=token_of_row,
                            tokens_per_expert=counts, ep=int(ep))
    if out is not None:
        return torch.index_select(x, 0, token_of_row, out=out), perm
    return x.index_select(0, token_of_row), perm


def permute_bwd(drows: Any, perm: TokenPermutation) -> Any:
    """``dx`` ``[t, h]``: each token's ``k`` row gradients summed in top-k order (in
    float32 or wider, rounded once)."""
    import torch

    wide = _wide(torch, drows.dtype)
    return drows[perm.row_of].to(wide).sum(1).to(drows.dtype)


def unpermute(rows: Any, probs: Any, perm: TokenPermutation, *, shared: Any = None) -> Any:
    """``out[i] = sum_j probs[i, j] * rows[row_of[i, j]]`` ``[t, h]``, summed in top-k order
    in the wider of float32 and the probabilities' dtype, rounded once to the rows' dtype;
    plus ``shared`` (the shared experts' output) after the rounding."""
    import torch

    wide = torch.promote_types(_wide(torch, rows.dtype), probs.dtype)
    out = (rows[perm.row_of].to(wide) * probs.to(wide).unsqueeze(-1)).sum(1).to(rows.dtype)
    return out if shared is None else out + shared


def unpermute_bwd(dout: Any, rows: Any, probs: Any, perm: TokenPermutation, *,
                  out: Any = None) -> tuple[Any, Any]:
    """``(drows [t k, h], dprobs [t, k])`` of ``unpermute`` for its output's gradient
    ``dout`` (``shared``'s gradient is ``dout`` itself): each row's gradient is its token's
    ``dout`` times its probability (rounded to the rows' dtype), each probability's the dot
    product of ``dout`` with its row (in the probabilities' dtype). ``drows`` is written
    into ``out`` when given (the combine gradient's send buffer)."""
    import torch

    wide = torch.promote_types(_wide(torch, rows.dtype), probs.dtype)
    d = dout.to(wide)
    drows_tk = (d.unsqueeze(1) * probs.to(wide).unsqueeze(-1)).to(rows.dtype)  # [t, k, h]
    drows = torch.empty_like(rows) if out is None else out
    drows[perm.row_of.reshape(-1)] = drows_tk.reshape(-1, rows.shape[-1])
    dprobs = (rows[perm.row_of].to(wide) * d.unsqueeze(1)).sum(-1).to(probs.dtype)
    return drows, dprobs


# ------------------------------------------------------------------ sort by local expert


def _counts_table(torch: Any, counts: Any, device: Any) -> Any:
    """``counts`` (nested host lists or a tensor) as a 2-D int64 tensor on ``device``."""
    c = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, dtype=torch.int64)
    if c.dim() != 2:
        raise ArgumentError(f"counts must be a [ep, local experts] table, got shape "
                            f"{tuple(c.shape)}")
    return c.to(device=device, dtype=torch.int64)


def _chunk_gather(torch: Any, sizes: Any, total: int, *, inverse: bool) -> Any:
    """Row indices that reorder chunks of a ``[ep, L]`` table from (source, expert) order
    to (expert, source) order (``inverse``: back)."""
    src = sizes.reshape(-1)  # chunk sizes in the order the rows are in now
    start_src = torch.cumsum(src, 0) - src
    ep, L = sizes.shape
    # chunk sizes and source starts in (expert, source) order
    dst_sizes = sizes.t().reshape(-1)
    dst_start_in_src = start_src.view(ep, L).t().reshape(-1)
    if inverse:  # rows are in (expert, source) order, to go back to (source, expert)
        start_dst = torch.cumsum(dst_sizes, 0) - dst_sizes
        # for each source-order chunk, where it starts in the expert order
        back = start_dst.view(L, ep).t().reshape(-1)
        sizes_now, starts_from = src, back
    else:
        sizes_now, starts_from = dst_sizes, dst_start_in_src
    out_start = torch.cumsum(sizes_now, 0) - sizes_now
    offset = torch.repeat_interleave(starts_from - out_start, sizes_now, output_size=total)
    return offset + torch.arange(total, device=sizes.device)


def expert_sort(rows: Any, counts: Any, *, out: Any = None) -> Any:
    """Received rows from (source rank, local expert) chunk order to (local expert, source
    rank) order; ``counts`` ``[ep, L]`` the rows of each chunk (see the module docstring;
    an int tensor on the rows' device keeps the op free of host copies, as a CUDA graph
    needs). Into ``out`` when given."""
    return _reorder(rows, counts, inverse=False, out=out)


def expert_unsort(rows: Any, counts: Any, *, out: Any = None) -> Any:
    """The inverse of ``expert_sort`` (the same ``counts``); into ``out`` when given (the
    combine's send buffer)."""
    return _reorder(rows, counts, inverse=True, out=out)


def _reorder(rows: Any, counts: Any, *, inverse: bool, out: Any) -> Any:
    import torch

    c = _counts_table(torch, counts, rows.device)
    if c.shape[0] == 1 or c.shape[1] == 1:  # one chunk per expert or per rank: in order
        return rows.clone() if out is None else out.copy_(rows)
    index = _chunk_gather(torch, c, rows.shape[0], inverse=inverse)
    if out is not None:
        return torch.index_select(rows, 0, index, out=out)
    return rows.index_select(0, index)


# -------------------------------------------------------------------- grouped GEMMs


def _group_counts(torch: Any, counts: Any) -> Any:
    """Per-group row counts as a 1-D int64 tensor (host lists or a tensor; a ``[ep, L]``
    table is summed over its ranks, giving the rows of each local expert)."""
    c = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, dtype=torch.int64)
    if c.dim() == 2:
        c = c.sum(0)
    if c.dim() != 1:
        raise ArgumentError(f"counts must list rows per group, got shape {tuple(c.shape)}")
    return c


def _host_counts(torch: Any, counts: Any) -> list[int]:
    return [int(v) for v in _group_counts(torch, counts).tolist()]


def grouped_mm_path(x: Any, w: Any, choice: str = "auto") -> str:
    """``"grouped_mm"`` or ``"loop"``: what ``grouped_mm(x, w, ...)`` runs under ``choice``
    (one of ``GROUPED_GEMM_PATHS``). ``"auto"`` takes ``torch._grouped_mm`` on a CUDA GPU
    of compute capability 9.0 or newer, in bfloat16, with rows of 16-byte multiples (its
    kernel's requirement), the loop elsewhere."""
    return _path(x, w.dtype, (x.shape[-1], w.shape[-1]), choice)


def _path(x: Any, w_dtype: Any, widths: tuple[int, ...], choice: str) -> str:
    import torch

    if choice not in GROUPED_GEMM_PATHS:
        raise ArgumentError(f"grouped_gemm must be one of {GROUPED_GEMM_PATHS}, got {choice!r}")
    if choice != "auto":
        return choice
    if not hasattr(torch, "_grouped_mm") or x.device.type != "cuda":
        return "loop"
    if x.dtype != torch.bfloat16 or w_dtype != torch.bfloat16:
        return "loop"
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return "loop"
    if any(n % 8 for n in widths):
        return "loop"
    return "grouped_mm"


def _offsets(torch: Any, counts: Any, device: Any) -> Any:
    return torch.cumsum(_group_counts(torch, counts).to(device), 0).to(torch.int32)


def grouped_mm(x: Any, w: Any, counts: Any, *, path: str = "auto", out: Any = None) -> Any:
    """Each group's rows times its weight: ``[r, in] x [G, in, out] -> [r, out]``, group
    ``g`` the ``counts[g]`` rows after the groups before it (``counts``: ``G`` host ints, an
    int tensor, or a ``[ep, G]`` table summed over ranks; the ``torch._grouped_mm`` path
    reads a device tensor without host copies, the loop reads host ints without a
    synchronisation). ``path``: see ``grouped_mm_path``. Into ``out`` when given."""
    import torch

    if w.dim() != 3 or x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ArgumentError(f"grouped_mm needs x [rows, in] and w [groups, in, out], got "
                            f"{tuple(x.shape)} and {tuple(w.shape)}")
    if grouped_mm_path(x, w, path) == "grouped_mm":
        y = torch._grouped_mm(x, w, offs=_offsets(torch, counts, x.device))
        return y if out is None else out.copy_(y)
    sizes = _host_counts(torch, counts)
    _check_groups(sizes, w.shape[0], x.shape[0])
    out = x.new_empty(x.shape[0], w.shape[2]) if out is None else out
    start = 0
    for g, n in enumerate(sizes):
        if n:
            torch.matmul(x[start:start + n], w[g], out=out[start:start + n])
        start += n
    return out


def grouped_mm_wgrad(x: Any, dy: Any, counts: Any, *, path: str = "auto") -> Any:
    """Each group's weight gradient ``x_g^T dy_g``: ``[r, in], [r, out] -> [G, in, out]``
    (zero for a group without rows); ``counts`` and ``path`` as ``grouped_mm`` takes them
    (``path`` decided on ``x`` and ``dy``)."""
    import torch

    c = _group_counts(torch, counts)
    groups = int(c.shape[0])
    if _path(x, dy.dtype, (x.shape[-1], dy.shape[-1]), path) == "grouped_mm":
        dw = torch._grouped_mm(x.t(), dy, offs=_offsets(torch, c, x.device))
        # a group without rows: zero (not every kernel writes it)
        return dw.masked_fill((c.to(x.device) == 0).view(-1, 1, 1), 0)
    sizes = _host_counts(torch, c)
    _check_groups(sizes, groups, x.shape[0])
    dw = x.new_zeros(groups, x.shape[1], dy.shape[1])
    start = 0
    for g, n in enumerate(sizes):
        if n:
            torch.matmul(x[start:start + n].t(), dy[start:start + n], out=dw[g])
        start += n
    return dw


def _check_groups(sizes: Sequence[int], groups: int, rows: int) -> None:
    if len(sizes) != groups:
        raise ArgumentError(f"counts list {len(sizes)} groups, the weights hold {groups}")
    if sum(sizes) != rows:
        raise ArgumentError(f"counts sum to {sum(sizes)} rows, the input has {rows}")


# ------------------------------------------------------------------- SwiGLU experts


def expert_swiglu(ks: Any, h: Any) -> Any:
    """``silu(gate) * up`` of the fused gate/up output ``h`` ``[r, 2 fe]`` (gate first),
    through the kernel set ``ks``'s ``swiglu``."""
    fe = h.shape[-1] // 2
    return ks.swiglu(h[:, :fe], h[:, fe:])


def expert_swiglu_bwd(ks: Any, da: Any, h: Any) -> Any:
    """``dh`` ``[r, 2 fe]`` of ``expert_swiglu`` (gate's gradient first), through
    ``ks.swiglu_bwd``."""
    import torch

    fe = h.shape[-1] // 2
    dg, du = ks.swiglu_bwd(da, h[:, :fe], h[:, fe:])
    return torch.cat((dg, du), dim=-1)

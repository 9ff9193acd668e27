"""The mixture-of-experts block of the training loop's decoder, op by op.

A decoder layer of a model with ``ModelArch.moe`` (``kareus.model.moe``) runs, in place of
the dense MLP, the ops of ``kareus.model.decoder.moe_decoder_layer`` in its order; this
module writes each of them for [`DecoderShard`][kareus.exec.train.DecoderShard]
(``_op_<name>``), which mixes it in. The math is Megatron-Core's MoE layer with the
all-to-all token dispatcher, dropless, at an expert tensor-parallel size of 1:

* ``router``: the logits ``xn2 @ Wr`` in the router dtype (``MoEArch.router_dtype``,
  float32 by default: the normed input and the weight cast to it, as Megatron-Core's
  ``moe_router_dtype="fp32"`` does); ``router_topk``: the ``k`` largest logits of each token
  and the softmax over them (Megatron-Core's default ``softmax`` score function with
  ``moe_router_pre_softmax=False``; Mixtral's router; Qwen3 MoE's with
  ``norm_topk_prob=True``). No auxiliary load-balancing loss, no score bias, no capacity:
  every token reaches its ``k`` experts;
* ``permute``: each token copied once per chosen expert, the rows ordered by global expert
  (then by token): the rows for EP rank ``r``'s experts ``[r E/EP, (r+1) E/EP)`` are one
  contiguous block. Before the copy the ranks exchange their token counts per expert (an
  all-to-all of ``E`` integers per rank over the EP group, on the compute stream, as
  Megatron-Core's dispatcher does), so each rank knows how many rows it sends to and
  receives from each: the dispatch's split sizes, read on the host (a synchronisation:
  the reason the MoE layer does not run in CUDA graphs, see below);
* the dispatch all-to-all (``"dispatch"``) sends the blocks; the received rows are ordered
  by source rank, then by local expert; ``expert_sort`` reorders them by local expert (then
  source rank; Megatron-Core's ``sort_chunks_by_idxs``) when a rank holds more than one
  expert, and ``expert_unsort`` restores the order after the experts;
* ``expert_gate_up``, ``expert_swiglu``, ``expert_down``: each local expert's SwiGLU MLP on
  its rows (``W1e``: ``[local experts, 2, hidden, expert_ffn]``, gate then up; ``W2e``:
  ``[local experts, expert_ffn, hidden]``);
* the combine all-to-all (``"combine"``) returns the rows to the ranks that routed them;
  ``unpermute`` weights each row by its probability (in the router dtype), sums each
  token's ``k`` rows and adds the shared experts' output: the layer's MLP output, which the
  next layer's input norm adds to the residual stream;
* shared experts (``MoEArch.shared_experts``; TP = 1): one SwiGLU MLP of width
  ``shared_experts x shared_expert_ffn`` on every token (several shared experts side by side
  are that one MLP), run after the dispatch is launched.

The backward mirrors it: ``unpermute_bwd`` gives each row's gradient (the output's, times
its probability) and each probability's (the output's gradient dotted with the row), the
``"combine_grad"`` all-to-all sends the rows' gradients to the experts, the experts'
backward runs (data and weight gradients per expert, accumulated in place), the
``"dispatch_grad"`` all-to-all returns the input rows' gradients, ``permute_bwd`` sums
each token's ``k`` of them, ``router_topk_bwd`` is the softmax's backward scattered to
the chosen logits, ``router_dgrad`` and ``router_wgrad`` the router GEMM's.

Layout over ranks (``kareus.exec.train._groups``): the EP group's ranks hold different
experts (the ``W1e``, ``W2e`` of global experts ``[ep_rank E/EP, (ep_rank+1) E/EP)``, whose
gradients are summed over the expert-data-parallel group); the router and the shared
experts are replicated over TP and EP (their gradients summed over TP, each TP rank having
routed its sequence shard under sequence parallelism, and over CP with every weight).

Recomputation: ``"none"`` and ``"selective"`` keep what the MoE backward reads (the
normed input, the routing, the experts' input rows and gate/up/SwiGLU outputs, the
combined rows, the shared experts' activations); ``"full"`` keeps the layer's input and
re-runs the forward, routing, count exchange and both all-to-alls included, up to the
combine (the un-permutation's output is read by no backward op).

**CUDA graphs**: the rows each rank sends and receives are known only after the routing,
on the host; a graph fixes every shape at capture. The loop refuses a mixture of experts
with ``graphs=True`` (``TrainingLoop(graphs=False)``, eager launches); the dense layers
are unaffected.

The grouped GEMMs run as one GEMM of the ``KernelSet`` per local expert (``_expert_mm``,
``_expert_wgrad``); the row copies and the routing are torch indexing ops.

torch is imported inside the functions that need it.
"""

from __future__ import annotations

from typing import Any

import attrs

from kareus.errors import WorkloadError

__all__ = ["MOE_KEPT", "MoEBlock", "moe_layout"]

#: Per-layer MoE activations each recomputation policy keeps for the backward (beside the
#: dense layer's ``KEPT_FOR_BACKWARD``; ``"full"`` keeps none of them).
MOE_KEPT: frozenset[str] = frozenset({"xn2", "probs", "topi", "route", "xe", "eg", "eu",
                                      "ea", "comb_out", "sg", "su", "sa"})

#: The MoE block's per-layer collectives (all-to-alls over the EP group), whose tensors
#: are the layer's activations (their sizes follow the routing), not pool buffers.
MOE_COMMS = ("dispatch", "combine", "combine_grad", "dispatch_grad")


@attrs.define
class Route:
    """One MoE block's routing of one nanobatch (what every op after ``permute`` reads).

    Attributes:
        order: For each permuted row, its index in the ``[tokens, k]`` top-k table (rows
            ordered by global expert, then token).
        row_token: For each permuted row, its token.
        input_splits: Rows sent to each EP rank (the dispatch's input splits).
        output_splits: Rows received from each EP rank.
        tokens_per_expert: Rows of each local expert (after the sort).
        sort_idx: The received rows in local-expert order (``None``: no sort).
        unsort_idx: Its inverse.
    """

    order: Any
    row_token: Any
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    tokens_per_expert: tuple[int, ...]
    sort_idx: Any = None
    unsort_idx: Any = None


def moe_layout(moe: Any, *, tp: int, cp: int, ep: int, sp: bool) -> None:
    """Refuse a mixture-of-experts layout the loop does not compute (one line each).

    Raises:
        WorkloadError: EP does not divide the experts or TP x CP; TP > 1 without
            sequence parallelism; shared experts at TP > 1.
    """
    if moe.experts % ep:
        raise WorkloadError(f"ep={ep} does not divide the {moe.experts} experts")
    if (tp * cp) % ep:
        raise WorkloadError(f"ep={ep} must divide TP x CP = {tp * cp} (the training loop runs "
                            "DP=1: the EP ranks fold over the TP and CP ranks)")
    if tp > 1 and not sp:
        raise WorkloadError(f"a mixture of experts at TP={tp} needs sequence parallelism "
                            "(sp=True), as Megatron-Core requires")
    if tp > 1 and moe.shared_experts:
        raise WorkloadError(f"shared experts at TP={tp} are not computed: use tp=1")


class MoEBlock:
    """The MoE ops of [`DecoderShard`][kareus.exec.train.DecoderShard] (a mixin: it reads
    the shard's kernels, groups, weights and activations; see the module docstring)."""

    # set by DecoderShard
    torch: Any
    ks: Any
    groups: Any
    moe: Any
    h: int
    dtype: Any
    device: Any
    eps: float
    phase: str
    n: int
    act: dict[tuple[int, int], dict[str, Any]]

    def W(self, layer: int, name: str) -> Any:
        raise NotImplementedError

    def G(self, layer: int, name: str) -> Any:
        raise NotImplementedError

    def _reduced(self, name: str, layer: int, nb: int) -> Any:
        raise NotImplementedError

    def _buf(self, name: str, nb: int) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ dimensions
    def _moe_dims(self) -> None:
        """The MoE block's dimensions on this rank (after ``_shard_dims``)."""
        moe = self.moe
        self.ep, self.ep_rank = self.groups.ep_size, self.groups.ep_rank
        self.n_experts, self.topk = moe.experts, moe.experts_per_token
        self.local_experts = moe.experts // self.ep
        self.first_expert = self.ep_rank * self.local_experts
        self.fe = moe.expert_ffn
        self.fs = moe.shared_experts * moe.shared_expert_ffn
        self.sort_tokens = self.ep > 1 and self.local_experts > 1
        self.rdt = getattr(self.torch, moe.router_dtype)

    def _moe_shapes(self) -> dict[str, tuple[tuple[int, ...], float, bool]]:
        """The MoE block's replicated weights per layer: name -> (shape, std, sharded)."""
        h, std = self.h, 0.02
        out: dict[str, tuple[tuple[int, ...], float, bool]] = {
            "Wr": ((h, self.n_experts), std, False)}
        if self.fs:
            out |= {"Wsg": ((h, self.fs), std, False), "Wsu": ((h, self.fs), std, False),
                    "Wsd": ((self.fs, h), self._out_std(), False)}
        return out

    def _expert_shapes(self) -> dict[str, tuple[tuple[int, ...], float]]:
        """This rank's experts' weights per layer: name -> (shape, std); each expert is
        initialised from its global index, so the EP ranks hold different experts and a
        model of one rank holds them all."""
        h, L = self.h, self.local_experts
        return {"W1e": ((L, 2, h, self.fe), 0.02), "W2e": ((L, self.fe, h), self._out_std())}

    def _out_std(self) -> float:
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers
    def _expert_mm(self, x: Any, w: Any, counts: tuple[int, ...], *, out: Any = None,
                   transpose: bool = False, accumulate: bool = False) -> Any:
        """The grouped GEMM: ``x``'s rows of local expert ``e`` (``counts[e]`` of them, in
        expert order) times ``w[e]`` (transposed with ``transpose``), one KernelSet GEMM per
        expert, into ``out``'s rows."""
        torch = self.torch
        cols = w.shape[-2] if transpose else w.shape[-1]
        if out is None:
            out = torch.empty(x.shape[0], cols, device=x.device, dtype=x.dtype)
        lo = 0
        for e, c in enumerate(counts):
            if c:
                we = w[e].t() if transpose else w[e]
                self.ks.matmul(x[lo:lo + c], we, out=out[lo:lo + c], accumulate=accumulate)
            lo += c
        return out

    def _expert_wgrad(self, x: Any, dy: Any, counts: tuple[int, ...], gw: Any) -> None:
        """Each local expert's weight gradient ``x_e^T dy_e``, added into ``gw[e]``."""
        lo = 0
        for e, c in enumerate(counts):
            if c:
                self.ks.matmul(x[lo:lo + c].t(), dy[lo:lo + c], out=gw[e], accumulate=True)
            lo += c

    def _ep_rows(self, a: dict[str, Any], sent: str, received: str) -> Any:
        """The rows an all-to-all delivered (``a[received]``), or at EP = 1 (no all-to-all)
        the rows it would have sent (``a[sent]``)."""
        return a[received] if self.ep > 1 else a[sent]

    def moe_comm_args(self, name: str, layer: int, nb: int) -> tuple[Any, Any, Any]:
        """``(input, output, (output_splits, input_splits))`` of the MoE all-to-all
        ``name`` of ``layer``, nanobatch ``nb`` (its tensors are the layer's activations)."""
        a = self.act[(layer, nb)]
        r: Route = a["route"]
        to_experts = (r.output_splits, r.input_splits)
        from_experts = (r.input_splits, r.output_splits)
        if name == "dispatch":
            return a["disp_in"], a["disp_out"], to_experts
        if name == "combine":
            return a["comb_in"], a["comb_out"], from_experts
        if name == "combine_grad":
            return a["cg_in"], a["cg_out"], to_experts
        return a["dg_in"], a["dg_out"], from_experts

    def _rows(self, n: int) -> Any:
        return self.torch.empty(n, self.h, device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ forward
    def _moe_mlp_norm(self, layer: int, a: dict[str, Any], nb: int) -> None:
        """The MoE layer's ``mlp_norm``: the residual sum and its norm, on this rank's
        tokens (its sequence shard under sequence parallelism: no TP all-gather)."""
        a["x_mid"], a["xn2"] = self.ks.add_rms_norm(
            a["x_in"], self._reduced("attn_out", layer, nb), self.W(layer, "w_mlp_norm"),
            self.eps)

    def _op_router(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["logits"] = self.ks.matmul(a["xn2"].to(self.rdt), self.W(layer, "Wr").to(self.rdt))

    def _op_router_topk(self, layer: int, a: dict[str, Any], nb: int) -> None:
        top, a["topi"] = self.torch.topk(a.pop("logits"), self.topk, dim=-1)
        a["probs"] = self.torch.softmax(top, dim=-1)

    def _op_permute(self, layer: int, a: dict[str, Any], nb: int) -> None:
        """Exchange the token counts per expert over the EP group, then copy each token to
        its ``k`` rows in expert order (the dispatch's input)."""
        torch = self.torch
        experts = a["topi"].reshape(-1)
        order = torch.sort(experts, stable=True).indices
        counts = torch.bincount(experts, minlength=self.n_experts).view(self.ep, -1)
        if self.ep > 1:  # every rank's counts for this rank's experts (a host read follows)
            recv = torch.empty_like(counts)
            self.groups.all_to_all(recv, counts, [1] * self.ep, [1] * self.ep, group="ep")
        else:
            recv = counts
        sent, got = counts.sum(dim=1).tolist(), recv.tolist()
        per_expert = tuple(sum(row[e] for row in got) for e in range(self.local_experts))
        r = Route(order=order, row_token=order // self.topk, input_splits=tuple(sent),
                  output_splits=tuple(sum(row) for row in got), tokens_per_expert=per_expert)
        if self.sort_tokens:  # (source rank, expert) chunks -> (expert, source rank)
            offs: list[list[int]] = []
            o = 0
            for row in got:
                offs.append([])
                for c in row:
                    offs[-1].append(o)
                    o += c
            idx = [i for e in range(self.local_experts) for s in range(self.ep)
                   for i in range(offs[s][e], offs[s][e] + got[s][e])]
            r.sort_idx = torch.tensor(idx, dtype=torch.int64, device=self.device)
            r.unsort_idx = torch.empty_like(r.sort_idx)
            r.unsort_idx[r.sort_idx] = torch.arange(len(idx), device=self.device)
        a["route"] = r
        a["disp_in"] = a["xn2"].index_select(0, r.row_token)
        if self.ep > 1:
            a["disp_out"] = self._rows(sum(r.output_splits))

    def _op_expert_sort(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["xe"] = a.pop("disp_out").index_select(0, a["route"].sort_idx)

    def _expert_input(self, a: dict[str, Any]) -> Any:
        if "xe" not in a:
            a["xe"] = a.pop("disp_out") if self.ep > 1 else a.pop("disp_in")
        a.pop("disp_in", None)  # sent
        return a["xe"]

    def _op_expert_gate_up(self, layer: int, a: dict[str, Any], nb: int) -> None:
        x, w = self._expert_input(a), self.W(layer, "W1e")
        n = a["route"].tokens_per_expert
        a["eg"] = self._expert_mm(x, w[:, 0], n, out=self._ffn_rows(x, self.fe))
        a["eu"] = self._expert_mm(x, w[:, 1], n, out=self._ffn_rows(x, self.fe))

    def _ffn_rows(self, x: Any, f: int) -> Any:
        return self.torch.empty(x.shape[0], f, device=self.device, dtype=self.dtype)

    def _op_expert_swiglu(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["ea"] = self.ks.swiglu(a["eg"], a["eu"])

    def _op_expert_down(self, layer: int, a: dict[str, Any], nb: int) -> None:
        r: Route = a["route"]
        y = self._expert_mm(a["ea"], self.W(layer, "W2e"), r.tokens_per_expert)
        if self.sort_tokens:
            a["ey"] = y
        else:
            self._to_combine(a, y)

    def _to_combine(self, a: dict[str, Any], rows: Any) -> None:
        """The experts' output rows in received order: the combine's input (at EP = 1 its
        output: no all-to-all)."""
        r: Route = a["route"]
        if self.ep > 1:
            a["comb_in"] = rows
            a["comb_out"] = self._rows(sum(r.input_splits))
        else:
            a["comb_out"] = rows

    def _op_expert_unsort(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self._to_combine(a, a.pop("ey").index_select(0, a["route"].unsort_idx))

    def _row_probs(self, a: dict[str, Any]) -> Any:
        """Each permuted row's probability (router dtype)."""
        return a["probs"].reshape(-1).index_select(0, a["route"].order)

    def _op_unpermute(self, layer: int, a: dict[str, Any], nb: int) -> None:
        """Each token's rows weighted by their probabilities and summed (in the promoted
        dtype of rows and probabilities, as Megatron-Core's un-permutation), plus the
        shared experts' output: the layer's MLP output."""
        torch = self.torch
        r: Route = a["route"]
        a.pop("comb_in", None)  # sent
        rows = a["comb_out"] * self._row_probs(a).unsqueeze(1)
        y = torch.zeros(a["xn2"].shape[0], self.h, device=self.device, dtype=rows.dtype)
        y.index_add_(0, r.row_token, rows)
        y = y.to(self.dtype)
        if self.fs:
            y.add_(a.pop("sy"))
        a["mlp_out"] = y

    def _op_shared_gate(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["sg"] = self.ks.matmul(a["xn2"], self.W(layer, "Wsg"))

    def _op_shared_up(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["su"] = self.ks.matmul(a["xn2"], self.W(layer, "Wsu"))

    def _op_shared_swiglu(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["sa"] = self.ks.swiglu(a["sg"], a["su"])

    def _op_shared_down(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["sy"] = self.ks.matmul(a["sa"], self.W(layer, "Wsd"))

    # ------------------------------------------------------------------ backward
    def _op_unpermute_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        """Each row's gradient (the token's output gradient times the row's probability)
        for the combine's backward, and each probability's (the output gradient dotted
        with the row)."""
        torch = self.torch
        r: Route = a["route"]
        dy = a["dy"].index_select(0, r.row_token)
        p = self._row_probs(a)
        drows = (dy * p.unsqueeze(1)).to(self.dtype)
        dp = (dy.to(p.dtype) * a.pop("comb_out").to(p.dtype)).sum(dim=1)
        dprobs = torch.zeros_like(a["probs"]).view(-1)
        dprobs.index_copy_(0, r.order, dp)
        a["dprobs"] = dprobs.view_as(a["probs"])
        if self.ep > 1:
            a["cg_in"] = drows
            a["cg_out"] = self._rows(sum(r.output_splits))
        else:
            a["dey"] = drows

    def _expert_out_grad(self, a: dict[str, Any]) -> Any:
        """The gradient of the experts' output rows in expert order."""
        if "dey" not in a:
            a.pop("cg_in", None)
            a["dey"] = a.pop("cg_out")
        return a["dey"]

    def _op_expert_unsort_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a.pop("cg_in", None)
        a["dey"] = a.pop("cg_out").index_select(0, a["route"].sort_idx)

    def _op_expert_down_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["dea"] = self._expert_mm(self._expert_out_grad(a), self.W(layer, "W2e"),
                                   a["route"].tokens_per_expert, transpose=True)

    def _op_expert_down_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self._expert_wgrad(a["ea"], self._expert_out_grad(a), a["route"].tokens_per_expert,
                           self.G(layer, "W2e"))

    def _op_expert_swiglu_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["deg"], a["deu"] = self.ks.swiglu_bwd(a.pop("dea"), a["eg"], a["eu"])

    def _op_expert_gate_up_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        w, n = self.W(layer, "W1e"), a["route"].tokens_per_expert
        dx = self._expert_mm(a["deg"], w[:, 0], n, transpose=True)
        a["dxe"] = self._expert_mm(a["deu"], w[:, 1], n, out=dx, transpose=True,
                                   accumulate=True)
        if not self.sort_tokens:
            self._to_dispatch_grad(a, a.pop("dxe"))

    def _op_expert_gate_up_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        gw, n = self.G(layer, "W1e"), a["route"].tokens_per_expert
        self._expert_wgrad(a["xe"], a["deg"], n, gw[:, 0])
        self._expert_wgrad(a["xe"], a["deu"], n, gw[:, 1])

    def _to_dispatch_grad(self, a: dict[str, Any], rows: Any) -> None:
        """The input rows' gradients in received order: the dispatch's backward's input (at
        EP = 1 its output)."""
        r: Route = a["route"]
        if self.ep > 1:
            a["dg_in"] = rows
            a["dg_out"] = self._rows(sum(r.input_splits))
        else:
            a["dg_out"] = rows

    def _op_expert_sort_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self._to_dispatch_grad(a, a.pop("dxe").index_select(0, a["route"].unsort_idx))

    def _dxn2(self, a: dict[str, Any]) -> Any:
        """The gradient of the normed input, accumulated by the shared experts', the
        permutation's and the router's backward (zeros first)."""
        if "dxn2" not in a:
            a["dxn2"] = self.torch.zeros_like(a["xn2"])
        return a["dxn2"]

    def _op_permute_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a.pop("dg_in", None)
        self._dxn2(a).index_add_(0, a["route"].row_token, a.pop("dg_out"))

    def _op_router_topk_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        """The softmax's backward over the top-k, scattered to the chosen logits."""
        p, dp = a["probs"], a.pop("dprobs")
        dv = p * (dp - (dp * p).sum(dim=-1, keepdim=True))
        dlogits = self.torch.zeros(p.shape[0], self.n_experts, device=self.device,
                                   dtype=p.dtype)
        a["dlogits"] = dlogits.scatter_(1, a["topi"], dv)

    def _op_router_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        d = self.ks.matmul(a["dlogits"], self.W(layer, "Wr").to(self.rdt).t())
        self._dxn2(a).add_(d.to(self.dtype))

    def _op_router_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        g = self.ks.matmul(a["xn2"].to(self.rdt).t(), a.pop("dlogits"))
        self.G(layer, "Wr").add_(g.to(self.dtype))

    def _moe_mlp_norm_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        """The norm's backward with the residual's gradient added, on this rank's tokens;
        under sequence parallelism into the all-gather before ``out_dgrad``."""
        a["dx_mid"] = self.ks.rms_norm_bwd_add(
            a.pop("dxn2"), a["x_mid"], self.W(layer, "w_mlp_norm"), a["dy"],
            self.G(layer, "w_mlp_norm"), self.eps)
        if self.groups.tp_size > 1:  # sequence parallelism (required at TP > 1)
            buf = self._buf("attn_out_grad", nb).view(-1, self.h)
            a["dx_mid"] = buf.copy_(a["dx_mid"])

    def _op_shared_down_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["dsa"] = self.ks.matmul(a["dy"], self.W(layer, "Wsd").t())

    def _op_shared_down_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self.ks.matmul(a["sa"].t(), a["dy"], out=self.G(layer, "Wsd"), accumulate=True)

    def _op_shared_swiglu_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["dsg"], a["dsu"] = self.ks.swiglu_bwd(a.pop("dsa"), a["sg"], a["su"])

    def _op_shared_gate_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self._dxn2(a).add_(self.ks.matmul(a["dsg"], self.W(layer, "Wsg").t()))

    def _op_shared_up_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self.ks.matmul(a["dsu"], self.W(layer, "Wsu").t(), out=self._dxn2(a), accumulate=True)

    def _op_shared_gate_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self.ks.matmul(a["xn2"].t(), a.pop("dsg"), out=self.G(layer, "Wsg"), accumulate=True)

    def _op_shared_up_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self.ks.matmul(a["xn2"].t(), a.pop("dsu"), out=self.G(layer, "Wsu"), accumulate=True)

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
  its rows, two grouped GEMMs (``W1e``: ``[local experts, hidden, 2 expert_ffn]``, gate
  then up, as Megatron-Core's fused ``linear_fc1``; ``W2e``: ``[local experts, expert_ffn,
  hidden]``);
* the combine all-to-all (``"combine"``) returns the rows to the ranks that routed them;
  ``unpermute`` weights each row by its probability and sums each token's ``k`` rows (in
  float32 or the router dtype, whichever is wider, rounded once), then adds the shared
  experts' output: the layer's MLP output, which the next layer's input norm adds to the
  residual stream. (Megatron-Core 0.16 multiplies the probabilities in inside its experts,
  before the down projection: the same sum, other roundings; ``kareus.exec.kernels``);
* shared experts (``MoEArch.shared_experts``; TP = 1): one SwiGLU MLP of width
  ``shared_experts x shared_expert_ffn`` on every token (several shared experts side by side
  are that one MLP), run after the dispatch is launched.

The backward mirrors it: ``unpermute_bwd`` gives each row's gradient (the output's, times
its probability) and each probability's (the output's gradient dotted with the row), the
``"combine_grad"`` all-to-all sends the rows' gradients to the experts, the experts'
backward runs (each grouped GEMM's data gradient, and its weight gradients added to the
experts' gradient buffers), the
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
on the host; a graph fixes every shape at capture. A training loop of a mixture-of-experts model
runs every schedule eagerly (``graphs=None`` resolves to ``False`` for it) and refuses
``graphs=True`` in one line.

Every op runs on the ``KernelSet``'s MoE kernels (``router``, ``router_topk``,
``permute``, ``expert_sort``, ``grouped_mm`` (``torch._grouped_mm`` on the production path),
``expert_swiglu``, ``unpermute`` and their backward: ``kareus.exec.kernels``); this module
only strings them, exchanges the counts and keeps the activations.

torch is imported inside the functions that need it.
"""

from __future__ import annotations

from typing import Any

import attrs

from kareus.errors import WorkloadError

__all__ = ["MOE_COMMS", "MOE_KEPT", "MoEBlock", "Route", "moe_layout"]

#: Per-layer MoE activations each recomputation policy keeps for the backward (beside the
#: dense layer's ``KEPT_FOR_BACKWARD``; ``"full"`` keeps none of them).
MOE_KEPT: frozenset[str] = frozenset({"xn2", "probs", "topi", "route", "xe", "h1", "ea",
                                      "comb_out", "sg", "su", "sa"})

#: The MoE block's per-layer collectives (all-to-alls over the EP group), whose tensors
#: are the layer's activations (their sizes follow the routing), not pool buffers.
MOE_COMMS = ("dispatch", "combine", "combine_grad", "dispatch_grad")


@attrs.define
class Route:
    """One MoE block's routing of one nanobatch (what every op after ``permute`` reads).

    Attributes:
        perm: Where ``permute`` put each token's copies (the kernels'
            ``TokenPermutation``).
        input_splits: Rows sent to each EP rank (the dispatch's input splits).
        output_splits: Rows received from each EP rank.
        recv: ``[ep][local experts]`` rows received from each rank for each local expert
            (host lists: the sorts' chunk table).
        local_counts: Rows of each local expert (after the sort).
    """

    perm: Any
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    recv: list[list[int]]
    local_counts: list[int]


def moe_layout(moe: Any, *, tp: int, cp: int, ep: int, sp: bool, dp: int = 1) -> None:
    """Refuse a mixture-of-experts layout the loop does not compute (one line each).

    Raises:
        WorkloadError: EP does not divide the experts or TP x CP x DP; TP > 1 without
            sequence parallelism; shared experts at TP > 1.
    """
    if moe.experts % ep:
        raise WorkloadError(f"ep={ep} does not divide the {moe.experts} experts")
    if (tp * cp * dp) % ep:
        raise WorkloadError(f"ep={ep} must divide TP x CP x DP = {tp * cp * dp} (the EP ranks "
                            "fold over the TP, CP and DP ranks)")
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
        """Layer ``layer``'s weight ``name`` (``DecoderShard.W``)."""
        raise NotImplementedError

    def G(self, layer: int, name: str) -> Any:
        """Layer ``layer``'s gradient buffer of weight ``name`` (``DecoderShard.G``)."""
        raise NotImplementedError

    def _reduced(self, name: str, layer: int, nb: int) -> Any:
        raise NotImplementedError

    def _buf(self, name: str, nb: int) -> Any:
        raise NotImplementedError

    def _out_std(self) -> float:
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
        return {"W1e": ((L, h, 2 * self.fe), 0.02), "W2e": ((L, self.fe, h), self._out_std())}

    # ------------------------------------------------------------------ helpers
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

    def _sent_or_received(self, a: dict[str, Any], sent: str, received: str) -> Any:
        """What an all-to-all delivered (``a[received]``; its input ``a[sent]`` dropped),
        or at EP = 1, where it does not run, its input."""
        rows = a.pop(sent) if self.ep == 1 else a.pop(received)
        a.pop(sent, None)
        return rows

    def _to_send(self, a: dict[str, Any], rows: Any, sent: str, received: str,
                 n_received: int) -> None:
        """``rows`` as an all-to-all's input, and its output buffer of ``n_received`` rows
        (at EP = 1 the rows themselves: it does not run)."""
        a[sent] = rows
        if self.ep > 1:
            a[received] = self._rows(n_received)

    # ------------------------------------------------------------------ forward
    def _moe_mlp_norm(self, layer: int, a: dict[str, Any], nb: int) -> None:
        """The MoE layer's ``mlp_norm``: the residual sum and its norm, on this rank's
        tokens (its sequence shard under sequence parallelism: no TP all-gather)."""
        a["x_mid"], a["xn2"] = self.ks.add_rms_norm(
            a["x_in"], self._reduced("attn_out", layer, nb), self.W(layer, "w_mlp_norm"),
            self.eps)

    def _op_router(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["logits"] = self.ks.router(a["xn2"], self.W(layer, "Wr"),
                                     dtype=self.moe.router_dtype)

    def _op_router_topk(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["probs"], a["topi"] = self.ks.router_topk(a.pop("logits"), self.topk)

    def _op_permute(self, layer: int, a: dict[str, Any], nb: int) -> None:
        """Copy each token to its ``k`` rows in expert order (the dispatch's input), and
        exchange the rows per expert over the EP group (the dispatch's splits, read on the
        host)."""
        rows, perm = self.ks.permute(a["xn2"], a["topi"], experts=self.n_experts, ep=self.ep)
        counts = perm.send_counts
        if self.ep > 1:  # every rank's rows for this rank's experts
            recv = self.torch.empty_like(counts)
            self.groups.all_to_all(recv, counts.contiguous(), [1] * self.ep, [1] * self.ep,
                                   group="ep")
        else:
            recv = counts
        # one host read of both tables (the sizes every later op and all-to-all needs)
        sent, got = (self.torch.stack((counts, recv)).tolist())
        r = Route(perm=perm, input_splits=tuple(int(sum(row)) for row in sent),
                  output_splits=tuple(int(sum(row)) for row in got), recv=got,
                  local_counts=[sum(row[e] for row in got) for e in range(self.local_experts)])
        a["route"] = r
        self._to_send(a, rows, "disp_in", "disp_out", sum(r.output_splits))

    def _expert_input(self, a: dict[str, Any]) -> Any:
        """The received rows in local-expert order (after the sort, when it runs)."""
        if "xe" not in a:
            a["xe"] = self._sent_or_received(a, "disp_in", "disp_out")
        return a["xe"]

    def _op_expert_sort(self, layer: int, a: dict[str, Any], nb: int) -> None:
        rows = self._sent_or_received(a, "disp_in", "disp_out")
        a["xe"] = self.ks.expert_sort(rows, a["route"].recv)

    def _op_expert_gate_up(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["h1"] = self.ks.grouped_mm(self._expert_input(a), self.W(layer, "W1e"),
                                     a["route"].local_counts)

    def _op_expert_swiglu(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["ea"] = self.ks.expert_swiglu(a["h1"])

    def _op_expert_down(self, layer: int, a: dict[str, Any], nb: int) -> None:
        r: Route = a["route"]
        y = self.ks.grouped_mm(a["ea"], self.W(layer, "W2e"), r.local_counts)
        if self.sort_tokens:
            a["ey"] = y
        else:
            self._to_send(a, y, "comb_in", "comb_out", sum(r.input_splits))

    def _op_expert_unsort(self, layer: int, a: dict[str, Any], nb: int) -> None:
        r: Route = a["route"]
        self._to_send(a, self.ks.expert_unsort(a.pop("ey"), r.recv), "comb_in", "comb_out",
                      sum(r.input_splits))

    def _op_unpermute(self, layer: int, a: dict[str, Any], nb: int) -> None:
        """Each token's rows weighted by their probabilities and summed, plus the shared
        experts' output: the layer's MLP output (the next layer's norm adds it to the
        residual stream). The combined rows are kept (the probabilities' gradient)."""
        a["mlp_out"] = self.ks.unpermute(self._combined(a), a["probs"], a["route"].perm,
                                         shared=a.pop("sy", None))

    def _combined(self, a: dict[str, Any]) -> Any:
        """The combine's output rows (kept as ``comb_out``; at EP = 1 its input)."""
        if "comb_in" in a:
            a["comb_out"] = self._sent_or_received(a, "comb_in", "comb_out")
        return a["comb_out"]

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
        """Each row's gradient (its token's output gradient times its probability), sent
        back to the experts, and each probability's (the output gradient dotted with the
        row)."""
        r: Route = a["route"]
        drows, a["dprobs"] = self.ks.unpermute_bwd(a["dy"], self._combined(a), a["probs"],
                                                   r.perm)
        del a["comb_out"]
        self._to_send(a, drows, "cg_in", "cg_out", sum(r.output_splits))

    def _expert_out_grad(self, a: dict[str, Any]) -> Any:
        """The gradient of the experts' output rows in local-expert order."""
        if "dey" not in a:
            a["dey"] = self._sent_or_received(a, "cg_in", "cg_out")
        return a["dey"]

    def _op_expert_unsort_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        rows = self._sent_or_received(a, "cg_in", "cg_out")
        a["dey"] = self.ks.expert_unsort_bwd(rows, a["route"].recv)

    def _op_expert_down_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["dea"] = self.ks.grouped_mm(self._expert_out_grad(a),
                                      self.W(layer, "W2e").transpose(1, 2),
                                      a["route"].local_counts)

    def _op_expert_down_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        dw = self.ks.grouped_mm_wgrad(a.pop("ea"), self._expert_out_grad(a),
                                      a["route"].local_counts)
        self.G(layer, "W2e").add_(dw)
        del a["dey"]

    def _op_expert_swiglu_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["dh1"] = self.ks.expert_swiglu_bwd(a.pop("dea"), a.pop("h1"))

    def _op_expert_gate_up_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        r: Route = a["route"]
        dx = self.ks.grouped_mm(a["dh1"], self.W(layer, "W1e").transpose(1, 2),
                                r.local_counts)
        if self.sort_tokens:
            a["dxe"] = dx
        else:
            self._to_send(a, dx, "dg_in", "dg_out", sum(r.input_splits))

    def _op_expert_gate_up_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        dw = self.ks.grouped_mm_wgrad(a.pop("xe"), a.pop("dh1"), a["route"].local_counts)
        self.G(layer, "W1e").add_(dw)

    def _op_expert_sort_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        r: Route = a["route"]
        self._to_send(a, self.ks.expert_sort_bwd(a.pop("dxe"), r.recv), "dg_in", "dg_out",
                      sum(r.input_splits))

    def _dxn2(self, a: dict[str, Any], d: Any) -> None:
        """Add ``d`` to the gradient of the normed input (the shared experts', the
        permutation's and the router's backward each give part of it)."""
        if "dxn2" in a:
            a["dxn2"].add_(d)
        else:
            a["dxn2"] = d

    def _op_permute_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        drows = self._sent_or_received(a, "dg_in", "dg_out")
        self._dxn2(a, self.ks.permute_bwd(drows, a["route"].perm))

    def _op_router_topk_bwd(self, layer: int, a: dict[str, Any], nb: int) -> None:
        a["dlogits"] = self.ks.router_topk_bwd(a.pop("dprobs"), a["probs"], a["topi"],
                                               self.n_experts)

    def _op_router_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self._dxn2(a, self.ks.router_dgrad(a["dlogits"], self.W(layer, "Wr"),
                                           dtype=self.dtype))

    def _op_router_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        g = self.ks.router_wgrad(a["xn2"], a.pop("dlogits"))
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
        self._dxn2(a, self.ks.matmul(a["dsg"], self.W(layer, "Wsg").t()))

    def _op_shared_up_dgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self.ks.matmul(a["dsu"], self.W(layer, "Wsu").t(), out=a["dxn2"], accumulate=True)

    def _op_shared_gate_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self.ks.matmul(a["xn2"].t(), a.pop("dsg"), out=self.G(layer, "Wsg"), accumulate=True)

    def _op_shared_up_wgrad(self, layer: int, a: dict[str, Any], nb: int) -> None:
        self.ks.matmul(a["xn2"].t(), a.pop("dsu"), out=self.G(layer, "Wsu"), accumulate=True)

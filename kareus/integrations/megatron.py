"""A kareus plan inside a Megatron-Core training script (``pip install "kareus[megatron]"``).

Megatron-Core builds each decoder layer from a spec (``ModuleSpec``: a class, its params,
its submodules) and runs microbatches through a pipeline schedule whose steps
(``schedules.forward_step`` and ``schedules.backward_step``) it calls by module-level name.
kareus uses exactly those two extension points (and, to chain the layers, the decoder
block's instance ``forward``), nothing forked or copied:

* [`kareus_layer_spec`][kareus.integrations.megatron.kareus_layer_spec] is the spec of
  [`KareusTransformerLayer`][kareus.integrations.megatron.KareusTransformerLayer]: Megatron's
  own ``TransformerLayer`` with the local spec's submodules, so the parameters, their names,
  checkpoints, DDP's ``main_grad`` buffers and the optimizer stay Megatron's; only the
  layer's forward is kareus's (a [`PlannedLayer`][kareus.integrations.PlannedLayer] on the
  layer's own weights, its backward through autograd into them). The spec's params carry
  the [`PlanApplier`][kareus.integrations.PlanApplier] every layer of the model shares.
* [`chain_layers`][kareus.integrations.megatron.chain_layers] (one call on the built
  model) runs the decoder block's kareus layers as one
  [`PlannedStack`][kareus.integrations.PlannedStack], so that each layer's last forward
  collective overlaps the next layer's first ops instead of running exposed: it replaces
  the ``forward`` of the model's ``TransformerBlock`` instance (the plain training call; any
  other runs Megatron's own), and ``unchain_layers`` restores it.
* [`wrap_schedule`][kareus.integrations.megatron.wrap_schedule] wraps the schedule's steps
  while it is entered, so that each microbatch's forward runs in
  ``applier.microbatch(mb, "fwd")`` and its backward in ``applier.microbatch(mb, "bwd")``
  (the plan's configuration and clock of that computation), and restores them on exit.
* [`workload_from_megatron`][kareus.integrations.megatron.workload_from_megatron] reads the
  workload a plan is made for from the ``TransformerConfig``, refusing what kareus's layer
  does not compute.
* [`moe_layer_weights`][kareus.integrations.megatron.moe_layer_weights] reads a
  Megatron-Core ``MoELayer``'s router and local experts in kareus's layout (differentiable
  views): what the planned MoE layer runs on (``kareus_layer_spec`` with an MoE workload:
  the local spec's ``MoELayer``).

The module is tested with the Megatron-Core releases in ``TESTED_MEGATRON`` and refuses
another at import (``MegatronVersionError``); set ``KAREUS_MEGATRON_UNTESTED=1`` to try
one anyway (a warning instead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import megatron.core  # type: ignore[import-untyped, import-not-found]
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # type: ignore[import-untyped, import-not-found]
from megatron.core.tensor_parallel.layers import (  # type: ignore[import-untyped, import-not-found]
    ColumnParallelLinear,
    RowParallelLinear,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention  # type: ignore[import-untyped, import-not-found]
from megatron.core.transformer.spec_utils import ModuleSpec  # type: ignore[import-untyped, import-not-found]
from megatron.core.transformer.transformer_layer import TransformerLayer  # type: ignore[import-untyped, import-not-found]
from packaging.version import Version

from kareus.errors import ArgumentError, ArgumentTypeError, KareusError, WorkloadError
from kareus.integrations._layer import PlanApplier
from kareus.integrations._megatron_config import check_layer_config, workload_from_megatron
from kareus.integrations._weights import (
    experts_from_linears,
    gate_up_from_fused,
    linear,
    qkv_from_grouped,
)
from kareus.integrations.megatron_args import workload_from_megatron_args
from kareus.model import cp_positions

__all__ = ["CHAIN_ENV", "GRAPHS_ENV", "LAYOUTS", "LAYOUT_ENV", "PLAN_ENV", "SCHEDULE_ENV",
           "TESTED_MEGATRON", "UNTESTED_ENV", "KareusCoreAttention", "KareusTransformerLayer",
           "MegatronVersionError", "SequenceParallelRMSNorm", "chain_layers",
           "check_layer_config", "check_megatron_version", "kareus_layer_spec", "layer_spec",
           "moe_layer_weights",
           "megatron_lm_applier", "release_layer_spec", "unchain_layers",
           "workload_from_megatron", "workload_from_megatron_args", "wrap_schedule"]

#: The Megatron-Core releases this module is tested with: ``(lowest, first untested)``:
#: the 0.15 and 0.16 lines (their CPU tests run with 0.15.3 and 0.16.1; Megatron-LM's
#: ``pretrain_gpt.py`` of ``core_v0.15.3`` and ``core_v0.16.1`` built kareus's layers).
TESTED_MEGATRON = ("0.15.0", "0.17.0")

#: Set to ``1`` to run with an untested Megatron-Core release (a warning, not an error).
UNTESTED_ENV = "KAREUS_MEGATRON_UNTESTED"


class MegatronVersionError(KareusError, ImportError):
    """An installed Megatron-Core release outside ``TESTED_MEGATRON``: the schedule's step
    functions and the layer's call convention this module relies on are not public API."""


def check_megatron_version(version: str | None = None) -> str:
    """The installed (or given) Megatron-Core version, checked against ``TESTED_MEGATRON``.

    Raises:
        MegatronVersionError: it is outside the tested range and ``KAREUS_MEGATRON_UNTESTED``
            is not ``1``.
    """
    v = str(version if version is not None else megatron.core.__version__)
    lo, hi = TESTED_MEGATRON
    try:
        ok = Version(lo) <= Version(v) < Version(hi)
    except ValueError:
        ok = False
    if not ok:
        msg = (f"kareus.integrations.megatron is tested with megatron-core >={lo},<{hi}, "
               f"found {v}: install one (pip install \"megatron-core>={lo},<{hi}\") or set "
               f"{UNTESTED_ENV}=1 to try this one")
        if os.environ.get(UNTESTED_ENV) != "1":
            raise MegatronVersionError(msg)
        warnings.warn(msg, stacklevel=2)
    return v


MEGATRON_VERSION = check_megatron_version()


# ------------------------------------------------------------------ the layer


class KareusTransformerLayer(TransformerLayer):  # type: ignore[misc]
    """Megatron-Core's ``TransformerLayer`` whose forward and backward kareus schedules.

    Built by Megatron from a spec exactly like its own layer
    ([`kareus_layer_spec`][kareus.integrations.megatron.kareus_layer_spec]): the same
    submodules, so the same parameters under the same names. The forward takes Megatron's
    ``[seq, batch, hidden]`` hidden states (under ``sequence_parallel=True``, which the
    applier's workload must say too, this rank's sequence shard ``[seq / TP, batch,
    hidden]``, as Megatron's own layers pass them), runs the applier's
    [`PlannedLayer`][kareus.integrations.PlannedLayer] on them (``[batch, seq, hidden]``) with
    this layer's weights as differentiable views (``kareus_weights``), and returns
    ``(output, None)`` as Megatron's layer does; the weight gradients reach the parameters
    by autograd (and Megatron DDP's hooks from there).

    With context parallelism (``context_parallel_size > 1``) the hidden states are the
    rank's two load-balanced chunks of each sequence, as Megatron-Core's
    ``get_batch_on_this_cp_rank`` and its RoPE (``get_pos_emb_on_this_cp_rank``) lay them
    out, which is kareus's CP layout: the applier's CP group must be Megatron's
    (``TorchParallelGroups.from_groups(tp=..., cp=parallel_state.get_context_parallel_group())``),
    and the layer computes the attention itself (all-gathered keys and values, whatever
    ``cp_comm_type`` of ``"p2p"`` and ``"all_gather"`` the config names).

    The layer computes causal self-attention with RoPE over whole sequences: it refuses
    (``ArgumentError``) packed sequences, inference, cross-attention, attention masks other
    than the causal one, attention biases and a RoPE other than the applier's. With
    ``kareus_applier`` set to ``None`` it runs Megatron's own forward.

    Built from the module-level ``layer_spec`` (Megatron-LM's ``--spec``), it chooses its
    submodules from its config (``qk_layernorm``) and layout, and takes the applier Megatron-LM's
    arguments make ([`megatron_lm_applier`][kareus.integrations.megatron.megatron_lm_applier]).

    Args:
        applier: The [`PlanApplier`][kareus.integrations.PlanApplier] every layer of the
            model shares (the spec's params pass it); ``None``: Megatron's own forward.
        layout: Without submodules (``layer_spec``): ``"local"`` or ``"te"`` parameter names
            (default: ``KAREUS_LAYOUT``, else from Megatron-LM's ``--transformer-impl``);
            with submodules, the layout is theirs.
        *args: ``TransformerLayer``'s positional arguments.
        **kwargs: ``TransformerLayer``'s keyword arguments (``config``, ``submodules``,
            ``layer_number``, ...).

    Raises:
        WorkloadError: the config asks for what kareus's layer does not compute, or is not
            the applier's workload's layer (``check_layer_config``).
        ArgumentError: the submodules are not the local spec's (a fused norm).
    """

    def __init__(self, *args: Any, applier: PlanApplier | _FromMegatronLM | None = None,
                 layout: str | None = None, **kwargs: Any) -> None:
        config = kwargs["config"] if "config" in kwargs else (args[0] if args else None)
        if kwargs.get("submodules") is None and len(args) < 2:
            # the module-level ``layer_spec``: the submodules of this config and layout
            if getattr(config, "persist_layer_norm", False):
                raise ArgumentError("kareus's layers use Megatron-Core's local RMSNorm "
                                    "(torch.nn.RMSNorm), which takes no persist_layer_norm: "
                                    "give Megatron-LM --no-persist-layer-norm")
            if layout is None:
                layout = _megatron_lm_layout()
            kwargs["submodules"] = _layer_submodules(
                bool(getattr(config, "qk_layernorm", False)), layout,
                cp=int(getattr(config, "context_parallel_size", 1) or 1) > 1,
                experts=getattr(config, "num_moe_experts", None))
        if isinstance(applier, _FromMegatronLM):
            applier = megatron_lm_applier(config)
        if applier is not None and not isinstance(applier, PlanApplier):
            raise ArgumentTypeError(f"applier must be a kareus PlanApplier, got "
                                    f"{type(applier).__name__}")
        config = kwargs.get("config", args[0] if args else None)
        if applier is not None and config is not None:
            # before Megatron builds the submodules: a CP config with a CP=1 applier would
            # otherwise stop in the local attention's own assertion instead of this line
            check_layer_config(config, applier.workload.model, applier.workload.parallelism.tp,
                               applier.workload.parallelism.cp,
                               ep=applier.workload.parallelism.ep)
        if applier is not None:
            _refuse_documents(applier)
        super().__init__(*args, **kwargs)
        cfg = self.config
        self._heads = int(cfg.num_attention_heads)
        self._kv_heads = int(cfg.num_query_groups or cfg.num_attention_heads)
        self._head_dim = int(cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads)
        self._tp = int(cfg.tensor_model_parallel_size or 1)
        self._qk_norm = bool(getattr(cfg, "qk_layernorm", False))
        #: ``"te"``: the norm weights live in ``linear_qkv`` and ``linear_fc1``
        #: (``layer_norm_weight``), as in Megatron's Transformer Engine spec.
        self.layout = ("te" if isinstance(getattr(self.self_attention, "linear_qkv", None),
                                          _NormedColumnParallelLinear) else "local")
        norms = (["input_layernorm", "pre_mlp_layernorm"] if self.layout == "local" else [])
        if self._qk_norm:
            norms += ["self_attention.q_layernorm", "self_attention.k_layernorm"]
        for name in norms:
            try:
                mod = self.get_submodule(name)
            except AttributeError:
                mod = None
            if not isinstance(getattr(mod, "weight", None), torch.Tensor):
                raise ArgumentError(f"KareusTransformerLayer reads {name}.weight, which the "
                                    "spec's submodules lack: build it with "
                                    "kareus_layer_spec(applier)")
        if self.layout == "te" and not isinstance(getattr(self.mlp, "linear_fc1", None),
                                                  _NormedColumnParallelLinear):
            raise ArgumentError("KareusTransformerLayer's TE layout reads "
                                "mlp.linear_fc1.layer_norm_weight, which the spec's submodules "
                                "lack: build it with kareus_layer_spec(applier, layout='te')")
        self._rope_checked: set[tuple[int, str]] = set()
        self._mask_seen: tuple[Any, ...] | None = None
        self.kareus_applier: PlanApplier | None = None
        self._planned: Any = None
        self.set_applier(applier)

    def set_applier(self, applier: PlanApplier | None) -> None:
        """Run this layer under ``applier`` (``None``: Megatron's own forward).

        The layer's own config is checked against the applier's workload, whatever made
        that workload: what kareus's layer does not compute is refused, and so is any field
        that differs from the workload's model (``check_layer_config``: dimensions,
        ``qk_layernorm``, ``layernorm_epsilon``, ``add_qkv_bias``, TP), in one line naming
        Megatron's field.

        Raises:
            WorkloadError: the config asks for what kareus's layer does not compute, or it
                is not the applier's workload's layer.
        """
        if applier is not None:
            p = applier.workload.parallelism
            check_layer_config(self.config, applier.workload.model, p.tp, p.cp,
                               recompute=applier.workload.recompute, sp=p.sequence_parallel,
                               ep=p.ep)
            _refuse_documents(applier)
            self._check_cp_group(applier)
        self.kareus_applier = applier
        self._planned = applier.layer() if applier is not None else None

    def _check_cp_group(self, applier: PlanApplier) -> None:
        """The applier's CP coordinates are this layer's in Megatron's CP group (a rank
        holding other chunks than its CP rank says would attend to the wrong keys)."""
        cp = getattr(getattr(self, "pg_collection", None), "cp", None)
        if cp is None:
            return
        megatron = (int(cp.size()), int(cp.rank()))
        mine = (applier.groups.cp_size, applier.groups.cp_rank)
        if mine != megatron:
            raise WorkloadError(f"the applier's CP group is size {mine[0]}, rank {mine[1]}; "
                                f"Megatron's is size {megatron[0]}, rank {megatron[1]}: pass "
                                "TorchParallelGroups.from_groups(tp=..., cp=parallel_state."
                                "get_context_parallel_group())")

    def kareus_weights(self) -> dict[str, Any]:
        """This rank's weights in kareus's layout (differentiable views of the parameters).

        Raises:
            ArgumentError: a submodule whose weight kareus reads has forward hooks (Megatron
                DDP's ``overlap_param_gather`` gathers parameters in such hooks): kareus
                reads the weights without calling those modules, so the hooks would not run.
        """
        att, mlp = self.self_attention, self.mlp
        moe = getattr(mlp, "router", None) is not None
        read = [("input_layernorm", self.input_layernorm),
                ("self_attention.linear_qkv", att.linear_qkv),
                ("self_attention.linear_proj", att.linear_proj),
                ("pre_mlp_layernorm", self.pre_mlp_layernorm)]
        read += ([(f"mlp.{n}", m) for n, m in mlp.named_modules() if n] if moe else
                 [("mlp.linear_fc1", mlp.linear_fc1), ("mlp.linear_fc2", mlp.linear_fc2)])
        if self._qk_norm:
            read += [("self_attention.q_layernorm", att.q_layernorm),
                     ("self_attention.k_layernorm", att.k_layernorm)]
        for name, mod in read:
            if mod._forward_pre_hooks or mod._forward_hooks:
                raise ArgumentError(f"{name} of layer {self.layer_number} has forward hooks "
                                    "(Megatron DDP's overlap_param_gather sets some): a kareus "
                                    "layer reads its weights without calling its modules, so "
                                    "they would not run; turn overlap_param_gather off")
        te = self.layout == "te"
        if moe:  # the MoE block's router and this rank's experts (local layout)
            mine = moe_layer_weights(mlp)
        else:
            wg, wu = gate_up_from_fused(mlp.linear_fc1.weight)
            mine = {"Wg": wg, "Wu": wu, "Wd": linear(mlp.linear_fc2.weight)}
        out = {"w_attn_norm": (att.linear_qkv.layer_norm_weight if te
                               else self.input_layernorm.weight),
               "Wqkv": qkv_from_grouped(att.linear_qkv.weight, heads=self._heads // self._tp,
                                        kv_heads=self._kv_heads // self._tp,
                                        head_dim=self._head_dim),
               "Wo": linear(att.linear_proj.weight),
               "w_mlp_norm": (mlp.linear_fc1.layer_norm_weight if te
                              else self.pre_mlp_layernorm.weight), **mine}
        if self._qk_norm:
            # Whole on every TP rank; each rank's heads give part of the gradient, which
            # Megatron's finalize_model_grads sums over TP (its q/k_layernorm rule)
            out["w_q_norm"] = att.q_layernorm.weight
            out["w_k_norm"] = att.k_layernorm.weight
        return out

    def forward(self, hidden_states: Any = None, attention_mask: Any = None, context: Any = None,
                context_mask: Any = None, rotary_pos_emb: Any = None,
                rotary_pos_cos: Any = None, rotary_pos_sin: Any = None,
                rotary_pos_cos_sin: Any = None, attention_bias: Any = None,
                inference_context: Any = None, packed_seq_params: Any = None,
                sequence_len_offset: Any = None, padding_mask: Any = None, *,
                inference_params: Any = None, **kwargs: Any) -> tuple[Any, Any]:
        """The layer's output ``[seq, batch, hidden]`` and ``None`` (no cross-attention
        context), as Megatron's ``TransformerLayer.forward``."""
        if self._planned is None:
            if padding_mask is not None:
                # Megatron-Core 0.16 added this argument; 0.15's layer takes none (and its
                # block never passes one), so it travels only when given
                kwargs["padding_mask"] = padding_mask
            return super().forward(  # type: ignore[no-any-return]
                hidden_states, attention_mask=attention_mask, context=context,
                context_mask=context_mask, rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                inference_context=inference_context, packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                inference_params=inference_params, **kwargs)
        unsupported = {"packed_seq_params": packed_seq_params,
                       "inference_context": inference_context,
                       "inference_params": inference_params, "context": context,
                       "context_mask": context_mask, "attention_bias": attention_bias,
                       "rotary_pos_cos": rotary_pos_cos, "rotary_pos_sin": rotary_pos_sin,
                       "rotary_pos_cos_sin": rotary_pos_cos_sin,
                       "sequence_len_offset": sequence_len_offset, "padding_mask": padding_mask}
        given = sorted(k for k, v in unsupported.items() if v is not None)
        given += sorted(k for k, v in kwargs.items() if v is not None)
        if given:
            raise ArgumentError(f"a kareus layer computes causal self-attention over whole "
                                f"sequences in training; it got {given}: run these batches "
                                "with Megatron's own layer (layer.set_applier(None))")
        if self.config.recompute_granularity == "full" and self.training:
            # Megatron's block checkpoints its layers (its _checkpointed_forward): the kareus
            # layer, which re-runs its own forward in its backward, would run three times
            raise ArgumentError("recompute_granularity='full': the kareus layer recomputes "
                                "itself, and Megatron's block would re-run it in its own "
                                "checkpoint; run the layers chained (chain_layers(model))")
        s = _sequence_length(self, hidden_states)
        self._check_mask(attention_mask, s)
        self._check_rope(rotary_pos_emb, s, hidden_states.device)
        x = hidden_states.transpose(0, 1).contiguous()
        y = self._planned(x, self.kareus_weights())
        return y.transpose(0, 1).contiguous(), None

    def _check_mask(self, mask: Any, s: int) -> None:
        """``None`` or the causal mask (``True`` above the diagonal), else a refusal."""
        if mask is None:
            return
        seen = (mask.data_ptr(), tuple(mask.shape), mask._version)
        if seen == self._mask_seen:
            return
        causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).triu(1)
        if (mask.dtype != torch.bool or tuple(mask.shape[-2:]) != (s, s)
                or not bool((mask == causal).all())):
            raise ArgumentError("a kareus layer computes causal attention: pass "
                                "attention_mask=None (or the causal mask), not a padding or "
                                "document mask")
        self._mask_seen = seen

    def _check_rope(self, emb: Any, s: int, device: Any) -> None:
        """Megatron's RoPE table (``[seq, 1, 1, head_dim]`` angles; with CP, those of the
        rank's chunks' global positions) is the applier's, checked once per sequence
        length."""
        if isinstance(emb, tuple):
            emb = emb[0]
        if emb is None:
            raise ArgumentError("a kareus layer applies RoPE: build the model with "
                                "position_embedding_type='rope'")
        if (s, str(device)) in self._rope_checked:
            return
        applier = self.kareus_applier
        assert applier is not None
        hd = self._head_dim
        inv = applier.rope_inv_freq
        if inv is None:
            inv = 1.0 / (applier.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float64)
                                                / hd))
        inv = torch.as_tensor(inv, dtype=torch.float64).cpu()
        groups = applier.groups
        pos = cp_positions(s * groups.cp_size, groups.cp_size, groups.cp_rank)
        ang = torch.outer(torch.tensor(pos, dtype=torch.float64), inv)
        want = torch.cat((ang, ang), -1)
        got = emb.detach().reshape(emb.shape[0], -1).double().cpu()
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-4):
            raise ArgumentError(f"the model's RoPE ({tuple(emb.shape)} angles) is not the "
                                f"applier's (base {applier.rope_base}, head_dim {hd}, "
                                "rotary_percent 1): pass PlanApplier(rope_base=<GPTModel's "
                                "rotary_base>) or rope_inv_freq=model.rotary_pos_emb.inv_freq")
        self._rope_checked.add((s, str(device)))


def moe_layer_weights(layer: Any) -> dict[str, Any]:
    """This rank's MoE weights of a Megatron-Core ``MoELayer`` in kareus's layout
    (``kareus.integrations.moe_weight_names``: ``Wr``, the local experts' ``W1e`` and
    ``W2e`` and, with shared experts, ``Wsg``/``Wsu``/``Wsd``), as differentiable views of
    the layer's own parameters.

    Reads every expert module Megatron-Core builds: ``SequentialMLP`` (each local expert's
    gated ``linear_fc1`` ``[2 ffn, hidden]``, gate rows first, and ``linear_fc2``),
    ``TEGroupedMLP`` (``linear_fc1.weight<i>``, ``linear_fc2.weight<i>``, the same
    layouts) and the legacy ``GroupedMLP`` (``weight1`` holding each local expert's
    ``[hidden, 2 ffn]`` block, gate columns first: ``W1e`` itself, and ``weight2`` each
    ``[ffn, hidden]``: ``W2e``).
    The local experts are this rank's (``experts / expert_model_parallel_size`` of them, in
    expert order); expert tensor parallelism must be 1 and the shared experts unsplit
    (TP = 1), as the MoE workload requires.

    Raises:
        WorkloadError: experts split over tensor parallelism, or shared experts split over
            TP.
        ArgumentTypeError: not an ``MoELayer`` (no router and experts).
    """
    router, experts = getattr(layer, "router", None), getattr(layer, "experts", None)
    if router is None or experts is None:
        raise ArgumentTypeError(f"expected a Megatron-Core MoELayer, got {type(layer).__name__}")
    config = layer.config
    tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    etp = getattr(config, "expert_tensor_parallel_size", None)
    if (tp if etp is None else int(etp)) != 1:
        raise WorkloadError("the layer's experts are split over tensor parallelism "
                            "(expert_tensor_parallel_size > 1): kareus's experts are whole: "
                            "set expert_tensor_parallel_size=1")
    n = int(layer.num_local_experts)
    if hasattr(experts, "local_experts"):  # SequentialMLP
        local = list(experts.local_experts)
        w1e, w2e = experts_from_linears([e.linear_fc1.weight for e in local],
                                        [e.linear_fc2.weight for e in local])
    elif hasattr(experts, "weight1"):  # the legacy GroupedMLP: one block per local expert
        h = int(config.hidden_size)
        w1e, w2e = experts.weight1.view(n, h, -1), experts.weight2.view(n, -1, h)
    else:  # TEGroupedMLP: one weight per local expert
        w1e, w2e = experts_from_linears(
            [getattr(experts.linear_fc1, f"weight{i}") for i in range(n)],
            [getattr(experts.linear_fc2, f"weight{i}") for i in range(n)])
    out = {"Wr": linear(router.weight), "W1e": w1e, "W2e": w2e}
    shared = getattr(layer, "shared_experts", None)
    if shared is not None:
        if tp != 1:
            raise WorkloadError("the layer's shared experts are split over tensor parallelism "
                                f"(TP={tp}): kareus's shared experts are whole (TP = 1)")
        out["Wsg"], out["Wsu"] = gate_up_from_fused(shared.linear_fc1.weight)
        out["Wsd"] = linear(shared.linear_fc2.weight)
    return out


def _refuse_documents(applier: PlanApplier) -> None:
    """A workload of packed documents (``document_tokens``) is refused: the layer attends
    causally over whole sequences (Megatron's packed sequences are refused per call)."""
    if applier.workload.document_tokens is not None:
        raise WorkloadError(f"the workload masks packed documents (document_tokens="
                            f"{applier.workload.document_tokens}); kareus's Megatron-Core "
                            "layer attends causally over whole sequences: make the workload "
                            "without document_tokens")


def _sequence_length(layer: KareusTransformerLayer, hidden_states: Any) -> int:
    """The (CP-local) sequence length of Megatron's ``[s, b, h]`` hidden states: under
    sequence parallelism each TP rank holds ``s / TP`` of it."""
    s = int(hidden_states.shape[0])
    applier = layer.kareus_applier
    if applier is not None and applier.workload.parallelism.sequence_parallel:
        s *= applier.workload.parallelism.tp
    return s


class SequenceParallelRMSNorm(torch.nn.Module):
    """RMSNorm for Megatron-Core's modules under ``sequence_parallel=True`` without
    Transformer Engine: a ``weight`` (the state-dict name of the local spec's
    ``torch.nn.RMSNorm``), ``eps``, and the weight marked ``sequence_parallel`` as
    Megatron's own sequence-parallel norms mark theirs (``TENorm``, ``FusedLayerNorm``), so
    that ``finalize_model_grads`` sums its gradient over TP (each rank's norm saw its
    sequence shard only). RMSNorm is per token, so it computes on the shard what it
    computes on the whole sequence.

    Megatron-Core 0.16's local spec cannot build an RMSNorm layer under sequence
    parallelism (its ``WrappedTorchNorm`` refuses ``sequence_parallel``, and apex's
    ``FusedLayerNorm`` is LayerNorm only); [`kareus_layer_spec`][kareus.integrations.megatron.kareus_layer_spec]
    uses this module there, and so can the ``TransformerBlock``'s final norm
    (``TransformerBlockSubmodules(layer_specs=..., layer_norm=SequenceParallelRMSNorm)``).

    Args:
        config: The ``TransformerConfig`` (its ``sequence_parallel`` is read).
        hidden_size: The normalised size.
        eps: The RMSNorm epsilon.
        **kwargs: Megatron's other norm arguments (``persist_layer_norm``, ...), unused.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ArgumentError(f"SequenceParallelRMSNorm is RMSNorm; the config has "
                                f"normalization={config.normalization!r}")
        self.eps = float(eps)
        device = "cpu" if getattr(config, "use_cpu_initialization", False) else None
        self.weight = torch.nn.Parameter(torch.ones(int(hidden_size), device=device,
                                                    dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, x: Any) -> Any:
        """``rms_norm(x) * weight`` over the last dimension."""
        return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)


#: The parameter layouts of ``kareus_layer_spec``.
LAYOUTS = ("local", "te")


def kareus_layer_spec(applier: PlanApplier | None, *, qk_layernorm: bool | None = None,
                      layout: str = "local") -> ModuleSpec:
    """The spec of a GPT decoder layer that kareus runs: Megatron-Core's local spec
    (``get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=...)``: its
    submodules, so the parameters, their names and checkpoints are Megatron's) with
    [`KareusTransformerLayer`][kareus.integrations.megatron.KareusTransformerLayer] as the
    module and ``applier`` in its params (``build_module`` passes them to the constructor).

    Pass it as ``GPTModel(config, transformer_layer_spec=kareus_layer_spec(applier), ...)``.

    With ``layout="te"`` the parameters are named as in Megatron-Core's Transformer Engine
    spec (``get_gpt_layer_with_transformer_engine_spec``), so a checkpoint of a TE-spec model
    loads into kareus's layers and saves back unchanged, without Transformer Engine
    installed: there ``input_layernorm`` and ``pre_mlp_layernorm`` are ``IdentityOp`` and the
    RMSNorm weights are ``self_attention.linear_qkv.layer_norm_weight`` and
    ``mlp.linear_fc1.layer_norm_weight`` (TE's ``TELayerNormColumnParallelLinear``: the map
    Megatron-Core's own local spec gives in its ``sharded_state_dict_keys_map``), the query
    and key norms stay ``self_attention.q_layernorm.weight`` / ``k_layernorm.weight``
    (``TENorm``), and each module keeps the ``_extra_state`` entry a TE checkpoint holds for
    it (``linear_qkv``, ``core_attention``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``:
    always, ``None`` until one is loaded; the q/k norms: when the checkpoint has one),
    returned as loaded. The weights themselves have the local spec's shapes and layouts
    (TE's are the same). With ``applier=None`` the layer runs Megatron's own forward on
    these modules (the norm applied inside ``linear_qkv`` / ``linear_fc1``, as TE's fused
    module does).

    Under sequence parallelism (the applier's workload's ``sp``, and the config's
    ``sequence_parallel=True``; the local layout only) the layer's norms are
    [`SequenceParallelRMSNorm`][kareus.integrations.megatron.SequenceParallelRMSNorm]s (the
    local spec's refuse ``sequence_parallel``; same parameter names); the model's final
    norm needs one too: pass ``TransformerBlockSubmodules(layer_specs=[spec] * num_layers,
    layer_norm=SequenceParallelRMSNorm)`` as the ``transformer_layer_spec``.

    Args:
        applier: The applier every layer shares (``None``: Megatron's own forward).
        qk_layernorm: Give the attention its per-head query and key RMSNorms
            (``self_attention.q_layernorm`` and ``k_layernorm``; the config's
            ``qk_layernorm`` must agree). ``None``: as the applier's workload's model
            (``qk_norm``), without them when there is no applier.
        layout: ``"local"`` (Megatron-Core's local spec's names) or ``"te"`` (its
            Transformer Engine spec's names).

    With a mixture-of-experts workload (``ModelArch.moe``; the config's ``num_moe_experts``
    and the rest of its MoE block must be the workload's: ``check_layer_config``) the MLP is
    the local spec's ``MoELayer`` (``get_gpt_layer_local_spec(num_experts=...)``:
    ``SequentialMLP`` experts, Megatron-Core's parameter names), run by the planned layer
    eagerly (``moe_layer_weights`` reads its router and this rank's experts); the
    applier's groups need the EP group (``TorchParallelGroups.from_groups(ep=
    parallel_state.get_expert_model_parallel_group())``); the TE layout is refused.

    With context parallelism in the applier's workload (CP > 1) the spec's core attention
    is [`KareusCoreAttention`][kareus.integrations.megatron.KareusCoreAttention], a
    stand-in without parameters: Megatron's local ``DotProductAttention`` refuses CP, and
    the kareus layer computes its attention itself.
    """
    if applier is not None and not isinstance(applier, PlanApplier):
        raise ArgumentTypeError(f"applier must be a kareus PlanApplier, got "
                                f"{type(applier).__name__}")
    if qk_layernorm is None:
        qk_layernorm = applier is not None and applier.workload.model.qk_norm
    if not isinstance(qk_layernorm, bool):
        raise ArgumentTypeError(f"qk_layernorm must be a bool or None, got "
                                f"{type(qk_layernorm).__name__}")
    cp = applier is not None and applier.workload.parallelism.cp > 1
    sp = applier is not None and applier.workload.parallelism.sequence_parallel
    if sp and layout != "local":
        raise WorkloadError("kareus_layer_spec(layout='te') does not mark its fused norms' "
                            "weights for sequence parallelism: use layout='local' with "
                            "sequence_parallel=True")
    moe = applier.workload.model.moe if applier is not None else None
    subs = _layer_submodules(qk_layernorm, layout, cp=cp,
                             experts=None if moe is None else moe.experts)
    if sp:  # the local spec's norms refuse sequence_parallel: the same RMSNorm, marked
        subs = _sequence_parallel_norms(subs, qk_layernorm)
    return ModuleSpec(module=KareusTransformerLayer, params={"applier": applier},
                      submodules=subs)


def _layer_submodules(qk_layernorm: bool, layout: str, *, cp: bool = False,
                      experts: int | None = None) -> Any:
    """The ``TransformerLayerSubmodules`` of kareus's layer in ``layout``; with ``cp`` (the
    workload's CP > 1) the core attention is the parameter-free
    [`KareusCoreAttention`][kareus.integrations.megatron.KareusCoreAttention] (Megatron's
    local attention refuses context parallelism); with ``experts`` (a mixture of experts)
    the MLP is the local spec's ``MoELayer`` (``SequentialMLP`` experts: the parameter names
    of Megatron-Core's local MoE spec)."""
    from megatron.core.transformer.identity_op import IdentityOp  # type: ignore[import-untyped, import-not-found]

    if layout not in LAYOUTS:
        raise ArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if experts and layout != "local":
        raise WorkloadError("kareus's mixture-of-experts layers take Megatron-Core's local "
                            "spec's names (SequentialMLP experts), not the Transformer Engine "
                            "spec's (TEGroupedMLP): use layout='local' (Megatron-LM: "
                            "--transformer-impl local, or KAREUS_LAYOUT=local)")
    sub = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False,
                                   normalization="RMSNorm",
                                   qk_layernorm=qk_layernorm).submodules
    attn, mlp = sub.self_attention, sub.mlp
    te = layout == "te"
    core = ((_TEStateCoreAttention if te else KareusCoreAttention) if cp
            else (_TEStateDotProductAttention if te else attn.submodules.core_attention))
    if not te and not cp:
        return sub
    attn_sub = dataclasses.replace(attn.submodules, core_attention=core)
    if not te:
        return dataclasses.replace(sub, self_attention=ModuleSpec(
            module=attn.module, params=dict(attn.params), submodules=attn_sub))
    attn_sub = dataclasses.replace(
        attn_sub, linear_qkv=_NormedColumnParallelLinear, linear_proj=_TEStateRowParallelLinear,
        **({"q_layernorm": _TEStateNorm, "k_layernorm": _TEStateNorm} if qk_layernorm else {}))
    mlp_sub = dataclasses.replace(mlp.submodules, linear_fc1=_NormedColumnParallelLinear,
                                  linear_fc2=_TEStateRowParallelLinear)
    return dataclasses.replace(
        sub, input_layernorm=IdentityOp, pre_mlp_layernorm=IdentityOp,
        self_attention=ModuleSpec(module=attn.module, params=dict(attn.params),
                                  submodules=attn_sub),
        mlp=ModuleSpec(module=mlp.module, params=dict(mlp.params), submodules=mlp_sub))


# ------------------------------------------------------------------ the TE layout's modules


class _KeptExtraState:
    """Keeps the ``_extra_state`` a checkpoint gives (TE's FP8 metadata, an empty tensor or
    ``None``) and returns it as given; ``None`` until one is loaded."""

    def set_extra_state(self, state: Any) -> None:
        self._kareus_extra_state = state

    def get_extra_state(self) -> Any:
        return getattr(self, "_kareus_extra_state", None)


class _NormedColumnParallelLinear(_KeptExtraState, ColumnParallelLinear):  # type: ignore[misc]
    """Megatron's ``ColumnParallelLinear`` with the RMSNorm before it, under Transformer
    Engine's names: ``layer_norm_weight`` (first, as TE registers it), ``weight`` and
    ``_extra_state`` (TE's ``TELayerNormColumnParallelLinear`` with RMSNorm, unfused)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = kwargs["config"]
        size = int(kwargs["input_size"] if "input_size" in kwargs else args[0])
        device = (self.weight.device if isinstance(getattr(self, "weight", None), torch.Tensor)
                  else None)
        w = torch.nn.Parameter(torch.ones(size, dtype=config.params_dtype, device=device))
        w.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
        self._parameters = {"layer_norm_weight": w, **self._parameters}  # type: ignore[has-type]
        self._norm_eps = float(config.layernorm_epsilon)

    def forward(self, input_: Any, weight: Any = None, runtime_gather_output: Any = None
                ) -> Any:
        x = torch.nn.functional.rms_norm(input_, (int(input_.shape[-1]),),
                                         self.layer_norm_weight, self._norm_eps)
        return super().forward(x, weight, runtime_gather_output)


class _TEStateRowParallelLinear(_KeptExtraState, RowParallelLinear):  # type: ignore[misc]
    """Megatron's ``RowParallelLinear`` keeping TE's ``_extra_state`` (``TERowParallelLinear``'s
    names)."""


class _TEStateDotProductAttention(_KeptExtraState, DotProductAttention):  # type: ignore[misc]
    """Megatron's ``DotProductAttention`` keeping TE's ``_extra_state``
    (``TEDotProductAttention``'s names)."""


class _TEStateNorm:
    """Megatron's local RMSNorm for the query/key norms (``TENorm``'s ``weight``), keeping an
    ``_extra_state`` entry when the checkpoint has one (Transformer Engine 2's norms do)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm  # type: ignore[import-untyped, import-not-found]

        norm = WrappedTorchNorm(*args, **kwargs)
        key = "_extra_state"

        def load(state_dict: Any, prefix: str, *rest: Any) -> None:
            if prefix + key in state_dict:
                norm._kareus_extra_state = state_dict.pop(prefix + key)

        def save(module: Any, state_dict: Any, prefix: str, *rest: Any) -> None:
            if hasattr(module, "_kareus_extra_state"):
                state_dict[prefix + key] = module._kareus_extra_state

        norm._register_load_state_dict_pre_hook(load)
        norm._register_state_dict_hook(save)
        return norm


def _sequence_parallel_norms(submodules: Any, qk_layernorm: bool) -> Any:
    """``submodules`` with [`SequenceParallelRMSNorm`][kareus.integrations.megatron.SequenceParallelRMSNorm]
    as every norm of the layer (the same parameter names)."""
    att = submodules.self_attention
    if qk_layernorm:
        att = ModuleSpec(module=att.module, params=att.params, submodules=dataclasses.replace(
            att.submodules, q_layernorm=SequenceParallelRMSNorm,
            k_layernorm=SequenceParallelRMSNorm))
    return dataclasses.replace(submodules, input_layernorm=SequenceParallelRMSNorm,
                               pre_mlp_layernorm=SequenceParallelRMSNorm, self_attention=att)


class KareusCoreAttention(torch.nn.Module):
    """The core attention of a context-parallel kareus layer: a stand-in without
    parameters or state (as Megatron's local ``DotProductAttention``, so the state dict is
    the local spec's), never called, because the kareus layer computes its attention
    itself (keys and values all-gathered over the CP group). Megatron's local attention
    refuses context parallelism, so a layer with this stand-in cannot run Megatron's own
    forward (``set_applier(None)``): calling it raises ``ArgumentError``."""

    def __init__(self, config: Any = None, layer_number: int = 1, attn_mask_type: Any = None,
                 attention_type: str = "self", **kwargs: Any) -> None:
        super().__init__()
        self.config = config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: the kareus layer computes its attention itself (``ArgumentError``)."""
        raise ArgumentError("a context-parallel kareus layer computes its attention itself; "
                            "Megatron's local attention does not run context parallelism "
                            "(run it under an applier, or build Megatron's own layers with "
                            "Transformer Engine's spec)")


class _TEStateCoreAttention(_KeptExtraState, KareusCoreAttention):
    """The context-parallel stand-in of the TE layout, keeping ``TEDotProductAttention``'s
    ``_extra_state``."""


def kareus_layers(model: Any) -> list[KareusTransformerLayer]:
    """The kareus layers of ``model`` (any wrapping: DDP, ``Float16Module``, a list)."""
    models = model if isinstance(model, list | tuple) else [model]
    return [m for mm in models for m in mm.modules() if isinstance(m, KareusTransformerLayer)]


# ------------------------------------------------------------------ Megatron-LM's --spec

#: The plan the ``layer_spec`` entry applies: the path of a ``plan.json`` (or the
#: ``kareus optimize --out`` folder holding one); unset: the ``"sequential"`` baseline.
PLAN_ENV = "KAREUS_PLAN"
#: The schedule of the ``layer_spec`` entry (``kareus``, ``sequential``, ``nanobatching``);
#: unset: ``kareus`` with a plan, ``sequential`` without.
SCHEDULE_ENV = "KAREUS_SCHEDULE"
#: ``1``: the ``layer_spec`` entry replays its layers from their own CUDA graphs (a GPU
#: only); ``0``: eager; unset: the applier's default, graphs on a CUDA device and eager
#: elsewhere (the fast path unless told otherwise).
GRAPHS_ENV = "KAREUS_GRAPHS"
#: ``0``: the ``layer_spec`` entry leaves the decoder's layers unchained (each layer its own
#: node; its workload has ``chained_layers=False``, so a plan must be made for that:
#: ``kareus optimize --megatron-args ... --unchained-layers``); default: chained
#: (``chain_layers``).
CHAIN_ENV = "KAREUS_CHAIN"
#: ``local`` or ``te``: the parameter names of the ``layer_spec`` entry's layers; unset:
#: ``te`` when Megatron-LM runs with ``--transformer-impl transformer_engine`` (its
#: default), so the checkpoints of a TE-spec run load, else ``local``.
LAYOUT_ENV = "KAREUS_LAYOUT"


class _FromMegatronLM:
    """The ``applier`` of ``layer_spec``: built from Megatron-LM's own arguments when
    Megatron builds the first layer."""

    def __repr__(self) -> str:
        return "<the applier of Megatron-LM's arguments, built with the first layer>"


class _Entry:
    """The process's ``layer_spec`` applier and the schedule wrapper it entered."""

    applier: PlanApplier | None = None
    stack: contextlib.ExitStack | None = None


def _megatron_lm_args() -> Any:
    try:
        from megatron.training import get_args  # type: ignore[import-untyped, import-not-found]
    except ImportError:
        get_args = None
    args = get_args() if get_args is not None else None
    if args is None:
        raise ArgumentError("kareus.integrations.megatron.layer_spec reads Megatron-LM's parsed "
                            "arguments (megatron.training.get_args()), which this process does "
                            "not have: run it with Megatron-LM's pretrain_gpt.py --spec "
                            "kareus.integrations.megatron layer_spec, or in your own script "
                            "build a PlanApplier and pass kareus_layer_spec(applier)")
    return args


def _megatron_lm_layout() -> str:
    layout = os.environ.get(LAYOUT_ENV)
    if layout:
        if layout not in LAYOUTS:
            raise ArgumentError(f"{LAYOUT_ENV}={layout!r}: give one of {LAYOUTS}")
        return layout
    impl = getattr(_megatron_lm_args(), "transformer_impl", "local")
    return "te" if impl == "transformer_engine" else "local"


def megatron_lm_applier(config: Any) -> PlanApplier:
    """The [`PlanApplier`][kareus.integrations.PlanApplier] of the ``layer_spec`` entry,
    built once per process from Megatron-LM's own state when Megatron builds the first
    layer: the workload from its parsed arguments and the layer's ``TransformerConfig``
    ([`workload_from_megatron_args`][kareus.integrations.megatron_args.workload_from_megatron_args]:
    microbatches from the global batch, the padded vocabulary, DP), the TP and CP groups and
    the pipeline stage from ``parallel_state``, the plan from ``KAREUS_PLAN``, RoPE's base
    from ``--rotary-base``; then it enters [`wrap_schedule`][kareus.integrations.megatron.wrap_schedule]
    for the rest of the process (with ``chain=True`` unless ``KAREUS_CHAIN=0``), before the
    trainer fetches its schedule (``get_forward_backward_func()``, which Megatron-LM calls
    in ``train()``, after building the model). Later layers get the same applier;
    [`release_layer_spec`][kareus.integrations.megatron.release_layer_spec] undoes it.

    Raises:
        ArgumentError: no Megatron-LM arguments in this process, or a second model whose
            workload differs.
        MegatronArgsError: a Megatron-LM setting kareus's layer does not compute (dropout,
            ...), named by its flag.
        PlanError: the plan was made for another job.
    """
    from megatron.core import parallel_state  # type: ignore[import-untyped, import-not-found]

    from kareus.compose.plan import Plan
    from kareus.exec.train import TorchParallelGroups

    args = _megatron_lm_args()
    workload = _entry_workload(args, config)
    if _Entry.applier is not None:
        if _Entry.applier.workload != workload:
            raise ArgumentError("layer_spec built a second model with another workload in this "
                                "process: call kareus.integrations.megatron.release_layer_spec() "
                                "between the two")
        return _Entry.applier
    plan_path = os.environ.get(PLAN_ENV)
    plan = None
    if plan_path:
        path = Path(plan_path)
        plan = Plan.load(path / "plan.json" if path.is_dir() else path)
    cp = (parallel_state.get_context_parallel_group()
          if workload.parallelism.cp > 1 else None)
    ep = workload.parallelism.ep > 1  # the expert-parallel group and its data-parallel one
    groups = TorchParallelGroups.from_groups(
        tp=parallel_state.get_tensor_model_parallel_group(), cp=cp,
        ep=parallel_state.get_expert_model_parallel_group() if ep else None,
        edp=parallel_state.get_expert_data_parallel_group() if ep else None)
    applier = PlanApplier(workload=workload, groups=groups, plan=plan,
                          schedule=os.environ.get(SCHEDULE_ENV) or None,
                          stage=parallel_state.get_pipeline_model_parallel_rank(),
                          rope_base=float(getattr(args, "rotary_base", 10000)),
                          eps=float(config.layernorm_epsilon),
                          graphs=_graphs_from_env(), start=False)
    stack = contextlib.ExitStack()
    stack.enter_context(wrap_schedule(applier, chain=os.environ.get(CHAIN_ENV) != "0"))
    _Entry.applier, _Entry.stack = applier, stack
    return applier


def _entry_workload(args: Any, config: Any) -> Any:
    """The ``layer_spec`` entry's workload: Megatron-LM's arguments' and the layer's
    config's, its layers unchained (``chained_layers=False``) under ``KAREUS_CHAIN=0``,
    where they run one by one, so that a plan is checked against what runs."""
    workload = workload_from_megatron_args(args, config=config)
    if os.environ.get(CHAIN_ENV) == "0":
        workload = workload.with_(chained_layers=False)
    return workload


def _graphs_from_env() -> bool | None:
    """``KAREUS_GRAPHS`` as the applier's ``graphs``: ``1`` True, ``0`` False, unset None."""
    value = os.environ.get(GRAPHS_ENV, "").strip()
    if value == "":
        return None
    if value not in ("0", "1"):
        raise ArgumentError(f"{GRAPHS_ENV}={value!r}: give 1 (own CUDA graphs), 0 (eager) or "
                            "leave it unset (graphs on a CUDA device)")
    return value == "1"


def release_layer_spec() -> None:
    """Leave the schedule wrapper the ``layer_spec`` entry entered and forget its applier
    (the next model built from ``layer_spec`` builds a new one). Idempotent."""
    stack, _Entry.stack, _Entry.applier = _Entry.stack, None, None
    if stack is not None:
        stack.close()


#: The ``--spec`` target of Megatron-LM's ``pretrain_gpt.py``:
#: ``--spec kareus.integrations.megatron layer_spec``. A module-level ``ModuleSpec`` (Megatron
#: takes it as it is, without calling it) of
#: [`KareusTransformerLayer`][kareus.integrations.megatron.KareusTransformerLayer] whose
#: submodules are chosen per layer from its config (``qk_layernorm``) and layout
#: (``KAREUS_LAYOUT``), and whose applier is built when the first layer is
#: ([`megatron_lm_applier`][kareus.integrations.megatron.megatron_lm_applier]).
layer_spec = ModuleSpec(module=KareusTransformerLayer, params={"applier": _FromMegatronLM()})


# ------------------------------------------------------------------ the block

#: ``TransformerBlock.forward``'s arguments that are not the plain training call (the
#: inference, packed-sequence, cross-attention and fused-RoPE inputs): given one, the
#: chained block runs Megatron's own forward (whose kareus layers refuse what they do not
#: compute).
_NOT_PLAIN = ("context", "context_mask", "rotary_pos_cos", "rotary_pos_sin",
              "rotary_pos_cos_sin", "attention_bias", "inference_context", "packed_seq_params",
              "sequence_len_offset", "padding_mask", "inference_params",
              "dynamic_inference_decode_only")

#: Where a chained block keeps the forward it replaced (``None``: the class's).
_SAVED = "_kareus_unchained_forward"


def _blocks(model: Any) -> list[Any]:
    from megatron.core.transformer.transformer_block import TransformerBlock  # type: ignore[import-untyped, import-not-found]

    models = model if isinstance(model, list | tuple) else [model]
    return [m for mm in models for m in mm.modules() if isinstance(m, TransformerBlock)]


def chain_layers(model: Any) -> Any:
    """Run the decoder layers of each ``TransformerBlock`` of ``model`` as one
    [`PlannedStack`][kareus.integrations.PlannedStack], so that each layer's last forward
    collective overlaps the next layer's first ops as the plan composes them (per layer,
    it runs exposed at every layer boundary). Returns ``model``.

    Call it once on the built model (any wrapping: ``GPTModel``, DDP, ``Float16Module``, a
    list), before or after DDP: ``chain_layers(model)``. It replaces the ``forward`` of
    each block *instance* (``model.decoder``; the class is untouched) by one that, in the
    plain training call, does what Megatron-Core's ``TransformerBlock.forward`` does with
    kareus layers: the pipeline's input tensor when the stage does not pre-process, a
    viewless input, the layers (here: one stack on their ``kareus_weights()``, with the
    layers' own checks of the mask and the RoPE and one ``[s, b, h] <-> [b, s, h]``
    transpose each way for the whole stack), the final layernorm when the stage
    post-processes. The values are those of the layers run one by one.

    Any other call runs Megatron's own block forward, layer by layer (as without
    ``chain_layers``: same values, the boundary collectives exposed): an inference,
    packed-sequence, cross-attention or fused-RoPE argument (which the kareus layers then
    refuse, typed, as they do unchained), a layer whose applier is ``None`` (Megatron's
    own layer) or not the others', forward hooks on a layer (the stack does not call the
    layers as modules: DDP's ``overlap_param_gather`` registers such hooks), and the
    configurations ``workload_from_megatron`` refuses for kareus (fp8 or fp4,
    CPU offloading), and an applier whose workload's layers are unchained
    (``Workload.chained_layers=False``: its plan costs each layer run on its own); the
    configuration and hook cases warn once per block.
    With ``recompute_granularity="full"`` the stack recomputes each layer itself (Megatron's
    block checkpoint is not used), which is how kareus layers run Megatron's full
    recomputation: unchained, a kareus layer refuses it in training. ``unchain_layers(model)`` restores the block's forward.

    Raises:
        ArgumentError: ``model`` has no ``TransformerBlock``, or one whose layers are not all
            ``KareusTransformerLayer`` (build them with ``kareus_layer_spec``).
    """
    blocks = _blocks(model)
    if not blocks:
        raise ArgumentError("chain_layers takes a Megatron-Core model with a TransformerBlock "
                            "(GPTModel's decoder); this one has none")
    for block in blocks:
        other = sorted({type(lay).__name__ for lay in block.layers
                        if not isinstance(lay, KareusTransformerLayer)})
        if other:
            raise ArgumentError(f"chain_layers chains KareusTransformerLayers; this block has "
                                f"{other}: build the model with kareus_layer_spec(applier)")
    for block in blocks:
        if not _is_chained(block):
            setattr(block, _SAVED, block.__dict__.get("forward"))
            block._kareus_warned = set()
            block.forward = types.MethodType(_chained_block_forward, block)
    return model


def unchain_layers(model: Any) -> Any:
    """Undo [`chain_layers`][kareus.integrations.megatron.chain_layers]: each block of
    ``model`` runs the forward it had before (Megatron's own, layer by layer). Returns
    ``model``; a block that is not chained is left as it is."""
    for block in _blocks(model):
        if _is_chained(block):
            saved = block.__dict__.pop(_SAVED)
            del block.forward
            if saved is not None:
                block.forward = saved
            del block._kareus_warned
    return model


def _chain_kareus_blocks(model: Any) -> None:
    """Chain each block of ``model`` whose layers are all kareus layers (others untouched)."""
    if model is None:
        return
    for block in _blocks(model):
        layers = list(block.layers)
        if (layers and not _is_chained(block)
                and all(isinstance(lay, KareusTransformerLayer) for lay in layers)):
            chain_layers(block)


def _is_chained(block: Any) -> bool:
    fwd = block.__dict__.get("forward")
    return getattr(fwd, "__func__", None) is _chained_block_forward


def _class_forward(block: Any) -> Callable[..., Any]:
    saved = block.__dict__.get(_SAVED)
    if saved is not None:
        return saved  # type: ignore[no-any-return]
    return functools.partial(type(block).forward, block)


def _why_not_chained(block: Any, args: Mapping[str, Any]) -> tuple[str, bool] | None:
    """Why this call of the block runs Megatron's own forward (and whether to warn), or
    ``None`` when it is the plain training call the stack runs."""
    if any(args.get(k) is not None for k in _NOT_PLAIN):
        return "not the plain training call", False
    layers = list(block.layers)
    if not layers:
        return "no layers", False
    applier = layers[0].kareus_applier
    if applier is None or any(lay.kareus_applier is not applier for lay in layers):
        return "a layer runs Megatron's own forward or another applier", False
    if not applier.workload.chained_layers:  # what its plan was made for: layer by layer
        return "the workload's layers are unchained (chained_layers=False)", False
    cfg = block.config
    for bad, what in ((cfg.fp8 or getattr(cfg, "fp4", None), "fp8 or fp4"),
                      (cfg.cpu_offloading, "cpu_offloading")):
        if bad:
            return f"the config sets {what}", True
    if any(lay._forward_pre_hooks or lay._forward_hooks for lay in layers):
        return "a layer has forward hooks (the stack does not call the layers as modules)", True
    return None


def _chained_block_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``TransformerBlock.forward`` with the kareus layers as one stack (``chain_layers``)."""
    from megatron.core.utils import WrappedTensor, make_viewless_tensor  # type: ignore[import-untyped, import-not-found]

    own = _class_forward(self)
    bound = inspect.signature(type(self).forward).bind(self, *args, **kwargs).arguments
    why = _why_not_chained(self, bound)
    if why is not None:
        if why[1] and why[0] not in self._kareus_warned:
            self._kareus_warned.add(why[0])
            warnings.warn(f"chain_layers: {why[0]}, so this block runs its kareus layers one "
                          "by one (each layer's last forward collective exposed)", stacklevel=2)
        return own(*args, **kwargs)
    hidden_states = bound["hidden_states"]
    if isinstance(hidden_states, WrappedTensor):
        hidden_states = hidden_states.unwrap()
    if not self.pre_process:
        hidden_states = self.input_tensor  # set_input_tensor(), as Megatron's block
    hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
    layers: list[KareusTransformerLayer] = list(self.layers)
    first = layers[0]
    applier = first.kareus_applier
    assert applier is not None
    s = _sequence_length(first, hidden_states)
    # every layer shares the applier: the first layer's checks hold for all
    first._check_mask(bound.get("attention_mask"), s)
    first._check_rope(bound.get("rotary_pos_emb"), s, hidden_states.device)
    x = hidden_states.transpose(0, 1).contiguous()
    y = applier.stack(len(layers))(x, [lay.kareus_weights() for lay in layers])
    hidden_states = y.transpose(0, 1).contiguous()
    if self.final_layernorm is not None:
        hidden_states = self.final_layernorm(hidden_states)
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True,
                                             keep_graph=True)
    return hidden_states


# ------------------------------------------------------------------ the schedule

#: The pipeline schedules whose step functions the wrapper follows.
_PLAIN = ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving")
_INTERLEAVED = "forward_backward_pipelining_with_interleaving"
_STEPS = ("forward_step", "backward_step")


class _Counters:
    """The microbatch of each step of one ``forward_backward`` call."""

    def __init__(self) -> None:
        self.bwd = 0
        self.fwd = 0
        self.num_microbatches = 1

    def reset(self) -> None:
        self.bwd = self.fwd = 0


@contextlib.contextmanager
def wrap_schedule(applier: PlanApplier, *, chain: bool = False) -> Iterator[None]:
    """While entered, each microbatch's forward in Megatron-Core's pipeline schedule runs
    in ``applier.microbatch(mb, "fwd")`` and its backward in ``applier.microbatch(mb,
    "bwd")``: the plan's configuration and clock of that computation.

    It replaces ``megatron.core.pipeline_parallel.schedules.forward_step`` and
    ``backward_step`` (which the schedules call by module-level name) and the
    forward-backward functions (to start each call's count afresh) and restores them on
    exit, an exception included. The forward's microbatch is the schedule's
    ``current_microbatch`` (counted when not given); the backward's is counted: the
    non-interleaved schedules (no pipelining, 1F1B) run the backwards in forward order.
    The interleaved (virtual-pipeline) schedule is refused. Entering a forward-backward
    call starts the applier ([`start`][kareus.integrations.PlanApplier.start],
    idempotent), where every rank of every pipeline stage reaches it.

    With ``chain=True`` each forward-backward call also chains the decoder layers of its
    ``model`` ([`chain_layers`][kareus.integrations.megatron.chain_layers] on every
    ``TransformerBlock`` whose layers are all kareus layers; once), so that a trainer that
    builds its own model (Megatron-LM's ``pretrain_gpt.py``) runs them as one stack.

    Raises:
        MegatronVersionError: Megatron-Core outside ``TESTED_MEGATRON``.
        ArgumentError: the schedule is already wrapped (entered twice).
    """
    from megatron.core.pipeline_parallel import schedules  # type: ignore[import-untyped, import-not-found]

    check_megatron_version()
    if not isinstance(applier, PlanApplier):
        raise ArgumentTypeError(f"applier must be a kareus PlanApplier, got "
                                f"{type(applier).__name__}")
    names = (*_STEPS, *_PLAIN, _INTERLEAVED)
    original = {n: getattr(schedules, n) for n in names}
    if any(getattr(f, "_kareus_wrapped", False) for f in original.values()):
        raise ArgumentError("Megatron's schedule is already wrapped: enter wrap_schedule once")
    counts = _Counters()
    fwd_sig = inspect.signature(original["forward_step"])

    def forward_step(*args: Any, **kwargs: Any) -> Any:
        bound = fwd_sig.bind_partial(*args, **kwargs).arguments
        n = int(bound.get("num_microbatches") or 1)
        counts.num_microbatches = n
        mb = bound.get("current_microbatch")
        mb = counts.fwd % n if mb is None else int(mb)
        counts.fwd += 1
        with applier.microbatch(mb, "fwd"):
            return original["forward_step"](*args, **kwargs)

    def backward_step(*args: Any, **kwargs: Any) -> Any:
        mb = counts.bwd % counts.num_microbatches
        counts.bwd += 1
        with applier.microbatch(mb, "bwd"):
            return original["backward_step"](*args, **kwargs)

    def plain(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            counts.reset()
            # Every rank enters the schedule here, before any pipeline communication: the
            # place to agree on the plan (a collective over every rank) if the applier was
            # built with start=False; in the first microbatch scope a later stage would
            # reach it only after receiving the first stage's output (a deadlock).
            applier.start()
            if chain:
                _chain_kareus_blocks(kwargs.get("model"))
            return fn(*args, **kwargs)
        return run

    @functools.wraps(original[_INTERLEAVED])
    def interleaved(*args: Any, **kwargs: Any) -> Any:
        raise ArgumentError("kareus's schedule wrapper follows the non-interleaved schedules: "
                            "set virtual_pipeline_model_parallel_size=None for kareus")

    wrapped: Mapping[str, Callable[..., Any]] = {
        "forward_step": forward_step, "backward_step": backward_step,
        **{n: plain(original[n]) for n in _PLAIN}, _INTERLEAVED: interleaved}
    try:
        for n, f in wrapped.items():
            f._kareus_wrapped = True  # type: ignore[attr-defined]
            setattr(schedules, n, f)
        yield None
    finally:
        for n, f in original.items():
            setattr(schedules, n, f)

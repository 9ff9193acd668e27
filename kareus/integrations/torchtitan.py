"""A kareus plan inside torchtitan's Llama 3 and Qwen3 dense models (torchtitan 0.3.x).

torchtitan builds a ``Llama3Model`` from nested config dataclasses, tensor-parallelizes it
with its own declarative sharding plan (``model.parallelize(parallel_dims)`` or
``parallelize_llama``) and trains it with its ``Trainer``. kareus takes over the one thing
its plans are about, each decoder layer's schedule: every ``Llama3TransformerBlock`` of the
built, parallelized model runs through a [`PlannedLayer`][kareus.integrations.PlannedLayer]
whose weights are the block's own parameters, read through differentiable views at every
call, so the gradients land in torchtitan's parameters (as DTensors under the
``partial_dtensor`` backend, as plain local shards under the default ``spmd_types``)
and torchtitan's optimizer, gradient clipping, checkpoints, embedding, final norm, LM head
and loss see nothing else.

With torchtitan's own ``Trainer`` (what its users run), one call:

* [`workload_from_trainer`][kareus.integrations.torchtitan.workload_from_trainer]: the
  workload a built ``Trainer`` runs, read from its config and model (what a plan is made
  for);
* [`wrap_trainer`][kareus.integrations.torchtitan.wrap_trainer]: ``wrap_trainer(trainer,
  plan)`` between ``config.build()`` and ``trainer.train()`` checks the plan against that
  workload, refuses what kareus does not run as torchtitan would (naming torchtitan's
  flag, before step 1), applies it and enters the plan's scopes in the Trainer's steps;
  [`main`][kareus.integrations.torchtitan.main] is torchtitan's ``-m torchtitan.train``
  with that call (``python -m kareus.integrations.torchtitan --plan plan.json ...``).

The lower-level calls, for a loop of your own:

* [`workload_from_torchtitan`][kareus.integrations.torchtitan.workload_from_torchtitan]:
  the [`Workload`][kareus.model.Workload] a plan is made for (``kareus optimize``), read from
  a ``Llama3Model`` or its config, refusing what kareus's layer does not compute;
* [`apply_plan`][kareus.integrations.torchtitan.apply_plan]: builds the
  [`PlanApplier`][kareus.integrations.PlanApplier] from the model (its RoPE frequencies,
  its TP group) and routes each block's forward through it, the decoder's blocks chained
  into one stack where they can be;
* the two ``with applier.microbatch(...)`` lines around each microbatch's forward and
  backward (the ``"kareus"`` schedule needs them).

**Layouts.** torchtitan's fused ``wqkv`` packs its rows per key/value head (the group's
query heads, its key head, its value head) and rotates interleaved pairs ``(2i, 2i + 1)``
with complex numbers; separate ``wq``/``wk``/``wv`` rotate the same way. kareus's layer
reads query, key and value heads blocked and rotates halves, so the query and key rows of
each head are reordered (the same attention scores: see ``kareus.integrations._weights``).
The RoPE frequencies are taken from the block's own rope cache, so Llama 3.1's scaled
frequencies are the model's, not a recomputation. Qwen3's blocks rotate halves
(``CosSinRoPE``): their rows keep their order; their per-head ``q_norm``/``k_norm``
weights become the planned layer's ``w_q_norm``/``w_k_norm`` (see ``_head_norm`` for
their gradient under TP).

**Sequence parallelism** (``parallelism.enable_sequence_parallel``, on by default in
torchtitan 0.3): its TP plan passes each block this rank's sequence shard (``[batch, seq /
TP, hidden]``; a DTensor placed ``Shard(1)`` over ``tp`` under ``partial_dtensor``) and
keeps the norms on it. The workload says so too (``Parallelism.sp``, read from the model's
sharding plan by ``workload_from_torchtitan``); the planned layer then takes and returns
the shard (the TP all-gathers and reduce-scatters inside it, as torchtitan's plan does
them around the projections). The norm weights' gradients are this rank's part, handed
back as torchtitan's own blocks hand theirs (see ``_head_norm``).

**Why the forward of each block instance is replaced** (an instance attribute, the way
torchtitan's ``Module.parallelize`` wraps the forward of the modules it shards) rather
than the class changed or a config ``@override`` used: the plan is applied to one
already built and parallelized model, whose parameters stay where they are; torchtitan's
classes are not touched, other models in the process are unaffected, and
[`remove_plan`][kareus.integrations.torchtitan.remove_plan] restores the block.

**Chained blocks.** One planned layer per block is one autograd node per block, so the last
forward all-reduce of every layer would run exposed. torchtitan's ``Decoder.forward`` runs
its blocks back to back (embeddings, then ``for layer in self.layers.values(): h =
layer(h, attention_masks, positions)`` with nothing in between, then the final norm and
the LM head), so by default ``apply_plan`` runs them as one
[`PlannedStack`][kareus.integrations.PlannedStack]: it wraps the decoder's forward on the
instance (around torchtitan's own redistribution wrapper) to mark the loop, and gives the
``layers`` container an instance ``values`` that hands that one loop a single callable
running the stack (every other caller gets the blocks). Blocks with anything around their
call that a stack would skip (FSDP's ``fully_shard`` hooks, module hooks,
``torch.compile``) run per block, checked at every forward; ``chain=False`` turns it off,
``chain=True`` requires it. The workload says which runs (``Workload.chained_layers``), so
that the plan's partitions are those that run: torchtitan's ``Trainer`` wraps every block
in FSDP, so under it the blocks never chain, ``workload_from_trainer`` says
``chained_layers=False`` and the plan costs each block run on its own (its first ops bare,
its last collective exposed); a plan for chained layers is refused where the blocks cannot
chain, and a workload of unchained layers runs per block wherever it is applied.

Tested with torchtitan 0.3.0 on torch 2.14.1 (``pip install "kareus[torchtitan]"``; its
Trainer does not run on torch 2.13); other torchtitan versions are refused (their model API
differs: 0.3 rebuilt it).
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from kareus._logging import get_logger
from kareus.errors import ArgumentError, ArgumentTypeError, PlanError, WorkloadError
from kareus.integrations._layer import PlanApplier
from kareus.integrations._torchtitan_moe import moe_of_layer
from kareus.integrations._weights import LAYER_WEIGHTS, head_norm, linear, qkv_from_separate
from kareus.model.moe import MoEArch
from kareus.model.workload import ModelArch, Parallelism, Workload

__all__ = ["TESTED_VERSIONS", "apply_plan", "chained_blocks", "main", "masks_documents",
           "moe_block_weights", "planned_blocks", "recompute_from_torchtitan", "remove_plan",
           "sequence_parallel_of", "workload_from_torchtitan",
           "workload_from_torchtitan_config", "workload_from_trainer", "wrap_trainer"]

#: The torchtitan releases this adapter is tested with (a ``packaging`` specifier).
TESTED_VERSIONS = ">=0.3,<0.4"

#: The attribute a planned block keeps its applier under.
_APPLIER_ATTR = "_kareus_applier"

#: The attribute a chained decoder keeps its chain under.
_CHAIN_ATTR = "_kareus_chain"

#: The attribute a planned block (or its checkpoint wrapper) keeps torch.compile's
#: compiled call under while the planned layer runs uncompiled.
_COMPILED_ATTR = "_kareus_compiled_call_impl"

_checked_version: str | None = None

_log = get_logger(__name__)


def check_torchtitan_version() -> str:
    """The installed torchtitan's version, refused unless it is 0.3.x.

    Raises:
        ArgumentError: torchtitan is missing or of another release.
    """
    global _checked_version
    if _checked_version is not None:
        return _checked_version
    from importlib import metadata

    try:
        version = metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        raise ArgumentError('torchtitan is not installed: pip install "kareus[torchtitan]" '
                            f"(torchtitan{TESTED_VERSIONS})") from None
    parts = version.split(".")
    if parts[:2] != ["0", "3"]:
        raise ArgumentError(f"kareus.integrations.torchtitan is tested with torchtitan 0.3.x; "
                            f"found {version}: pip install \"torchtitan{TESTED_VERSIONS}\"")
    _checked_version = version
    return version


# ------------------------------------------------------------------ the model's dimensions


def _model_config(model_or_config: Any) -> Any:
    """The ``Decoder.Config`` of a built torchtitan model, or the config itself."""
    Decoder = _classes().Decoder
    if isinstance(model_or_config, Decoder.Config):
        return model_or_config
    cfg = getattr(model_or_config, "config", None)
    if isinstance(cfg, Decoder.Config):
        return cfg
    raise ArgumentTypeError("expected a torchtitan Llama3Model (built) or its "
                            f"Llama3Model.Config, got {type(model_or_config).__name__}")


def _classes() -> Any:
    """torchtitan's classes this adapter reads (imported on first use)."""
    global _CLASSES
    if _CLASSES is None:
        check_torchtitan_version()
        from torchtitan.models.common import attention  # type: ignore[import]
        from torchtitan.models.common.decoder import Decoder  # type: ignore[import]
        from torchtitan.models.common.feed_forward import FeedForward  # type: ignore[import]
        from torchtitan.models.common.linear import Linear  # type: ignore[import]
        from torchtitan.models.common.nn_modules import RMSNorm  # type: ignore[import]
        from torchtitan.models.common.rope import (  # type: ignore[import]
            ComplexRoPE,
            CosSinRoPE,
        )
        from torchtitan.models.llama3.model import (  # type: ignore[import]
            Llama3TransformerBlock,
        )
        from torchtitan.models.qwen3.model import (  # type: ignore[import]
            Qwen3TransformerBlock,
        )

        _CLASSES = types.SimpleNamespace(
            Decoder=Decoder, FeedForward=FeedForward, Linear=Linear, ComplexRoPE=ComplexRoPE,
            CosSinRoPE=CosSinRoPE, RMSNorm=RMSNorm,
            Blocks=(Llama3TransformerBlock, Qwen3TransformerBlock),
            GQAttention=attention.GQAttention,
            QKVLinear=attention.QKVLinear, FusedQKVLinear=attention.FusedQKVLinear,
            SDPA=attention.ScaledDotProductAttention, Flex=attention.FlexAttention,
            Varlen=attention.VarlenAttention)
    return _CLASSES


_CLASSES: Any = None


def _check_layer(where: str, lc: Any) -> None:
    """Refuse a layer config whose modules kareus's layer does not compute."""
    tt = _classes()
    if not any(isinstance(lc, b.Config) for b in tt.Blocks):
        raise WorkloadError(f"{where} is a {type(lc).__qualname__}: kareus applies plans to "
                            "Llama3TransformerBlock and Qwen3TransformerBlock layers only")
    moe = getattr(lc, "moe", None) is not None
    if moe == (lc.feed_forward is not None):
        raise WorkloadError(f"{where} has {'both' if moe else 'neither'} a feed_forward "
                            f"{'and' if moe else 'nor'} a moe: kareus's layer has one MLP, "
                            "dense or a mixture of experts")
    if not moe and type(lc.feed_forward) is not tt.FeedForward.Config:
        raise WorkloadError(f"{where}'s MLP is a {type(lc.feed_forward).__qualname__}: "
                            "kareus's layer computes torchtitan's plain FeedForward (SwiGLU)")
    att = lc.attention
    if type(att) is not tt.GQAttention.Config:
        raise WorkloadError(f"{where}'s attention is a {type(att).__qualname__}: kareus's "
                            "layer computes GQAttention")
    if type(att.qkv_linear) not in (tt.QKVLinear.Config, tt.FusedQKVLinear.Config):
        raise WorkloadError(f"{where}'s QKV projection is a "
                            f"{type(att.qkv_linear).__qualname__} (e.g. tp_gemm_backend "
                            "dist_gemm): kareus runs its own collectives; use the default "
                            "tp_gemm_backend")
    if type(att.wo) is not tt.Linear.Config:
        raise WorkloadError(f"{where}'s output projection is a {type(att.wo).__qualname__}: "
                            "use the default tp_gemm_backend")
    if type(att.rope) not in (tt.ComplexRoPE.Config, tt.CosSinRoPE.Config):
        raise WorkloadError(f"{where}'s RoPE is a {type(att.rope).__qualname__}: kareus "
                            "reads torchtitan's ComplexRoPE (Llama 3's interleaved pairs) "
                            "and CosSinRoPE (Qwen3's rotate-half)")
    inner = att.inner_attention
    if isinstance(inner, tt.Varlen.Config):
        if tuple(inner.window_size) != (-1, 0):
            raise WorkloadError(f"{where} attends within a window {inner.window_size}: "
                                "kareus's layer is causal over the whole sequence")
    elif not isinstance(inner, (tt.SDPA.Config, tt.Flex.Config)):
        raise WorkloadError(f"{where}'s inner attention is a {type(inner).__qualname__}: "
                            "kareus's layer computes causal attention (SDPA, flex, varlen)")
    ff = lc.feed_forward
    qkv = att.qkv_linear
    linears = ([] if moe else [ff.w1, ff.w2, ff.w3]) + [att.wo] + (
        [qkv.wqkv] if hasattr(qkv, "wqkv") else [qkv.wq, qkv.wkv])
    if any(getattr(lin, "bias", False) for lin in linears):
        raise WorkloadError(f"{where} has biases in its projections: kareus's layer has none")
    _check_norms(where, lc)


def _check_norms(where: str, lc: Any) -> None:
    """Refuse norms other than RMSNorms with a weight (the query/key norm's over a head)."""
    rms = _classes().RMSNorm.Config
    qk = lc.attention.qk_norm
    if qk is not None and (type(qk) is not rms or not qk.elementwise_affine):
        raise WorkloadError(f"{where}'s qk_norm is a {type(qk).__qualname__} without a "
                            "weight or not an RMSNorm: kareus's layer computes an RMSNorm "
                            "with a weight over each head (Qwen3's)")
    for name in ("attention_norm", "ffn_norm"):
        norm = getattr(lc, name)
        if type(norm) is not rms or not norm.elementwise_affine:
            raise WorkloadError(f"{where}'s {name} is a {type(norm).__qualname__} (or has no "
                                "weight): kareus's layer computes an RMSNorm with a weight")
    _layer_eps(where, lc)


def _layer_eps(where: str, lc: Any) -> float:
    """The one RMSNorm epsilon of a layer's norms (kareus's layer uses one, the model's
    ``norm_eps``), refusing norms that differ."""
    names = ["attention_norm", "ffn_norm"] + (["attention.qk_norm"]
                                              if lc.attention.qk_norm is not None else [])
    eps = {n: float((lc.attention.qk_norm if n == "attention.qk_norm"
                     else getattr(lc, n)).eps) for n in names}
    if len(set(eps.values())) > 1:
        raise WorkloadError(f"{where}'s norms have different eps ({eps}): kareus's layer "
                            "takes one RMSNorm epsilon per model")
    return eps["attention_norm"]


def _layer_dims(i: int, lc: Any, dim: int
                ) -> tuple[int, int, int, int, bool, float, MoEArch | None]:
    """``(heads, kv_heads, head_dim, ffn, qk_norm, eps, moe)`` of layer config ``lc``,
    refusing what kareus's layer does not compute. An MoE layer's ``ffn`` is its experts'
    width (torchtitan's MoE config has no dense width, which no layer of an all-MoE model
    uses)."""
    where = f"layer {i}"
    _check_layer(where, lc)
    att, ff = lc.attention, lc.feed_forward
    heads = int(att.n_heads)
    kv = int(att.n_kv_heads if att.n_kv_heads is not None else heads)
    hd = int(att.head_dim if att.head_dim is not None else dim // heads)
    if int(att.rope.dim) != hd:
        raise WorkloadError(f"{where} rotates {att.rope.dim} of {hd} dimensions per head: "
                            "kareus's layer rotates the whole head (partial RoPE is not "
                            "supported)")
    moe = None if getattr(lc, "moe", None) is None else moe_of_layer(where, lc, dim)
    if moe is None and int(ff.w1.in_features) != dim:
        raise WorkloadError(f"{where}'s MLP takes {ff.w1.in_features} features, the model "
                            f"{dim}")
    qk = att.qk_norm is not None
    if qk and int(att.qk_norm.normalized_shape) != hd:
        raise WorkloadError(f"{where}'s qk_norm normalizes {att.qk_norm.normalized_shape} "
                            f"features, a head has {hd}: kareus normalizes each head")
    ffn = int(ff.w1.out_features) if moe is None else moe.expert_ffn
    return heads, kv, hd, ffn, qk, _layer_eps(where, lc), moe


def model_arch_from_torchtitan(model_or_config: Any, *, name: str = "torchtitan-llama3"
                               ) -> ModelArch:
    """The [`ModelArch`][kareus.model.ModelArch] of a torchtitan Llama 3 or Qwen3 model,
    dense or Qwen3 MoE (built or config): ``dim``, the layer count, heads, key/value heads,
    head dimension, the SwiGLU hidden size as the model builds it (``feed_forward.w1``'s
    output features), the vocabulary, and the layer features: ``qk_norm`` (the attention's
    per-head ``qk_norm``, Qwen3's), ``norm_eps`` (the norms' one epsilon) and
    ``tied_embeddings`` (``enable_weight_tying``).

    A Qwen3 MoE model's layers (``moe`` set, every layer) give ``ModelArch.moe``
    (``kareus.integrations._torchtitan_moe``: experts, top-k, the experts' width, shared
    experts), and ``ffn`` is the experts' width (torchtitan's MoE config has no dense
    width); what kareus's MoE block does not compute (``load_balance_coeff``, torchtitan's
    default aux-loss-free balancing, sigmoid scores, no ``route_norm``, ``route_scale``,
    group-limited routing, another dispatcher or expert module) is refused in one line.
    Such a model is planned and emulated, and ``apply_plan`` runs its blocks under a plan
    (TP = 2 or more with sequence parallelism and EP folded over TP, or EP over CP).

    Raises:
        ArgumentTypeError: not a torchtitan decoder model or config.
        WorkloadError: a layer kareus's layer does not compute (an MoE setting above, a
            query/key norm other
            than an RMSNorm with a weight over each head, norms of different eps, biases,
            partial RoPE, windowed attention, a fused TP GEMM backend), or layers of
            different shapes.
    """
    cfg = _model_config(model_or_config)
    dim = int(cfg.dim)
    layers = list(cfg.layers)
    if not layers:
        raise WorkloadError("the model has no layers")
    dims = [_layer_dims(i, lc, dim) for i, lc in enumerate(layers)]
    if any(d != dims[0] for d in dims):
        odd = next(i for i, d in enumerate(dims) if d != dims[0])
        raise WorkloadError(f"the layers differ in shape (layer 0 {dims[0]}, layer {odd} "
                            f"{dims[odd]}): a plan is made for one layer shape (a model whose "
                            "every layer is dense, or every layer a mixture of experts)")
    heads, kv, hd, ffn, qk, eps, moe = dims[0]
    return ModelArch(name=name, layers=len(layers), hidden=dim, heads=heads, kv_heads=kv,
                     head_dim=hd, ffn=ffn, vocab=int(cfg.vocab_size), qk_norm=qk,
                     norm_eps=eps,
                     tied_embeddings=bool(getattr(cfg, "enable_weight_tying", False)),
                     moe=moe)


def sequence_parallel_of(model_or_config: Any) -> bool | None:
    """Whether torchtitan's TP plan of a model (or its config) is sequence parallel
    (``parallelism.enable_sequence_parallel``): its blocks' attention norm takes the
    sequence sharded over ``tp`` (``Shard(1)``). ``None`` when the model has no TP plan
    (its config was not updated from a ``ParallelismConfig``)."""
    from torchtitan.distributed.parallel_dims import MeshAxisName  # type: ignore[import]

    layers = list(_model_config(model_or_config).layers or [])
    norm = getattr(layers[0], "attention_norm", None) if layers else None
    sc = getattr(norm, "sharding_config", None)
    layout = None if sc is None else (sc.in_src_shardings or {}).get("input")
    if layout is None:
        return None
    tp_type = layout.per_axis_spmd_types().get(MeshAxisName.TP)
    return getattr(tp_type, "dim", None) == 1


#: What torchtitan 0.3's per-op selective checkpointing keeps and re-runs, for messages.
_SELECTIVE_DIFFERS = ("torchtitan's selective is per-op (it keeps attention's output and every "
                      "other matmul's and re-runs the norms, RoPE, SwiGLU and the other "
                      "matmuls), not kareus's selective (the attention core re-run, all else "
                      "kept)")


def recompute_from_torchtitan(activation_checkpoint: Any, *,
                              selective_as: str | None = None) -> str:
    """The recomputation policy (``Workload.recompute``) kareus's planned layers run for
    torchtitan 0.3's ``Trainer.Config.activation_checkpoint``.

    * ``None`` (the ``none`` subcommand): every activation kept: ``"none"``;
    * ``FullAC.Config`` (``full``): every block re-run from its input in the backward:
      ``"full"`` (kareus's layer recomputes itself: torchtitan's checkpoint wrapper around
      each planned block calls it directly);
    * ``SelectiveAC.Config`` (``selective``, torchtitan's default) is per-op selective
      checkpointing: it keeps the outputs of attention, every other matmul and the
      reduce-scatters and recomputes the rest. That is none of kareus's policies (its
      ``"selective"`` re-runs the attention core alone and keeps everything else), so it
      is not mapped silently: ``selective_as`` names the policy the planned layers run in
      its place (``"selective"``, ``"full"`` or ``"none"``: the same values, other memory
      and time; the plan is made for that policy), and without it the setting is refused.
      torchtitan 0.3 has no per-layer selective option (``every N layers``) to map.
    * ``MemoryBudgetAC.Config`` (``memory-budget``: the compiler chooses what to keep):
      refused.

    Also takes the subcommand names (``"none"``, ``"full"``, ``"selective"``,
    ``"memory-budget"``).

    Raises:
        WorkloadError: a setting kareus's layer does not run (one line naming it).
        ArgumentTypeError: not an ``activation_checkpoint`` setting.
        ArgumentError: ``selective_as`` is not a recomputation policy.
    """
    from kareus.model.workload import RECOMPUTE_POLICIES

    if selective_as is not None and selective_as not in RECOMPUTE_POLICIES:
        raise ArgumentError(f"selective_as must be one of {RECOMPUTE_POLICIES}, got "
                            f"{selective_as!r:.40}")
    names = {"none": "none", "full": "full", "selective": None, "memory-budget": None}
    if activation_checkpoint is None:
        return "none"
    if isinstance(activation_checkpoint, str):
        if activation_checkpoint not in names:
            raise ArgumentTypeError(f"activation_checkpoint must be one of {sorted(names)} "
                                    f"or its config, got {activation_checkpoint!r:.40}")
        kind = activation_checkpoint
    else:
        from torchtitan.distributed.activation_checkpoint import (  # type: ignore[import-untyped, import-not-found]
            FullAC,
            MemoryBudgetAC,
            SelectiveAC,
        )

        kinds = ((FullAC.Config, "full"), (SelectiveAC.Config, "selective"),
                 (MemoryBudgetAC.Config, "memory-budget"))
        found = next((k for cls, k in kinds if type(activation_checkpoint) is cls), None)
        if found is None:
            raise ArgumentTypeError(f"activation_checkpoint must be torchtitan's FullAC, "
                                    f"SelectiveAC or MemoryBudgetAC config or None, got "
                                    f"{type(activation_checkpoint).__name__}")
        kind = found
    if kind == "selective":
        if selective_as is None:
            raise WorkloadError(f"activation_checkpoint is selective: {_SELECTIVE_DIFFERS}; "
                                "name the policy kareus's layers run in its place "
                                "(selective_as='selective', 'full' or 'none'; kareus optimize "
                                "--selective-as), or set activation-checkpoint:full or "
                                "activation-checkpoint:none")
        return selective_as
    if kind == "memory-budget":
        raise WorkloadError("activation_checkpoint is memory-budget (the compiler chooses "
                            "what to recompute), not a policy kareus's layer runs: set "
                            "activation-checkpoint:full, activation-checkpoint:none or "
                            "activation-checkpoint:selective")
    return names[kind]  # type: ignore[return-value]


def workload_from_torchtitan(model_or_config: Any, *, tp: int, cp: int = 1,
                             microbatch_size: int, seq_len: int, num_microbatches: int,
                             nanobatches: int = 2, pp: int = 1, dp: int = 1,
                             name: str = "torchtitan-llama3",
                             recompute: str = "full", sp: bool | None = None,
                             document_tokens: int | None = None, ep: int = 1) -> Workload:
    """The workload ``kareus optimize`` makes a plan for, from a torchtitan Llama 3 model.

    Args:
        model_or_config: A built ``Llama3Model`` (parallelized or not) or its
            ``Llama3Model.Config``.
        tp: Tensor-parallel degree (``parallelism.tensor_parallel_degree``).
        cp: Context-parallel degree (``apply_plan`` takes 1 only: torchtitan's CP is its
            own attention over load-balanced chunks).
        microbatch_size: Sequences per microbatch: ``training.local_batch_size`` (each
            gradient accumulation step runs one local batch; the steps are
            ``num_microbatches``).
        seq_len: Tokens per sequence (``training.seq_len``).
        num_microbatches: Microbatches per optimizer step: the Trainer's
            ``gradient_accumulation_steps`` (``training.global_batch_size`` over
            ``training.local_batch_size`` times the data-parallel degree).
        nanobatches: The nanobatch count of the baseline ``"nanobatching"`` schedule.
        pp: Pipeline-parallel degree; dp: data-parallel degree (for the plan's job size).
        name: The model's name in the workload.
        recompute: The recomputation policy: the trainer's
            (``recompute_from_torchtitan(config.activation_checkpoint)``).
        sp: Sequence parallelism (``parallelism.enable_sequence_parallel``); ``None``: as
            the model's TP plan says ([`sequence_parallel_of`][kareus.integrations.torchtitan.sequence_parallel_of];
            off without one).
        document_tokens: Where the model's attention masks packed documents
            ([`masks_documents`][kareus.integrations.torchtitan.masks_documents]), their
            length the plan is costed for (``Workload.document_tokens``); ``apply_plan``
            refuses a plan for such a model without it, and it for a model whose attention
            masks none.
        ep: Expert-parallel degree of a Qwen3 MoE model
            (``parallelism.expert_parallel_degree``); it must divide ``tp x cp x dp``.

    Raises:
        ArgumentTypeError: not a torchtitan model or config.
        WorkloadError: the model has a layer kareus's layer does not compute (see
            [`model_arch_from_torchtitan`][kareus.integrations.torchtitan.model_arch_from_torchtitan]),
            or the degrees do not divide its heads, or an MoE model at TP > 1 without
            expert parallelism (torchtitan then splits the experts over TP).
    """
    arch = model_arch_from_torchtitan(model_or_config, name=name)
    if sp is None:
        sp = bool(sequence_parallel_of(model_or_config))
    _check_moe_degrees(arch, tp, ep)
    return Workload(model=arch, parallelism=Parallelism(tp=tp, cp=cp, pp=pp, dp=dp,
                                                        sp=bool(sp), ep=ep),
                    microbatch_size=microbatch_size, seq_len=seq_len,
                    num_microbatches=num_microbatches, nanobatches=nanobatches,
                    recompute=recompute, document_tokens=document_tokens)


def _check_moe_degrees(arch: ModelArch, tp: int, ep: int) -> None:
    """Refuse what torchtitan's MoE runs at these degrees and kareus does not: at TP > 1
    with expert parallelism off, torchtitan splits each expert's hidden dimension over TP
    (its dense placement), where kareus's experts are whole on every rank."""
    if arch.moe is not None and int(tp) > 1 and int(ep) == 1:
        raise WorkloadError(f"at tensor_parallel_degree={tp} with expert_parallel_degree=1 "
                            "torchtitan splits every expert over TP, and kareus's experts are "
                            "not split over TP: set parallelism.expert_parallel_degree > 1 "
                            "(it folds the TP ranks into expert parallelism)")


# ------------------------------------------------------------------ the blocks' weights


def _local(t: Any) -> Any:
    """This rank's shard of a parameter: ``DTensor.to_local()`` (differentiable: the
    gradient comes back as a DTensor of the parameter's placements), or the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def moe_block_weights(moe: Any) -> dict[str, Any]:
    """This rank's weights of a torchtitan 0.3 ``MoE`` module (a Qwen3 MoE block's
    ``moe``) in kareus's layout (``kareus.integrations.moe_weight_names``): ``Wr`` from the
    router's ``gate`` (``[experts, dim]``, transposed), the local experts' ``W1e`` and
    ``W2e`` from ``GroupedExperts``' ``w1_EFD`` (gate), ``w3_EFD`` (up) and ``w2_EDF``
    (down) (``kareus.integrations.experts_from_stacked``;
    under expert parallelism each a DTensor sharded over ``ep`` on the expert dimension:
    this rank's shard), and the shared experts' ``w1``/``w3``/``w2`` when the block has
    them. Differentiable views of the module's parameters. The router's weight is whole
    on every rank and applied to this rank's tokens (its sequence shard under TP), so its
    gradient is handed back as this rank's part, as the query/key norms' are
    (``_head_norm``).

    Raises:
        ArgumentTypeError: not a torchtitan ``MoE`` module.
    """
    from kareus.integrations._weights import experts_from_stacked

    routed, router = getattr(moe, "routed_experts", None), getattr(moe, "router", None)
    inner = getattr(routed, "inner_experts", None)
    if inner is None or router is None:
        raise ArgumentTypeError(f"expected a torchtitan MoE module, got {type(moe).__name__}")
    w1e, w2e = experts_from_stacked(_local(inner.w1_EFD), _local(inner.w3_EFD),
                                    _local(inner.w2_EDF))
    out = {"Wr": linear(_head_norm(router.gate.weight)), "W1e": w1e, "W2e": w2e}
    shared = getattr(moe, "shared_experts", None)
    if shared is not None:
        out["Wsg"] = linear(_local(shared.w1.weight))
        out["Wsu"] = linear(_local(shared.w3.weight))
        out["Wsd"] = linear(_local(shared.w2.weight))
    return out


def _head_norm(weight: Any) -> Any:
    """This rank's query/key norm weight: whole on every TP rank, applied to its own heads,
    so each rank's backward yields only its heads' part of the gradient (and, under
    sequence parallelism, the attention and MLP norms' weights: applied to this rank's
    sequence shard, the same holds).

    What torchtitan's own module hands back differs by SPMD backend, and the view does the
    same: under ``spmd_types`` the parameter is a plain tensor typed replicated, whose
    gradient stays this rank's part (summing it is left to what reduces replicated
    gradients); under ``partial_dtensor`` it is a DTensor replicated over TP, whose
    gradient DTensor sums over the TP ranks. So the DTensor's local view declares its
    gradient partial over the ``tp`` mesh dimension (``to_local(grad_placements=...)``):
    DTensor then sums the parts, neither twice nor not at all (checked against torchtitan's
    blocks in the gloo tests, both backends)."""
    to_local = getattr(weight, "to_local", None)
    if not callable(to_local):
        return weight
    from torch.distributed.tensor import Partial

    names = tuple(getattr(weight.device_mesh, "mesh_dim_names", None) or ())
    if not names and len(weight.placements) == 1:
        names = ("tp",)  # the TP plan's one-dimensional mesh
    grads = tuple(Partial() if name == "tp" and p.is_replicate() else p
                  for name, p in zip(names, weight.placements, strict=True))
    return to_local(grad_placements=grads)


def _grouped_rope_order(kv_heads: int, per_kv: int, head_dim: int, device: Any,
                        interleaved: bool = True) -> Any:
    """Rows of a local fused ``wqkv`` (``[kv_heads, per_kv + 2, head_dim]`` rows: each
    group's query heads, key head, value head) in kareus's order: every query head, then
    every key head, then every value head; with ``interleaved``, the query and key rows of
    each head taking interleaved RoPE pairs to halves (``0, 2, 4, ..., 1, 3, 5, ...``)."""
    import torch

    r = per_kv + 2
    plain = torch.arange(head_dim)
    halves = (torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
              if interleaved else plain)

    def head(g: int, j: int, rope: bool) -> Any:
        return (g * r + j) * head_dim + (halves if rope else plain)

    rows = [head(g, j, True) for g in range(kv_heads) for j in range(per_kv)]
    rows += [head(g, per_kv, True) for g in range(kv_heads)]
    rows += [head(g, per_kv + 1, False) for g in range(kv_heads)]
    return torch.cat(rows).to(device)


class _BlockLayout:
    """How one torchtitan block's parameters become kareus's ``LAYER_WEIGHTS``."""

    def __init__(self, block: Any, *, sp: bool = False) -> None:
        att = block.attention
        self.sp = sp  # the norms saw this rank's sequence shard: their gradients, a part
        self.head_dim = int(att.head_dim)
        self.fused = isinstance(att.qkv_linear, _classes().FusedQKVLinear)
        # Llama 3's ComplexRoPE rotates interleaved pairs, Qwen3's CosSinRoPE halves
        self.interleaved = isinstance(att.rope, _classes().ComplexRoPE)
        self.qk_norm = getattr(att, "q_norm", None) is not None
        #: A Qwen3 MoE block: its MLP is the ``moe`` module (``moe_block_weights``).
        self.moe = getattr(block, "moe", None) is not None
        self.shared_experts = self.moe and block.moe.shared_experts is not None
        self.per_kv = int(att.n_heads) // int(att.n_kv_heads)
        # FlexAttention / VarlenAttention: the decoder's masks are block_causal documents
        self.documents = isinstance(att.inner_attention, (_classes().Flex,
                                                          _classes().Varlen))
        self._order: dict[tuple[int, str], Any] = {}

    def _fused_qkv(self, w: Any) -> Any:
        rows = int(w.shape[0])
        per_group = (self.per_kv + 2) * self.head_dim
        if rows % per_group:
            raise WorkloadError(f"a fused wqkv shard of {rows} rows does not hold whole "
                                f"key/value groups of {per_group}: TP must divide n_kv_heads")
        key = (rows, str(w.device))
        order = self._order.get(key)
        if order is None:
            order = _grouped_rope_order(rows // per_group, self.per_kv, self.head_dim,
                                        w.device, self.interleaved)
            self._order[key] = order
        return w.index_select(0, order).t()

    def weights(self, block: Any) -> dict[str, Any]:
        """The block's weights in kareus's layout, differentiable views of its parameters."""
        att = block.attention
        if self.fused:
            qkv = self._fused_qkv(_local(att.qkv_linear.wqkv.weight))
        else:
            q = att.qkv_linear
            qkv = qkv_from_separate(_local(q.wq.weight), _local(q.wk.weight),
                                    _local(q.wv.weight), head_dim=self.head_dim,
                                    interleaved_rope=self.interleaved)
        norm = _head_norm if self.sp else _local  # see _head_norm
        if self.moe:  # the router (this rank's part of its gradient) and the EP shard
            mlp = moe_block_weights(block.moe)
        else:
            ff = block.feed_forward
            mlp = {"Wg": linear(_local(ff.w1.weight)), "Wu": linear(_local(ff.w3.weight)),
                   "Wd": linear(_local(ff.w2.weight))}
        out = {"w_attn_norm": norm(block.attention_norm.weight), "Wqkv": qkv,
               "Wo": linear(_local(att.wo.weight)),
               "w_mlp_norm": norm(block.ffn_norm.weight), **mlp}
        if self.qk_norm:  # whole on every TP rank: see _head_norm
            out["w_q_norm"] = head_norm(_head_norm(att.q_norm.weight),
                                        interleaved_rope=self.interleaved)
            out["w_k_norm"] = head_norm(_head_norm(att.k_norm.weight),
                                        interleaved_rope=self.interleaved)
        assert set(out) == set(LAYER_WEIGHTS[:4]) | set(mlp) | (
            {"w_q_norm", "w_k_norm"} if self.qk_norm else set())
        return out


def _rope_inv_freq(block: Any) -> Any:
    """The block's RoPE frequencies (``head_dim / 2``), read from its rope cache: the
    angle at position 1 (ComplexRoPE: ``cache[p, i] = exp(i * p * freq_i)``; CosSinRoPE:
    ``cache[p] = (cos, cos, sin, sin)`` of ``p * freq``)."""
    import torch

    rope = block.attention.rope
    cache = _local(rope.cache).detach()
    if isinstance(rope, _classes().CosSinRoPE):
        hd = int(block.attention.head_dim)
        if cache.dim() != 2 or cache.shape[0] < 2 or cache.shape[1] != 2 * hd:
            raise WorkloadError("the block's rope cache is not torchtitan's cos/sin "
                                "[max_seq_len, 2 head_dim] cache")
        cos, sin = cache[1, : hd // 2].double(), cache[1, hd: hd + hd // 2].double()
        if not torch.allclose(cos * cos + sin * sin, torch.ones((), dtype=torch.float64,
                                                                device=cache.device),
                              atol=1e-5):
            raise WorkloadError("the block's RoPE scales magnitudes as well as angles: "
                                "kareus's layer rotates only")
        return torch.atan2(sin, cos).float().cpu()
    if not torch.is_complex(cache) or cache.dim() != 2 or cache.shape[0] < 2:
        raise WorkloadError("the block's rope cache is not torchtitan's complex "
                            "[max_seq_len, head_dim / 2] cache (model.to(dtype) casts it to "
                            "real): cast the parameters only, build with ComplexRoPE")
    if not torch.allclose(cache[:2].abs(), torch.ones((), device=cache.device), atol=1e-5):
        raise WorkloadError("the block's RoPE scales magnitudes as well as angles: kareus's "
                            "layer rotates only")
    return torch.angle(cache[1]).float().cpu()


# ------------------------------------------------------------------ applying a plan


def _tp_group(mesh: Any, tp_group: Any, tp: int) -> Any:
    """The TP process group from ``tp_group``, a DeviceMesh or a torchtitan ParallelDims."""
    if tp_group is not None:
        if mesh is not None:
            raise ArgumentError("pass the TP group once: mesh= or tp_group=")
        return tp_group
    if mesh is None:
        if tp > 1:
            raise ArgumentError(f"the workload has TP={tp}: pass mesh= (torchtitan's "
                                "ParallelDims or its tp DeviceMesh) or tp_group=")
        return None
    get_mesh = getattr(mesh, "get_mesh", None)
    if callable(get_mesh):  # torchtitan's ParallelDims
        if tp == 1:
            return None
        mesh = get_mesh("tp")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if len(names) > 1:
        if "tp" not in names:
            raise ArgumentError(f"the device mesh has dimensions {names} and no 'tp'")
        mesh = mesh["tp"]
    if not hasattr(mesh, "get_group"):
        raise ArgumentTypeError(f"mesh must be a torchtitan ParallelDims or a DeviceMesh, "
                                f"got {type(mesh).__name__}")
    return mesh.get_group() if mesh.size() > 1 else None


def planned_blocks(model: Any) -> list[Any]:
    """The ``Llama3TransformerBlock`` and ``Qwen3TransformerBlock`` modules of ``model``, in
    module order."""
    blocks = _classes().Blocks
    return [m for m in model.modules() if isinstance(m, blocks)]


def apply_plan(model: Any, *, workload: Workload, mesh: Any = None, tp_group: Any = None,
               plan: Any = None, schedule: str | None = None, chain: bool | None = None,
               full_ac: bool = False, replace_ac: bool = False,
               **applier_kwargs: Any) -> PlanApplier:
    """Run every ``Llama3TransformerBlock`` (or ``Qwen3TransformerBlock``) of a built
    torchtitan model under a plan.

    Call it after torchtitan has parallelized the model (``model.parallelize`` or
    ``parallelize_llama``) and before the first forward, on every rank. Each block's
    ``forward`` is replaced on the instance by one that passes the block's input and its
    own parameters (differentiable views) to a planned layer; embeddings, the final norm,
    the LM head, the loss, the optimizer and checkpoints stay torchtitan's.

    **Chaining.** torchtitan's ``Decoder.forward`` runs its blocks back to back
    (``for layer in self.layers.values(): h = layer(h, attention_masks, positions)``,
    nothing in between). With ``chain`` on, each decoder whose ``layers`` are all planned
    blocks runs them as one [`PlannedStack`][kareus.integrations.PlannedStack]
    (``applier.stack(n)``): each layer's last forward all-reduce overlaps the next layer's
    first ops, as the plan composes them, so only one forward collective per decoder
    forward runs exposed instead of one per layer. The decoder's forward is wrapped on the
    instance (around torchtitan's own, its input/output redistribution included) to mark
    its loop, and the ``layers`` container's ``values()`` gives that one loop a single
    callable that runs the stack; every other caller of ``values()`` gets the blocks. A
    block with anything around its call that a stack would skip (``fully_shard``'s FSDP
    hooks, any module hook, ``torch.compile``, a forward replaced after this call) runs
    per block instead, checked at every forward.

    Args:
        model: The built, parallelized ``Llama3Model`` (or a pipeline stage of one).
        workload: What the plan was made for
            ([`workload_from_torchtitan`][kareus.integrations.torchtitan.workload_from_torchtitan]
            of this model); checked against the model.
        mesh: torchtitan's ``ParallelDims`` or its TP ``DeviceMesh`` (or a mesh with a
            ``"tp"`` dimension); or pass ``tp_group=`` (a ``torch.distributed`` group).
        plan: The plan (``kareus.Plan.load("plan.json")``); ``None`` runs a baseline.
        schedule: ``"kareus"`` (the default with a plan), ``"sequential"`` or
            ``"nanobatching"``.
        chain: ``None`` (the default): chain each decoder's blocks where it can (see
            above), per block otherwise; ``True``: chain or refuse (``WorkloadError`` saying
            why, here or at the forward); ``False``: every block per block. The plan's
            partitions must be those that run: a workload of unchained layers
            (``chained_layers=False``, as torchtitan's Trainer runs its FSDP-wrapped
            blocks) runs per block whatever ``chain`` says (``True`` refused), and a plan
            for chained layers is refused unless every block chains (here, and at every
            forward).
        full_ac: The blocks are wrapped in torchtitan's *full* activation checkpointing
            (``activation_checkpoint = FullAC.Config()``): kareus's layer recomputes each
            block's forward in its backward itself (the workload's ``recompute="full"``),
            so each wrapper calls its block directly (checkpointing it again would run the
            planned forward, collectives included, inside the backward). Any other
            wrapper is refused unless ``replace_ac``.
        replace_ac: The blocks are wrapped in any of torchtitan's activation checkpointing
            (full or per-op selective) and kareus's layer runs the workload's
            recomputation policy in its place (each wrapper calls its block directly);
            [`wrap_trainer`][kareus.integrations.torchtitan.wrap_trainer] sets it from the
            Trainer's ``activation_checkpoint``
            ([`recompute_from_torchtitan`][kareus.integrations.torchtitan.recompute_from_torchtitan]).
        **applier_kwargs: Passed to [`PlanApplier`][kareus.integrations.PlanApplier]
            (``executor``, ``frequency``, ``kernels``, ``record``, ...); ``rope_inv_freq``
            and ``eps`` come from the model.

    Returns:
        The applier: enter ``applier.microbatch(mb, "fwd")`` around each microbatch's
        forward and ``applier.microbatch(mb, "bwd")`` around its backward (or
        [`wrap_trainer`][kareus.integrations.torchtitan.wrap_trainer]).

    Raises:
        WorkloadError: the model is not the workload's (a field of its layers differs from
            the workload's model: dimensions, ``qk_norm``, ``norm_eps``), has no Llama 3 or
            Qwen3 block, has a layer
            kareus does not compute, is wrapped in activation checkpointing, or the
            workload asks for context parallelism; ``chain=True`` and a decoder's blocks
            cannot be chained (or the workload's layers are unchained); a plan for chained
            layers and blocks that cannot all be chained.
        ArgumentError: the TP group is missing or given twice, or an applier argument the
            model sets.
    """
    check_torchtitan_version()
    if chain not in (None, True, False):
        raise ArgumentTypeError(f"chain must be None, True or False, got {chain!r}")
    if not isinstance(workload, Workload):
        raise ArgumentTypeError(f"workload must be a kareus.Workload, got "
                                f"{type(workload).__name__}")
    for key in ("rope_inv_freq", "rope_base", "eps", "groups", "workload"):
        if key in applier_kwargs:
            raise ArgumentError(f"apply_plan reads {key} from the model and its mesh: do not "
                                "pass it")
    if workload.parallelism.cp != 1:
        raise WorkloadError("torchtitan's context parallelism is its own attention over "
                            "load-balanced chunks: apply kareus plans with CP=1")
    arch = _check_model(model, workload)  # its layers and its TP layout: the workload's
    blocks = planned_blocks(model)
    wrappers = _checkpoint_wrappers(model, blocks)
    if wrappers and not (full_ac or replace_ac):
        raise WorkloadError("the blocks are wrapped in activation checkpointing: kareus's "
                            "layer runs the workload's recomputation policy itself; pass "
                            "replace_ac=True (wrap_trainer does) or build without "
                            "checkpointing (activation-checkpoint:none)")
    if not blocks:
        raise WorkloadError("the model has no Llama 3 or Qwen3 block (a pipeline stage "
                            "without layers needs no plan)")
    if any(hasattr(m, _APPLIER_ATTR) or hasattr(m, _CHAIN_ATTR) for m in model.modules()):
        raise ArgumentError("a plan is applied to this model already: remove_plan(model) "
                            "first")
    _check_documents(model, blocks, plan, schedule, workload)
    asked = chain is True
    chain, strict = _chaining(model, blocks, workload, plan, schedule, chain)
    # chain=True (or a plan for chained layers) refuses before anything is replaced
    decoders = [] if chain is False else _decoders(model, blocks, strict=strict)
    inv = _rope_inv_freq(blocks[0])
    import torch

    for blk in blocks[1:]:
        if not torch.equal(_rope_inv_freq(blk), inv):
            raise WorkloadError("the blocks' RoPE frequencies differ: kareus's layers share "
                                "one set")
    from kareus.exec.train import TorchParallelGroups

    group = _tp_group(mesh, tp_group, workload.parallelism.tp)
    groups = TorchParallelGroups.from_groups(tp=group, ep=_ep_group(mesh, workload))
    applier = PlanApplier(workload=workload, groups=groups, plan=plan, schedule=schedule,
                          rope_inv_freq=inv, eps=arch.norm_eps, **applier_kwargs)
    layer = applier.layer()
    installed = {id(blk): _plan_block(blk, applier, layer) for blk in blocks}
    _around_blocks(blocks, wrappers, applier)
    for decoder, own in decoders:
        _Chain(decoder, own, applier, [installed[id(b)] for b in own], strict=strict,
               chain_asked=asked)
    return applier


def _ep_group(mesh: Any, workload: Workload) -> Any:
    """The expert-parallel process group of a Qwen3 MoE workload at EP > 1: the ``ep``
    dimension of torchtitan's ``ParallelDims`` (its sparse mesh, which its experts are
    sharded over), or ``None`` at EP = 1."""
    if workload.parallelism.ep == 1:
        return None
    get = getattr(mesh, "get_optional_mesh", None)
    ep_mesh = get("ep") if callable(get) else None
    if ep_mesh is None:
        raise ArgumentError(f"the workload has EP={workload.parallelism.ep}: pass mesh= "
                            "torchtitan's ParallelDims (parallelism.expert_parallel_degree), "
                            "whose ep mesh holds the experts")
    if int(ep_mesh.size()) != workload.parallelism.ep:
        raise WorkloadError(f"torchtitan's ep mesh has {ep_mesh.size()} ranks, the workload "
                            f"EP={workload.parallelism.ep}: make the workload with "
                            "workload_from_torchtitan(model, ep=...)")
    return ep_mesh.get_group()


def _chaining(model: Any, blocks: list[Any], workload: Workload, plan: Any,
              schedule: str | None, chain: bool | None) -> tuple[bool | None, bool]:
    """``(chain, strict)`` for ``apply_plan``: whether to chain the decoders' blocks and
    whether a block that cannot be chained is refused (at ``apply_plan`` and at every
    forward) rather than run per block.

    The plan's partitions must be those that run. A workload of unchained layers
    (``chained_layers=False``, torchtitan's Trainer) is run per block, even where the
    blocks could chain: that is what its plan costs, and per block computes the same
    values (``chain=True`` is refused). A plan for chained layers is refused unless every
    block is chained; the check is repeated at every forward.

    Raises:
        WorkloadError: ``chain=True`` with unchained layers; a plan for chained layers where
            the blocks cannot all chain (FSDP's ``fully_shard``, module hooks,
            ``torch.compile``, ``chain=False``, blocks outside a torchtitan ``Decoder``).
    """
    if not workload.chained_layers:
        if chain:
            raise WorkloadError("chain=True, but the workload's layers are unchained "
                                "(chained_layers=False: its plan costs each block run on its "
                                "own): pass chain=None, or make the workload and its plan "
                                "with chained_layers=True")
        return False, False
    if plan is None or schedule not in (None, "kareus"):
        return chain, bool(chain)
    why = ("chain=False runs each block on its own" if chain is False
           else _why_unchained(model, blocks))
    if why is not None:
        raise WorkloadError(f"the plan was made for chained layers (its workload's "
                            f"chained_layers=True), but {why}, so the blocks run one by one: "
                            "make the plan for unchained layers (kareus optimize "
                            "--unchained-layers, or --torchtitan-args, which reads it)")
    return True, True


def _check_model(model: Any, workload: Workload) -> Any:
    """The model's own config against the workload, whatever made the workload: its layers'
    architecture and its TP plan's layout. Returns the model's ``ModelArch``."""
    arch = model_arch_from_torchtitan(model, name=workload.model.name)
    # an MoE model's MLP is its block (the dense width no layer has is not compared)
    mlp = ("ffn",) if arch.moe is None and workload.model.moe is None else ("moe",)
    for field in ("hidden", "heads", "kv_heads", "head_dim", *mlp, "qk_norm", "norm_eps",
                  "qkv_bias"):
        mine, theirs = getattr(arch, field), getattr(workload.model, field)
        if mine != theirs:
            raise WorkloadError(f"the model's layers have {field}={mine}, the workload's "
                                f"model {field}={theirs}: make the workload with "
                                "workload_from_torchtitan(model, ...)")
    par = workload.parallelism
    planned_sp = sequence_parallel_of(model)
    if par.tp > 1 and planned_sp is not None and planned_sp != par.sequence_parallel:
        raise WorkloadError(f"the model's TP plan has enable_sequence_parallel={planned_sp}, "
                            f"the workload sp={par.sp}: make the workload with "
                            "workload_from_torchtitan(model, ...)")
    return arch


def _block_seq(workload: Workload) -> int:
    """The tokens per sequence a block gets on this rank: the CP chunk, its TP shard under
    sequence parallelism."""
    p = workload.parallelism
    return workload.seq_len // p.cp // (p.tp if p.sequence_parallel else 1)


def _around_blocks(blocks: list[Any], wrappers: list[Any], applier: PlanApplier) -> None:
    """What wraps the planned blocks: activation-checkpoint wrappers call their block
    directly (kareus's layer runs the workload's recomputation policy itself); torch.compile of a block
    (torchtitan compiles each, fullgraph) would trace into the planned layer, so the block
    runs uncompiled (its compiled call set aside, restored by ``remove_plan``; the planned
    forward is excluded from compilation) while torchtitan's compiled loss stays."""
    for w in wrappers:
        w.forward = types.MethodType(lambda self, *a, **k: self._checkpoint_wrapped_module(
            *a, **k), w)
        setattr(w, _APPLIER_ATTR, applier)
    for m in [*blocks, *wrappers]:
        compiled = m.__dict__.get("_compiled_call_impl")
        if compiled is not None:
            m.__dict__[_COMPILED_ATTR] = compiled
            m._compiled_call_impl = None


def _check_seq(local: Any, seq: int, sp: bool) -> None:
    if int(local.shape[1]) != seq:
        layout = ("this rank's sequence shard (sequence parallelism)" if sp
                  else "whole sequences")
        raise WorkloadError(f"the block got sequences of {local.shape[1]} tokens, the "
                            f"workload {seq} ({layout}): make the workload for this "
                            "model's seq_len and enable_sequence_parallel "
                            "(workload_from_torchtitan)")


def _plan_block(block: Any, applier: PlanApplier, layer: Any) -> tuple[Any, _BlockLayout]:
    """Replace ``block``'s forward (on the instance) by the planned layer's; the forward
    installed and the block's layout."""
    sp = applier.workload.parallelism.sequence_parallel
    layout = _BlockLayout(block, sp=sp)
    seq = _block_seq(applier.workload)

    def forward(self: Any, x: Any, attention_masks: Any = None, positions: Any = None
                ) -> Any:
        pos = _rope_positions(attention_masks, positions, layout.documents)
        local, rewrap = _unwrap_input(x, sp)
        _check_seq(local, seq, sp)
        return rewrap(layer(local, layout.weights(self), positions=pos,
                            documents=layout.documents))

    import torch

    # torch.compile traces around the planned layer, never into it (its executor launches
    # collectives on side streams and keeps Python state): torchtitan compiles the rest
    block.forward = torch.compiler.disable(types.MethodType(forward, block))
    setattr(block, _APPLIER_ATTR, applier)
    return block.__dict__["forward"], layout


def _decoders(model: Any, blocks: list[Any], *, strict: bool) -> list[tuple[Any, list[Any]]]:
    """``(decoder, its blocks)`` of every torchtitan ``Decoder`` in ``model`` whose
    ``layers`` are all blocks of ``blocks``; with ``strict``, refuse a planned block that no
    such decoder runs (it could not be chained)."""
    planned = {id(b) for b in blocks}
    out, covered = [], set()
    for m in model.modules():
        if not isinstance(m, _classes().Decoder):
            continue
        own = list(_layers_values(m))
        if own and all(id(b) in planned for b in own):
            for b in own if strict else ():
                why = _around_call(b, None, compiled=False)  # apply_plan uncompiles it
                if why is not None:
                    raise WorkloadError(f"chain=True: a block of {type(m).__name__} {why}; "
                                        "pass chain=None to run such blocks per block")
            out.append((m, own))
            covered |= {id(b) for b in own}
        elif strict and any(id(b) in planned for b in own):
            raise WorkloadError(f"chain=True: {type(m).__name__}.layers holds modules other "
                                "than Llama 3 or Qwen3 blocks: kareus chains a decoder whose "
                                "layers are all planned; pass chain=None (per block there)")
    if strict and len(covered) != len(planned):
        raise WorkloadError("chain=True: some planned blocks are not the layers of a "
                            "torchtitan Decoder (whose forward loops over them): pass "
                            "chain=None to run those per block")
    return out


def _layers_values(decoder: Any) -> Any:
    """The decoder's blocks in its loop's order (``layers.values()`` of the container's
    class: not a chain's override)."""
    import torch

    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleDict):
        return ()
    return torch.nn.ModuleDict.values(layers)


def _around_call(block: Any, installed: Any, *, compiled: bool = True) -> str | None:
    """What would run around ``block``'s call, which a stack skips (None: nothing);
    ``installed``: the planned forward the block must still have (None: not checked);
    ``compiled=False``: not ``torch.compile`` (``apply_plan`` sets a planned block's
    compiled call aside)."""
    from torch.nn.modules import module as torch_module

    fsdp: tuple[type, ...] = ()
    try:
        from torch.distributed.fsdp import FSDPModule

        fsdp = (FSDPModule,)
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    if isinstance(block, fsdp):
        return "is sharded by fully_shard (FSDP: its hooks gather the parameters)"
    if compiled and getattr(block, "_compiled_call_impl", None) is not None:
        return "is compiled (torch.compile)"
    if (block._forward_pre_hooks or block._forward_hooks or block._backward_hooks
            or block._backward_pre_hooks):
        return "has module hooks"
    if (torch_module._global_forward_pre_hooks or torch_module._global_forward_hooks
            or torch_module._global_backward_hooks
            or torch_module._global_backward_pre_hooks):
        return "would run global module hooks"
    if installed is not None and block.__dict__.get("forward") is not installed:
        return "has a forward replaced after apply_plan"
    return None


class _Chain:
    """One torchtitan decoder's planned blocks, run as one ``PlannedStack`` by the
    decoder's own loop.

    ``Decoder.forward`` loops ``for layer in self.layers.values(): h = layer(h,
    attention_masks, positions)``. The decoder's forward is wrapped on the instance
    (around what was there: torchtitan's redistribution wrapper or the class's) to mark
    that its loop is running, and ``layers.values`` (an instance attribute of the
    container) gives the first call of a marked forward a single callable that runs the
    stack; any other call, or a block that cannot be chained now, gets the blocks."""

    def __init__(self, decoder: Any, blocks: list[Any], applier: PlanApplier,
                 installed: list[tuple[Any, _BlockLayout]], *, strict: bool,
                 chain_asked: bool = True) -> None:
        self.blocks, self.strict, self.chain_asked = blocks, strict, chain_asked
        self.installed = [f for f, _ in installed]
        self.layouts = [lay for _, lay in installed]
        self.stack = applier.stack(len(blocks))
        self.sp = applier.workload.parallelism.sequence_parallel
        self.seq = _block_seq(applier.workload)
        self.armed = False
        self.decoder_name = type(decoder).__name__
        self.own_forward = decoder.__dict__.get("forward")  # torchtitan's wrapper, if any
        inner = decoder.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            self.armed = True
            try:
                return inner(*args, **kwargs)
            finally:
                self.armed = False

        layers = decoder.layers

        def values() -> Any:
            if self.armed:
                self.armed = False
                why = self.why_not()
                if why is None:
                    return (self.run,)
                if self.strict and not self.chain_asked:
                    raise WorkloadError(f"the plan was made for chained layers "
                                        f"(chained_layers=True), but a block of "
                                        f"{self.decoder_name} {why}: remove that, or make the "
                                        "plan for unchained layers (kareus optimize "
                                        "--unchained-layers)")
                if self.strict:
                    raise WorkloadError(f"chain=True: a block of {self.decoder_name} {why}; "
                                        "pass chain=None to run such blocks per block")
            return _layers_values(decoder)

        decoder.forward = forward
        layers.values = values
        setattr(decoder, _CHAIN_ATTR, self)

    def why_not(self) -> str | None:
        """Why the blocks cannot run as one stack now (None: they can)."""
        for blk, fwd in zip(self.blocks, self.installed, strict=True):
            why = _around_call(blk, fwd)
            if why is not None:
                return why
        return None

    def run(self, h: Any, attention_masks: Any = None, positions: Any = None) -> Any:
        """Every block of the decoder on ``h``: what its loop computes."""
        documents = self.layouts[0].documents
        pos = _rope_positions(attention_masks, positions, documents)
        local, rewrap = _unwrap_input(h, self.sp)
        _check_seq(local, self.seq, self.sp)
        weights = [lay.weights(blk) for lay, blk in zip(self.layouts, self.blocks,
                                                         strict=True)]
        return rewrap(self.stack(local, weights, positions=pos, documents=documents))

    def remove(self, decoder: Any) -> None:
        del decoder.layers.values
        if self.own_forward is None:
            del decoder.forward
        else:
            decoder.forward = self.own_forward
        delattr(decoder, _CHAIN_ATTR)


def chained_blocks(model: Any) -> list[Any]:
    """The planned blocks of ``model`` that its next forward runs as stacks (one per
    decoder), in module order; the others run per block."""
    out: list[Any] = []
    for m in model.modules():
        chain = getattr(m, _CHAIN_ATTR, None)
        if isinstance(chain, _Chain) and chain.why_not() is None:
            out += chain.blocks
    return out


def remove_plan(model: Any) -> int:
    """Give each planned block its own forward back, and each chained decoder its forward
    and its ``layers``' ``values``; the number of blocks restored."""
    for m in list(model.modules()):
        chain = getattr(m, _CHAIN_ATTR, None)
        if isinstance(chain, _Chain):
            chain.remove(m)
    n = 0
    blocks = planned_blocks(model)
    for m in [*blocks, *_checkpoint_wrappers(model, blocks)]:
        if _COMPILED_ATTR in m.__dict__:
            m._compiled_call_impl = m.__dict__.pop(_COMPILED_ATTR)
        if _APPLIER_ATTR in m.__dict__:
            del m.forward
            delattr(m, _APPLIER_ATTR)
            n += any(m is b for b in blocks)
    return n


def _checkpoint_wrappers(model: Any, blocks: list[Any]) -> list[Any]:
    """The activation-checkpoint wrappers (torch's ``CheckpointWrapper``, as torchtitan
    applies them) around blocks of ``blocks``."""
    ids = {id(b) for b in blocks}
    return [m for m in model.modules()
            if id(getattr(m, "_checkpoint_wrapped_module", None)) in ids]


def _unwrap_input(x: Any, sp: bool = False) -> tuple[Any, Callable[[Any], Any]]:
    """A block input as a local tensor, and how to wrap the output like the input.

    Under torchtitan's ``partial_dtensor`` backend blocks pass replicated DTensors (under
    sequence parallelism: sharded along the sequence, ``Shard(1)``, over ``tp``);
    ``to_local``/``from_local`` are differentiable (the gradient of the output is made
    replicated, an all-reduce where torchtitan left it partial; a shard stays a shard)."""
    placements = getattr(x, "placements", None)
    if placements is None:
        return x, lambda y: y
    names = tuple(getattr(x.device_mesh, "mesh_dim_names", None) or ())
    if not names:  # the TP plan's one-dimensional mesh, or unnamed dimensions
        names = ("tp",) if len(placements) == 1 else ("",) * len(placements)
    from torch.distributed.tensor import Replicate, Shard

    want = [Shard(1) if sp and name == "tp" else Replicate() for name in names]
    if list(placements) != want:
        layout = ("sharded along the sequence over tp only (sequence parallelism)" if sp
                  else "replicated (whole sequences on every TP rank)")
        raise WorkloadError(f"the block's input is a DTensor placed {tuple(placements)}; the "
                            f"workload's layer takes it {layout}: make the workload with "
                            "workload_from_torchtitan(model, ...) (its sp)")
    from torch.distributed.tensor import DTensor

    mesh = x.device_mesh

    def rewrap(y: Any) -> Any:
        return DTensor.from_local(y, mesh, placements, run_check=False)

    return x.to_local(), rewrap


def _rope_positions(attention_masks: Any, positions: Any, documents: bool = False) -> Any:
    """The positions the planned layer rotates by (and, with ``documents``, masks the
    documents of): None where they are ``0 .. seq - 1`` in every sequence (no packing:
    one document per sequence), this rank's ``[batch, seq]`` positions where documents are
    packed (positions restart at each one).

    ``documents``: the block's attention is FlexAttention or VarlenAttention, whose masks
    torchtitan's decoder builds from the positions (``block_causal``: each token attends
    to the earlier tokens of its own document); the planned layer builds the same mask
    from the positions. Without it (SDPA) attention is causal over the whole sequence and
    the decoder passes no masks: masks there (a custom mask) are refused."""
    import torch

    if positions is None:
        if attention_masks is not None:
            raise WorkloadError("kareus's layer computes causal attention: attention masks "
                                "without positions (a custom mask) are not supported")
        return None
    if attention_masks is not None and not documents:
        raise WorkloadError("the block gets attention masks but its attention is not "
                            "FlexAttention or VarlenAttention (block_causal documents): "
                            "kareus's layer does not compute a custom mask")
    if _capturing():
        # inside a CUDA graph capture (torchtitan's step capture, replayed for every batch)
        # the values cannot be read, and the next batch's may differ: always rotate by them
        return _local(positions)
    # Every block of one forward gets the same positions tensor: read it once (reading a
    # GPU tensor's values waits for the GPU, which a check per block would do per layer).
    seen = _CHECKED_POSITIONS.get("last")
    if seen is not None and seen[0]() is positions and seen[1] == positions._version:
        plain, p = seen[2], seen[3]
    else:
        p = _local(positions)
        want = torch.arange(p.shape[-1], device=p.device, dtype=p.dtype)
        plain = bool(torch.equal(p, want.expand_as(p)))
        _CHECKED_POSITIONS["last"] = (weakref.ref(positions), positions._version, plain, p)
    return None if plain else p


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured (False without CUDA)."""
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


#: The positions tensor checked last (a weak reference, its version counter, whether
#: it is plain ``0 .. seq - 1``, and its local tensor).
_CHECKED_POSITIONS: dict[str, Any] = {}


# ------------------------------------------------------------------ torchtitan's Trainer


def _trainer_parts(trainer: Any) -> tuple[Any, Any, Any]:
    """``(config, parallel_dims, model)`` of a torchtitan 0.3 ``Trainer``."""
    check_torchtitan_version()
    config = getattr(trainer, "config", None)
    dims = getattr(trainer, "parallel_dims", None)
    parts = getattr(trainer, "model_parts", None)
    if config is None or dims is None or not parts:
        raise ArgumentTypeError("expected a built torchtitan 0.3 Trainer (config.build() of "
                                f"its Trainer.Config), got {type(trainer).__name__}")
    if getattr(dims, "pp_enabled", False) or len(parts) != 1:
        raise WorkloadError("pipeline parallelism (parallelism.pipeline_parallel_degree > 1): "
                            "torchtitan's pipeline schedule runs the microbatches and kareus's "
                            "adapter does not enter its steps; run "
                            "--parallelism.pipeline_parallel_degree 1")
    return config, dims, parts[0]


def workload_from_trainer(trainer: Any, *, nanobatches: int = 2, name: str | None = None,
                          selective_as: str | None = None,
                          document_tokens: int | None = None) -> Workload:
    """The [`Workload`][kareus.model.Workload] a torchtitan 0.3 ``Trainer`` runs, read from
    its config and its model (what ``kareus optimize`` makes the plan for).

    * the model: [`model_arch_from_torchtitan`][kareus.integrations.torchtitan.model_arch_from_torchtitan]
      of ``trainer.model_config`` (after torchtitan's ``--override.imports``), refusing
      layers kareus's layer does not compute;
    * parallelism: ``tp``, ``cp``, ``pp`` and the data-parallel degree (``dp_replicate x
      dp_shard``) of ``trainer.parallel_dims``; ``sp`` from
      ``parallelism.enable_sequence_parallel`` (on by default; off at TP = 1);
    * the batch: ``microbatch_size = training.local_batch_size`` (one local batch per
      gradient-accumulation step), ``num_microbatches`` the Trainer's
      ``gradient_accumulation_steps``, ``seq_len = training.seq_len``;
    * ``recompute`` from ``activation_checkpoint``
      ([`recompute_from_torchtitan`][kareus.integrations.torchtitan.recompute_from_torchtitan]):
      ``None`` (``activation-checkpoint:none``) is ``"none"``, ``full`` ``"full"``;
      ``selective`` (torchtitan's default, per-op) is ``selective_as`` (refused without
      it: no kareus policy is torchtitan's per-op selection), ``memory-budget`` refused;
    * ``dtype_bytes`` from the dtype the blocks compute in: ``training.dtype`` if bfloat16,
      else FSDP's ``training.mixed_precision_param`` (torchtitan wraps every block in
      FSDP, whose mixed precision casts the parameters);
    * ``document_tokens``: where the model's attention masks packed documents
      (FlexAttention or VarlenAttention, ``block_causal``:
      [`masks_documents`][kareus.integrations.torchtitan.masks_documents]), the
      documents' length the plan is costed for, which no config says (it is the data's):
      given here, refused when missing; with SDPA attention (causal over the whole
      sequence) none.
    * ``chained_layers`` from the blocks: ``False``, since every block is wrapped in FSDP
      (``fully_shard``, even at one data-parallel rank), whose hooks run around each
      block's call, so the blocks run one by one (each its own planned layer) and the plan
      is made for that: per layer, its first ops bare and its last collective exposed.

    Args:
        trainer: The built Trainer (``config.build()``), before ``train()``.
        nanobatches: The nanobatch count of the baseline ``"nanobatching"`` schedule (a
            planning choice, not the Trainer's; a plan records its own).
        name: The model's name in the workload (default ``"torchtitan-<module>-<flavor>"``).
        selective_as: Under torchtitan's per-op selective checkpointing, the
            recomputation policy kareus's planned layers run in its place
            (``"selective"``, ``"full"`` or ``"none"``); ignored otherwise.
        document_tokens: Where the attention masks packed documents: their length as
            the cost model takes it (``Workload.document_tokens``: sum of the squared
            document lengths over the sum of lengths of your data,
            [`document_tokens_of`][kareus.model.document_tokens_of] of a batch's
            ``positions``).

    Raises:
        ArgumentTypeError: not a built torchtitan Trainer.
        WorkloadError: pipeline parallelism, selective checkpointing without
            ``selective_as``, memory-budget checkpointing, a layer kareus's layer does
            not compute, attention masking documents without ``document_tokens`` (or
            ``document_tokens`` for attention that masks none).
    """
    config, dims, model = _trainer_parts(trainer)
    return _workload_of(config, trainer.model_config,
                        (int(dims.tp), int(dims.cp), int(dims.pp),
                         int(dims.dp_replicate) * int(dims.dp_shard)),
                        int(trainer.gradient_accumulation_steps), nanobatches=nanobatches,
                        name=name, selective_as=selective_as,
                        document_tokens=document_tokens,
                        chained=_why_unchained(model) is None)


def _why_unchained(model: Any, blocks: list[Any] | None = None) -> str | None:
    """Why ``model``'s planned blocks (``blocks``, or all of them) cannot run as one stack
    (``None``: they can): something around a block's call (``_blocks_chain``), or a block
    that is not a layer of a torchtitan ``Decoder`` (e.g. wrapped for activation
    checkpointing, as the Trainer's default selective checkpointing does)."""
    why = _blocks_chain(model)
    if why is None:
        try:
            _decoders(model, planned_blocks(model) if blocks is None else blocks, strict=True)
        except WorkloadError:
            why = "some planned blocks are not the layers of a torchtitan Decoder"
    return why


def _blocks_chain(model: Any) -> str | None:
    """Why ``model``'s planned blocks cannot run as one stack (``None``: they can): under
    torchtitan 0.3's Trainer every block is wrapped in FSDP (``fully_shard``: its llama3
    and qwen3 ``parallelize`` functions call ``apply_fsdp_to_decoder`` at every
    data-parallel degree, one included), whose hooks a stack would skip. A compiled block
    can chain: ``apply_plan`` runs it uncompiled."""
    for blk in planned_blocks(model):
        why = _around_call(blk, None, compiled=False)
        if why is not None:
            return f"a block {why}"
    return None


def _workload_of(config: Any, model_config: Any, degrees: tuple[int, int, int, int],
                 accumulation_steps: int, *, nanobatches: int, name: str | None,
                 selective_as: str | None, document_tokens: int | None,
                 documents_required: bool = True, chained: bool = False) -> Workload:
    """The workload of a Trainer config, its (updated, overridden) model config, its
    ``(tp, cp, pp, dp)`` and gradient-accumulation steps; ``documents_required``: a model
    whose attention masks documents needs ``document_tokens`` (otherwise the workload
    then has none: a baseline, which costs nothing); ``chained``: whether its blocks can
    run as one stack (never under the Trainer: ``_blocks_chain``)."""
    spec = getattr(config, "model_spec", None)
    if name is None:
        name = (f"torchtitan-{spec.name}-{spec.flavor}" if spec is not None
                else "torchtitan-model")
    arch = model_arch_from_torchtitan(model_config, name=name)
    training = config.training
    compute = (training.dtype if training.dtype == "bfloat16"
               else training.mixed_precision_param)
    tp, cp, pp, dp = degrees
    ep = int(getattr(config.parallelism, "expert_parallel_degree", 1) or 1)
    if arch.moe is not None and bool(getattr(getattr(config, "debug", None),
                                             "moe_force_load_balance", False)):
        raise WorkloadError("debug.moe_force_load_balance routes tokens round-robin, not by "
                            "the router's logits as kareus's router does: turn it off")
    _check_moe_degrees(arch, tp, ep)
    par = Parallelism(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep if arch.moe is not None else 1,
                      sp=tp > 1 and bool(config.parallelism.enable_sequence_parallel))
    recompute = recompute_from_torchtitan(config.activation_checkpoint,
                                          selective_as=selective_as)
    masked = _config_masks_documents(model_config)
    if masked and document_tokens is None and documents_required:
        raise WorkloadError("the model's attention masks packed documents (FlexAttention or "
                            "VarlenAttention, block_causal), whose length no config says: "
                            "pass document_tokens= (the sum of squared document lengths "
                            "over the sum of lengths of your data: "
                            "kareus.model.document_tokens_of)")
    if not masked and document_tokens is not None:
        raise WorkloadError(f"document_tokens={document_tokens}, but the model's attention "
                            "(SDPA) is causal over the whole sequence and masks no "
                            "documents: drop document_tokens")
    return Workload(model=arch, parallelism=par,
                    microbatch_size=int(training.local_batch_size),
                    seq_len=int(training.seq_len),
                    num_microbatches=int(accumulation_steps),
                    nanobatches=int(nanobatches), recompute=recompute,
                    dtype_bytes=2 if compute == "bfloat16" else 4,
                    document_tokens=document_tokens, chained_layers=bool(chained))


def workload_from_torchtitan_config(config: Any, *, world_size: int, nanobatches: int = 2,
                                    name: str | None = None,
                                    selective_as: str | None = None,
                                    document_tokens: int | None = None) -> Workload:
    """The workload torchtitan 0.3's ``Trainer`` would run for ``config`` on ``world_size``
    ranks, without building it (no devices, no data): what ``kareus optimize
    --torchtitan-args`` makes a plan for, equal to
    [`workload_from_trainer`][kareus.integrations.torchtitan.workload_from_trainer] of the
    built Trainer: its layers unchained (``chained_layers=False``: the Trainer wraps every
    block in FSDP, so its blocks run one by one).

    The model config is updated from the config and its ``--override.imports`` applied,
    as the Trainer does; the degrees are ``ParallelDims.from_config`` (a
    ``data_parallel_shard_degree`` of -1 takes the ranks left); the gradient-accumulation
    steps ``training.global_batch_size`` over ``training.local_batch_size`` times the
    data-parallel degree.

    Args:
        config: A ``Trainer.Config`` (``ConfigManager().parse_args([...])``); not changed.
        world_size: The ranks the job runs on (``torchrun``'s ``WORLD_SIZE``).
        nanobatches: As ``workload_from_trainer`` takes it.
        name: As ``workload_from_trainer`` takes it.
        selective_as: As ``workload_from_trainer`` takes it.
        document_tokens: As ``workload_from_trainer`` takes it (required where the
            attention masks packed documents).

    Raises:
        ArgumentError: no model in the config, or degrees that do not multiply to
            ``world_size``, or batch sizes that do not divide.
        WorkloadError: as ``workload_from_trainer``.
    """
    config, model_config = _trainer_config_copy(config)
    par = config.parallelism
    rep, shard = int(par.data_parallel_replicate_degree), int(par.data_parallel_shard_degree)
    cp, tp, pp = (int(par.context_parallel_degree), int(par.tensor_parallel_degree),
                  int(par.pipeline_parallel_degree))
    world = int(world_size)
    if shard < 0:
        shard = world // (rep * cp * tp * pp)
    if shard < 1 or rep * shard * cp * tp * pp != world:
        raise ArgumentError(f"torchtitan's degrees (data_parallel_replicate {rep} x "
                            f"data_parallel_shard {par.data_parallel_shard_degree} x context "
                            f"{cp} x tensor {tp} x pipeline {pp}) do not make {world} ranks: "
                            "give the job's GPU count (--gpus)")
    dp = rep * shard
    local, glob = int(config.training.local_batch_size), int(config.training.global_batch_size)
    if glob < 0:
        glob = local * dp
    if glob <= 0 or glob % (local * dp):
        raise ArgumentError(f"training.global_batch_size {glob} is not a multiple of "
                            f"training.local_batch_size {local} x the data-parallel degree "
                            f"{dp}")
    return _workload_of(config, model_config, (tp, cp, pp, dp), glob // (local * dp),
                        nanobatches=nanobatches, name=name, selective_as=selective_as,
                        document_tokens=document_tokens)


def _trainer_config_copy(config: Any) -> tuple[Any, Any]:
    """A copy of a ``Trainer.Config`` and its model config, updated from it and with its
    ``--override.imports`` applied, as the Trainer does when it is built."""
    import copy

    check_torchtitan_version()
    if getattr(config, "model_spec", None) is None:
        raise ArgumentError("the torchtitan config has no model: give --module and --config")
    config = copy.deepcopy(config)
    config.model_spec.model.update_from_config(config=config)
    if config.override.imports:
        from torchtitan.config.override import apply_overrides  # type: ignore[import]

        apply_overrides(config.override, config)
    return config, config.model_spec.model


def masks_documents(model_or_config: Any) -> bool:
    """Whether a torchtitan model's attention masks packed documents (``FlexAttention`` /
    ``VarlenAttention``: ``block_causal``), whose workload then needs ``document_tokens``
    (the documents' length its plan is costed for). Takes a built model, its config, or a
    ``Trainer.Config`` (its model after its ``--override.imports``)."""
    if getattr(model_or_config, "model_spec", None) is not None:
        model_or_config = _trainer_config_copy(model_or_config)[1]
    return _config_masks_documents(model_or_config)


def _config_masks_documents(model_or_config: Any) -> bool:
    tt = _classes()
    return any(isinstance(lc.attention.inner_attention, (tt.Flex.Config, tt.Varlen.Config))
               for lc in _model_config(model_or_config).layers or ())


def _refuse_unsupported(config: Any, model: Any, workload: Workload) -> None:
    """Refuse, in torchtitan 0.3's own words, what kareus's planned layers do not run
    exactly as torchtitan would (before the first step)."""
    if workload.model.moe is not None:
        # the workload models unchained MoE layers, but the Trainer's FSDP-wrapped MoE
        # blocks (experts sharded over its expert-data-parallel mesh) are checked against
        # torchtitan's own run nowhere: refused, not trusted
        raise WorkloadError("a mixture-of-experts model (moe in the model config) under "
                            "torchtitan's Trainer is not checked against torchtitan's own run: "
                            "apply the plan to the blocks chained (apply_plan, no FSDP)")
    if workload.parallelism.cp != 1:
        raise WorkloadError("parallelism.context_parallel_degree > 1: torchtitan's context "
                            "parallelism is its own attention over load-balanced chunks; "
                            "run --parallelism.context_parallel_degree 1")
    if config.parallelism.spmd_backend == "full_dtensor":
        raise WorkloadError("parallelism.spmd_backend full_dtensor: kareus's adapter is "
                            "tested with spmd_types (the default) and partial_dtensor")


def _refuse_replayed_plan(plan: Any, schedule: str | None, stage: int = 0) -> None:
    """Under torchtitan's CUDA graphs one captured forward-backward is replayed for every
    gradient-accumulation step: refuse, before step 1, a plan whose computations of one
    phase differ (the replay would run the captured one's choice for all)."""
    if plan is None or schedule not in (None, "kareus"):
        return
    for phase in ("fwd", "bwd"):
        mine = {v for k, v in plan.assignment.items()
                if k.startswith(f"s{stage}.") and k.endswith(f".{phase}")}
        if len(mine) > 1:
            raise WorkloadError(
                f"training.disable_cuda_graphs is off: torchtitan captures one "
                f"forward-backward and replays it for every gradient-accumulation step, but "
                f"the plan gives the {phase} computations {len(mine)} different choices "
                "(configurations, nanobatches or clocks): make a plan with one choice per "
                "phase, or pass --training.disable-cuda-graphs")


def _masks_documents(block: Any) -> bool:
    """Whether a block's attention is FlexAttention or VarlenAttention (the decoder gives
    it ``block_causal`` document masks)."""
    tt = _classes()
    return isinstance(block.attention.inner_attention, (tt.Flex, tt.Varlen))


def _check_documents(model: Any, blocks: list[Any], plan: Any, schedule: str | None,
                     workload: Workload) -> None:
    """Refuse what the planned layers' document masks would not reproduce, or a plan would
    not cost: blocks of both kinds (masked and not), a decoder whose masks are not
    torchtitan's ``block_causal`` documents (an overridden ``get_attention_masks``), a plan
    for masked attention whose workload does not say so (``document_tokens``: it was
    costed for causal attention over whole sequences, not the pairs within documents
    that run), and a workload that says so for attention that masks none."""
    tt = _classes()
    kinds = {_masks_documents(b) for b in blocks}
    if len(kinds) > 1:
        raise WorkloadError("some blocks attend with FlexAttention or VarlenAttention "
                            "(document masks) and some with SDPA: kareus applies one "
                            "attention to every layer")
    if kinds != {True}:
        if workload.document_tokens is not None:
            raise WorkloadError(f"the workload masks packed documents (document_tokens="
                                f"{workload.document_tokens}), the model's attention (SDPA) "
                                "is causal over the whole sequence: make the workload "
                                "without document_tokens")
        return
    Decoder = tt.Decoder
    for m in model.modules():
        if isinstance(m, Decoder) and (
                type(m).get_attention_masks is not Decoder.get_attention_masks
                or type(m)._create_flex_attention_mask_for_document
                is not Decoder._create_flex_attention_mask_for_document):
            raise WorkloadError(f"{type(m).__name__} builds its own attention masks: kareus's "
                                "layer computes torchtitan's block_causal document mask only")
    if (plan is not None and schedule in (None, "kareus")
            and workload.document_tokens is None):
        raise WorkloadError("the model's attention masks packed documents (FlexAttention or "
                            "VarlenAttention, block_causal), but the workload does not "
                            "(document_tokens): make the plan for a workload with "
                            "document_tokens= (kareus optimize --document-tokens), whose "
                            "cost is the attention within documents")


def _plan_of(plan: Any) -> Any:
    from kareus.compose.plan import Plan

    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, bytes)) or hasattr(plan, "__fspath__"):
        return Plan.load(plan)  # type: ignore[arg-type]
    raise ArgumentTypeError(f"plan must be a kareus Plan, a plan file's path or None, got "
                            f"{type(plan).__name__}")


def _step_capture(trainer: Any) -> bool:
    """Whether the Trainer captures its forward-backward in a CUDA graph (torchtitan's
    ``training.disable_cuda_graphs = False`` on an NVIDIA GPU: its ``fwd_bwd_fn`` is
    ``wrap_with_cuda_graph`` of ``_forward_backward_body``; on a CPU the wrapper is the
    body itself). Refuses a forward-backward wrapped by anything else."""
    body = getattr(trainer, "_forward_backward_body", None)
    if getattr(trainer, "fwd_bwd_fn", None) == body:
        return False
    if not trainer.config.training.disable_cuda_graphs:
        return True
    raise WorkloadError("the Trainer's fwd_bwd_fn is wrapped by something other than "
                        "torchtitan's CUDA graphs (training.disable_cuda_graphs is set): "
                        "kareus enters its scopes in torchtitan's own forward-backward; "
                        "remove that wrapper")


def wrap_trainer(trainer: Any, plan: Any = None, *, schedule: str | None = None,
                 chain: bool | None = None, selective_as: str | None = None,
                 **applier_kwargs: Any) -> PlanApplier:
    """Apply a plan to a torchtitan 0.3 ``Trainer``: one call between ``config.build()``
    and ``trainer.train()``, on every rank.

    It reads the workload the Trainer runs
    ([`workload_from_trainer`][kareus.integrations.torchtitan.workload_from_trainer]),
    refuses what kareus's layers do not run exactly as torchtitan would (each in one line
    naming torchtitan's own setting, before the first step), checks the plan against that
    workload (``PlanError`` if it was made for another), applies it
    ([`apply_plan`][kareus.integrations.torchtitan.apply_plan] on the Trainer's model and
    mesh) and enters the plan's microbatch scopes in the Trainer's steps:

    * **training**: ``Trainer.train_step`` calls ``forward_backward_step`` once per
      gradient-accumulation step, which calls ``trainer.fwd_bwd_fn(inputs, labels,
      global_valid_tokens, extra_kwargs)``; this replaces ``fwd_bwd_fn`` on the instance by
      the same steps, the forward in ``applier.microbatch(mb, "fwd")`` and the backward in
      ``applier.microbatch(mb, "bwd")``, ``mb`` counting the calls of one step;
    * **CUDA graphs** (``training.disable_cuda_graphs = False``, torchtitan's default on
      NVIDIA GPUs): those steps are wrapped in torchtitan's own ``wrap_with_cuda_graph``
      as its body was, so torchtitan warms them up eagerly, captures them once and replays
      the capture for every gradient-accumulation step; the planned layers launch their
      kernels into that capture (no graphs of their own). As one capture serves every
      microbatch, a plan must give every forward (and every backward) one choice: others
      are refused here;
    * **sequence parallelism** (``parallelism.enable_sequence_parallel``, the default):
      the planned layers take and return this rank's sequence shard, as torchtitan's
      blocks do (the workload's ``sp``);
    * **activation checkpointing**: torchtitan's checkpoint wrapper around each block
      calls the planned block directly, which runs the workload's recomputation policy:
      ``full`` is kareus's ``"full"``, ``none`` its ``"none"``; torchtitan's per-op
      ``selective`` (the default) is none of kareus's policies, so the policy run in its
      place is named: the plan's workload's ``recompute`` (it was made for it), or
      ``selective_as`` without a plan
      ([`recompute_from_torchtitan`][kareus.integrations.torchtitan.recompute_from_torchtitan]);
    * **validation** (``validator.enable``): the validator's forward-only batches run the
      planned layers under the ``"sequential"`` schedule (no plan configuration exists for
      a forward without its backward; the values are the same);
    * **packed documents**: each batch's ``positions`` (restarting at every document)
      rotate the planned layers' RoPE, as torchtitan's blocks do; where the model's
      attention masks them (FlexAttention or VarlenAttention, ``block_causal``), the
      planned layers mask them as torchtitan does (block-sparse FlexAttention on a GPU),
      and a plan must have been made for a workload that says so
      (``document_tokens``, taken from the plan);
    * **torch.compile** (``compile.enable``): the planned blocks run uncompiled (torch's
      ``torch.compiler.disable``), torchtitan compiles the rest (the loss).

    Passing a [`PlanApplier`][kareus.integrations.PlanApplier] made with ``apply_plan``
    instead of a plan only enters its scopes (the lower-level path).

    Args:
        trainer: The built Trainer.
        plan: A [`Plan`][kareus.compose.Plan], a plan file's path (``kareus optimize``'s
            ``plan.json``), ``None`` (a baseline ``schedule``), or an applier.
        schedule: As ``apply_plan`` takes it (default ``"kareus"`` with a plan).
        chain: As ``apply_plan`` takes it. torchtitan wraps every block in FSDP (even at
            one data-parallel rank), so under the Trainer the blocks run per block: the
            workload is one of unchained layers (``chained_layers=False``), and a plan made
            for chained layers is refused.
        selective_as: Under torchtitan's per-op selective checkpointing, the policy the
            planned layers run in its place; default: the plan's workload's ``recompute``
            (required without a plan).
        **applier_kwargs: Passed to ``apply_plan`` (``kernels``, ``record``, ...).

    Returns:
        The applier (``applier.partitions_run`` with ``record=True``).

    Raises:
        WorkloadError: what kareus does not run as torchtitan would: context or pipeline
            parallelism, memory-budget checkpointing, selective checkpointing without a
            policy named, attention masking packed documents under a plan whose workload
            has no ``document_tokens`` (or the reverse), a plan of several choices per
            phase under CUDA graphs, a layer kareus does not compute, a plan made for
            chained layers.
        PlanError: the plan was made for another workload; a step runs more microbatches
            than the plan's workload.
    """
    if isinstance(plan, PlanApplier):
        if applier_kwargs or schedule is not None or chain is not None or selective_as:
            raise ArgumentError("wrap_trainer(trainer, applier) only enters the applier's "
                                "scopes: pass plan options to apply_plan")
        check_torchtitan_version()
        dims = getattr(trainer, "parallel_dims", None)
        if dims is not None and getattr(dims, "pp_enabled", False):
            raise WorkloadError("pipeline parallelism (parallelism.pipeline_parallel_degree "
                                "> 1): kareus's adapter does not enter the pipeline "
                                "schedule's steps; run --parallelism.pipeline_parallel_degree 1")
        applier = plan
        captured = _step_capture(trainer)
        if captured:
            _refuse_replayed_plan(applier.plan, applier.schedule, applier.stage)
    else:
        plan = _plan_of(plan)
        config, dims, model = _trainer_parts(trainer)
        planned = (plan.workload or {}) if plan is not None else {}
        nb = int(planned.get("nanobatches", 2))
        if selective_as is None and plan is not None:
            selective_as = planned.get("recompute")
        # packed documents masked: the plan's workload says their length (a baseline needs
        # none: it is not costed)
        docs = planned.get("document_tokens")
        unchained = _why_unchained(model)
        workload = _workload_of(config, trainer.model_config,
                                (int(dims.tp), int(dims.cp), int(dims.pp),
                                 int(dims.dp_replicate) * int(dims.dp_shard)),
                                int(trainer.gradient_accumulation_steps), nanobatches=nb,
                                name=None, selective_as=selective_as,
                                document_tokens=None if docs is None else int(docs),
                                documents_required=False,
                                chained=unchained is None)
        _refuse_unsupported(config, model, workload)
        if (plan is not None and planned.get("chained_layers", True)
                and not workload.chained_layers):
            # torchtitan 0.3's Trainer wraps every block in FSDP (fully_shard) on a GPU at
            # any data-parallel degree, and in a checkpoint wrapper under activation
            # checkpointing: its blocks run one by one
            raise WorkloadError(f"the plan was made for chained layers, but under this "
                                f"Trainer {unchained}, so its blocks run one by one: make "
                                "the plan with kareus optimize --torchtitan-args (which "
                                "reads this) or --unchained-layers")
        captured = _step_capture(trainer)
        if captured:
            _refuse_replayed_plan(plan, schedule)
        from torchtitan.distributed.activation_checkpoint import (  # type: ignore[import-untyped, import-not-found]
            SelectiveAC,
        )

        if isinstance(config.activation_checkpoint, SelectiveAC.Config):
            _log.info("kareus: torchtitan's per-op selective activation checkpointing is "
                      "replaced by kareus's recompute=%s in the planned layers",
                      workload.recompute)
        applier = apply_plan(model, workload=workload, mesh=dims, plan=plan,
                             schedule=schedule, chain=chain,
                             replace_ac=config.activation_checkpoint is not None,
                             **applier_kwargs)
        validator = getattr(trainer, "validator", None)
        if config.validator.enable and validator is not None:
            _wrap_validator(validator, applier)
    _enter_scopes(trainer, applier, captured=captured)
    return applier


def _wrap_validator(validator: Any, applier: PlanApplier) -> None:
    """Run the validator's forward-only batches under the ``"sequential"`` schedule (a
    plan configures a microbatch's forward and backward together; validation runs no
    backward). The values are those of any schedule: only the overlap differs."""
    validate = validator.validate

    def sequential_validate(*args: Any, **kwargs: Any) -> Any:
        before = applier.schedule
        applier.schedule = "sequential"
        try:
            return validate(*args, **kwargs)
        finally:
            applier.schedule = before

    validator.validate = sequential_validate


def _enter_scopes(trainer: Any, applier: PlanApplier, *, captured: bool = False) -> None:
    """Replace the Trainer's ``fwd_bwd_fn`` by its own steps inside the applier's
    microbatch scopes (wrapped in torchtitan's CUDA graph wrapper where the Trainer's was:
    ``captured``), and restart the microbatch count at each ``train_step``."""
    limit = applier.workload.num_microbatches
    state = {"mb": 0}
    train_step = trainer.train_step

    def counted_train_step(*args: Any, **kwargs: Any) -> Any:
        state["mb"] = 0
        return train_step(*args, **kwargs)

    def fwd_bwd(inputs: Any, labels: Any, global_valid_tokens: Any,
                extra_kwargs: dict[str, Any]) -> Any:
        # under a step capture this runs for torchtitan's eager warm-up and its one
        # capture only; the replays run what was captured
        mb = state["mb"]
        if mb >= limit:
            raise PlanError(f"a training step ran microbatch {mb}; the plan's workload has "
                            f"{limit} (num_microbatches = gradient accumulation steps)")
        state["mb"] = mb + 1
        loss_kwargs = ({"positions": extra_kwargs["positions"]}
                       if "positions" in extra_kwargs else {})
        with trainer.train_context():
            with applier.microbatch(mb, "fwd"):
                logits = trainer.model_parts[0](inputs, **extra_kwargs)
            loss, _ = trainer.loss_fn(logits, labels, global_valid_tokens, **loss_kwargs)
            del logits
            with _no_typecheck(), applier.microbatch(mb, "bwd"):
                loss.backward()
        return loss

    fn: Any = fwd_bwd
    if captured:
        from torchtitan.distributed.cudagraph import (  # type: ignore[import]
            wrap_with_cuda_graph,
        )

        fn = wrap_with_cuda_graph(fwd_bwd)
    trainer.fwd_bwd_fn = fn
    trainer.train_step = counted_train_step



@contextlib.contextmanager
def _no_typecheck() -> Iterator[None]:
    """spmd_types' type propagation off in the backward, as torchtitan's trainer does."""
    try:
        import spmd_types as spmd  # type: ignore[import]
    except ImportError:  # pragma: no cover - spmd_types comes with torchtitan 0.3
        yield None
        return
    with spmd.no_typecheck():
        yield None


# ------------------------------------------------------------------ the command line


def main(argv: list[str] | None = None) -> None:
    """``python -m kareus.integrations.torchtitan [--plan PATH] [--schedule NAME]
    [--selective-as POLICY] --module M --config C [torchtitan's flags]``: torchtitan 0.3's own ``-m
    torchtitan.train`` (its config parser, ``Trainer``, training loop and teardown) with
    [`wrap_trainer`][kareus.integrations.torchtitan.wrap_trainer] between building the
    Trainer and training it. ``--plan``: ``kareus optimize``'s ``plan.json`` made for
    [`workload_from_trainer`][kareus.integrations.torchtitan.workload_from_trainer] of
    this config; without it, ``--schedule`` names a baseline (``sequential``,
    ``nanobatching``). ``--selective-as``: under torchtitan's per-op selective activation
    checkpointing (its default), the recomputation policy kareus's layers run in its place
    (default: the plan's; required without a plan). Run it under ``torchrun`` as
    torchtitan's own entry point."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    mine: dict[str, str | None] = {"--plan": None, "--schedule": None,
                                   "--selective-as": None}
    rest: list[str] = []
    it = iter(args)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key in mine:
            if not eq:
                value = next(it, "")
            if not value:
                raise ArgumentError(f"{key} needs a value")
            mine[key] = value
        else:
            rest.append(arg)
    check_torchtitan_version()
    import torch
    from torchtitan.config import ConfigManager  # type: ignore[import]
    from torchtitan.tools.logging import init_logger  # type: ignore[import]

    init_logger()
    config = ConfigManager().parse_args(rest)
    trainer = config.build()
    try:
        wrap_trainer(trainer, mine["--plan"], schedule=mine["--schedule"],
                     selective_as=mine["--selective-as"])
        trainer.train()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

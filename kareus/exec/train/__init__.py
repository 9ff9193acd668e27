"""Training with a plan: a Llama-shaped decoder trained under kareus or its baselines.

The library's training loop, for measuring what a plan does to a real job and as the
pattern for applying one in your own loop. Each rank builds its shard of a decoder from a
preset's dimensions ([`DecoderShard`][kareus.exec.train.DecoderShard]: N layers, random
initialisation, fp32 master weights, AdamW, cross-entropy of next-token prediction on random
tokens), tensor, context and data parallel, every op on the production kernels (``kareus.exec.kernels``),
and runs iterations through an [`Executor`][kareus.exec.Executor] (a
[`TorchExecutor`][kareus.exec.TorchExecutor] by default, or any executor passed as
``TrainingLoop(executor=..., baseline=...)``) under one of three schedules ([`SCHEDULES`][kareus.exec.schedule.SCHEDULES]):

* ``"sequential"``: Megatron-LM without overlap (whole microbatches, each collective
  right after the ops that produce its tensor, the collective's own CTA count);
* ``"nanobatching"``: the default overlap (each collective launched with the next
  nanobatch's or segment's first op, its own CTA count);
* ``"kareus"``: every partition at the plan's launch slot with the plan's SM count, and
  the plan's clock requested per microbatch computation in stream order.

The three run the same ops on the same data from the same weights, so their losses agree
step by step (up to the rounding of different GEMM shapes and of the attention backward's
accumulation order).

A model with a mixture of experts (``ModelArch.moe``) runs its MoE layers (``_moe``: router,
top-k, permutation, grouped SwiGLU experts, shared experts, un-permutation, on the kernel
set's MoE kernels) with expert parallelism folded over the TP and CP ranks
(``TorchParallelGroups(tp=..., ep=...)``): the dispatch and combine all-to-alls and their
gradients are collectives of the schedule like the others, their split sizes exchanged
between the EP ranks after the routing; it runs eagerly (no CUDA graphs: the sizes are
data-dependent).

Which op runs in which partition is the decoder schedule,
[`kareus.exec.schedule`][kareus.exec.schedule], which this loop shares with the framework
adapters ([`kareus.integrations`][kareus.integrations]); its names were re-exported here and
still import from here for one release, with a ``DeprecationWarning``. Modules: ``_model`` (the
decoder's ops), ``_moe`` (the mixture-of-experts block's ops), ``_groups`` (TP, CP and EP
groups, and the one-GPU loopback stand-ins), ``_timed``
(the time-faithful loopback stand-in), ``_collectives`` (building a job's collectives), ``_loop``
(the loop, timing and energy of runs, overlap efficiency). A training script
is ``examples/train_torchrun.py``; ``bench/train_e2e.py`` measures the three schedules.
"""

from __future__ import annotations

from kareus.exec.model_check import refuse_uncomputed
from kareus.exec.train._collectives import (
    BACKENDS,
    LOOPBACK_MODES,
    faithful_note,
    make_collectives,
    named_collectives,
)
from kareus.exec.train._groups import (
    GroupedCollective,
    LoopbackGroupCollective,
    LoopbackGroups,
    ParallelGroups,
    TorchParallelGroups,
)
from kareus.exec.train._loop import (
    RunRecord,
    TrainingLoop,
    check_plan_splits,
    check_plan_types,
    check_plan_workload,
    given_plan,
    measure_runs,
    no_collective_backend,
    overlap_efficiency,
    shuffled_order,
)
from kareus.exec.train._model import KEPT_FOR_BACKWARD, DecoderShard
from kareus.exec.train._timed import (
    STAND_IN_LABEL,
    CollectiveTimes,
    FixedRateCollectiveTimes,
    TimedLoopbackGroupCollective,
)

__all__ = [
    "BACKENDS",
    "CollectiveTimes",
    "DecoderShard",
    "FixedRateCollectiveTimes",
    "KEPT_FOR_BACKWARD",
    "LOOPBACK_MODES",
    "GroupedCollective",
    "LoopbackGroupCollective",
    "LoopbackGroups",
    "ParallelGroups",
    "RunRecord",
    "STAND_IN_LABEL",
    "TimedLoopbackGroupCollective",
    "TorchParallelGroups",
    "TrainingLoop",
    "check_plan_splits",
    "check_plan_types",
    "check_plan_workload",
    "faithful_note",
    "given_plan",
    "make_collectives",
    "measure_runs",
    "named_collectives",
    "no_collective_backend",
    "overlap_efficiency",
    "refuse_uncomputed",
    "shuffled_order",
]


def __getattr__(name: str) -> object:
    """The decoder schedule's names this package re-exported before they moved to
    ``kareus.exec.schedule``: returned from there with a ``DeprecationWarning`` (one release)."""
    from kareus._compat import moved_attribute

    return moved_attribute(__name__, name)

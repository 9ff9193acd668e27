"""The training loop: a decoder trained under a plan, or under the schedules it replaces.

[`TrainingLoop`][kareus.exec.train.TrainingLoop] owns one rank's
[`DecoderShard`][kareus.exec.train.DecoderShard], two [`Executor`][kareus.exec.Executor]s (one
applying the plan, one for the baselines: [`TorchExecutor`][kareus.exec.TorchExecutor]s it builds,
or any executors the caller passes) and a fixed set of random-token microbatches (the
same on every rank and in every run, so that every schedule sees the same data and its loss can be
compared step by step). [`TrainingLoop.step`][kareus.exec.train.TrainingLoop.step] enqueues one
iteration: every microbatch computation of the pipeline schedule (1F1B with one stage: forward and
backward of each microbatch in turn) under ``"sequential"``, ``"nanobatching"`` or ``"kareus"``
([`kareus.exec.schedule`][kareus.exec.schedule]), the gradient sum over CP ranks and the AdamW step.

[`measure_runs`][kareus.exec.train.measure_runs] times runs of several steps back to back with
device events, the energy of each run from an [`EnergyMeter`][kareus.profilers.EnergyMeter] (step-edge
reads); [`shuffled_order`][kareus.exec.train.shuffled_order] gives the order of schedules and
repeats from a seed (so every rank runs the same order);
[`overlap_efficiency`][kareus.exec.train.overlap_efficiency] times each partition type's computation
alone, its collective alone and both under a configuration.

torch is imported inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from kareus.compose import Plan
from kareus.errors import ArgumentError, ArgumentTypeError, KareusError, PlanError, WorkloadError
from kareus.exec._graphs import prefer_workspace_free_gemms
from kareus.exec.executor import Executor, TorchExecutor, plan_config, plan_nanobatches
from kareus.exec.model_check import refuse_uncomputed
from kareus.exec.schedule import (
    SCHEDULES,
    DefaultConfig,
    Piece,
    TypeShape,
    pieces,
    run_computation,
    sp_backward_stream,
    stack_stream,
    type_shapes,
)
from kareus.exec.train._model import DecoderShard
from kareus.model.workload import ModelArch, Workload, get_model

__all__ = [
    "RunRecord",
    "TrainingLoop",
    "check_plan_splits",
    "check_plan_workload",
    "measure_runs",
    "overlap_efficiency",
    "shuffled_order",
]


def _check_groups(workload: Workload, groups: Any) -> None:
    """Refuse groups of other degrees than the workload's TP, CP, DP and EP."""
    p = workload.parallelism
    if (groups.tp_size, groups.cp_size) != (p.tp, p.cp):
        raise WorkloadError(f"the groups are TP={groups.tp_size} x CP={groups.cp_size}; the "
                            f"workload asks for TP={p.tp} x CP={p.cp}")
    if getattr(groups, "dp_size", 1) != p.dp:
        raise WorkloadError(f"the groups are DP={getattr(groups, 'dp_size', 1)}; the "
                            f"workload asks for DP={p.dp} (TorchParallelGroups(tp=..., "
                            "dp=...))")
    if getattr(groups, "ep_size", 1) != p.ep:
        raise WorkloadError(f"the groups are EP={getattr(groups, 'ep_size', 1)}; the "
                            f"workload asks for EP={p.ep} (TorchParallelGroups(tp=..., "
                            "ep=...))")


def _check_moe_run(workload: Workload, graphs: bool | None) -> None:
    """Refuse, in one line each, what the loop does not run of a mixture of experts: CUDA
    graphs (the dispatch's split sizes are data-dependent, read on the host after the
    routing: ``kareus.exec.train._moe``) and nanobatches along the sequence."""
    if graphs:
        raise WorkloadError("a mixture of experts runs eagerly in the training loop: its "
                            "all-to-alls' sizes follow the routing, read on the host, which a "
                            "CUDA graph cannot capture; pass graphs=False")
    if workload.sequence_split:
        raise WorkloadError("a mixture of experts with nanobatches along the sequence "
                            f"(microbatch_size=1, nanobatches={workload.nanobatches}) is not "
                            "run by the training loop: use nanobatches=1 or a larger "
                            "microbatch")


def check_plan_splits(plan: Plan, workload: Workload) -> None:
    """Refuse a plan that splits a microbatch's backward into other nanobatches than its
    forward when the workload keeps activations (``recompute`` ``"none"`` or
    ``"selective"``): they are kept per nanobatch, so the backward runs in the forward's
    split (full recomputation re-splits each layer's input, so any split runs).

    Raises:
        PlanError: a microbatch whose forward and backward nanobatch counts differ.
    """
    if workload.recompute == "full":
        return
    for key in plan.assignment:
        if not str(key).endswith(".fwd"):
            continue
        other = str(key)[:-4] + ".bwd"
        if other in plan.assignment and plan.nanobatches(key) != plan.nanobatches(other):
            raise PlanError(f"the plan splits {key} into {plan.nanobatches(key)} "
                            f"nanobatch(es) and {other} into {plan.nanobatches(other)}: "
                            f"with recompute={workload.recompute!r} a backward runs in its "
                            "forward's nanobatches (make the plan for this workload)")


def check_plan_workload(plan: Plan, workload: Workload, *, one_stage: bool = True) -> None:
    """Refuse a plan made for another job than ``workload``.

    Args:
        plan: The plan.
        workload: The job.
        one_stage: Whether the caller runs one pipeline stage only (the library's loop);
            otherwise the plan's stages must be the workload's PP degree (an integration
            applies stage ``s``'s configurations on the ranks of stage ``s``).

    Raises:
        PlanError: the plan has more than one pipeline stage (``one_stage``) or not the
            workload's PP stages, or its recorded workload differs from ``workload`` in TP,
            CP, EP (and DP, ``one_stage``), microbatch size, sequence length, nanobatches,
            microbatches, recomputation, packed documents (``document_tokens``), chained
            layers or model.
    """
    if not isinstance(plan, Plan):
        raise ArgumentTypeError(f"plan must be a kareus.compose.Plan, got "
                                f"{type(plan).__name__}")
    if one_stage and plan.num_stages != 1:
        raise PlanError(f"the training loop runs one pipeline stage; the plan has "
                        f"{plan.num_stages}: make a plan with pp=1")
    if not one_stage and plan.num_stages != workload.parallelism.pp:
        raise PlanError(f"the plan has {plan.num_stages} pipeline stage(s), the job "
                        f"{workload.parallelism.pp} (PP): make the plan for this job")
    w = plan.workload or {}
    if not w:
        raise PlanError("the plan does not record its workload: make it with kareus optimize")
    mine = workload.to_dict()
    theirs = dict(w)
    if isinstance(theirs.get("recompute"), bool):  # plans written before the policies
        theirs["recompute"] = "full" if theirs["recompute"] else "none"
    # the TP layout, not the flag: sequence parallelism at TP = 1 is the plain layout (as in
    # Megatron-LM); plans written before sequence parallelism have none
    theirs["sp"] = bool(theirs.get("sp", False)) and theirs.get("tp") != 1
    mine["sp"] = workload.parallelism.sequence_parallel
    # absent from a description: chained layers (as every plan written before the setting)
    theirs["chained_layers"] = bool(theirs.get("chained_layers", True))
    mine["chained_layers"] = workload.chained_layers
    # expert parallelism: absent is 1 (a dense model, or a plan written before MoE)
    theirs["ep"] = theirs.get("ep", 1)
    mine["ep"] = workload.parallelism.ep
    keys: tuple[str, ...] = ("tp", "cp", "sp", "ep", "microbatch_size", "seq_len",
                             "nanobatches", "num_microbatches", "recompute", "chained_layers")
    if one_stage:  # the library's loop runs the job's data parallelism itself
        keys += ("dp",)
    diff = [f"{k}: plan {theirs.get(k)!r}, job {mine[k]!r}" for k in keys
            if k in theirs and theirs[k] != mine[k]]
    # packed documents masked (their attention costed): absent is one document per sequence
    if theirs.get("document_tokens") != mine.get("document_tokens"):
        diff.append(f"document_tokens: plan {theirs.get('document_tokens')!r}, job "
                    f"{mine.get('document_tokens')!r}")
    if theirs["chained_layers"] != mine["chained_layers"]:
        diff[diff.index(f"chained_layers: plan {theirs['chained_layers']!r}, job "
                        f"{mine['chained_layers']!r}")] += (
            " (the job runs its layers one by one: make the plan with kareus optimize "
            "--unchained-layers)" if theirs["chained_layers"] else
            " (the job chains its layers: make the plan without --unchained-layers)")
    if "model" in w:
        diff += _architecture_differences(w["model"], workload.model)
    if diff:
        raise PlanError("the plan was made for another job (" + "; ".join(diff) +
                        "): make a plan for this workload")


def _architecture_differences(recorded: Any, model: ModelArch) -> list[str]:
    """How the model a plan was made for differs from ``model``, field by field; names do not
    matter (the same architecture under another name is the same model). A plan that names a
    preset only (written before plans carried the architecture) is taken as that preset's
    current architecture."""
    if isinstance(recorded, str):
        try:
            recorded = get_model(recorded).to_dict()
        except KareusError:  # a model this process does not know: by name only
            return [] if recorded == model.name else [
                f"model: plan {recorded!r}, job {model.name!r}"]
    if not isinstance(recorded, dict):
        return [f"model: plan {recorded!r:.60}, job {model.name!r}"]
    try:
        planned = ModelArch.from_dict({**recorded, "name": model.name})
    except (KareusError, ValueError) as exc:
        return [f"model: the plan's architecture is not readable ({exc})"]
    mine, theirs = attrs.asdict(model), attrs.asdict(planned)
    return [f"model.{k}: plan {theirs[k]!r}, job {mine[k]!r}" for k in mine
            if k != "name" and mine[k] != theirs[k]]


@attrs.frozen
class RunRecord:
    """One run: ``steps`` iterations of one schedule from the initial weights.

    Attributes:
        schedule: The schedule.
        repeat: Which repeat of that schedule.
        step_time_s: Device-event time of each timed iteration on this rank (at least the
            ``steps`` asked for; more where the window was lengthened for the energy
            counter: ``measure_runs``'s ``min_window_s``).
        losses: Loss after each iteration's forward passes (every iteration, warm-up
            included: step ``k`` of every run starts from the same weights history).
        window_s: Host time of the timed iterations (synchronised at both ends).
        energy_j: Energy of this rank's GPU per timed iteration, measured as
            ``energy_method`` says, or ``None`` (nothing measured it).
        counter_steps: NVML counter steps inside the window.
        sm_clock_mhz: Mean SM clock the meter sampled in the window (``None`` without a
            meter that samples clocks, or without a sample).
        energy_method: How ``energy_j`` was measured: ``"nvml_counter"`` (average power
            between the first and last NVML counter steps inside the window x the window
            / iterations), ``"nvml_power_samples"`` (no counter step inside the window:
            the mean of NVML's power readings sampled in it x the window / iterations,
            coarser), the meter's own ``energy_method`` where it names one (the CPU dry
            run's stand-in: ``"stand_in"``, not a measurement), ``"<Type>.energy_between"``
            for a meter that names none, or ``None`` (no energy).
        power_samples: NVML power readings inside the window (the fallback's basis).
        sub_powers_w: This GPU's average power over consecutive parts of the counter's
            span inside the window (W; up to ``WINDOW_PARTS``, each between counter steps;
            empty without them): a trend says the window was not steady (e.g. the power
            limiter still settling after the warm-up), which its mean hides.
    """

    schedule: str
    repeat: int
    step_time_s: tuple[float, ...]
    losses: tuple[float, ...]
    window_s: float
    energy_j: float | None
    counter_steps: int
    sm_clock_mhz: float | None = None
    energy_method: str | None = None
    power_samples: int = 0
    sub_powers_w: tuple[float, ...] = ()

    @property
    def time_s(self) -> float:
        """Mean iteration time of the run."""
        return statistics.fmean(self.step_time_s)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"schedule": self.schedule, "repeat": self.repeat,
                "step_time_s": list(self.step_time_s), "losses": list(self.losses),
                "window_s": self.window_s, "energy_j": self.energy_j,
                "counter_steps": self.counter_steps, "time_s": self.time_s,
                "sm_clock_mhz": self.sm_clock_mhz, "iterations": len(self.step_time_s),
                "energy_method": self.energy_method, "power_samples": self.power_samples,
                "sub_powers_w": list(self.sub_powers_w)}


#: Parts of a run's counter span whose average powers its record keeps
#: (``RunRecord.sub_powers_w``).
WINDOW_PARTS = 3


def shuffled_order(schedules: Sequence[str], repeats: int, seed: int) -> list[tuple[str, int]]:
    """``(schedule, repeat)`` pairs in an order shuffled by ``seed`` alone, so that every
    rank that passes the same seed runs the same order."""
    order = [(s, r) for r in range(repeats) for s in schedules]
    random.Random(seed).shuffle(order)
    return order


class TrainingLoop:
    """One rank of a decoder trained with tensor, context, data (and expert) parallelism
    under a plan.

    Args:
        workload: The job: model dimensions, TP, CP, microbatch size, sequence length,
            microbatches per iteration, nanobatches, recomputation. PP must be 1; DP > 1
            runs replicas on their own microbatches (``TorchParallelGroups(dp=...)``).
        groups: This rank's [`ParallelGroups`][kareus.exec.train.ParallelGroups] (TP x CP x
            DP, and EP, of the workload).
        collective: The partitions' collectives with exact SM caps (a
            [`GroupedCollective`][kareus.exec.train.GroupedCollective]); also the source of the
            communication buffers.
        default_collective: The baselines' collectives with their own CTA count
            (``None``: ``collective``).
        backends: Collectives by name, for a plan whose configurations name their
            backend ([`named_collectives`][kareus.exec.train.named_collectives]); the communication
            buffers come from the first of ``collective`` and these that allocates
            registered memory.
        plan: The plan the ``"kareus"`` schedule applies (``None``: only the baselines).
        frequency: The [`FrequencyTrigger`][kareus.exec.FrequencyTrigger] the plan's clocks
            go through (``None``: no clock requests).
        layers: Transformer layers to build (default: the model's). The plan's
            configurations are per partition type, so they apply to any number.
        streams: The stream backend (``None``: CUDA streams).
        kernels: The ops' ``KernelSet`` (or name).
        device: Torch device (default: the current CUDA device).
        dtype: Torch dtype name (default ``"bfloat16"``).
        seed: Seed of the weights and of the data.
        lr: AdamW learning rate.
        schedule: Pipeline schedule name when there is no plan (default ``"1f1b"``).
        comm_high_priority: Collectives on a high-priority stream, for every schedule
            ([`TorchExecutor`][kareus.exec.TorchExecutor]'s ``comm_high_priority``).
        graphs: Run each schedule's iteration from CUDA graphs (``None``, the default: on
            a CUDA device, or as the executors passed in capture, except for a mixture of
            experts, whose routing-sized all-to-alls run eagerly; ``False``: eager
            launches). Every schedule is run the same way, so comparisons stay fair. See
            [`step`][kareus.exec.train.TrainingLoop.step].
        executor: The executor that applies the plan (any
            [`Executor`][kareus.exec.Executor]; it holds the plan, which ``plan`` may then
            omit); ``None``: a [`TorchExecutor`][kareus.exec.TorchExecutor] built from
            ``collective``, ``backends``, ``frequency`` and ``streams``. Its ``empty``
            allocates the communication buffers when ``collective`` is not given.
        baseline: The executor that runs the baselines (any
            [`Executor`][kareus.exec.Executor]); ``None``: a
            [`TorchExecutor`][kareus.exec.TorchExecutor] built from ``collective`` and
            ``default_collective``.

    Attributes:
        executor: The executor applying the plan (``None`` without a plan).
        baseline: The executor of the baselines.
        graphs: Whether every schedule's iteration is replayed from graphs (the
            executors' [`graphs`][kareus.exec.Executor.graphs] capability).
    """

    def __init__(self, *, workload: Workload, groups: Any, collective: Any = None,
                 default_collective: Any = None, plan: Plan | None = None,
                 backends: Any = None,
                 frequency: Any = None, layers: int | None = None, streams: Any = None,
                 kernels: Any = None, device: Any = None, dtype: str = "bfloat16",
                 seed: int = 0, lr: float = 3e-4, schedule: str = "1f1b",
                 comm_high_priority: bool = True, graphs: bool | None = None,
                 executor: Executor | None = None, baseline: Executor | None = None) -> None:
        import torch

        from kareus.model.partition import build_partitions
        from kareus.model.pipeline import get_schedule

        if not isinstance(workload, Workload):
            raise ArgumentTypeError(f"workload must be a Workload, got {type(workload).__name__}")
        # first: a model whose layers the loop does not compute (e.g. a QKV bias)
        refuse_uncomputed(workload.model, where="kareus's training loop",
                          computes=frozenset({"qk_norm", "norm_eps", "moe"}))
        if torch.cuda.is_available():
            # Before the first GEMM; graphed or eager, one memset fewer per GEMM
            # (kareus.exec._graphs).
            prefer_workspace_free_gemms()
        p = workload.parallelism
        if p.pp != 1:
            raise WorkloadError(f"the training loop runs one pipeline stage (PP=1); the "
                                f"workload has PP={p.pp}")
        if workload.document_tokens is not None:
            raise WorkloadError(f"the training loop's data are whole sequences, causal "
                                f"attention over each; the workload masks packed documents "
                                f"(document_tokens={workload.document_tokens}): drop "
                                "document_tokens (packed documents run in the planned layers: "
                                "kareus.integrations.PlanApplier)")
        if not workload.chained_layers:
            raise WorkloadError("the training loop runs its layers as one chain; the workload "
                                "has chained_layers=False (layers run one by one, as "
                                "framework blocks wrapped in FSDP do): use chained_layers=True")
        _check_groups(workload, groups)
        moe = workload.model.moe
        if moe is not None:
            _check_moe_run(workload, graphs)
        has_comm = p.tp * p.cp * p.ep > 1
        plan = _plan_of(plan, executor, baseline,
                        needs_collective=has_comm and collective is None)
        if plan is not None:
            check_plan_workload(plan, workload)
            check_plan_splits(plan, workload)
        self.workload, self.groups, self.plan = workload, groups, plan
        self.types: dict[str, TypeShape] = (type_shapes(build_partitions(workload))
                                            if has_comm else {})
        # The partition types of a computation a plan runs unsplit (kareus's space holds
        # unsplit execution: kareus.compose.systems); a plan names them by their own names
        # in its unsplit choices
        self.unsplit_types: dict[str, TypeShape] = (
            type_shapes(build_partitions(workload.with_(nanobatches=1)))
            if has_comm and workload.nanobatches > 1 else self.types)
        self.model = DecoderShard(
            arch=workload.model, layers=layers, microbatch_size=workload.microbatch_size,
            seq_len=workload.seq_len, num_microbatches=workload.num_microbatches,
            groups=groups,
            backend=self._buffer_source(has_comm, collective, backends, executor or baseline),
            nanobatch_counts=tuple(sorted({1, workload.nanobatches})),
            recompute=workload.recompute, kernels=kernels, device=device, dtype=dtype,
            seed=seed, lr=lr, sp=p.sequence_parallel)
        self.layers = self.model.layers
        streams_ = {ph: stack_stream(ph, self.layers, tp=p.tp, cp=p.cp,
                                     recompute=workload.recompute,
                                     qk_norm=workload.model.qk_norm, sp=p.sequence_parallel,
                                     ep=p.ep, moe=moe)
                    for ph in ("fwd", "bwd")}
        # opened by the all-gather of the LM head's input gradient (an MoE layer's backward
        # reads its output gradient on the shard: no all-gather)
        if p.sequence_parallel and moe is None:
            streams_["bwd"] = sp_backward_stream(streams_["bwd"], self.layers)
        self.stacks: dict[str, list[Piece]] = {ph: pieces(st) for ph, st in streams_.items()}
        name = plan.schedule if plan is not None else schedule
        self.computations = list(get_schedule(name, 1, workload.num_microbatches)
                                 .stage_orders[0])
        if plan is not None:  # the types of each split the plan runs
            check_plan_types(plan, workload, self.types, self.unsplit_types,
                             {plan_nanobatches(plan, c.stage, c.microbatch, c.phase)
                              for c in self.computations})
        if graphs is None:
            given = executor or baseline
            graphs = given.graphs if given is not None else (
                self.model.device.type == "cuda" and moe is None)  # MoE: eager by default
            if moe is not None:
                _check_moe_run(workload, graphs)
        self.graphs = bool(graphs)
        self.baseline: Executor
        self.executor: Executor | None
        self.baseline, self.executor = self._executors(
            plan, executor, baseline, collective=collective if has_comm
            else no_collective_backend(), default_collective=default_collective,
            backends=backends, frequency=frequency, streams=streams,
            comm_high_priority=comm_high_priority)
        if self.executor is not None:
            self.executor.start()  # every rank compares the plan's digest
        for ex in (self.baseline, self.executor):
            if ex is not None and bool(ex.graphs) != self.graphs:
                raise ArgumentError(f"graphs={self.graphs}, but {type(ex).__name__}.graphs is "
                                    f"{ex.graphs}: every schedule runs the same way (pass graphs= "
                                    "to match the executors)")
        self._data(torch, seed)
        self.partitions_run: list[tuple[str, Any]] = []

    def _executors(self, plan: Plan | None, executor: Executor | None,
                   baseline: Executor | None, *, collective: Any, default_collective: Any,
                   backends: Any, frequency: Any, streams: Any, comm_high_priority: bool,
                   ) -> tuple[Executor, Executor | None]:
        """The baselines' executor and the plan's: those given, else TorchExecutors."""
        coll, named = collective, dict(backends or {})
        if baseline is None:
            baseline = TorchExecutor(collective=coll,
                                     default_collective=default_collective or coll,
                                     streams=streams, comm_high_priority=comm_high_priority,
                                     graphs=self.graphs)
        def make(plan: Plan) -> Executor:  # also another frontier point's (retarget)
            wanted = {b for cs in plan.partition_configs().values() for c in cs
                      if (b := getattr(c, "backend", None))}
            if wanted - set(named):
                raise PlanError(f"the plan's configurations name collective backends "
                                f"{sorted(wanted - set(named))}: pass them in backends= "
                                "(kareus.exec.train.named_collectives)")
            return TorchExecutor(plan=plan, collective=coll, frequency=frequency,
                                 default_collective=default_collective or coll,
                                 backends=named, streams=streams,
                                 comm_high_priority=comm_high_priority, graphs=self.graphs)

        if executor is None:
            self._make_plan_executor = make
            if plan is not None:
                executor = make(plan)
        return baseline, executor

    @staticmethod
    def _buffer_source(has_comm: bool, collective: Any, backends: Any,
                       executor: Executor | None) -> Any:
        """Where the model's communication buffers come from: the first of ``collective``
        and ``backends`` that allocates (registered memory), or, without ``collective``,
        the executor passed in (its ``empty``)."""
        if not has_comm:
            return None
        if collective is None:
            return executor
        return [collective, *dict(backends or {}).values()]

    def _data(self, torch: Any, seed: int) -> None:
        m, wl = self.model, self.workload
        # Stand-in groups (every rank holds this rank's data): tokens from this rank's
        # vocabulary shard. A token of another shard would get the zero embedding row, which
        # stays zero through the layers at a sequence's first position, and RMSNorm's
        # backward at a zero row multiplies the gradient by 1/sqrt(eps) (316) per norm:
        # non-finite gradients after about 20 layers. A real TP group sums every token's row.
        lo_id, hi_id = ((m.v0, min(m.v0 + m.v_local, wl.model.vocab))
                        if getattr(self.groups, "replicated", False) else (0, wl.model.vocab))
        self.batches = []
        # each data-parallel replica its own microbatches (replica r: r x M .. r x M + M - 1)
        first = getattr(self.groups, "dp_rank", 0) * wl.num_microbatches
        for mb in range(first, first + wl.num_microbatches):
            g = torch.Generator(device="cpu").manual_seed(seed * 7919 + 104729 + mb)
            tok = torch.randint(lo_id, hi_id, (wl.microbatch_size, wl.seq_len + 1),
                                generator=g)
            # this rank's tokens: its CP chunks (Megatron-Core's load-balanced layout)
            pos = torch.tensor(m.positions())
            self.batches.append((tok[:, pos].contiguous().to(m.device),
                                 tok[:, pos + 1].contiguous().to(m.device)))

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedules this loop can run (``"kareus"`` needs a plan)."""
        return SCHEDULES if self.plan is not None else SCHEDULES[:2]

    def reset(self) -> None:
        """Initial weights and a fresh optimizer (every run starts from the same state)."""
        self.model.reset()

    def step(self, schedule: str) -> Any:
        """Enqueue one iteration under ``schedule``; returns the loss (a device scalar, read
        it after the device finishes).

        With graphs (the default on a GPU) each microbatch computation of the schedule
        (forward or backward of one microbatch: its ops, its collectives at their slots
        and SM counts, its clock request) is a CUDA graph, captured the first time the
        schedule runs and replayed from then on; the gradients' zeroing and the
        optimizer step run eagerly between iterations (a handful of launches). One
        graph per computation rather than one per iteration, so that each computation's
        clock request sits at its start whatever the trigger, and a plan's per-microbatch
        choices map one to one onto graphs. The graphs of a schedule share one memory
        pool and replay in capture order (the pipeline schedule's order, the same at
        every iteration).
        """
        if schedule not in self.schedules:
            raise ArgumentError(f"schedule must be one of {self.schedules}, got {schedule!r}")
        if self._pending_plan is not None:  # a retarget takes effect here, between iterations
            self._switch_plan(self._pending_plan)
        m = self.model
        m.zero_grad()
        if self.graphs:
            self.graph_sequence(schedule).replay()
        else:
            for comp in self.computations:
                self._run_computation(schedule, comp)
        m.optimizer_step()
        return m.loss_sum.clone()

    # -- moving along the frontier (kareus.exec.retarget) ------------------------------
    _make_plan_executor: Callable[[Plan], Executor] | None = None
    _pending_plan: Plan | None = None
    frontier_switch: Any = None
    """The [`FrontierSwitch`][kareus.exec.retarget.FrontierSwitch] of the points used so far
    (``None`` before the first [`retarget`][kareus.exec.train.TrainingLoop.retarget])."""

    def retarget(self, *, deadline_s: float | None = None,
                 energy_budget_j: float | None = None,
                 stage_slowdown: Mapping[int, float] | Sequence[float] | None = None,
                 frontier: Any = None, executor_for: Callable[[Plan], Executor] | None = None,
                 decide: Callable[[int], int] | None = None) -> Plan:
        """Move to the point of the iteration frontier that meets a new target, from the
        next [`step`][kareus.exec.train.TrainingLoop.step] on (an iteration boundary).

        Exactly one target: ``deadline_s`` (the lowest-energy point within it),
        ``energy_budget_j`` (the fastest point within it, every GPU of the job) or
        ``stage_slowdown`` (``{0: s}``: the iteration is paced at ``s`` x the fastest
        point's time by a straggler, and the stage slows its clocks to that pace, as
        Perseus does: see [`kareus.exec.retarget`][kareus.exec.retarget]). Rank 0 decides and
        every rank of the default process group takes its point, so every rank calls this
        at the same iteration. Each point's executor is built once and kept with its CUDA
        graphs: switching back to a point replays them, nothing is captured again.

        Args:
            deadline_s: The iteration time limit (s).
            energy_budget_j: The iteration energy limit (J, every GPU of the job).
            stage_slowdown: ``{stage: factor}`` (or one factor per stage), each >= 1.
            frontier: The iteration frontier (``IterationFrontier.load`` of
                ``frontier.json`` beside ``plan.json``); needed on the first call, kept.
            executor_for: ``plan -> Executor`` for a new point, when the loop was given
                its executor (``executor=``); otherwise the loop builds a
                [`TorchExecutor`][kareus.exec.TorchExecutor] as for its first plan.
            decide: ``index -> every rank's index`` (default: rank 0's, broadcast).

        Returns:
            The plan the loop runs from the next step on.

        Raises:
            PlanError: the loop runs no plan, or a point's plan is for another job.
            InfeasibleError: no point meets the target.
            ArgumentError: no frontier, or more or less than one target.
        """
        from kareus.exec.retarget import FrontierSwitch, Target

        target = Target(deadline_s=deadline_s, energy_budget_j=energy_budget_j,
                        stage_slowdown=stage_slowdown)
        if self.executor is None or self.plan is None:
            raise PlanError("retarget moves a running plan along its frontier: build the loop "
                            "with plan= first")
        if self.frontier_switch is not None and frontier is not None:
            self.frontier_switch.use(frontier)  # the points built so far are kept
        if self.frontier_switch is None:
            if frontier is None:
                raise ArgumentError("retarget needs the plan's iteration frontier once: pass "
                                    "frontier=IterationFrontier.load('OUT/frontier.json')")
            make = executor_for or self._make_plan_executor
            if make is None:
                raise ArgumentError("the loop was given its executor (executor=): pass "
                                    "executor_for=plan -> Executor for the other points")
            current = self.executor
            self.frontier_switch = FrontierSwitch(
                frontier, current=current, make_executor=make, check=self._check_new_plan,
                decide=decide)
        plan = self.frontier_switch.choose(target, stages=1)
        if self.plan is None or plan.digest != self.plan.digest:
            self.frontier_switch.executor(plan)  # checked and built now, kept
        self._pending_plan = plan
        return plan

    def _check_new_plan(self, plan: Plan) -> None:
        check_plan_workload(plan, self.workload)
        if self.plan is not None and plan.schedule != self.plan.schedule:
            raise PlanError(f"the frontier's point runs the {plan.schedule!r} pipeline "
                            f"schedule, the loop {self.plan.schedule!r}: load the frontier "
                            "written with the plan")
        if self.types:
            check_plan_types(plan, self.workload, self.types, self.unsplit_types,
                             {plan_nanobatches(plan, c.stage, c.microbatch, c.phase)
                              for c in self.computations})

    def _switch_plan(self, plan: Plan) -> None:
        """Run ``plan`` from now on (its executor, built once, keeps its graphs)."""
        self._pending_plan = None
        if self.plan is not None and plan.digest == self.plan.digest:
            return
        ex = self.frontier_switch.executor(plan)
        ex.start()  # every rank compares the new plan's digest (a collective call)
        self.executor, self.plan = ex, plan

    def _nanobatches(self, schedule: str, comp: Any = None) -> int:
        if schedule == "sequential":
            return 1
        if schedule == "kareus" and comp is not None and self.plan is not None:
            return plan_nanobatches(self.plan, comp.stage, comp.microbatch, comp.phase)
        return self.workload.nanobatches

    def _executor(self, schedule: str) -> Executor:
        ex = self.executor if schedule == "kareus" else self.baseline
        assert ex is not None
        return ex

    def _run_computation(self, schedule: str, comp: Any) -> None:
        """Enqueue one microbatch computation (eagerly, or into the graph being captured)."""
        m, ex, n = self.model, self._executor(schedule), self._nanobatches(schedule, comp)
        scope = (ex.microbatch(comp.stage, comp.microbatch, comp.phase)
                 if schedule == "kareus" else contextlib.nullcontext())
        with scope:
            tokens, labels = self.batches[comp.microbatch]
            m.begin(comp.phase, n, tokens, labels)
            if schedule == "kareus" and n == 1 and self.workload.nanobatches > 1:
                # The plan runs this computation unsplit: each collective after its
                # piece's ops, with the SM count of its unsplit partition type.
                plan = self.plan
                assert plan is not None
                self.partitions_run = run_computation(
                    ex, self.stacks[comp.phase], schedule="sequential", nanobatches=1,
                    run_op=m.run_op, comm_args=m.comm_args, types=self.unsplit_types,
                    sequential_config_of=lambda key: plan_config(plan, key, ex.current))
            else:
                self.partitions_run = run_computation(
                    ex, self.stacks[comp.phase], schedule=schedule, nanobatches=n,
                    run_op=m.run_op, comm_args=m.comm_args, types=self.types,
                    plan_config_of=self._plan_config_of(ex),
                    chunk_of=m.chunk if m.seq_split else None)
            m.finish()

    def graph_sequence(self, schedule: str) -> Any:
        """The schedule's ``GraphSequence`` (one graph per
        microbatch computation), captured on first use.

        Capture runs every computation once eagerly first (library set-up), then captures
        them in order; gradients and the loss are zeroed afterwards and the weights are
        not touched, so capturing does not change what the next
        [`step`][kareus.exec.train.TrainingLoop.step] computes.

        Raises:
            GraphCaptureError: graphs are off for this loop, or an op cannot be captured.
        """
        ex = self._executor(schedule)
        signature = (schedule, self.layers,
                     tuple((c.stage, c.microbatch, c.phase, self._nanobatches(schedule, c))
                           for c in self.computations))
        seq = ex.sequence(f"train:{schedule}")
        if seq is not None and seq.key[0] == signature:
            return seq
        m = self.model
        m.zero_grad()
        seq = ex.capture(f"train:{schedule}",
                         [functools.partial(self._run_computation, schedule, comp)
                          for comp in self.computations], signature=signature, warmup=1)
        m.zero_grad()
        return seq

    def _plan_config_of(self, ex: Any) -> Callable[[str], Any] | None:
        if self.plan is None:
            return None
        plan = self.plan
        return lambda key: plan_config(plan, key, ex.current)


def check_plan_types(plan: Plan, workload: Workload, types: Mapping[str, Any],
                     unsplit_types: Mapping[str, Any], counts: Iterable[int]) -> None:
    """Refuse a plan that lacks a configuration for a partition type it will be asked for.

    Args:
        plan: The plan.
        workload: Its job.
        types: The partition types of the workload split in its nanobatches.
        unsplit_types: Those of the workload run unsplit (one nanobatch).
        counts: The nanobatch counts the plan's computations run.

    Raises:
        PlanError: a computation split in ``n`` has no configuration for some type.
    """
    for n in sorted(set(counts)):
        need = types if n > 1 or workload.nanobatches == 1 else unsplit_types
        missing = sorted(set(need) - set(plan.partition_configs(nanobatches=n)))
        if missing:
            raise PlanError(f"the plan has no configuration for partition types {missing} "
                            f"of its computations split in {n}: make it for this workload")


def given_plan(plan: Plan | None, executor: Executor | None,
               baseline: Executor | None) -> Plan | None:
    """The plan to apply: ``plan``, or the one ``executor`` applies (they must agree),
    after checking that the executors given are executors.

    Raises:
        ArgumentTypeError: ``executor`` or ``baseline`` is not an [`Executor`][kareus.exec.Executor].
        ArgumentError: ``executor`` applies another plan than ``plan``.
    """
    for label, given in (("executor", executor), ("baseline", baseline)):
        if given is not None and not isinstance(given, Executor):
            raise ArgumentTypeError(f"{label} must be a kareus.exec.Executor, got "
                                    f"{type(given).__name__}")
    if executor is None:
        return plan
    if plan is not None and executor.plan is not plan:
        raise ArgumentError("executor= applies another plan than plan=: pass the plan in "
                            "one place (the executor's)")
    return executor.plan


def _plan_of(plan: Plan | None, executor: Executor | None, baseline: Executor | None, *,
             needs_collective: bool) -> Plan | None:
    """The loop's plan (``plan``, or the one ``executor`` applies), after checking the
    executors given."""
    plan = given_plan(plan, executor, baseline)
    if executor is not None and executor.plan is None:
        raise PlanError("executor= applies no plan: build it with the plan, or pass the "
                        "baselines' executor as baseline=")
    if needs_collective and (baseline is None or (plan is not None and executor is None)):
        raise ArgumentError("a workload with TP or CP > 1 needs a collective backend (or the "
                            "executors that run its collectives: executor=, baseline=)")
    return plan


def no_collective_backend() -> Any:
    """The executors' backend of a job without collectives (TP = CP = 1; never called)."""
    from kareus.exec.train._groups import LoopbackGroupCollective

    return LoopbackGroupCollective(group_size=1)


def measure_runs(loop: TrainingLoop, order: Sequence[tuple[str, int]], *, steps: int,
                 warmup: int, meter: Any = None, barrier: Callable[[], None] | None = None,
                 log: Callable[[str], None] | None = None, min_window_s: float | None = None,
                 agree: Callable[[int], int] | None = None) -> list[RunRecord]:
    """Run ``warmup + steps`` (or more) iterations per ``(schedule, repeat)`` of ``order``,
    each run from the initial weights, timing the iterations after the warm-up back to back.

    NVML's energy counter steps only every so often (about every 100 ms on an H200): a
    window of a few 10-ms iterations may hold no step, and its energy could not be read.
    So a run's timed window lasts at least ``min_window_s``: after the ``steps`` asked for,
    more iterations are queued (as many as the first ones' pace says are missing, agreed
    on every rank) until the window is that long. Where the counter still did not step
    twice inside it, the energy is the mean of the meter's sampled power readings (NVML's
    ``nvmlDeviceGetPowerUsage``) over the window, and the record says so
    (``energy_method``); where neither was read, the energy is ``None``.

    Args:
        loop: The training loop.
        order: ``(schedule, repeat)`` pairs ([`shuffled_order`][kareus.exec.train.shuffled_order]);
            the same on every rank.
        steps: Timed iterations per run, at least.
        warmup: Untimed iterations first (their losses are recorded too).
        meter: An [`EnergyMeter`][kareus.profilers.EnergyMeter] already started, or ``None``.
        barrier: Called before each run (e.g. ``torch.distributed.barrier``).
        log: Progress lines.
        min_window_s: The shortest timed window (s); ``None``: with a meter,
            [`min_energy_window_s`][kareus.exec.nvml_device.min_energy_window_s] of it
            (about 0.75 s on an H200), without one 0 (exactly ``steps`` iterations).
        agree: ``n -> the largest n of every rank`` (every rank must run the same
            iterations: their collectives pair up); ``None``: the largest over
            ``torch.distributed``'s default group where one is initialised, else this
            rank's.

    Returns:
        One [`RunRecord`][kareus.exec.train.RunRecord] per run, in ``order``.
    """
    import torch

    from kareus.exec.nvml_device import min_energy_window_s

    if steps < 1 or warmup < 0:
        raise ArgumentError("steps must be >= 1 and warmup >= 0")
    if min_window_s is None:
        min_window_s = min_energy_window_s(meter) if meter is not None else 0.0
    if min_window_s < 0:
        raise ArgumentError(f"min_window_s must be >= 0, got {min_window_s}")
    agree = agree or _default_agree()
    cuda = loop.model.device.type == "cuda"
    out = []
    for schedule, repeat in order:
        loop.reset()
        if barrier is not None:
            barrier()
        losses = [loop.step(schedule) for _ in range(warmup)]
        _sync(torch, cuda)
        if meter is not None and warmup:  # let the counter step once inside the gap
            meter.wait_edges(1, timeout_s=0.5)
        times, t0, t1 = _timed_window(loop, schedule, losses, steps=steps,
                                      min_window_s=min_window_s, agree=agree, cuda=cuda)
        n = len(times)
        energy, counted, method, samples = _window_energy(meter, t0, t1, n)
        clock = (meter.mean_sm_clock_mhz(t0, t1)
                 if meter is not None and hasattr(meter, "mean_sm_clock_mhz") else None)
        parts = (tuple(float(w) for w in meter.split_powers_w(t0, t1, WINDOW_PARTS))
                 if meter is not None and hasattr(meter, "split_powers_w") else ())
        rec = RunRecord(schedule=schedule, repeat=repeat, step_time_s=times,
                        losses=tuple(float(x) for x in losses), window_s=t1 - t0,
                        energy_j=energy, counter_steps=counted, sm_clock_mhz=clock,
                        energy_method=method, power_samples=samples, sub_powers_w=parts)
        out.append(rec)
        if log is not None:
            how = {"nvml_counter": f"{counted} counter steps",
                   "nvml_power_samples": f"NO counter step: {samples} power readings"}
            log(f"{schedule} repeat {repeat}: {1e3 * rec.time_s:.2f} ms/iteration over "
                f"{n} iterations ({rec.window_s:.2f} s), loss {rec.losses[0]:.4f} -> "
                f"{rec.losses[-1]:.4f}" +
                (f", {energy:.1f} J/iteration on this GPU ({how.get(method or '', method)})"
                 if energy is not None else
                 (", energy NOT measured (no counter step, no power reading)"
                  if meter is not None else "")))
    return out


def _default_agree() -> Callable[[int], int]:
    """The largest ``n`` of every rank of the default process group (this rank's alone
    without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return lambda n: n

    def agree(n: int) -> int:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, int(n))
        return max(int(x) for x in every)
    return agree


def _timed_window(loop: TrainingLoop, schedule: str, losses: list[Any], *, steps: int,
                  min_window_s: float, agree: Callable[[int], int], cuda: bool
                  ) -> tuple[tuple[float, ...], float, float]:
    """``steps`` iterations back to back, then more (agreed on every rank) until the window
    lasts ``min_window_s``; each iteration's time, and the window's host ends."""
    import torch

    events: list[tuple[Any, Any]] = []  # CUDA events, or host times without CUDA

    def run(n: int) -> None:
        for _ in range(n):
            if cuda:
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                losses.append(loop.step(schedule))
                b.record()
                events.append((a, b))
            else:
                s = time.perf_counter()
                losses.append(loop.step(schedule))
                events.append((s, time.perf_counter()))

    t0 = time.perf_counter()
    run(steps)
    _sync(torch, cuda)
    t1 = time.perf_counter()
    for _ in range(8):  # the pace may change as the window grows: a few rounds at most
        more = 0
        if t1 - t0 < min_window_s:
            pace = max((t1 - t0) / len(events), 1e-9)
            more = max(1, math.ceil(1.05 * (min_window_s - (t1 - t0)) / pace))
        more = int(agree(more))
        if more <= 0:
            break
        run(more)
        _sync(torch, cuda)
        t1 = time.perf_counter()
    times = tuple((a.elapsed_time(b) / 1e3) if cuda else (b - a) for a, b in events)
    return times, t0, t1


def _window_energy(meter: Any, t0: float, t1: float, n: int
                   ) -> tuple[float | None, int, str | None, int]:
    """``(energy per iteration, counter steps, method, power readings)`` of a window of
    ``n`` iterations (``RunRecord.energy_method`` says what each method is)."""
    if meter is None:
        return None, 0, None, 0
    e, d, counted = meter.energy_between(t0, t1)
    if counted >= 1 and d > 0:
        method = str(getattr(meter, "energy_method", f"{type(meter).__name__}.energy_between"))
        return e / d * (t1 - t0) / n, counted, method, 0
    if hasattr(meter, "mean_power_w"):
        power, samples = meter.mean_power_w(t0, t1)
        if power is not None:
            return power * (t1 - t0) / n, counted, "nvml_power_samples", samples
        return None, counted, None, samples
    return None, counted, None, 0


def _sync(torch: Any, cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def overlap_efficiency(workload: Workload, *, executor: Executor,
                       configs: dict[str, Any], kernels: Any = None, reps: int = 20,
                       warmup: int = 3) -> dict[str, dict[str, float]]:
    """Each partition type's time over max(computation alone, collective alone).

    Builds every type's runnable partition at the workload's nanobatch shapes
    (``kareus.exec.torch_partition``, its buffers from a
    [`TorchExecutor`][kareus.exec.TorchExecutor]'s backend, or from another executor's
    [`empty`][kareus.exec.Executor.empty]) and times, with CUDA events over ``reps``
    back-to-back runs: its ops alone; its collective alone with the configuration's SM count;
    and both under the configuration
    ([`Executor.run_partition`][kareus.exec.Executor.run_partition]). 1.0 is the limit of
    overlap. Every rank must call this with the same arguments (the collectives).

    Args:
        workload: The job (its partition types).
        executor: Runs the partitions (any [`Executor`][kareus.exec.Executor]; a
            [`TorchExecutor`][kareus.exec.TorchExecutor] runs them on its backend, with SM caps
            or the default).
        configs: Partition type -> configuration (a plan's, or
            [`DefaultConfig`][kareus.exec.schedule.DefaultConfig]).
        kernels: The ops' kernel set.
        reps: Timed runs of each.
        warmup: Untimed runs first.

    Returns:
        Type -> ``{"time_s", "compute_s", "comm_s", "efficiency"}``.
    """
    import torch

    from kareus.exec.torch_partition import runnable_partitions

    parts = runnable_partitions(workload, sorted(configs), kernels=kernels)
    coll = executor.collective if isinstance(executor, TorchExecutor) else None
    out: dict[str, dict[str, float]] = {}
    for name in sorted(configs):
        part, cfg = parts[name], configs[name]
        kind = part.comm_op.kind.value
        if coll is None:  # another executor: its own buffers
            backend: Any = executor
        else:  # the group's backend's buffers, as the loop's model allocates them
            backend = coll.backend_for(kind) if hasattr(coll, "backend_for") else coll
        prog = part.build(collective=backend)
        alone = (DefaultConfig(None) if isinstance(cfg, DefaultConfig)
                 else attrs.evolve(cfg, launch_slot=None))

        def compute() -> None:
            prog.run_plain()  # noqa: B023 - called in this iteration
            prog.advance()  # noqa: B023

        def comm() -> None:
            executor.run_partition([], [], prog.comm_tensor, alone,  # noqa: B023
                                   comm_kind=kind,  # noqa: B023
                                   comm_output=prog.comm_output,  # noqa: B023
                                   comm_group=prog.comm_group,  # noqa: B023
                                   comm_splits=prog.comm_splits)  # noqa: B023
            prog.advance()  # noqa: B023

        def both() -> None:
            executor.run_partition(prog.ops, prog.op_names, prog.comm_tensor,  # noqa: B023
                                   cfg, comm_kind=kind,  # noqa: B023
                                   comm_output=prog.comm_output,  # noqa: B023
                                   comm_group=prog.comm_group,  # noqa: B023
                                   comm_splits=prog.comm_splits)  # noqa: B023
            prog.advance()  # noqa: B023

        row = {}
        for label, fn in (("compute_s", compute), ("comm_s", comm), ("time_s", both)):
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            row[label] = a.elapsed_time(b) / 1e3 / reps
        row["efficiency"] = row["time_s"] / max(row["compute_s"], row["comm_s"])
        out[name] = row
    return out

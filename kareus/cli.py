"""The ``kareus`` command.

``kareus gpus`` and ``kareus workloads`` list the presets; ``kareus optimize`` runs
the whole pipeline on a workload; ``kareus show PLAN`` prints a plan file.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

# Only the standard library and kareus's light modules at import time: the console entry point
# imports this module before main() installs the Ctrl-C handling, and numpy, scipy or torch
# imported here would widen the window in which a Ctrl-C prints a traceback from the imports.
from kareus._logging import configure as configure_logging
from kareus._version import __version__
from kareus.errors import ArgumentError, KareusError, MissingFileError

__all__ = ["main"]


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for k, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if k and _numeric(c) else c.ljust(w)
                               for c, w in zip(row, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _numeric(s: str) -> bool:
    try:
        float(s.replace(",", "").rstrip("%"))
    except ValueError:
        return False
    return True


def cmd_gpus(args: argparse.Namespace) -> int:
    """``kareus gpus``: print the GPU presets (SMs, clocks, peaks, power); returns 0."""
    from kareus.model.gpu import GPU_PRESETS

    rows = []
    for g in GPU_PRESETS.values():
        rows.append([g.name, g.sm_count, f"{g.min_clock_mhz}-{g.max_clock_mhz}",
                     len(g.clocks_mhz), f"{g.bf16_peak_tflops:.0f}", f"{g.hbm_bandwidth_gbps:.0f}",
                     f"{g.nvlink_bandwidth_gbps:.0f}", f"{g.power_limit_w:.0f}",
                     f"{g.static_power_w:.0f}"])
    print(_table(["gpu", "SMs", "clocks MHz", "#clocks", "bf16 TFLOP/s", "HBM GB/s",
                  "NVLink GB/s", "power limit W", "static W"], rows))
    return 0


def cmd_workloads(args: argparse.Namespace) -> int:
    """``kareus workloads``: print the model presets (shape and parameter count); returns 0."""
    from kareus.model.workload import MODEL_PRESETS

    rows = []
    for m in MODEL_PRESETS.values():
        # a mixture of experts' MLP: its experts' width (the dense width is unused)
        ffn = m.ffn if m.moe is None else f"{m.moe.expert_ffn} x{m.moe.experts}"
        rows.append([m.name, m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, ffn, m.vocab,
                     f"{m.params / 1e9:.2f}", _features(m)])
    print(_table(["workload", "layers", "hidden", "heads", "KV heads", "head dim", "FFN",
                  "vocab", "params (B)", "layer features"], rows))
    return 0


def _features(m) -> str:  # type: ignore[no-untyped-def]
    """A model's layer features in a few words (``-`` for a plain Llama layer)."""
    words = [w for w, on in (("qk-norm", m.qk_norm), ("QKV bias", m.qkv_bias),
                             ("tied embeddings", m.tied_embeddings)) if on]
    words.append(f"eps {m.norm_eps:g}")
    if m.moe is not None:
        shared = (f" + {m.moe.shared_experts} shared" if m.moe.shared_experts else "")
        words.append(f"MoE: {m.moe.experts} experts{shared}, top-{m.moe.experts_per_token}")
    return ", ".join(words)


def _whole_number(text: str, lowest: int, highest: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {value}")
    if highest is not None and value > highest:
        raise argparse.ArgumentTypeError(f"must be <= {highest:,}, got {value:,}")
    return value


def _positive_int(text: str) -> int:
    return _whole_number(text, 1)


def _nonnegative_int(text: str) -> int:
    return _whole_number(text, 0)


def _int_up_to(highest: int) -> Callable[[str], int]:
    """A positive whole number no larger than ``highest``: an option's sane range, so that an
    absurd value is refused before any work rather than deep inside it."""
    def parse(text: str) -> int:
        return _whole_number(text, 1, highest)
    parse.__name__ = "whole number"  # argparse names the type in its message
    return parse


#: The largest values the options take (each far beyond any training job or useful run):
#: one parallel degree, the GPUs of a job, the batch dimensions, the profiles per type.
_MAX_DEGREE = 65_536
_MAX_GPUS = 1_048_576
_MAX_MICROBATCHES = 1_000_000
_MAX_MICROBATCH_SIZE = 65_536
_MAX_SEQ_LEN = 16_777_216
_MAX_NANOBATCHES = 64
_MAX_BUDGET = 1_000_000
_MAX_SEED = 2**32 - 1  # numpy's seeds


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return value


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return value


def _noise(text: str) -> float:
    """``--noise``: a relative spread in [0, 0.5), as the emulated profiler takes it."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < 0.5:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be in [0, 0.5), got {value}")
    return value


#: The defaults of the options that ``--megatron-args`` replaces (``None`` in the parser, so
#: that an option given beside ``--megatron-args`` is refused rather than ignored).
_JOB_DEFAULTS = {"tp": 4, "cp": 1, "pp": 2, "microbatches": 8, "microbatch_size": 8,
                 "seq_len": 4096}

#: The mixture-of-experts options the framework's flags give (``None`` in the parser:
#: refused beside ``--megatron-args`` / ``--torchtitan-args``, which say the expert-parallel
#: degree themselves: ``--expert-model-parallel-size``,
#: ``--parallelism.expert_parallel_degree``). ``--routing-imbalance`` is no framework's
#: setting (it is the data's): it applies to their workloads too.
_MOE_OPTIONS = ("ep",)

#: ``kareus.model.RANK_ORDERS``, spelt here so that building the parser does not import the
#: model package (tests/test_cli.py checks that they agree).
_RANK_ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")


def _workload_from_megatron_flags(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The workload of ``--megatron-args``: the job as Megatron-LM's flags describe it."""
    from kareus.errors import WorkloadError
    from kareus.integrations.megatron_args import parse_megatron_args, workload_from_megatron_args

    given = [f"--{k.replace('_', '-')}" for k in (*_JOB_DEFAULTS, "workload", "model_file",
                                                   "rank_order", *_MOE_OPTIONS)
             if getattr(args, k, None) is not None] + [
                 f for f, on in (("--no-recompute", args.no_recompute),
                                 ("--recompute", getattr(args, "recompute", None) is not None),
                                 ("--sp", getattr(args, "sp", False))) if on]
    if given:
        raise ArgumentError(f"--megatron-args describes the model, the parallelism and the "
                            f"batch; drop {', '.join(given)} (give them as Megatron-LM flags)")
    flags = parse_megatron_args(args.megatron_args)
    tp, cp, pp = (flags.tensor_model_parallel_size, flags.context_parallel_size,
                  flags.pipeline_model_parallel_size)
    dp = 1 if args.dp is None else args.dp
    if args.gpus is not None:
        if args.gpus % (tp * cp * pp):
            raise WorkloadError(f"--gpus {args.gpus} is not a multiple of the flags' TP x CP x PP "
                                f"= {tp * cp * pp}")
        if args.dp is not None and args.dp != args.gpus // (tp * cp * pp):
            raise WorkloadError(f"--gpus {args.gpus} and --dp {args.dp} disagree: give one")
        dp = args.gpus // (tp * cp * pp)
    if tp == 1 and cp == 1 and not (flags.num_experts
                                    and flags.expert_model_parallel_size > 1):
        raise WorkloadError("the Megatron-LM flags give TP=1 and CP=1 (and no expert "
                            "parallelism): no layer has a collective to overlap, so there is "
                            "nothing to plan; train with layer_spec without KAREUS_PLAN (the "
                            "sequential schedule)")
    if tp > 8 or tp * cp * pp * dp > _MAX_GPUS:
        raise WorkloadError(f"TP={tp} x CP={cp} x PP={pp} x DP={dp}: beyond what kareus models "
                            f"(TP <= 8, at most {_MAX_GPUS:,} GPUs)")
    if getattr(args, "document_tokens", None) is not None:
        raise ArgumentError("--document-tokens: Megatron-Core's planned layers attend causally "
                            "over whole sequences; drop it with --megatron-args")
    return _imbalanced(workload_from_megatron_args(flags, dp=dp, nanobatches=args.nanobatches),
                       args)


def _imbalanced(wl, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """``wl`` with ``--routing-imbalance`` (an assumption about the data, which no
    framework flag says), when given."""
    imbalance = getattr(args, "routing_imbalance", None)
    return wl if imbalance is None else wl.with_(routing_imbalance=imbalance)


def _workload_from_torchtitan_flags(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The workload of ``--torchtitan-args``: what torchtitan 0.3's Trainer runs for those
    flags (``--module``/``--config`` and overrides, as ``-m torchtitan.train`` takes them)
    on ``--gpus`` ranks; ``--recompute`` names the policy kareus's layers run in place of
    torchtitan's per-op selective checkpointing."""
    import contextlib
    import io

    from kareus.errors import WorkloadError
    from kareus.integrations.megatron_args import read_megatron_flags
    from kareus.integrations.torchtitan import (
        check_torchtitan_version,
        masks_documents,
        workload_from_torchtitan_config,
    )

    given = [f"--{k.replace('_', '-')}" for k in (*_JOB_DEFAULTS, "workload", "model_file",
                                                   "dp", "rank_order", *_MOE_OPTIONS)
             if getattr(args, k, None) is not None] + [
                 f for f, on in (("--no-recompute", args.no_recompute),
                                 ("--sp", getattr(args, "sp", False)),
                                 ("--megatron-args",
                                  getattr(args, "megatron_args", None) is not None)) if on]
    if given:
        raise ArgumentError(f"--torchtitan-args describes the model, the parallelism and the "
                            f"batch; drop {', '.join(given)} (give them as torchtitan flags; "
                            "--gpus is the job's rank count)")
    check_torchtitan_version()
    from torchtitan.config import ConfigManager  # type: ignore[import]

    try:
        argv = read_megatron_flags(args.torchtitan_args)
    except KareusError as exc:
        raise ArgumentError(str(exc).replace("--megatron-args", "--torchtitan-args")) from None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            config = ConfigManager().parse_args(argv)
    except SystemExit:
        why = " ".join(err.getvalue().split())[-300:]
        raise ArgumentError(f"--torchtitan-args: torchtitan's parser refused the flags "
                            f"({why or 'no message'})") from None
    if args.gpus is None:
        raise ArgumentError("--torchtitan-args needs --gpus (the job's rank count: torchrun's "
                            "WORLD_SIZE)")
    docs = getattr(args, "document_tokens", None)
    masked = masks_documents(config)
    if masked and docs is None:
        raise ArgumentError("the model's attention masks packed documents (FlexAttention or "
                            "VarlenAttention, block_causal), whose length the flags do not "
                            "say: give --document-tokens (sum of squared document lengths "
                            "over sum of lengths of your data: kareus.model.document_tokens_of)")
    if docs is not None and not masked:
        raise ArgumentError("--document-tokens: the model's attention (SDPA) is causal over "
                            "the whole sequence and masks no documents; drop it")
    wl = workload_from_torchtitan_config(config, world_size=args.gpus,
                                         nanobatches=args.nanobatches,
                                         selective_as=args.recompute, document_tokens=docs)
    if args.recompute is not None and wl.recompute != args.recompute:
        raise ArgumentError(f"--recompute {args.recompute} contradicts the flags' "
                            f"activation_checkpoint ({wl.recompute}); --recompute names the "
                            "policy run in place of torchtitan's selective only")
    if wl.parallelism.tp == 1 and wl.parallelism.cp == 1 and wl.parallelism.ep == 1:
        raise WorkloadError("the torchtitan flags give TP=1 and CP=1 (and no expert "
                            "parallelism): no layer has a collective to overlap, so there is "
                            "nothing to plan")
    return _imbalanced(wl, args)


def _workload_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The job's workload; ``--unchained-layers``: its layers run one by one
    (``Workload.chained_layers=False``); ``--torchtitan-args`` says so itself (torchtitan's
    Trainer wraps every block in FSDP)."""
    wl = _job_workload(args)
    if getattr(args, "unchained_layers", False) and wl.chained_layers:
        wl = wl.with_(chained_layers=False)
    return wl


def _job_workload(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from kareus.errors import WorkloadError
    from kareus.model.workload import Parallelism, Workload, get_model

    if getattr(args, "torchtitan_args", None) is not None:
        return _workload_from_torchtitan_flags(args)
    if getattr(args, "megatron_args", None) is not None:
        return _workload_from_megatron_flags(args)
    for name, default in _JOB_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    if (args.workload is None) == (args.model_file is None):
        raise WorkloadError("give either --workload PRESET or --model-file FILE (one of them)")
    if args.model_file is not None:
        from kareus.model.files import register_model

        model = register_model(args.model_file, replace=True)
    else:
        model = get_model(args.workload)
    dp = 1 if args.dp is None else args.dp
    if args.gpus is not None:
        per_replica = args.tp * args.cp * args.pp
        if args.gpus % per_replica:
            raise WorkloadError(
                f"--gpus {args.gpus} is not a multiple of TP x CP x PP = {args.tp} x {args.cp} x "
                f"{args.pp} = {per_replica}; choose parallel degrees whose product divides it")
        dp = args.gpus // per_replica
        if args.dp is not None and args.dp != dp:
            raise WorkloadError(
                f"--gpus {args.gpus} and --dp {args.dp} disagree: {args.gpus} GPUs at TP x CP x "
                f"PP = {per_replica} make DP = {dp}; give one of --gpus and --dp")
    ep = getattr(args, "ep", None) or 1
    if args.tp == 1 and args.cp == 1 and ep == 1:
        raise WorkloadError("--tp 1 --cp 1: no layer has a collective to overlap, and kareus "
                            "schedules collectives; use --tp 2 or more, or --cp 2 or more (the "
                            "default is --tp 4)"
                            + ("" if model.moe is None else ", or --ep 2 or more"))
    world = args.tp * args.cp * args.pp * dp
    if world > _MAX_GPUS:
        raise WorkloadError(
            f"--tp {args.tp} x --cp {args.cp} x --pp {args.pp} x --dp {dp} = {world:,} GPUs: more "
            f"than {_MAX_GPUS:,} GPUs is not a job kareus models; lower --dp (or --gpus)")
    if args.tp > 8:
        raise WorkloadError(f"--tp {args.tp}: tensor parallelism beyond one 8-GPU NVLink node "
                            "is not modelled; use --tp <= 8 and spread the rest over --cp/--pp")
    imbalance = getattr(args, "routing_imbalance", None)
    moe = {} if imbalance is None else {"routing_imbalance": imbalance}
    order = getattr(args, "rank_order", None) or _RANK_ORDERS[0]
    return Workload(model=model, parallelism=Parallelism(tp=args.tp, cp=args.cp, pp=args.pp,
                                                         dp=dp, sp=bool(args.sp), ep=ep,
                                                         rank_order=order),
                    microbatch_size=args.microbatch_size, seq_len=args.seq_len,
                    num_microbatches=args.microbatches, recompute=_recompute_from_args(args),
                    nanobatches=args.nanobatches,
                    document_tokens=getattr(args, "document_tokens", None), **moe)


def _recompute_from_args(args: argparse.Namespace) -> str:
    """The recomputation policy of ``--recompute`` (default ``full``); ``--no-recompute`` is
    ``--recompute none`` (kept for older command lines), refused beside another policy."""
    if args.no_recompute:
        if args.recompute not in (None, "none"):
            raise ArgumentError(f"--no-recompute is --recompute none; it contradicts "
                                f"--recompute {args.recompute}: give one of them")
        return "none"
    return "full" if args.recompute is None else str(args.recompute)


def _execution_from_args(args: argparse.Namespace) -> str:
    """The emulated execution mode of ``--no-graphs``: ``"eager"`` with it, else
    ``"graphed"`` (what the executor runs on a GPU)."""
    return "eager" if getattr(args, "no_graphs", False) else "graphed"


_DEFAULT_GPU = "a100-40gb"


def _profiler_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    spec = args.profiler
    if spec == "emulated":
        from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler

        if getattr(args, "gpu_profile", None) is not None:
            gpu = EmulatedGPU.from_profile(args.gpu_profile)
            if args.gpu is not None and args.gpu != gpu.name:
                raise ArgumentError(f"--gpu {args.gpu} and --gpu-profile (a profile of {gpu.name}) "
                                 "disagree: give one of them")
            if args.gpu is None and gpu.name != _DEFAULT_GPU:
                # the profile does not switch the GPU behind the user's back
                raise ArgumentError(f"--gpu-profile {args.gpu_profile} is a profile of {gpu.name}, "
                                 f"but the GPU is {_DEFAULT_GPU} (the default): add --gpu "
                                 f"{gpu.name}")
            return EmulatedProfiler(gpu, noise=args.noise, seed=args.seed,
                                    execution=_execution_from_args(args))
        return EmulatedProfiler(args.gpu or _DEFAULT_GPU, noise=args.noise, seed=args.seed,
                                execution=_execution_from_args(args))
    if spec.startswith("replay:"):
        from pathlib import Path

        from kareus.profilers.replay import ReplayProfiler

        path = Path(spec.split(":", 1)[1])
        if path.is_dir():
            raise ArgumentError(f"--profiler {spec}: {str(path)!r} is a folder; replay: wants a "
                             "recording file (one written by --record FILE)")
        if not path.is_file():
            raise MissingFileError(f"--profiler {spec}: no such file {str(path)!r}")
        return ReplayProfiler(path, gpu=args.gpu)  # None: the recording's GPU
    raise ArgumentError(f"--profiler must be 'emulated', 'replay:FILE' or 'nvml' (real GPUs, "
                     f"under torchrun), got {spec!r:.60}")


_MIN_SEQ_LEN = 128

# A long run is said up front (on stderr), an absurd one refused, from the workflow's
# estimate of its length (kareus.workflow.estimate_run_s).
_EST_SAY_ABOVE_S = 120.0
_EST_REFUSE_ABOVE_S = 2 * 86400.0


def _say_estimate(run, args) -> None:  # type: ignore[no-untyped-def]
    """Say up front, on stderr, how long a long run will take (profiles and composition);
    refuse one estimated at more than two days."""
    from kareus.errors import InfeasibleError
    from kareus.model.partition import build_partitions

    est = run.estimate_s
    if est <= _EST_SAY_ABOVE_S:
        return
    types = build_partitions(run.workload).types.values()
    profiles = sum(min(args.budget, len(run.profiler.space(p))) for p in types)
    computations = 2 * run.workload.parallelism.pp * run.workload.num_microbatches
    what = (f"up to {profiles:,} profiles over {len(types)} partition types and compose "
            f"{computations:,} microbatch computations")
    if est > _EST_REFUSE_ABOVE_S:
        raise InfeasibleError(
            f"this run would make {what}: roughly {_duration(est)} on a 2-core CPU "
            f"(estimated); lower --budget (each type's space has "
            f"{min(len(run.profiler.space(p)) for p in types):,}+ configurations) or "
            f"--microbatches")
    print(f"kareus: this run makes {what.replace('compose ', 'composes ')}: roughly "
          f"{_duration(est)} on a 2-core CPU (estimated; lower --budget or --microbatches for "
          f"a quicker run). Ctrl-C stops it; the same command resumes.", file=sys.stderr)


def _duration(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:,.0f} min"
    if seconds < 86400 * 3:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 86400:,.0f} days"


def _cmd_tune(args: argparse.Namespace) -> int:
    """``kareus optimize --profiler nvml``: ``kareus.tune.tune`` on every rank."""
    from kareus.tune import tune

    if args.record is not None:
        raise ArgumentError("--record is for emulated runs; a tuning run keeps every measurement "
                         "in --out/logs")
    workload = _workload_from_args(args)
    args.resume_hint = f"the logs in {args.out}/logs keep every measurement"
    report = tune(workload, out_dir=args.out, gpu=args.gpu, budget=args.budget, seed=args.seed,
                  schedule=args.schedule, surrogate=args.surrogate, fresh=args.fresh,
                  progress=not args.quiet, allow_clock_changes=args.allow_clock_changes,
                  types=None if args.types is None else args.types.split(","),
                  backends=None if args.backends is None else args.backends.split(","),
                  deadline_s=args.deadline_s, energy_budget_j=args.energy_budget_j,
                  graphs=False if getattr(args, "no_graphs", False) else None,
                  loopback=args.loopback)
    if report is None:  # not rank 0
        return 0
    if report.result is not None:
        print(report.result.table())
        print()
    for name, fr in report.frontiers.items():
        print(f"{name}: {len(fr.measured())} profiles, {len(fr.points)} on its front")
    print(f"GPU time: {report.gpu_time_s:.1f} GPU-s ({report.wall_s:.1f} s on "
          f"{report.world_size} GPU(s)); {report.info.get('clock_note', '')}")
    print("wrote " + ", ".join(str(p) for p in report.paths.values())
          + f", and {args.out}/logs/")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``kareus calibrate``: measure a GPU profile on this machine's GPU and write it;
    returns 0."""
    from kareus.profilers.calibrate import calibrate_to_file

    path = calibrate_to_file(args.out, workloads=args.workload or ["llama3.2-3b"],
                             kernels=[k for k in args.kernels.split(",") if k], gpu=args.gpu,
                             collectives_from=args.collectives_from, reps=args.reps,
                             power_s=args.power_s, log=print)
    print(f"wrote {path}")
    return 0


def _check_profiler_options(args: argparse.Namespace) -> None:
    """Refuse the options that the chosen ``--profiler`` would ignore."""
    if getattr(args, "gpu_profile", None) is not None and args.profiler != "emulated":
        raise ArgumentError(f"--gpu-profile calibrates the emulated profiler; --profiler "
                         f"{args.profiler} measures instead: drop one of them")
    if getattr(args, "no_graphs", False) and args.profiler not in ("emulated", "nvml"):
        raise ArgumentError(f"--no-graphs emulates (or, with --profiler nvml, measures) eager "
                         f"execution; --profiler {args.profiler} replays as it ran: drop "
                         "--no-graphs")


def _check_loopback_option(args: argparse.Namespace) -> None:
    if getattr(args, "loopback", "plain") != "plain" and args.profiler != "nvml":
        raise ArgumentError(f"--loopback {args.loopback} stands in for collectives on one "
                            f"real GPU (--profiler nvml); --profiler {args.profiler} does "
                            "not run them: drop --loopback")


def _check_optimize_options(args: argparse.Namespace) -> None:
    """The options of an emulated or replayed ``kareus optimize`` that need no workload: the
    GPU (and its file), the plan's limit, the number of processes."""
    import os

    from kareus.model.gpu import get_gpu

    if args.gpu_file is not None:
        from kareus.model.files import register_gpu

        args.gpu = register_gpu(args.gpu_file, replace=True).name
    if args.gpu is not None:
        get_gpu(args.gpu)
    if args.deadline_s is not None and args.energy_budget_j is not None:
        raise ArgumentError("give at most one of --deadline-s and --energy-budget-j")
    cores = os.cpu_count() or 1
    if args.jobs > cores:
        raise ArgumentError(f"--jobs {args.jobs}: this machine has {cores} CPU core(s), and each "
                            f"job is a process that keeps one busy; use --jobs {cores} or fewer")


def _say_start(args: argparse.Namespace, run) -> None:  # type: ignore[no-untyped-def]
    """The run's first lines on stderr (none with ``--quiet``): what runs, and what the
    search spaces hold against the budget."""
    if args.quiet:
        return
    from kareus.compose import kareus_types

    workload, profiler = run.workload, run.profiler
    print(f"kareus: optimising {workload.describe()} on {profiler.gpu.name} "
          f"({workload.parallelism.world_size} GPUs) with the {args.profiler} profiler"
          + (f", {_execution_from_args(args)} execution" if args.profiler == "emulated" else "")
          + (f" (calibrated from the measured profile {args.gpu_profile})"
             if getattr(args, "gpu_profile", None) and args.profiler == "emulated" else ""),
          file=sys.stderr)
    sizes = [len(profiler.space(p)) for p in kareus_types(workload, run.partitions).values()]
    print(f"kareus: {len(sizes)} partition types, {min(sizes):,}-{max(sizes):,} configurations "
          f"each (clocks x communication SMs x launch slots); --budget {args.budget} profiles "
          f"each (a smaller budget finds less of each front; emulated, the plans 16 profiles "
          f"chose saved, valued noise-free, a median 0.55 (per job 0.29-0.68) of the energy "
          f"saving over nanobatching+perseus that 96 profiles' plans saved, 4 jobs x 5 seeds: "
          f"docs/search.md)",
          file=sys.stderr)


def cmd_optimize(args: argparse.Namespace) -> int:
    """``kareus optimize``: search, compose and write the plans and tables of one workload
    (``--profiler nvml`` tunes on the real GPUs); returns the exit status."""
    _check_profiler_options(args)
    _check_loopback_option(args)
    if args.profiler == "nvml":
        if args.jobs > 1:
            raise ArgumentError("--jobs is for emulated and replayed runs; a tuning run measures "
                             "on the job's GPUs, one partition type after another")
        return _cmd_tune(args)

    from kareus._io import check_output_file, check_output_folder
    from kareus.compose import kareus_types
    from kareus.compose.plan import Plan
    from kareus.errors import InfeasibleError, WorkloadError
    from kareus.workflow import prepare
    from kareus.workflow.outdir import guarded_folder
    from kareus.workflow.result import joules

    _check_optimize_options(args)
    # Paths first: a bad --out or --record is found now, not after the search.
    out = check_output_folder(args.out, what="--out")
    if args.record is not None:
        check_output_file(args.record, what="--record")
    workload = _workload_from_args(args)
    if workload.seq_len < _MIN_SEQ_LEN:
        raise WorkloadError(f"--seq-len {workload.seq_len}: training sequences shorter than "
                            f"{_MIN_SEQ_LEN} tokens are not modelled (launch overheads would "
                            f"dominate every kernel); use --seq-len >= {_MIN_SEQ_LEN}")
    profiler = _profiler_from_args(args)
    if args.record is not None:
        from kareus.profilers.replay import RecordingProfiler

        profiler = RecordingProfiler(profiler)
    # every check of the run (memory, parallelism, what the profiler measures, the search),
    # once, before the folder is made
    run = prepare(workload, profiler=profiler, budget=args.budget, seed=args.seed,
                  schedule=args.schedule, surrogate=args.surrogate)
    _say_estimate(run, args)
    if run.left_out and not args.quiet:
        print(f"kareus: {' and '.join(run.left_out)} left out: --microbatch-size 1 holds one "
              "sequence, which they cannot split into nanobatches at --cp > 1 (nanobatches "
              "along the sequence are modelled at --cp 1 only)", file=sys.stderr)
    with guarded_folder(out, run.manifest, fresh=args.fresh, what="--out"):
        args.resume_hint = f"the search logs in {out / 'logs'} keep every measurement"
        _say_start(args, run)
        with contextlib.ExitStack() as stack:
            executor = None
            if args.jobs > 1:
                from concurrent.futures import ProcessPoolExecutor

                # no more processes than partition types to search
                workers = min(args.jobs, len(kareus_types(workload, run.partitions)))
                executor = stack.enter_context(ProcessPoolExecutor(max_workers=workers))
            result = run.run(log_dir=out / "logs", pool=executor, progress=not args.quiet)
        try:
            plan: Plan | None = result.select(deadline_s=args.deadline_s,
                                              energy_budget_j=args.energy_budget_j)
        except InfeasibleError as exc:  # the searches' results are still worth keeping
            plan, infeasible = None, exc
        paths = result.save(out, plan=plan, write_plan=plan is not None)
        if args.record is not None:
            # A resumed search reads its earlier measurements back from its log instead of
            # measuring them: record those too, so the file replays the whole run.
            for fr in result.partition_frontiers().values():
                for obs in fr.measured():  # under the partition's name (the key may be x@n1)
                    profiler.add_earlier(fr.partition, obs.config, obs.measurement)
            paths["record"] = profiler.save(
                args.record, workload=workload.to_dict(),
                what=f"every measurement of `kareus optimize` on {workload.describe()} with "
                     f"the {args.profiler} profiler ({profiler.gpu.name})")
    print(result.table())
    print()
    wrote = ", ".join(str(p) for p in paths.values()) + f", and {out / 'logs'}/"
    if plan is None:
        option = "--deadline-s" if args.deadline_s is not None else "--energy-budget-j"
        raise InfeasibleError(f"{infeasible}; wrote {wrote}, but no plan.json (the same command "
                              f"with a looser {option} reuses every measurement)")
    print(f"chosen plan: {plan.time_s:.4f} s, {joules(plan.energy_j)} J per iteration "
          f"(digest {plan.digest[:12]})")
    print(f"wrote {wrote} ({result.wall_s:.1f} s)")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """``kareus show``: print the summary of a saved plan (a plan file, or an output
    folder's plan.json); returns 0."""
    from kareus.compose.plan import Plan
    from kareus.errors import PlanError

    if args.gpu_file is not None:
        from kareus.model.files import register_gpu

        register_gpu(args.gpu_file, replace=True)
    from pathlib import Path

    path = Path(args.plan)
    if path.is_dir() and (path / "plan.json").is_file():  # `kareus show OUT`
        path = path / "plan.json"
    try:
        plan = Plan.load(path)
    except PlanError as exc:
        if "unknown GPU" in str(exc):  # the Python hint, in the command's words
            raise PlanError(f"{exc} (on the command line: kareus show PLAN --gpu-file "
                            "FILE)") from None
        raise
    print(plan.summary())
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """``kareus verify``: run a plan and its baselines in the library's training loop on
    this job's GPUs and compare with the predictions (``kareus.workflow.verify``); 0 when
    every system is within ``--tolerance``, 1 when one is not."""
    from kareus.workflow.verification import verify

    if args.gpu_file is not None:
        from kareus.model.files import register_gpu

        register_gpu(args.gpu_file, replace=True)
    report = verify(args.plan, results=args.results,
                    systems=None if args.systems is None else args.systems.split(","),
                    steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                    order_seed=args.order_seed, seed=args.seed, tolerance=args.tolerance,
                    device=args.device, backend=args.backend,
                    graphs=False if args.no_graphs else None, busy_steps=args.busy_steps,
                    min_window_s=args.min_window_s, loopback=args.loopback, out=args.out,
                    log=None if args.quiet else print)
    if report is None:  # not rank 0
        return 0
    print(report.table())
    if "path" in report.facts:
        print(f"wrote {report.facts['path']}")
    if not report.passed:
        bad = [s.system for s in report.systems if not s.within(report.tolerance)]
        print(f"kareus: verify: {', '.join(bad)} measured outside the tolerance "
              f"({100 * report.tolerance:g}%) of the prediction"
              + ("" if report.measured else " (a dry run: not a measurement)"),
              file=sys.stderr)
        return 1
    return 0


_VERBOSE_HELP = ("log what kareus decides (resumes, refusals, fallbacks, device and kernel "
                 "choices) to stderr: -v info, -vv debug")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``kareus: error: ...``, with where to
    read more, instead of the usage block and then the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kareus: error: {_one_line(message)} ({self.prog} --help lists "
                     "the options)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``kareus`` command's argument parser, one sub-command per ``cmd_*`` function."""
    from kareus.search import SURROGATES

    parser = _Parser(
        prog="kareus",
        description="Joint communication-SM, launch-slot and GPU-frequency scheduling for "
                    "large-model training.")
    parser.add_argument("--version", action="version", version=f"kareus {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help=_VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("gpus", help="list the GPU presets")
    p.set_defaults(func=cmd_gpus)
    p = sub.add_parser("workloads", help="list the model presets")
    p.set_defaults(func=cmd_workloads)

    p = sub.add_parser(
        "optimize", help="search, compose and compare the five systems on a workload",
        description="Search every partition type's schedule space, compose the iteration "
                    "frontiers of megatron, nanobatching, perseus, nanobatching+perseus and "
                    "kareus, print the comparison and write results.json, plan.json, "
                    "frontier.png and the search logs to --out.")
    p.add_argument("--workload", default=None, help="model preset (see `kareus workloads`)")
    p.add_argument("--model-file", default=None, metavar="FILE",
                   help="your own model architecture, a .toml or .json file, a Hugging Face "
                        "config.json, or a Megatron-Core/Megatron-LM configuration (.json or "
                        ".yaml) (instead of --workload; see docs/plugins.md and "
                        "docs/integrations.md)")
    p.add_argument("--megatron-args", default=None, metavar="FLAGS",
                   help="the model, parallelism and batch as Megatron-LM's pretrain_gpt.py "
                        "flags (one quoted string, or @FILE holding them), instead of "
                        "--workload/--model-file, --tp/--cp/--pp/--sp, --microbatches/"
                        "--microbatch-size/--seq-len and --recompute; the plan is accepted by "
                        "`--spec kareus.integrations.megatron layer_spec` (docs/integrations.md)")
    p.add_argument("--torchtitan-args", default=None, metavar="FLAGS",
                   help="the model, parallelism and batch as torchtitan 0.3's -m "
                        "torchtitan.train flags (--module M --config C and overrides; one "
                        "quoted string, or @FILE), with --gpus the job's rank count, instead "
                        "of --workload/--model-file and the job options; --recompute names "
                        "the policy run in place of torchtitan's selective checkpointing; "
                        "the plan is what `python -m kareus.integrations.torchtitan --plan` "
                        "takes (docs/integrations.md)")
    p.add_argument("--gpu", default=None,
                   help="GPU preset (default: a100-40gb, or the recording's GPU with "
                        "--profiler replay:FILE)")
    p.add_argument("--gpu-file", default=None, metavar="FILE",
                   help="your own GPU, a .toml or .json file (instead of --gpu)")
    p.add_argument("--tp", type=_int_up_to(_MAX_DEGREE), default=None,
                   help="tensor parallel (default 4)")
    p.add_argument("--cp", type=_int_up_to(_MAX_DEGREE), default=None,
                   help="context parallel (default 1)")
    p.add_argument("--pp", type=_int_up_to(_MAX_DEGREE), default=None,
                   help="pipeline stages (default 2)")
    p.add_argument("--dp", type=_int_up_to(_MAX_GPUS), default=None,
                   help="data parallel (default 1, or GPUs / (TP x CP x PP) with --gpus)")
    p.add_argument("--gpus", type=_int_up_to(_MAX_GPUS), default=None,
                   help="total GPUs; sets DP = GPUs / (TP x CP x PP) (with --dp, they must "
                        "agree)")
    p.add_argument("--microbatches", type=_int_up_to(_MAX_MICROBATCHES), default=None,
                   help="microbatches per iteration (default 8)")
    p.add_argument("--microbatch-size", type=_int_up_to(_MAX_MICROBATCH_SIZE), default=None,
                   help="sequences per microbatch (default 8)")
    p.add_argument("--seq-len", type=_int_up_to(_MAX_SEQ_LEN), default=None,
                   help="sequence length (default 4096)")
    p.add_argument("--document-tokens", type=_int_up_to(_MAX_SEQ_LEN), default=None,
                   metavar="TOKENS",
                   help="the sequences pack documents and the attention masks them "
                        "(torchtitan's FlexAttention/VarlenAttention block_causal): the "
                        "documents' length as the cost model takes it (sum of squared "
                        "lengths over sum of lengths: kareus.model.document_tokens_of); "
                        "default: one document per sequence")
    p.add_argument("--nanobatches", type=_int_up_to(_MAX_NANOBATCHES), default=2,
                   help="nanobatches per microbatch for overlap (default 2)")
    p.add_argument("--sp", action="store_true",
                   help="sequence parallelism (Megatron-LM's --sequence-parallel): each TP "
                        "all-reduce becomes a reduce-scatter and an all-gather, norms on the "
                        "sequence shard; nothing changes at --tp 1")
    p.add_argument("--ep", type=_int_up_to(_MAX_DEGREE), default=None,
                   help="expert parallel degree of a mixture-of-experts model (default 1): "
                        "it divides TP x CP x DP (Megatron-Core's MoE parallel folding, "
                        "experts not split over TP); a divisor of 8 (one NVLink node)")
    p.add_argument("--rank-order", default=None, choices=_RANK_ORDERS,
                   help="how the job's ranks are laid out, fastest first (Megatron-Core's "
                        "order): tp-cp-ep-dp-pp (default, Megatron-LM's and torchtitan's) or "
                        "tp-cp-ep-pp-dp (Megatron-LM's --use-tp-pp-dp-mapping); it decides "
                        "which pipeline sends and gradient reductions cross nodes")
    p.add_argument("--routing-imbalance", type=_positive_float, default=None,
                   help="of a mixture-of-experts model: the busiest expert-parallel rank's "
                        "tokens over the mean, in [1, --ep] (default 1.0: balanced routing)")
    p.add_argument("--unchained-layers", action="store_true",
                   help="the layers run one by one, each its own planned layer (Megatron-Core "
                        "layers left unchained, KAREUS_CHAIN=0): no collective overlaps "
                        "across a layer boundary, each layer's first ops run bare and its "
                        "last collective exposed, and the plan is made for that; "
                        "--torchtitan-args sets it (torchtitan's Trainer wraps every block "
                        "in FSDP, so its blocks never chain)")
    p.add_argument("--recompute", default=None, choices=("none", "selective", "full"),
                   help="activation recomputation: full (the default: the backward re-runs "
                        "each layer's forward), selective (the attention core only, as "
                        "Megatron-LM's --recompute-activations) or none")
    p.add_argument("--no-recompute", action="store_true",
                   help="the same as --recompute none (kept for older command lines)")
    p.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"),
                   help="pipeline schedule: 1f1b (default) or gpipe")
    p.add_argument("--profiler", default="emulated",
                   help="emulated (default), replay:FILE (recorded measurements), or nvml "
                        "(measure on this job's GPUs: run under torchrun, one process per GPU "
                        "of one stage's TP x CP group, or one process for a smoke run)")
    p.add_argument("--gpu-profile", default=None, metavar="PATH",
                   help="--profiler emulated: calibrate the emulated GPU from a measured GPU "
                        "profile (a file written by `kareus calibrate`, or the name of one "
                        "shipped with kareus: h200-sxm); it does not change the GPU: give "
                        "--gpu too (--gpu h200-sxm --gpu-profile h200-sxm)")
    p.add_argument("--no-graphs", action="store_true",
                   help="eager execution instead of CUDA-graph replay, the default: "
                        "--profiler emulated emulates it (every op launched from the host at "
                        "its host cost; docs/emulator.md), --profiler nvml measures it "
                        "(docs/tuning.md)")
    p.add_argument("--allow-clock-changes", action="store_true",
                   help="--profiler nvml: search the clocks by locking them (needs root; "
                        "never on shared machines); default: only the default clock")
    p.add_argument("--types", default=None, metavar="LIST",
                   help="--profiler nvml: search only these partition types (comma list) and "
                        "write their frontiers, without composing (a smoke run)")
    p.add_argument("--backends", default=None, metavar="LIST",
                   help="--profiler nvml: collective backends to search (own, nccl_capped); "
                        "default: every one that runs on the group")
    p.add_argument("--loopback", choices=("plain", "faithful"), default="plain",
                   help="--profiler nvml in one process: the one-GPU stand-in for the TP and "
                        "CP groups' collectives: plain (a kernel of their bytes, default) or "
                        "faithful (each holds its SM count for the real collective's time, "
                        "from the measured collective curves; a STAND-IN, said in tune.json)")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="also save every measurement to FILE (replay it with "
                        "--profiler replay:FILE)")
    p.add_argument("--noise", type=_noise, default=0.01,
                   help="emulated measurement noise, relative, in [0, 0.5) (default 0.01)")
    p.add_argument("--budget", type=_int_up_to(_MAX_BUDGET), default=96,
                   help="profiles per partition type for kareus's search (default 96)")
    p.add_argument("--seed", type=lambda s: _whole_number(s, 0, _MAX_SEED), default=0,
                   help="seed of search and emulator noise (>= 0; default 0)")
    p.add_argument("--jobs", type=_positive_int, default=1, metavar="N",
                   help="search up to N partition types at once, in N processes (emulated "
                        "and replayed profilers; the result is the same as with 1, the "
                        "default)")
    p.add_argument("--surrogate", choices=tuple(SURROGATES), default="gp",
                   help="the search's model of time and energy: gp (Gaussian process, the "
                        "default) or trees (the reference artifact's XGBoost ensemble)")
    p.add_argument("--out", default="kareus-out",
                   help="output folder (default kareus-out); a run resumes the search logs "
                        "of the same job there, and refuses a folder of another job")
    p.add_argument("--fresh", action="store_true",
                   help="discard the results and search logs already in --out and start again")
    p.add_argument("--deadline-s", type=_positive_float, default=None,
                   help="plan.json: lowest-energy plan within this iteration time")
    p.add_argument("--energy-budget-j", type=_positive_float, default=None,
                   help="plan.json: fastest plan within this iteration energy (all GPUs)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress (default: a bar on a terminal, a line every few seconds "
                        "in a pipe or log)")
    p.set_defaults(func=cmd_optimize)

    p = sub.add_parser(
        "calibrate", help="measure a GPU profile for the emulator on this machine's GPU",
        description="On one GPU, at the clocks it runs at (nothing is locked or changed): per-op "
                    "time and power of the runnable partitions, the GEMM peak, HBM "
                    "bandwidth, idle power and the power of a GPU waiting on a collective; "
                    "writes a GPU profile (see docs/emulator.md).")
    p.add_argument("--out", required=True, metavar="PATH", help="the profile file to write")
    p.add_argument("--workload", action="append", default=None, metavar="NAME",
                   help="a workload whose partitions to measure: a preset name (its default "
                        "shapes) or 'MODEL tp=.. cp=.. mbs=.. seq=.. nb=..' (repeatable; "
                        "default: llama3.2-3b)")
    p.add_argument("--kernels", default="triton,reference", metavar="LIST",
                   help="kernel sets, the first with power (default triton,reference)")
    p.add_argument("--gpu", default=None,
                   help="the GPU preset the profile refines (default: from the device name)")
    p.add_argument("--collectives-from", default="shipped", metavar="PATH",
                   help="a profile of the same GPU model to copy the collective curves from "
                        "(measured on several GPUs); 'shipped' (default): kareus's own if "
                        "it ships one; 'none': no collectives")
    p.add_argument("--reps", type=_positive_int, default=30, help="timed runs per op (30)")
    p.add_argument("--power-s", type=_positive_float, default=1.0,
                   help="seconds of each op's power loop (default 1.0)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("show", help="print a plan file in human-readable form")
    p.add_argument("plan", help="path of a plan.json, or the --out folder holding one")
    p.add_argument("--gpu-file", default=None, metavar="FILE",
                   help="the GPU file of a plan made for your own GPU")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser(
        "verify", help="run a plan and its baselines on this job's GPUs and compare with "
                       "the predictions",
        description="Trains the plan's job in kareus's training loop (under torchrun on its "
                    "TP x CP GPUs, or in one process on one GPU with loopback collectives "
                    "standing in for the groups, the energy scaled to the job as the tune "
                    "scales), the plan and each baseline results.json predicts, interleaved; "
                    "prints predicted vs measured time and energy, writes verify.json, and "
                    "exits 1 when a system is outside --tolerance. Clocks are never changed.")
    p.add_argument("plan", help="a plan.json, or the kareus optimize --out folder holding it")
    p.add_argument("--results", default=None, metavar="PATH",
                   help="the results.json with the baselines' predictions (default: the one "
                        "beside the plan)")
    p.add_argument("--systems", default=None, metavar="LIST",
                   help="systems to run, of megatron,nanobatching,kareus (default: kareus "
                        "and every baseline results.json predicts)")
    p.add_argument("--steps", type=_positive_int, default=4, help="timed iterations per run "
                   "(default 4)")
    p.add_argument("--warmup", type=_nonnegative_int, default=1,
                   help="untimed iterations first in each run (default 1)")
    p.add_argument("--repeats", type=_positive_int, default=2,
                   help="runs per system, interleaved (default 2)")
    p.add_argument("--order-seed", type=_nonnegative_int, default=0,
                   help="seed of the run order (default 0)")
    p.add_argument("--seed", type=_nonnegative_int, default=0,
                   help="seed of the weights and data (default 0)")
    p.add_argument("--tolerance", type=_positive_float, default=0.10,
                   help="largest relative difference of measured time and total energy from "
                        "the prediction (default 0.10)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (default) or cpu: a dry run whose figures are NOT measurements")
    p.add_argument("--backend", default=None, choices=("nccl_capped", "own", "loopback"),
                   help="the collectives (default nccl_capped on several GPUs, loopback on one)")
    p.add_argument("--no-graphs", action="store_true",
                   help="launch every op eagerly instead of replaying CUDA graphs")
    p.add_argument("--busy-steps", type=_nonnegative_int, default=2,
                   help="iterations queued behind a held GPU per system, for the GPU-busy "
                        "fraction (default 2; 0: skip)")
    p.add_argument("--loopback", choices=("plain", "faithful"), default="plain",
                   help="in one process: the stand-in for the groups' collectives: plain (a "
                        "kernel of their bytes, default) or faithful (each holds its SM count "
                        "for the real collective's time, from the measured collective "
                        "curves; its figures are labelled STAND-IN)")
    p.add_argument("--min-window-s", type=_nonnegative_float, default=None, metavar="S",
                   help="shortest timed window of a run: iterations are added after --steps "
                        "until it lasts this long, so that NVML's energy counter steps "
                        "inside it (default: 7.5 of the counter's step periods, at least "
                        "0.5 s; about 0.75 s on an H200)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="verify.json's path or folder (default: beside the plan)")
    p.add_argument("--gpu-file", default=None, metavar="FILE",
                   help="the GPU file of a plan made for your own GPU")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_verify)
    for command in sub.choices.values():  # -v after the command works too
        command.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                             help=_VERBOSE_HELP)
    return parser


#: The exit status of a bug (sysexits.h's EX_SOFTWARE), distinct from every refusal (2) and
#: failure of the machine (1).
INTERNAL_ERROR_STATUS = 70


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kareus`` command on ``argv`` (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success; 2 with the usage on stderr without a command; on a
        failure, one line on stderr: a [`KareusError`][kareus.errors.KareusError] says what
        to change and returns its ``exit_code`` (2 for a bad request, 1 for a failure of the
        machine; the argument parser's own refusals exit 2 through ``SystemExit``), any
        other ``OSError`` returns 1, and anything else is a bug, reported as
        ``kareus: internal error: ...`` with status 70; 130 when interrupted (Ctrl-C), 143
        when stopped by SIGTERM.
    """
    args: argparse.Namespace | None = None
    try:  # the handlers first: a stop while parsing or setting up is one line too, never lost
        with _signals_as_stops() as received:
            try:
                parser = build_parser()  # imports the search layer (numpy) for its choices
                args = parser.parse_args(argv)
                configure_logging(getattr(args, "verbose", 0))
            except Exception as exc:
                return _report_failure(exc, args, received)
            if not getattr(args, "func", None):  # no command: what there is, a bad status
                parser.print_help(sys.stderr)
                return 2
            status = _run(args, received)
            if received and status != 130 and status != 143:
                # A stop whose exception something swallowed (code that catches every
                # exception, or a finaliser it landed in): never a run that reports success.
                raise _Stopped(received[0])
            return status
    except (KeyboardInterrupt, _Stopped) as exc:  # before _run, or as the handlers go back
        return _report_stop(exc, args)


def console_main() -> int:
    """The process entry point of the ``kareus`` script and of ``python -m kareus``:
    [`main`][kareus.cli.main] with the stop handlers in place for the rest of the process.

    ``main`` puts the previous handlers back when it returns, for callers that run it
    in-process; here a Ctrl-C after the command has finished (while the interpreter exits)
    is ignored rather than shown as a traceback, and one before is the command's one line.
    The process asks cuBLAS for GEMMs without a workspace before anything runs on a GPU
    (``kareus.exec.prefer_workspace_free_gemms``; unless ``CUBLAS_WORKSPACE_CONFIG`` is
    set): graph replays then carry no memset per GEMM.

    Returns:
        The exit status of ``main``.
    """
    global _process_done
    from kareus.exec._graphs import prefer_workspace_free_gemms

    prefer_workspace_free_gemms()
    try:
        _take_stop_signals()
        status = main()
    except (KeyboardInterrupt, _Stopped) as exc:  # in main's last steps
        status = _report_stop(exc, None)
    _process_done = True
    return status


class _Stopped(BaseException):
    """Ctrl-C (SIGINT) or a scheduler's stop (SIGTERM) while a command runs.

    Raised from the signal handler so that the same clean-up runs as for any exception
    (logs synced, GPU clocks restored, the folder unlocked). It is not a KeyboardInterrupt
    on purpose: CPython remembers a KeyboardInterrupt that passed through code an extension
    ran with ``PyRun_*`` and then ends the process by SIGINT after ``main`` returned,
    whatever status it returned.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


#: The signals the handler below has received during the current command (reset when a
#: command starts): ``main`` checks it after the command, so that a stop never goes unseen.
_received: list[int] = []

#: Set by ``console_main`` once the command's status is final: the process is exiting and a
#: late signal has nothing left to stop.
_process_done = False


def _raise_stopped(signum: int, frame: object) -> None:
    _received.append(signum)
    if not _process_done:
        raise _Stopped(signum)


def _take_stop_signals() -> dict[int, object]:
    """Install ``_raise_stopped`` for SIGTERM, and for SIGINT where Python's default handler
    (or this one) has it; returns the handlers replaced. A SIGINT that was ignored (a job
    started in the background) stays so."""
    taken = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _raise_stopped):
        taken.append(signal.SIGINT)
    return {sig: signal.signal(sig, _raise_stopped) for sig in taken}


def _redeliver_stops(hook):  # type: ignore[no-untyped-def]
    """An ``sys.unraisablehook`` that sends a stop the interpreter could not raise (it landed
    in a finaliser, a ``__del__`` or a weakref callback, whose exceptions Python only prints)
    to the main thread again, instead of printing it and losing it.

    It is sent again a moment later from another thread: sent from the hook itself, the
    handler would run inside the finaliser again."""

    def unraisable(info):  # type: ignore[no-untyped-def]
        exc = info.exc_value
        if isinstance(exc, (_Stopped, KeyboardInterrupt)) and not _process_done:
            signum = getattr(exc, "signum", signal.SIGINT)
            timer = threading.Timer(_REDELIVER_AFTER_S, _interrupt_main, (signum,))
            timer.daemon = True
            timer.start()
            return
        hook(info)

    return unraisable


_REDELIVER_AFTER_S = 0.01


def _interrupt_main(signum: int) -> None:
    if signal.getsignal(signum) is _raise_stopped and not _process_done:  # still running
        _thread.interrupt_main(signal.Signals(signum))


@contextlib.contextmanager
def _signals_as_stops() -> Iterator[list[int]]:
    """Turn SIGTERM, and SIGINT where Python's default handler has it, into ``_Stopped``
    while the command runs (main thread only; the previous handlers are put back after).
    A SIGINT that was ignored (a job started in the background) stays so. Yields the list
    of the signals received."""
    del _received[:]
    if threading.current_thread() is not threading.main_thread():
        yield _received
        return
    hook = sys.unraisablehook
    sys.unraisablehook = _redeliver_stops(hook)
    previous = _take_stop_signals()
    try:
        yield _received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        sys.unraisablehook = hook


def _report_stop(exc: BaseException, args: argparse.Namespace | None) -> int:
    """One line for a Ctrl-C or SIGTERM (with how to resume, once a run has said); returns
    130 or 143."""
    term = isinstance(exc, _Stopped) and exc.signum == signal.SIGTERM
    hint = getattr(args, "resume_hint", None)
    print("kareus: " + ("stopped by SIGTERM" if term else "interrupted")
          + (f"; run the same command again to resume ({hint})" if hint else ""),
          file=sys.stderr)
    return 143 if term else 130


def _run(args: argparse.Namespace, received: Sequence[int] = ()) -> int:
    """Run the parsed command; every failure becomes one line on stderr and an exit status.

    Only a [`KareusError`][kareus.errors.KareusError] is the user's to fix; an ``OSError``
    (a full disk, a closed pipe) is the machine's; anything else is a bug in kareus (or in a
    plug-in) and says so, whatever its type: a bare ``ValueError`` raised deep inside is not
    an argument the user can change.
    """
    try:
        return int(args.func(args) or 0)
    except (KeyboardInterrupt, _Stopped) as exc:
        return _report_stop(exc, args)
    except Exception as exc:
        return _report_failure(exc, args, received)


def _report_failure(exc: Exception, args: argparse.Namespace | None,
                    received: Sequence[int]) -> int:
    """One line for a failure (called while ``exc`` is being handled); returns the exit
    status. Under ``python -X dev`` a bug is raised again, for its traceback."""
    if received:  # a stop that something turned into another exception (an extension's
        # import that reports any failure as an ImportError, a broad except)
        return _report_stop(_Stopped(received[0]), args)
    if isinstance(exc, KareusError):
        print(f"kareus: error: {_cli_words(_one_line(exc))}", file=sys.stderr)
        return exc.exit_code
    if isinstance(exc, BrokenPipeError):  # the reader of stdout went away (`kareus gpus | head`)
        return 1
    if isinstance(exc, OSError):
        print(f"kareus: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    print(f"kareus: internal error: {type(exc).__name__}: {_one_line(exc)} (please "
          f"report it; python -X dev -m kareus ... shows the traceback)", file=sys.stderr)
    if sys.flags.dev_mode:
        raise exc
    return INTERNAL_ERROR_STATUS


#: Python argument names in an error's remedy and the command's options that set them.
_CLI_WORDS = (("optimize(..., fresh=True)", "--fresh"), ("fresh=True", "--fresh"))


def _cli_words(message: str) -> str:
    """An error of the library, its remedy said in the command's words (``--fresh`` for
    ``fresh=True``)."""
    for python, option in _CLI_WORDS:
        message = message.replace(python, option)
    return message


def _one_line(exc: BaseException | str) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 2000 else text[:1997] + "..."


if __name__ == "__main__":  # pragma: no cover
    sys.exit(console_main())

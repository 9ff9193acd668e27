"""Megatron-LM's own ``pretrain_gpt.py``, unmodified, with Megatron's layers and with
kareus's (``--spec kareus.integrations.megatron layer_spec``): losses and step times side by
side, on one or more Megatron-Core release lines.

It runs the same job (mock data, the flags of ``job_flags``) once per case, each a fresh
``torchrun``:

* ``megatron``: Megatron-LM's own layers (``--transformer-impl local``: the local spec);
* ``kareus``: kareus's layers through ``layer_spec``, eager (``KAREUS_GRAPHS=0``; the
  sequential schedule without
  ``--plan``; under the plan with ``--plan``, made by
  ``kareus optimize --megatron-args "<the same flags>"``);
* ``kareus-graphs``: the same with ``KAREUS_GRAPHS=1`` (kareus's CUDA graphs per layer,
  also what an unset ``KAREUS_GRAPHS`` gives on a GPU);
* ``kareus-nanobatching``: ``KAREUS_SCHEDULE=nanobatching``;

parses Megatron-LM's log lines (``lm loss`` and ``elapsed time per iteration (ms)`` of
every iteration: ``--log-interval 1``) and prints, per iteration, each case's loss, then each
case's median step time over the iterations after ``--warmup``; ``--json PATH`` writes it all,
per release line (``"lines"``, keyed by the megatron-core version each line imported).

``--shape`` chooses the layer: ``llama`` (RMSNorm eps 1e-5, GQA, SwiGLU, RoPE base 500000,
hidden 1024 / 16 heads / 8 KV heads / FFN 2816, vocabulary 32000) or ``qwen3`` (Qwen3-1.7B's
layer: per-head query/key RMSNorm ``--qk-layernorm``, RMSNorm eps 1e-6 ``--norm-epsilon 1e-6``,
GQA, SwiGLU, RoPE base 1000000, hidden 2048 / 16 heads / 8 KV heads of 128 / FFN 6144, its
vocabulary of 151936 and tied embeddings, which are Megatron-LM's default); ``--layers``,
``--hidden``, ... change the dimensions. Both are layers kareus computes; a flag it does not
compute is refused by the spec before the first step, in one line naming the flag.

Megatron-LM's trainer (``megatron.training``) is not in the ``megatron-core`` wheel: give a
Megatron-LM checkout with ``--megatron-lm DIR``, once per release line to run (the lines run
one after the other). Only its ``pretrain_gpt.py``, ``gpt_builders.py``, ``model_provider.py``
and ``megatron/{training,legacy,rl,post_training}`` are used, e.g. from a clone::

    git -C Megatron-LM archive core_v0.16.1 pretrain_gpt.py gpt_builders.py \\
        model_provider.py megatron/training megatron/legacy megatron/rl \\
        megatron/post_training | tar -x -C megatron-lm-0.16.1

``megatron.core`` is ``DIR/megatron/core`` when ``DIR`` has one (a whole clone, or a
``megatron-core`` wheel unpacked into ``DIR``: ``python -m zipfile -e
megatron_core-0.15.3-....whl megatron-lm-0.15.3``), else the installed one (``megatron/``
has no ``__init__.py``, so the two merge): so two lines run in one environment, the
installed release and one unpacked beside its trainer. Each line's megatron-core version is
read (and written to the JSON) before it runs; ``--untested`` sets
``KAREUS_MEGATRON_UNTESTED=1`` for a release outside kareus's tested lines.

``megatron.training`` imports ``six`` and ``regex`` (its tokenizers); where they are not
installed the script puts empty stand-ins beside the checkout (the ``NullTokenizer`` of
these runs uses neither). Megatron-LM runs ``make`` in ``megatron/core/datasets`` at start
(to compile its dataset helpers); a wheel ships them compiled but without the ``Makefile``,
so where the compiled helpers lie without one inside the checkout (an unpacked wheel) the
script writes a ``Makefile`` whose target does nothing (and says so); an installed
megatron-core without one is left alone (the script says what will fail).

One H200, TP=1 (the default), 20 iterations, both shapes on the 0.16 line::

    python examples/integrations/megatron_lm_pretrain.py --megatron-lm megatron-lm-0.16.1 \\
        --json megatron_lm_1xh200.json
    python examples/integrations/megatron_lm_pretrain.py --megatron-lm megatron-lm-0.16.1 \\
        --megatron-lm megatron-lm-0.15.3 --shape qwen3 --json megatron_lm_qwen3_1xh200.json

At TP=1 no layer has a collective, so there is no plan to apply: the kareus cases run the
baselines; ``--tp 2 --gpus 2 --plan plan.json`` runs a plan on two GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Megatron-LM's log line of one iteration (``training_log``, ``--log-interval 1``).
_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): "
                   r"([0-9.]+) \|.*?lm loss: ([0-9.Ee+-]+) \|")

#: The layer shapes of ``--shape``: their dimensions (each the default of its option) ...
SHAPES: dict[str, dict[str, int | None]] = {
    # a Llama-style layer (the shape of the recorded 1x H200 run)
    "llama": {"hidden": 1024, "heads": 16, "kv_heads": 8, "kv_channels": None, "ffn": 2816,
              "vocab": 32000, "rotary_base": 500000},
    # Qwen3-1.7B's layer (its config.json: hidden 2048, 16 heads, 8 KV heads, head_dim 128,
    # intermediate 6144, rms_norm_eps 1e-6, rope_theta 1000000, vocab 151936 (the
    # NullTokenizer adds one token to --vocab-size), tie_word_embeddings true: Megatron-LM
    # ties them unless --untie-embeddings-and-output-weights)
    "qwen3": {"hidden": 2048, "heads": 16, "kv_heads": 8, "kv_channels": 128, "ffn": 6144,
              "vocab": 151935, "rotary_base": 1000000},
}
#: ... and the feature flags Megatron-LM builds that layer with.
SHAPE_FLAGS: dict[str, list[str]] = {
    "llama": [],
    "qwen3": ["--qk-layernorm", "--norm-epsilon", "1e-6"],
}

#: The cases: (name, extra environment).
CASES = {"megatron": None, "kareus": {"KAREUS_GRAPHS": "0"},
         "kareus-graphs": {"KAREUS_GRAPHS": "1"},
         "kareus-nanobatching": {"KAREUS_SCHEDULE": "nanobatching"}}


def job_flags(args: argparse.Namespace) -> list[str]:
    """The job's flags (without ``--spec``): a GPT of ``args.shape`` on mock data."""
    channels = (["--kv-channels", str(args.kv_channels)] if args.kv_channels is not None
                else [])
    return [
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--group-query-attention",
        "--num-query-groups", str(args.kv_heads), *channels, "--ffn-hidden-size", str(args.ffn),
        "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
        "--micro-batch-size", str(args.mbs), "--global-batch-size", str(args.gbs),
        "--tensor-model-parallel-size", str(args.tp), "--swiglu", "--disable-bias-linear",
        "--normalization", "RMSNorm", *SHAPE_FLAGS[args.shape],
        "--position-embedding-type", "rope",
        "--rotary-base", str(args.rotary_base), "--hidden-dropout", "0",
        "--attention-dropout", "0",
        "--bf16", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab),
        "--mock-data", "--lr", "3e-4", "--min-lr", "3e-5", "--train-iters", str(args.iters),
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", str(args.iters), "--seed", "1234",
        "--transformer-impl", "local", "--distributed-backend", "nccl",
        # Megatron-Core's local modules without Apex or Transformer Engine: torch's RMSNorm
        # takes no persist_layer_norm, the linears no gradient-accumulation fusion, and
        # the fused softmax / RoPE kernels are not built
        "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion", "--no-rope-fusion",
    ]


def stub_tokenizer_imports(folder: Path) -> list[str]:
    """Empty ``six`` / ``regex`` modules in ``folder`` for those not installed (returns
    their names): ``megatron.training``'s tokenizer modules import them at import time, and
    the ``NullTokenizer`` of these runs uses neither."""
    import importlib.util

    missing = [m for m in ("six", "regex") if importlib.util.find_spec(m) is None]
    for m in missing:
        (folder / m).mkdir(parents=True, exist_ok=True)
        (folder / m / "__init__.py").write_text('"""a stand-in: the NullTokenizer uses none"""\n')
    return missing


def line_environment(args: argparse.Namespace, megatron_lm: Path) -> dict[str, str]:
    """The environment of every run of one release line: ``megatron_lm`` (its trainer, and
    its ``megatron/core`` when it has one) first on ``PYTHONPATH``, then kareus, the
    tokenizer stand-ins and the caller's path."""
    stubs = megatron_lm.resolve() / "_kareus_stubs"
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", NCCL_NVLS_ENABLE="0",
               PYTHONPATH=os.pathsep.join([str(megatron_lm), str(REPO), str(stubs),
                                           os.environ.get("PYTHONPATH", "")]))
    if args.untested:
        env["KAREUS_MEGATRON_UNTESTED"] = "1"
    return env


def command(args: argparse.Namespace, case: str, megatron_lm: Path | None = None
            ) -> tuple[list[str], dict[str, str]]:
    """The ``torchrun`` command and environment of one case (on ``megatron_lm``, default
    the first ``--megatron-lm``)."""
    megatron_lm = Path(megatron_lm if megatron_lm is not None else args.megatron_lm[0])
    flags = job_flags(args)
    env = line_environment(args, megatron_lm)
    extra = CASES[case]
    if extra is not None:
        flags += ["--spec", "kareus.integrations.megatron", "layer_spec"]
        env.update(extra)
        if args.plan is not None and "KAREUS_SCHEDULE" not in extra:
            env["KAREUS_PLAN"] = str(args.plan)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.gpus}", str(megatron_lm / "pretrain_gpt.py"), *flags]
    return cmd, env


#: What a line's environment imports: its megatron-core version and folder.
_PROBE = ("import os, megatron.core as m; "
          "print(m.__version__, os.path.dirname(os.path.abspath(m.__file__)))")

#: The ``Makefile`` written where a wheel's compiled dataset helpers lie without one.
_NOOP_MAKEFILE = ("# written by kareus's examples/integrations/megatron_lm_pretrain.py: the\n"
                  "# megatron-core wheel ships helpers_cpp compiled; Megatron-LM runs make here\n"
                  "default:\n\t@true\n")


def megatron_core_of(args: argparse.Namespace, megatron_lm: Path) -> tuple[str, Path]:
    """The megatron-core version and folder a line's runs import (``DIR/megatron/core`` when
    the checkout has one, else the installed one).

    Raises:
        RuntimeError: megatron.core does not import there (the error's last line).
    """
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=line_environment(args, megatron_lm),
                          capture_output=True, text=True, check=False)
    out = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not out:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"megatron.core does not import with {megatron_lm}: {last}")
    version, folder = out[-1].split(" ", 1)
    return version, Path(folder)


def missing_helpers_makefile(core: Path) -> bool:
    """Whether the compiled dataset helpers lie in ``core/datasets`` without a ``Makefile``
    (a wheel's layout: Megatron-LM's start-up runs ``make`` there and exits when it fails)."""
    datasets = core / "datasets"
    return not (datasets / "Makefile").exists() and bool(list(datasets.glob("helpers_cpp*.so")))


def ensure_helpers_makefile(core: Path) -> bool:
    """Write a ``Makefile`` that does nothing into ``core/datasets`` where
    ``missing_helpers_makefile`` says one is missing. Returns whether it wrote one."""
    if not missing_helpers_makefile(core):
        return False
    (core / "datasets" / "Makefile").write_text(_NOOP_MAKEFILE)
    return True


#: Megatron-LM's memory report (``report_memory``, printed after the first and second
#: iterations, the second with the optimizer's state): torch's allocator's peaks, in MB.
_MEMORY = re.compile(r"memory \(MB\) \| allocated: ([\d.]+) \| max allocated: ([\d.]+) \| "
                     r"reserved: ([\d.]+) \| max reserved: ([\d.]+)")


def parse_memory(text: str) -> dict[str, float] | None:
    """Megatron-LM's last memory report: ``{"max_allocated_mb", "max_reserved_mb"}`` (rank
    0's, after the second iteration: the optimizer's state included), or None."""
    found = list(_MEMORY.finditer(text))
    if not found:
        return None
    m = found[-1]
    return {"max_allocated_mb": float(m.group(2)), "max_reserved_mb": float(m.group(4))}


def parse_log(text: str) -> dict[int, tuple[float, float]]:
    """``{iteration: (step time ms, lm loss)}`` of Megatron-LM's log."""
    return {int(m.group(1)): (float(m.group(2)), float(m.group(3)))
            for m in _LINE.finditer(text)}


def run_line(args: argparse.Namespace, cases: list[str], megatron_lm: Path
             ) -> dict[str, dict[str, object]]:
    """Every case on one release line: ``{case: results}``."""
    results: dict[str, dict[str, object]] = {}
    for case in cases:
        cmd, env = command(args, case, megatron_lm)
        shown = " ".join(f"{k}={env[k]}" for k in ("KAREUS_PLAN", "KAREUS_GRAPHS",
                                                     "KAREUS_SCHEDULE",
                                                     "KAREUS_MEGATRON_UNTESTED") if k in env)
        print(f"# {case}: {shown} {' '.join(cmd)}", flush=True)
        if args.print:
            continue
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        log = parse_log(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not log:
            tail = (proc.stdout + proc.stderr)[-4000:]
            print(f"{case} failed (exit {proc.returncode}):\n{tail}", file=sys.stderr)
            results[case] = {"exit": proc.returncode, "log_tail": tail}
            continue
        times = [t for it, (t, _) in sorted(log.items()) if it > args.warmup]
        results[case] = {"exit": 0, "loss": {it: loss for it, (_, loss) in sorted(log.items())},
                         "step_ms": {it: t for it, (t, _) in sorted(log.items())},
                         "median_step_ms": statistics.median(times) if times else None,
                         "memory": parse_memory(proc.stdout + proc.stderr)}
    return results


def print_line(args: argparse.Namespace, label: str, results: dict[str, dict[str, object]]
               ) -> None:
    """One line's losses per iteration and median step times."""
    ok = [c for c, r in results.items() if r.get("exit") == 0]
    print(f"\n== megatron-core {label}")
    print("iteration  " + "  ".join(f"{c:>20}" for c in ok))
    losses = {c: results[c]["loss"] for c in ok}
    for it in range(1, args.iters + 1):
        row = [loss.get(it) if isinstance(loss, dict) else None for loss in losses.values()]
        print(f"{it:>9}  " + "  ".join(f"{v:>20.6f}" if v is not None else f"{'-':>20}"
                                       for v in row))
    medians = {c: results[c]["median_step_ms"] for c in ok}
    print(f"median step time (ms), iterations {args.warmup + 1}-{args.iters}:  "
          + "  ".join(f"{c} {m:.1f}" if isinstance(m, float) else f"{c} -"
                      for c, m in medians.items()))
    mems = {c: results[c].get("memory") for c in ok}
    print("max allocated / max reserved after iteration 2 (MB):  "
          + "  ".join(f"{c} {m['max_allocated_mb']:.0f} / {m['max_reserved_mb']:.0f}"
                      if isinstance(m, dict) else f"{c} -" for c, m in mems.items()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, the shape's dimensions filled in where not given."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatron-lm", type=Path, action="append", required=True,
                    help="a Megatron-LM checkout (core_v0.16.1, core_v0.15.3, ...): "
                         "pretrain_gpt.py and megatron/training, and megatron/core when it "
                         "has one; repeat it to run several release lines")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama",
                    help="the layer: llama (default) or qwen3 (Qwen3-1.7B's)")
    ap.add_argument("--cases", default="megatron,kareus,kareus-graphs",
                    help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--plan", type=Path, default=None,
                    help="a plan from `kareus optimize --megatron-args` (TP >= 2)")
    ap.add_argument("--untested", action="store_true",
                    help="KAREUS_MEGATRON_UNTESTED=1: run a megatron-core outside kareus's "
                         "tested lines (a warning instead of the refusal)")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    for name in ("hidden", "heads", "kv-heads", "kv-channels", "ffn", "vocab", "rotary-base"):
        ap.add_argument(f"--{name}", type=int, default=None,
                        help="default: the shape's")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5,
                    help="iterations left out of the median step time (default 5)")
    ap.add_argument("--print", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.cases_list = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in args.cases_list if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}: choose from {list(CASES)}")
    return args


def write_json(args: argparse.Namespace, lines: dict[str, dict[str, object]]) -> None:
    """``--json``: the options, the job's flags and every line run so far (written after
    each line, so a run stopped in a later line keeps the earlier ones)."""
    if args.json is None:
        return
    shown = {k: str(v) for k, v in vars(args).items() if k != "cases_list"}
    args.json.write_text(json.dumps({"args": shown, "flags": " ".join(job_flags(args)),
                                     "lines": lines}, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases: list[str] = args.cases_list
    lines: dict[str, dict[str, object]] = {}
    failed = False
    for megatron_lm in args.megatron_lm:
        label = str(megatron_lm)
        entry: dict[str, object] = {"megatron_lm": str(megatron_lm)}
        if not args.print:
            try:
                version, core = megatron_core_of(args, megatron_lm)
            except RuntimeError as exc:
                print(str(exc), file=sys.stderr)
                lines[label] = {**entry, "error": str(exc)}
                failed = True
                write_json(args, lines)
                continue
            label = version if version not in lines else f"{version} ({megatron_lm})"
            entry.update(megatron_core=version, megatron_core_path=str(core))
            print(f"# line {label}: Megatron-LM {megatron_lm}, megatron-core {version} from "
                  f"{core}", flush=True)
            stubbed = stub_tokenizer_imports(megatron_lm.resolve() / "_kareus_stubs")
            if stubbed:
                print(f"# {', '.join(stubbed)} not installed: empty stand-ins (the "
                      "NullTokenizer uses neither)", flush=True)
            # only inside the checkout: an installed megatron-core is the environment's
            inside = megatron_lm.resolve() in core.resolve().parents
            if inside and ensure_helpers_makefile(core):
                print(f"# wrote {core / 'datasets' / 'Makefile'} (a target that does "
                      "nothing: the compiled dataset helpers are there)", flush=True)
            elif not inside and missing_helpers_makefile(core):
                print(f"# {core / 'datasets'} has the compiled dataset helpers without the "
                      "Makefile Megatron-LM runs at start-up, so it will stop there: unpack "
                      f"the megatron-core wheel into {megatron_lm} (python -m zipfile -e "
                      "WHEEL DIR) to run its own copy", flush=True)
        results = run_line(args, cases, megatron_lm)
        if args.print:
            continue
        entry["results"] = results
        lines[label] = entry
        write_json(args, lines)
        print_line(args, label, results)
        failed |= any(r.get("exit") != 0 for r in results.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

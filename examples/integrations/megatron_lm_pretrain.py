"""Megatron-LM's own ``pretrain_gpt.py``, unmodified, with Megatron's layers and with
kareus's (``--spec kareus.integrations.megatron layer_spec``): losses and step times side by
side.

It runs the same job (mock data, the flags below) once per case, each a fresh ``torchrun``:

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
case's median step time over the iterations after ``--warmup``; ``--json PATH`` writes it all.

Megatron-LM's trainer (``megatron.training``) is not in the ``megatron-core`` wheel: give a
Megatron-LM checkout with ``--megatron-lm DIR``. Only its ``pretrain_gpt.py``,
``gpt_builders.py``, ``model_provider.py`` and ``megatron/{training,legacy,rl,post_training}``
are used (``megatron.core`` is the installed wheel: ``megatron/`` has no ``__init__.py``, so
the two merge), e.g. from a clone::

    git -C Megatron-LM archive core_v0.16.1 pretrain_gpt.py gpt_builders.py \\
        model_provider.py megatron/training megatron/legacy megatron/rl \\
        megatron/post_training | tar -x -C megatron-lm-0.16.1

``megatron.training`` imports ``six`` and ``regex`` (its tokenizers); where they are not
installed the script puts empty stand-ins beside the checkout (the ``NullTokenizer`` of
these runs uses neither).

One H200, TP=1 (the default), 20 iterations::

    python examples/integrations/megatron_lm_pretrain.py --megatron-lm megatron-lm-0.16.1 \\
        --json megatron_lm_1xh200.json

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

#: The cases: (name, extra environment).
CASES = {"megatron": None, "kareus": {"KAREUS_GRAPHS": "0"},
         "kareus-graphs": {"KAREUS_GRAPHS": "1"},
         "kareus-nanobatching": {"KAREUS_SCHEDULE": "nanobatching"}}


def job_flags(args: argparse.Namespace) -> list[str]:
    """The job's flags (without ``--spec``): a Llama-style GPT on mock data."""
    return [
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--group-query-attention",
        "--num-query-groups", str(args.kv_heads), "--ffn-hidden-size", str(args.ffn),
        "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
        "--micro-batch-size", str(args.mbs), "--global-batch-size", str(args.gbs),
        "--tensor-model-parallel-size", str(args.tp), "--swiglu", "--disable-bias-linear",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--rotary-base", "500000", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--bf16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
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


def command(args: argparse.Namespace, case: str) -> tuple[list[str], dict[str, str]]:
    """The ``torchrun`` command and environment of one case."""
    flags = job_flags(args)
    stubs = Path(args.megatron_lm).resolve() / "_kareus_stubs"
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", NCCL_NVLS_ENABLE="0",
               PYTHONPATH=os.pathsep.join([str(args.megatron_lm), str(REPO), str(stubs),
                                           os.environ.get("PYTHONPATH", "")]))
    extra = CASES[case]
    if extra is not None:
        flags += ["--spec", "kareus.integrations.megatron", "layer_spec"]
        env.update(extra)
        if args.plan is not None and "KAREUS_SCHEDULE" not in extra:
            env["KAREUS_PLAN"] = str(args.plan)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.gpus}", str(Path(args.megatron_lm) / "pretrain_gpt.py"),
           *flags]
    return cmd, env


def parse_log(text: str) -> dict[int, tuple[float, float]]:
    """``{iteration: (step time ms, lm loss)}`` of Megatron-LM's log."""
    return {int(m.group(1)): (float(m.group(2)), float(m.group(3)))
            for m in _LINE.finditer(text)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatron-lm", type=Path, required=True,
                    help="a Megatron-LM checkout (core_v0.16.1): pretrain_gpt.py and "
                         "megatron/training")
    ap.add_argument("--cases", default="megatron,kareus,kareus-graphs",
                    help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--plan", type=Path, default=None,
                    help="a plan from `kareus optimize --megatron-args` (TP >= 2)")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5,
                    help="iterations left out of the median step time (default 5)")
    ap.add_argument("--print", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}: choose from {list(CASES)}")
    results: dict[str, dict[str, object]] = {}
    if not args.print:
        stubbed = stub_tokenizer_imports(Path(args.megatron_lm).resolve() / "_kareus_stubs")
        if stubbed:
            print(f"# {', '.join(stubbed)} not installed: empty stand-ins (the NullTokenizer "
                  "uses neither)", flush=True)
    for case in cases:
        cmd, env = command(args, case)
        shown = " ".join(f"{k}={env[k]}" for k in ("KAREUS_PLAN", "KAREUS_GRAPHS",
                                                     "KAREUS_SCHEDULE") if k in env)
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
                         "median_step_ms": statistics.median(times) if times else None}
    if args.print:
        return 0
    ok = [c for c in cases if results[c].get("exit") == 0]
    print("\niteration  " + "  ".join(f"{c:>20}" for c in ok))
    for it in range(1, args.iters + 1):
        row = [results[c]["loss"].get(it) for c in ok]  # type: ignore[union-attr]
        print(f"{it:>9}  " + "  ".join(f"{v:>20.6f}" if v is not None else f"{'-':>20}"
                                       for v in row))
    print(f"median step time (ms), iterations {args.warmup + 1}-{args.iters}:  "
          + "  ".join(f"{c} {results[c]['median_step_ms']:.1f}" for c in ok))
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=1))
    return 0 if len(ok) == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The kareus workload of a Megatron-LM job, read from the flags it trains with.

A Megatron-LM user describes the job once, as ``pretrain_gpt.py`` flags (``--num-layers``,
``--hidden-size``, ``--micro-batch-size``, ``--global-batch-size``, ``--tensor-model-parallel-size``,
...). [`workload_from_megatron_args`][kareus.integrations.megatron_args.workload_from_megatron_args]
turns those same flags into the [`Workload`][kareus.model.Workload] a plan is made for
(``kareus optimize --megatron-args "<flags>"``), and ``kareus.integrations.megatron``'s
``layer_spec`` turns Megatron-LM's own parsed arguments into the same workload when it builds
the first layer, so the plan and the running job agree field by field without renaming
anything.

What is computed as Megatron-LM computes it (``megatron/training/arguments.py`` and
``megatron/training/tokenizer/tokenizer.py`` of Megatron-LM ``core_v0.16.1``):

* the padded vocabulary: the tokenizer's vocabulary rounded up to a multiple of
  ``--make-vocab-size-divisible-by`` x TP (``--padded-vocab-size`` when given); the
  ``NullTokenizer`` of ``--mock-data`` runs has ``--vocab-size`` + 1 tokens (its end-of-document
  token), so ``--vocab-size 32000`` pads to 32128 at TP=1; any other tokenizer's vocabulary
  is in its files, which kareus does not read: give ``--padded-vocab-size`` (the "new size"
  Megatron-LM prints at start-up);
* microbatches per iteration: ``--global-batch-size`` / (``--micro-batch-size`` x DP), DP =
  GPUs / (TP x PP x CP) (Megatron's default global batch is one microbatch per replica);
* ``--ffn-hidden-size`` when not given: 4 x hidden, or with ``--swiglu`` the multiple of 64 below
  8/3 x hidden; ``--kv-channels`` when not given: hidden / heads; ``--num-query-groups`` only with
  ``--group-query-attention``; ``--recompute-activations`` as ``--recompute-granularity
  selective``; ``--bf16`` / ``--fp16`` as 2-byte activations;
* the model's features: ``--qk-layernorm``, ``--norm-epsilon``, ``--untie-embeddings-and-output-weights``
  (tied by default in Megatron-LM), ``--add-qkv-bias``; ``--rotary-base`` is the applier's RoPE base.
* a mixture of experts: ``--num-experts``, ``--moe-router-topk``, ``--moe-ffn-hidden-size``
  (default ``--ffn-hidden-size``), ``--moe-shared-expert-intermediate-size``,
  ``--expert-model-parallel-size`` (the workload's ``ep``), ``--moe-router-dtype`` and the
  other ``--moe-*`` flags of Megatron-LM ``core_v0.16.1`` (the ``TransformerConfig`` fields of
  the same names), read as ``kareus.integrations._megatron_moe`` reads the config: kareus's MoE
  block is Megatron-Core's ``MoELayer`` with ``--moe-token-dispatcher-type alltoall`` (not
  Megatron-LM's default ``allgather``), ``--expert-tensor-parallel-size 1``, softmax over the
  top-k logits, dropless, without an auxiliary loss, every layer MoE (``--moe-layer-freq 1``);
  any other value (a capacity factor, ``--moe-aux-loss-coeff`` above 0, the z-loss, expert
  bias, sigmoid scores, group-limited routing, ...) is refused in one line naming the flag's
  ``TransformerConfig`` field (``--moe-aux-loss-coeff`` is ``moe_aux_loss_coeff``).

Megatron-LM's argument parser lives in ``megatron.training``, which is not in the
``megatron-core`` wheel on PyPI (only in the Megatron-LM repository), so kareus cannot call it:
[`parse_megatron_args`][kareus.integrations.megatron_args.parse_megatron_args] is a small parser
of its own for the flags above, with Megatron-LM's defaults. A flag that changes nothing kareus
costs or runs (data, optimizer, learning rate, logging, checkpointing, fusions, initialisation,
...) is ignored; any other flag is refused in one line naming it, because kareus cannot tell
whether it changes the layer (the worst outcome is a plan for another model than the one
trained). Importing this module imports neither torch nor Megatron.
"""

from __future__ import annotations

import argparse
import math
import shlex
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs

from kareus.errors import ArgumentError, ArgumentTypeError, WorkloadError
from kareus.integrations._megatron_config import workload_from_megatron
from kareus.integrations._megatron_moe import MOE_DEFAULTS
from kareus.model.workload import Workload

__all__ = ["MegatronArgsError", "parse_megatron_args", "read_megatron_flags",
           "workload_from_megatron_args"]


class MegatronArgsError(ArgumentError):
    """A Megatron-LM flag list kareus cannot read, or a flag it does not compute."""


def _bool(name: str, default: bool = False) -> tuple[str, dict[str, Any]]:
    return name, {"action": "store_true", "default": default}


#: The flags kareus reads, with Megatron-LM core_v0.16.1's types, defaults and attribute
#: names (a ``TransformerConfig`` field's flag stores under the field's name:
#: ``--norm-epsilon`` is ``layernorm_epsilon``, ``--disable-bias-linear`` ``add_bias_linear``).
_READ: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--num-layers", {"type": int, "default": None}),
    ("--hidden-size", {"type": int, "default": None}),
    ("--ffn-hidden-size", {"type": int, "default": None}),
    ("--num-attention-heads", {"type": int, "default": None}),
    ("--kv-channels", {"type": int, "default": None}),
    _bool("--group-query-attention"),
    ("--num-query-groups", {"type": int, "default": 1}),
    ("--seq-length", {"type": int, "default": None}),
    ("--max-position-embeddings", {"type": int, "default": None}),
    ("--micro-batch-size", {"type": int, "default": None}),
    ("--global-batch-size", {"type": int, "default": None}),
    ("--rampup-batch-size", {"nargs": "*", "default": None}),
    ("--tensor-model-parallel-size", {"type": int, "default": 1}),
    ("--pipeline-model-parallel-size", {"type": int, "default": 1}),
    ("--context-parallel-size", {"type": int, "default": 1}),
    ("--expert-model-parallel-size", {"type": int, "default": 1}),
    _bool("--sequence-parallel"),
    ("--virtual-pipeline-model-parallel-size", {"type": int, "default": None}),
    ("--num-layers-per-virtual-pipeline-stage", {"type": int, "default": None}),
    ("--num-virtual-stages-per-pipeline-rank", {"type": int, "default": None}),
    ("--recompute-granularity", {"default": None, "choices": ("full", "selective")}),
    _bool("--recompute-activations"),
    ("--recompute-method", {"default": None}),
    ("--recompute-num-layers", {"type": int, "default": None}),
    ("--recompute-modules", {"nargs": "*", "default": None}),
    ("--hidden-dropout", {"type": float, "default": 0.1}),
    ("--attention-dropout", {"type": float, "default": 0.1}),
    _bool("--bf16"),
    _bool("--fp16"),
    ("--fp8-format", {"default": None, "dest": "fp8"}),
    ("--fp4-format", {"default": None, "dest": "fp4"}),
    ("--norm-epsilon", {"type": float, "default": 1e-5, "dest": "layernorm_epsilon"}),
    ("--normalization", {"default": "LayerNorm"}),
    ("--apply-layernorm-1p", {"action": "store_true", "default": False,
                             "dest": "layernorm_zero_centered_gamma"}),
    _bool("--qk-layernorm"),
    _bool("--qk-l2-norm"),
    _bool("--untie-embeddings-and-output-weights"),
    _bool("--swiglu"),
    _bool("--squared-relu"),
    _bool("--quick-geglu"),
    _bool("--openai-gelu"),
    ("--disable-bias-linear", {"action": "store_false", "dest": "add_bias_linear",
                               "default": True}),
    _bool("--add-qkv-bias"),
    ("--position-embedding-type", {"default": "learned_absolute"}),
    _bool("--use-rotary-position-embeddings"),
    ("--rotary-base", {"type": float, "default": 10000}),
    ("--rotary-percent", {"type": float, "default": 1.0}),
    _bool("--rotary-interleaved"),
    _bool("--use-rope-scaling"),
    ("--rotary-seq-len-interpolation-factor", {"type": int, "default": None}),
    ("--vocab-size", {"type": int, "default": None}),
    ("--padded-vocab-size", {"type": int, "default": None}),
    ("--make-vocab-size-divisible-by", {"type": int, "default": 128}),
    ("--tokenizer-type", {"default": None}),
    ("--num-experts", {"type": int, "default": None}),
    ("--expert-tensor-parallel-size", {"type": int, "default": None}),
    ("--moe-router-topk", {"type": int, "default": 2}),
    ("--moe-ffn-hidden-size", {"type": int, "default": None}),
    ("--moe-shared-expert-intermediate-size", {"type": int, "default": None}),
    _bool("--moe-shared-expert-overlap"),
    _bool("--moe-shared-expert-gate"),
    ("--moe-layer-freq", {"default": 1}),
    ("--moe-router-dtype", {"default": None, "choices": ("fp32", "fp64")}),
    ("--moe-token-dispatcher-type", {"default": "allgather",
                                     "choices": ("allgather", "alltoall", "flex")}),
    _bool("--moe-enable-deepep"),
    ("--moe-flex-dispatcher-backend", {"default": "deepep"}),
    _bool("--moe-grouped-gemm"),
    _bool("--moe-use-legacy-grouped-gemm"),
    _bool("--moe-permute-fusion"),
    _bool("--moe-router-fusion"),
    ("--moe-router-load-balancing-type", {"nargs": "+", "default": "aux_loss"}),
    ("--moe-aux-loss-coeff", {"type": float, "nargs": "+", "default": 0.0}),
    ("--moe-z-loss-coeff", {"type": float, "default": None}),
    ("--moe-input-jitter-eps", {"type": float, "default": None}),
    ("--moe-router-score-function", {"default": "softmax", "choices": ("softmax", "sigmoid")}),
    _bool("--moe-router-pre-softmax"),
    ("--moe-router-topk-scaling-factor", {"type": float, "default": None}),
    ("--moe-router-num-groups", {"type": int, "default": None}),
    ("--moe-router-group-topk", {"type": int, "default": None}),
    _bool("--moe-router-enable-expert-bias"),
    _bool("--moe-router-force-load-balancing"),
    _bool("--moe-router-padding-for-fp8"),
    _bool("--moe-router-padding-for-quantization"),
    _bool("--moe-enable-routing-replay"),
    ("--moe-expert-capacity-factor", {"type": float, "default": None}),
    _bool("--moe-pad-expert-input-to-capacity"),
    ("--moe-token-drop-policy", {"default": "probs", "choices": ("probs", "position")}),
    _bool("--moe-apply-probs-on-input"),
    ("--moe-latent-size", {"type": int, "default": None}),
    _bool("--moe-layer-recompute"),
    _bool("--multi-latent-attention"),
    ("--window-size", {"default": None}),
    _bool("--apply-residual-connection-post-layernorm"),
    _bool("--fp32-residual-connection"),
    _bool("--overlap-param-gather"),
    _bool("--use-tp-pp-dp-mapping"),
    ("--transformer-impl", {"default": "transformer_engine"}),
    ("--spec", {"nargs": "*", "default": None}),
)

#: Flags (taking a value) that change nothing kareus costs or runs: data, tokenizer files,
#: optimizer, schedule of the learning rate, logging, checkpoints, evaluation, seeds,
#: initialisation, distributed set-up, fusions of Megatron's own kernels.
_IGNORED_VALUE = frozenset(["--data-path", "--split", "--train-data-path", "--valid-data-path", "--test-data-path", "--data-cache-path", "--vocab-file", "--merge-file", "--tokenizer-model", "--num-workers", "--data-args-path", "--per-split-data-args-path", "--train-iters", "--train-samples", "--eval-iters", "--eval-interval", "--log-interval", "--save-interval", "--save", "--load", "--pretrained-checkpoint", "--ckpt-format", "--tensorboard-dir", "--wandb-project", "--wandb-exp-name", "--wandb-save-dir", "--lr", "--min-lr", "--lr-decay-style", "--lr-decay-iters", "--lr-decay-samples", "--lr-warmup-iters", "--lr-warmup-samples", "--lr-warmup-fraction", "--lr-warmup-init", "--weight-decay", "--start-weight-decay", "--end-weight-decay", "--weight-decay-incr-style", "--clip-grad", "--adam-beta1", "--adam-beta2", "--adam-eps", "--sgd-momentum", "--optimizer", "--loss-scale", "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis", "--init-method-std", "--seed", "--data-parallel-random-init", "--distributed-backend", "--distributed-timeout-minutes", "--local-rank", "--exit-interval", "--exit-duration-in-mins", "--exit-signal-handler-for-dataloader", "--timing-log-level", "--timing-log-option", "--tensorboard-log-interval", "--tensorboard-queue-size", "--log-params-norm-interval", "--num-dataset-builder-threads", "--dataloader-type", "--mmap-bin-files", "--object-storage-cache-path", "--ddp-bucket-size", "--ddp-num-buckets", "--attention-backend", "--use-checkpoint-args", "--non-persistent-save-interval", "--non-persistent-ckpt-type", "--manual-gc-interval", "--tokenizer-special-tokens", "--tiktoken-pattern", "--tokenizer-metadata", "--eod-mask-loss-type", "--dist-ckpt-strictness", "--ckpt-convert-format", "--ckpt-convert-save", "--profile-step-start", "--profile-step-end", "--profile-ranks", "--result-rejected-tracker-filename", "--train-sync-interval", "--check-weight-hash-across-dp-replicas-interval", "--num-distributed-optimizer-instances", "--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype", "--init-model-with-meta-device", "--logging-level", "--straggler-minmax-count", "--rerun-mode", "--data-sharding", "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--moe-router-bias-update-rate", "--moe-deepep-num-sms", "--moe-hybridep-num-sms"])

#: Flags without a value that change nothing kareus costs or runs.
_IGNORED_SWITCH = frozenset(["--mock-data", "--use-mcore-models", "--no-load-optim", "--no-load-rng", "--no-save-optim", "--no-save-rng", "--use-distributed-optimizer", "--overlap-grad-reduce", "--use-flash-attn", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-async-tensor-model-parallel-allreduce", "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32", "--log-throughput", "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard", "--log-params-norm", "--log-num-zeros-in-grad", "--log-progress", "--log-world-size-to-tensorboard", "--log-loss-scale-to-tensorboard", "--log-energy", "--tensorboard-log-interval", "--no-check-for-nan-in-loss-and-grad", "--check-for-nan-in-loss-and-grad", "--manual-gc", "--no-manual-gc-eval", "--bf16-reduced-precision-matmul", "--use-cpu-initialization", "--empty-unused-memory-level", "--no-create-attention-mask-in-dataloader", "--dist-ckpt-save-pre-mcore-014", "--auto-detect-ckpt-format", "--finetune", "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--legacy-tokenizer", "--use-dist-ckpt", "--async-save", "--no-initialization", "--profile", "--use-pytorch-profiler", "--record-memory-history", "--barrier-with-L1-time", "--disable-straggler-on-startup", "--enable-one-logger", "--no-mmap-bin-files", "--deterministic-mode", "--calculate-per-token-loss", "--check-weight-hash-across-dp-replicas-interval", "--ckpt-fully-parallel-save", "--ckpt-fully-parallel-load", "--ckpt-assume-constant-structure", "--no-ckpt-fully-parallel-save", "--use-torch-optimizer-for-cpu-offload", "--overlap-param-gather-with-optimizer-step", "--align-grad-reduce", "--align-param-gather", "--no-align-grad-reduce", "--no-align-param-gather", "--tp-comm-overlap", "--log-straggler", "--skip-train", "--trust-remote-code", "--moe-per-layer-logging"])

def read_megatron_flags(flags: str | Sequence[str]) -> list[str]:
    """The flag list of a string (split as a shell does), a sequence of strings, or
    ``@PATH`` (a file holding the flags, as ``pretrain_gpt.py`` is called: newlines, ``\\``
    continuations and ``#`` comments allowed).

    Raises:
        MegatronArgsError: the file cannot be read, or the text does not split.
    """
    if isinstance(flags, str):
        text = flags.strip()
        if text.startswith("@"):
            path = Path(text[1:])
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise MegatronArgsError(f"--megatron-args @{path}: cannot read the file "
                                        f"({type(exc).__name__}): give the flags inline or a "
                                        "readable UTF-8 file") from None
        try:
            return shlex.split(text.replace("\\\n", " "), comments=True)
        except ValueError as exc:
            raise MegatronArgsError(f"--megatron-args: the flags do not split as a shell line "
                                    f"({exc})") from None
    if not all(isinstance(f, str) for f in flags):
        raise ArgumentTypeError("the Megatron-LM flags must be strings")
    return list(flags)


def parse_megatron_args(flags: str | Sequence[str]) -> argparse.Namespace:
    """The Megatron-LM arguments kareus reads, parsed from ``pretrain_gpt.py``'s flags
    (a string, a list, or ``@PATH``) with Megatron-LM's defaults and its derived values
    (``ffn_hidden_size``, ``kv_channels``, ``num_query_groups``, ``recompute_granularity``),
    under Megatron-LM's attribute names.

    Raises:
        MegatronArgsError: a flag kareus neither reads nor knows to be harmless, a bad value,
            or a missing dimension.
    """
    argv = read_megatron_flags(flags)
    if argv[:1] and not argv[0].startswith("-"):  # "pretrain_gpt.py --flags", or "python ..."
        while argv and not argv[0].startswith("-"):
            argv = argv[1:]
    known = _drop_ignored(argv)

    class _Refuse(argparse.ArgumentParser):
        def error(self, message: str) -> Any:  # one line, our error type
            raise MegatronArgsError(f"--megatron-args: {message}")

    p = _Refuse(prog="megatron-args", add_help=False, allow_abbrev=False)
    for name, kw in _READ:
        p.add_argument(name, **kw)
    ns, unknown = p.parse_known_args(known)
    if unknown:
        flag = next((u for u in unknown if u.startswith("-")), unknown[0])
        raise MegatronArgsError(f"--megatron-args: kareus does not read {flag} and cannot tell "
                                "whether it changes the layer it plans: drop it from the flags "
                                "given to kareus if it changes no layer (a data, optimizer or "
                                "logging flag), or train without it")
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        if getattr(ns, name) is None:
            raise MegatronArgsError(f"--megatron-args: give --{name.replace('_', '-')}")
    if ns.ffn_hidden_size is None:
        ns.ffn_hidden_size = (int((4 * ns.hidden_size * 2 / 3) / 64) * 64 if ns.swiglu
                              else 4 * ns.hidden_size)
    if ns.kv_channels is None:
        if ns.hidden_size % ns.num_attention_heads:
            raise MegatronArgsError(f"--megatron-args: --hidden-size {ns.hidden_size} is not a "
                                    f"multiple of --num-attention-heads "
                                    f"{ns.num_attention_heads}: give --kv-channels")
        ns.kv_channels = ns.hidden_size // ns.num_attention_heads
    if ns.recompute_activations:
        ns.recompute_granularity = "selective"
    if ns.use_rotary_position_embeddings:
        ns.position_embedding_type = "rope"
    if ns.seq_length is None:
        ns.seq_length = ns.max_position_embeddings
    _derive_moe(ns)
    return ns


def _derive_moe(ns: argparse.Namespace) -> None:
    """Megatron-LM's derived MoE arguments (``validate_args``): ``--num-experts 0`` is
    none, ``--moe-ffn-hidden-size`` defaults to ``--ffn-hidden-size`` with experts,
    ``--expert-tensor-parallel-size`` to TP, a one-entry ``--moe-router-load-balancing-type``
    or ``--moe-aux-loss-coeff`` list to its entry, and ``--moe-layer-freq N`` is the number N
    (a pattern, which Megatron-LM evaluates as Python, stays text: refused)."""
    if ns.num_experts == 0:
        ns.num_experts = None
    if ns.num_experts is not None and ns.moe_ffn_hidden_size is None:
        ns.moe_ffn_hidden_size = ns.ffn_hidden_size
    if ns.expert_tensor_parallel_size is None:
        ns.expert_tensor_parallel_size = ns.tensor_model_parallel_size
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(ns, name)
        if isinstance(value, list) and len(value) == 1:
            setattr(ns, name, value[0])
    freq = ns.moe_layer_freq
    if isinstance(freq, str) and freq.strip().isdigit():
        ns.moe_layer_freq = int(freq)


def _drop_ignored(argv: Sequence[str]) -> list[str]:
    """``argv`` without the ignored flags (and the values of those that take some)."""
    read = {name for name, _ in _READ}
    keep: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in _IGNORED_SWITCH and name not in read:
            i += 1
            continue
        if name in _IGNORED_VALUE and name not in read:
            i += 1 if "=" in a else 2
            # a value list (``--data-path 1 a 1 b``): skip up to the next flag
            while "=" not in a and i < len(argv) and not argv[i].startswith("--"):
                i += 1
            continue
        keep.append(a)
        i += 1
    return keep


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


#: Megatron-LM attributes whose name changed between release lines: the 0.16 name (a
#: ``TransformerConfig`` field's) and the name Megatron-LM ``core_v0.15.x``'s
#: ``parse_args`` stores the same flag under (``--norm-epsilon``, ``--apply-layernorm-1p``).
_EARLIER_NAMES = {"layernorm_epsilon": "norm_epsilon",
                  "layernorm_zero_centered_gamma": "apply_layernorm_1p"}


def _renamed(args: Any, name: str, default: Any) -> Any:
    """``args.name``, else the 0.15 line's name of the same flag, else ``default``: a
    0.15 namespace read under the 0.16 name alone would give the default (``1e-5`` for
    ``--norm-epsilon 1e-6``: another model, silently)."""
    if hasattr(args, name):
        return getattr(args, name)
    return getattr(args, _EARLIER_NAMES[name], default)


def padded_vocab_size(args: Any) -> int:
    """The vocabulary Megatron-LM builds the model with: ``args.padded_vocab_size`` when set,
    else the tokenizer's vocabulary (``NullTokenizer``: ``vocab_size + 1``) rounded up to a
    multiple of ``make_vocab_size_divisible_by`` x TP.

    Raises:
        MegatronArgsError: the vocabulary is in tokenizer files kareus does not read.
    """
    padded = _get(args, "padded_vocab_size")
    if padded is not None:
        return int(padded)
    tokenizer = _get(args, "tokenizer_type")
    vocab = _get(args, "vocab_size")
    if tokenizer == "NullTokenizer" and vocab is not None:
        vocab = int(vocab) + 1  # its end-of-document token
    else:
        raise MegatronArgsError(
            f"--megatron-args: the vocabulary of --tokenizer-type {tokenizer or 'GPT2BPETokenizer'} "
            "(pretrain_gpt.py's default) is in its files, "
            "which kareus does not read: add --padded-vocab-size N (Megatron-LM prints the new "
            "size at start-up: 'padded vocab (size: V) with ... dummy tokens (new size: N)')")
    multiple = int(_get(args, "make_vocab_size_divisible_by", 128)) * int(
        _get(args, "tensor_model_parallel_size", 1) or 1)
    return int(math.ceil(vocab / multiple) * multiple)


def _flag_refusals(args: Any) -> str | None:
    """The first Megatron-LM default or flag kareus's layer does not compute, by flag."""
    dropout = (float(_get(args, "hidden_dropout", 0.1) or 0.0),
               float(_get(args, "attention_dropout", 0.1) or 0.0))
    checks = (
        (dropout != (0.0, 0.0),
         f"kareus's layer computes without dropout and Megatron-LM's defaults are 0.1: give "
         f"--hidden-dropout 0 --attention-dropout 0 (got {dropout[0]:g}, {dropout[1]:g})"),
        (not _get(args, "swiglu", False),
         "kareus's MLP is SwiGLU: give --swiglu"),
        (bool(_get(args, "add_bias_linear", True)),
         "kareus's projections have no bias: give --disable-bias-linear"),
        (_get(args, "normalization", "LayerNorm") != "RMSNorm",
         "kareus's norms are RMSNorm: give --normalization RMSNorm"),
        (_get(args, "position_embedding_type", "learned_absolute") != "rope",
         "kareus's layer applies RoPE: give --position-embedding-type rope"),
        (float(_get(args, "rotary_percent", 1.0)) != 1.0,
         "kareus's RoPE rotates whole heads: give --rotary-percent 1.0"),
        (bool(_get(args, "use_rope_scaling", False))
         or _get(args, "rotary_seq_len_interpolation_factor") is not None,
         "kareus's layer runs Megatron's plain RoPE frequencies: drop --use-rope-scaling and "
         "--rotary-seq-len-interpolation-factor"),
        (bool(_get(args, "squared_relu", False) or _get(args, "quick_geglu", False)
              or _get(args, "openai_gelu", False)),
         "kareus's MLP is SwiGLU: drop --squared-relu / --quick-geglu / --openai-gelu"),
        (not _moe_freq_one(_get(args, "moe_layer_freq", 1)),
         f"kareus models models whose every layer is MoE: give --moe-layer-freq 1 (got "
         f"{_get(args, 'moe_layer_freq', 1)!r:.60})"),
        (_get(args, "virtual_pipeline_model_parallel_size") is not None
         or _get(args, "num_layers_per_virtual_pipeline_stage") is not None
         or _get(args, "num_virtual_stages_per_pipeline_rank") is not None,
         "kareus follows the non-interleaved pipeline schedules: drop "
         "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank"),
        (bool(_get(args, "rampup_batch_size")),
         "a plan is made for one number of microbatches: drop --rampup-batch-size"),
        (bool(_get(args, "overlap_param_gather", False)),
         "kareus's layers read their weights without calling their modules, so the parameter "
         "all-gather hooks of --overlap-param-gather would not run: drop it"),
    )
    return next((msg for bad, msg in checks if bad), None)


def _moe_freq_one(freq: Any) -> bool:
    """``--moe-layer-freq`` says every layer is MoE: ``1`` (a pattern, which Megatron-LM
    evaluates as Python, is not evaluated here: give 1)."""
    if isinstance(freq, list | tuple):
        return len(freq) > 0 and all(f == 1 for f in freq)
    try:
        return int(freq) == 1
    except (TypeError, ValueError):
        return False


#: The MoE ``TransformerConfig`` fields a Megatron-LM flag of the same name sets (read by
#: ``kareus.integrations._megatron_moe``), with Megatron-LM's defaults: the config's own
#: (the same values), and two flags the config table does not hold.
_MOE_FIELDS: dict[str, Any] = {
    **{k: v for k, v in MOE_DEFAULTS.items() if k.startswith(("moe_", "expert_"))},
    "moe_shared_expert_overlap": False, "moe_grouped_gemm": False}


def _config_of(args: Any) -> SimpleNamespace:
    """The ``TransformerConfig`` fields ``workload_from_megatron`` reads, as
    Megatron-LM's ``core_transformer_config_from_args`` sets them from ``args``."""
    import types

    swiglu = bool(_get(args, "swiglu", False))
    fields = {
        "num_layers": _get(args, "num_layers"), "hidden_size": _get(args, "hidden_size"),
        "num_attention_heads": _get(args, "num_attention_heads"),
        "num_query_groups": (_get(args, "num_query_groups")
                             if _get(args, "group_query_attention", False) else None),
        "kv_channels": _get(args, "kv_channels"),
        "ffn_hidden_size": _get(args, "ffn_hidden_size"),
        "tensor_model_parallel_size": _get(args, "tensor_model_parallel_size", 1),
        "pipeline_model_parallel_size": _get(args, "pipeline_model_parallel_size", 1),
        "context_parallel_size": _get(args, "context_parallel_size", 1),
        "sequence_parallel": _get(args, "sequence_parallel", False),
        "recompute_granularity": _get(args, "recompute_granularity"),
        "recompute_method": _get(args, "recompute_method"),
        "recompute_num_layers": _get(args, "recompute_num_layers"),
        "recompute_modules": _get(args, "recompute_modules"),
        "gated_linear_unit": swiglu,
        "activation_func": types.SimpleNamespace(__name__="silu") if swiglu else None,
        "add_bias_linear": _get(args, "add_bias_linear", True),
        "add_qkv_bias": _get(args, "add_qkv_bias", False),
        "normalization": _get(args, "normalization", "LayerNorm"),
        "layernorm_epsilon": _renamed(args, "layernorm_epsilon", 1e-5),
        "layernorm_zero_centered_gamma": _renamed(args, "layernorm_zero_centered_gamma",
                                                  False),
        "qk_layernorm": _get(args, "qk_layernorm", False),
        "qk_l2_norm": _get(args, "qk_l2_norm", False),
        "num_moe_experts": _get(args, "num_experts") or None,
        **{name: _get(args, name, default) for name, default in _MOE_FIELDS.items()},
        "multi_latent_attention": _get(args, "multi_latent_attention", False),
        "window_size": _get(args, "window_size"),
        "apply_residual_connection_post_layernorm": _get(
            args, "apply_residual_connection_post_layernorm", False),
        "fp32_residual_connection": _get(args, "fp32_residual_connection", False),
        "rotary_interleaved": _get(args, "rotary_interleaved", False),
        "softmax_scale": _get(args, "softmax_scale"),
        "hidden_dropout": _get(args, "hidden_dropout", 0.1),
        "attention_dropout": _get(args, "attention_dropout", 0.1),
        "bf16": _get(args, "bf16", False), "fp16": _get(args, "fp16", False),
        "fp8": _get(args, "fp8"), "fp4": _get(args, "fp4"),
    }
    return SimpleNamespace(**fields)


def workload_from_megatron_args(args: argparse.Namespace | str | Sequence[str], *,
                                dp: int | None = None, nanobatches: int = 2,
                                name: str = "megatron-gpt", config: Any = None) -> Workload:
    """The [`Workload`][kareus.model.Workload] of a Megatron-LM ``pretrain_gpt.py`` job.

    Args:
        args: Megatron-LM's parsed arguments (``megatron.training.get_args()``: every
            derived value, ``padded_vocab_size`` and ``data_parallel_size`` included, is taken
            as Megatron computed it), or the flags the job is started with (a string, a list,
            or ``@PATH``; parsed by
            [`parse_megatron_args`][kareus.integrations.megatron_args.parse_megatron_args]).
        dp: The data-parallel degree (GPUs / (TP x PP x CP)); default: the arguments'
            ``data_parallel_size``, else 1.
        nanobatches: Parts each microbatch is split into by the plan's baseline.
        name: The model's name (a plan compares architectures field by field, not names).
        config: The model's own ``TransformerConfig`` (the layer passes it); default: the
            fields Megatron-LM sets from ``args``.

    The ranks' layout is Megatron-LM's: ``tp-cp-ep-dp-pp``, or ``tp-cp-ep-pp-dp`` under
    ``--use-tp-pp-dp-mapping`` (``Parallelism.rank_order``).

    Raises:
        MegatronArgsError: a flag kareus does not read, a Megatron-LM default or flag
            kareus's layer does not compute (named by its flag: dropout, bias, SwiGLU,
            RMSNorm, RoPE, ...), the batch or the vocabulary cannot be computed.
        WorkloadError: the config describes a layer kareus does not compute (named by its
            ``TransformerConfig`` field, whose flag is ``--field-name``).
    """
    ns = args if isinstance(args, argparse.Namespace | SimpleNamespace) else (
        parse_megatron_args(args))
    refused = _flag_refusals(ns)
    if refused:
        raise MegatronArgsError(refused)
    for flag in ("seq_length", "micro_batch_size"):
        if _get(ns, flag) is None:
            raise MegatronArgsError(f"--megatron-args: give --{flag.replace('_', '-')}")
    dp_ = int(dp if dp is not None else (_get(ns, "data_parallel_size") or 1))
    mbs = int(_get(ns, "micro_batch_size"))
    gbs = _get(ns, "global_batch_size")
    gbs = mbs * dp_ if gbs is None else int(gbs)
    if gbs % (mbs * dp_):
        raise MegatronArgsError(f"--global-batch-size {gbs} is not a multiple of "
                                f"--micro-batch-size {mbs} x DP {dp_}")
    try:
        wl = workload_from_megatron(
            config if config is not None else _config_of(ns), microbatch_size=mbs,
            seq_len=int(_get(ns, "seq_length")), num_microbatches=gbs // (mbs * dp_),
            vocab_size=padded_vocab_size(ns), nanobatches=nanobatches, name=name, dp=dp_,
            share_embeddings_and_output_weights=not _get(
                ns, "untie_embeddings_and_output_weights", False))
    except WorkloadError as exc:
        raise WorkloadError(f"Megatron-LM arguments: {exc} (the flag of TransformerConfig "
                            "field x is --x with dashes)") from None
    if _get(ns, "use_tp_pp_dp_mapping", False):  # the ranks' layout (RANK_ORDERS)
        wl = wl.with_(parallelism=attrs.evolve(wl.parallelism, rank_order="tp-cp-ep-pp-dp"))
    return wl

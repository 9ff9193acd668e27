"""torchtitan 0.3's own ``Trainer`` on a CPU, over gloo: a smoke test of a plan without a GPU.

torchtitan's ``Trainer`` is written for accelerators: at import it picks its device module
(``torch.cuda`` when no accelerator is found), asks it for device names, memory statistics
and synchronisation, and its stock configs read a tokenizer and a test dataset from a
checkout of torchtitan's repository (``./tests/assets``), which its wheel does not ship.
This module supplies the three things that are missing on a machine without a GPU, and
nothing else: the Trainer, its model, its parallelism, its data loader (documents packed,
``positions`` restarting at each document), its loss, optimizer, validator and metrics are
torchtitan's own.

* [`use_cpu`][kareus.testing.torchtitan_cpu.use_cpu]: points torchtitan's device module at
  the CPU (a stand-in that answers the memory and device questions its metrics ask) in this
  process; the process group is then gloo (torchtitan picks the device type's backend);
* [`write_cpu_assets`][kareus.testing.torchtitan_cpu.write_cpu_assets]: a small tokenizer
  (``tokenizer.json`` and ``tokenizer_config.json``, trained on the data) and a small text
  dataset of documents of different lengths, in a folder;
* [`cpu_trainer_config`][kareus.testing.torchtitan_cpu.cpu_trainer_config]: the
  ``Trainer.Config`` that torchtitan's own command line gives for ``--module M --config C``
  and your overrides, pointed at those assets (the same parser as ``-m torchtitan.train``).

Run under ``torchrun`` (one process per rank, ``OMP_NUM_THREADS=1``)::

    from kareus.testing.torchtitan_cpu import cpu_trainer_config, use_cpu, write_cpu_assets
    from kareus.integrations.torchtitan import wrap_trainer

    use_cpu()
    assets = write_cpu_assets("/tmp/tt-assets")      # every rank writes the same files
    config = cpu_trainer_config(assets, "--parallelism.tensor_parallel_degree", "2",
                                "--training.seq_len", "64", "--training.steps", "3")
    trainer = config.build()
    wrap_trainer(trainer, "plan.json")
    trainer.train()
    trainer.close()

Tested with torchtitan 0.3.0 and torch 2.14.1 (the release line where its Trainer runs on
a CPU; on torch 2.13 it fails while it is built).
"""

from __future__ import annotations

import json
import os
import random
import types
from pathlib import Path
from typing import Any

__all__ = ["cpu_trainer_config", "main", "trainer_runs_here", "use_cpu", "write_cpu_assets"]

#: The modules of torchtitan 0.3 that import its device type or module by name.
_DEVICE_MODULES = ("torchtitan.tools.utils", "torchtitan.components.metrics",
                   "torchtitan.distributed.parallel_dims", "torchtitan.distributed.utils",
                   "torchtitan.tools.profiler", "torchtitan.models.common.token_dispatcher")


def trainer_runs_here() -> str | None:
    """Why torchtitan 0.3's Trainer cannot run in this environment (None: it can).

    torchtitan 0.3.0 declares no torch requirement; on torch 2.13 its Trainer fails while
    it is built (``ValueError: ... all parameters must be DTensors on the full SPMD mesh``
    under its default ``spmd_types`` backend) and lacks ``torch.distributed.set_timeout``
    after the first step; on torch 2.14.1 it runs.
    """
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    try:
        from importlib import metadata

        version = metadata.version("torchtitan")
    except Exception:
        return "torchtitan is not installed"
    if version.split(".")[:2] != ["0", "3"]:
        return f"torchtitan {version} (tested with 0.3)"
    if not hasattr(torch.distributed, "set_timeout"):
        return (f"torch {torch.__version__} lacks torch.distributed.set_timeout, which "
                "torchtitan 0.3's Trainer calls (it runs on torch 2.14.1)")
    return None


def _cpu_device_module() -> Any:
    """What torchtitan asks of a device module, answered for the CPU (no memory figures:
    zeros, as a device without statistics)."""
    import torch

    def get_device_properties(device: Any = None) -> Any:
        return types.SimpleNamespace(name="cpu", total_memory=1)

    stats: dict[str, int] = {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0,
                             "num_alloc_retries": 0, "num_ooms": 0}
    mod = types.SimpleNamespace(
        set_device=lambda device=None: None, current_device=lambda: 0,
        device_count=lambda: 1, get_device_name=lambda device=None: "cpu",
        get_device_properties=get_device_properties,
        reset_peak_memory_stats=lambda device=None: None, empty_cache=lambda: None,
        memory_stats=lambda device=None: dict(stats), synchronize=torch.cpu.synchronize,
        is_available=lambda: True, manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed)
    return mod


def use_cpu() -> None:
    """Point torchtitan 0.3's device type and module at the CPU in this process.

    torchtitan picks ``cuda`` when no accelerator is found (``torchtitan.tools.utils``), and
    several of its modules import the pick by name; each gets ``"cpu"`` and a stand-in
    device module. The process group torchtitan then starts is gloo (the CPU's default
    backend). Call it before building the Trainer, in every rank.
    """
    import importlib

    module = _cpu_device_module()
    for name in _DEVICE_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # pragma: no cover - a module another 0.3.x may not have
            continue
        if hasattr(mod, "device_type"):
            setattr(mod, "device_type", "cpu")  # noqa: B010 - a module's global
        if hasattr(mod, "device_module"):
            setattr(mod, "device_module", module)  # noqa: B010


_WORDS = ["the", "a", "of", "to", "and", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this", "are", "from", "at", "or", "an", "plan", "layer", "rank", "step", "token", "model", "clock", "energy", "time", "frontier", "kernel", "stream", "graph", "batch", "sequence", "document", "attention", "norm", "gradient", "loss", "weight", "head"]


def write_cpu_assets(folder: str | os.PathLike[str], *, documents: int = 400,
                     seed: int = 0) -> Path:
    """Write a small tokenizer and text dataset for torchtitan's text loader into ``folder``.

    ``folder/tokenizer``: a byte-pair tokenizer trained on the data (``tokenizer.json``),
    with ``<|begin_of_text|>`` and ``<|end_of_text|>`` as BOS and EOS
    (``tokenizer_config.json``), under 300 tokens (every torchtitan debug model's vocabulary
    is larger); ``folder/data/train.jsonl``: ``documents`` documents of 5 to 120 words
    drawn with ``seed``, read by the ``c4_test`` dataset's loader (``load_dataset(path,
    split="train")``), so batches pack documents of different lengths. Idempotent: every
    rank may call it with the same arguments.

    Returns:
        ``folder``, for [`cpu_trainer_config`][kareus.testing.torchtitan_cpu.cpu_trainer_config].
    """
    root = Path(folder)
    tok_dir, data_dir = root / "tokenizer", root / "data"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 120)))
             for _ in range(int(documents))]
    _write_if_changed(data_dir / "train.jsonl",
                      "".join(json.dumps({"text": t}) + "\n" for t in texts))
    if not (tok_dir / "tokenizer.json").exists():
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        special = ["<|begin_of_text|>", "<|end_of_text|>"]
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(texts, trainer)
        tmp = tok_dir / f"tokenizer.json.{os.getpid()}"
        tok.save(str(tmp))
        os.replace(tmp, tok_dir / "tokenizer.json")
    _write_if_changed(tok_dir / "tokenizer_config.json", json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
         "add_bos_token": True, "add_eos_token": True}))
    return root


def _write_if_changed(path: Path, text: str) -> None:
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def cpu_trainer_config(assets: str | os.PathLike[str], *args: str, module: str = "llama3",
                       config: str = "llama3_debugmodel", sdpa: bool = True) -> Any:
    """torchtitan's ``Trainer.Config`` for ``--module module --config config`` and ``args``
    (torchtitan's own command-line overrides, as ``-m torchtitan.train`` takes them),
    reading the tokenizer and data of
    [`write_cpu_assets`][kareus.testing.torchtitan_cpu.write_cpu_assets] (training and
    validation), without checkpoints, writing under ``assets/outputs``; ``args`` come last,
    so they override these. With ``sdpa`` (the default), attention is torchtitan's SDPA,
    causal over the packed sequence (``--override.imports``
    [`causal_sdpa`][kareus.testing.torchtitan_sdpa.causal_sdpa]): FlexAttention, which the
    stock configs use, has no backward on a CPU. With ``sdpa=False`` the stock attention
    stays: torchtitan alone cannot train it here, but under ``wrap_trainer`` the planned
    layers compute its document masks themselves (on the CPU through SDPA with the dense
    mask), under a baseline schedule or a plan made for the documents
    (``document_tokens``).

    Raises:
        SystemExit: torchtitan's parser refused an argument (it prints why).
    """
    from torchtitan.config import ConfigManager  # type: ignore[import]

    base = ["--module", module, "--config", config, *_asset_flags(Path(assets), sdpa=sdpa)]
    return ConfigManager().parse_args([*base, *args])


def _asset_flags(root: Path, *, sdpa: bool) -> list[str]:
    """torchtitan's flags that read the assets in ``root`` (and swap in SDPA)."""
    base = ["--hf_assets_path", str(root / "tokenizer"),
            "--dump_folder", str(root / "outputs"),
            "--dataloader.dataset", "c4_test", "--dataloader.dataset_path", str(root / "data"),
            "--validator.dataloader.dataset", "c4_test",
            "--validator.dataloader.dataset_path", str(root / "data"),
            "--checkpoint.no-enable"]
    if sdpa:
        base += ["--override.imports", "kareus.testing.torchtitan_sdpa.causal_sdpa"]
    return base


def main(argv: list[str] | None = None) -> None:
    """``python -m kareus.testing.torchtitan_cpu ASSETS [kareus's and torchtitan's flags]``:
    [`kareus.integrations.torchtitan.main`][kareus.integrations.torchtitan.main] on the
    CPU, reading [`write_cpu_assets`][kareus.testing.torchtitan_cpu.write_cpu_assets]'
    files in ``ASSETS`` (written there first) with torchtitan's SDPA attention, as
    [`cpu_trainer_config`][kareus.testing.torchtitan_cpu.cpu_trainer_config] sets them;
    ``--module`` / ``--config`` default to torchtitan's debug Llama 3. Run it under
    ``torchrun --standalone --nproc_per_node N``."""
    import sys

    from kareus.integrations.torchtitan import main as train

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        raise SystemExit("usage: python -m kareus.testing.torchtitan_cpu ASSETS [flags]")
    root = write_cpu_assets(args[0])
    use_cpu()
    rest = args[1:]
    model = ([] if "--module" in rest or any(a.startswith("--module=") for a in rest)
             else ["--module", "llama3", "--config", "llama3_debugmodel"])
    train([*model, *_asset_flags(root, sdpa=True), *rest])


if __name__ == "__main__":
    main()

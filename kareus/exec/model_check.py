"""What kareus's decoder computes of a model, checked before anything runs.

The partition model costs every layer feature a model file or preset can name (query/key
normalisation, a QKV bias, the RMSNorm epsilon, tied embeddings), so any such model can be
planned. The decoder that runs a plan (the training loop, the runnable partitions, the planned
layers of ``kareus.integrations``) computes fewer of them today; running a model with one it
does not compute would train another model than the user's, so each refuses it here, in one
line naming the field.
"""

from __future__ import annotations

from kareus.errors import WorkloadError
from kareus.model.workload import ModelArch

__all__ = ["refuse_uncomputed"]


def refuse_uncomputed(arch: ModelArch, *, where: str,
                      computes: frozenset[str] = frozenset()) -> None:
    """Refuse a model whose layers ask for what kareus's decoder does not compute yet: run
    anyway, it would train another model than the user's (the worst kind of error is a
    silently different result).

    Planning such a model works (the partition model costs its ops); running it needs a
    decoder that computes: per-head query/key RMSNorm (``qk_norm``), a QKV bias
    (``qkv_bias``, computed nowhere yet), an RMSNorm epsilon other than 1e-5 (``norm_eps``),
    mixture-of-experts layers (``moe``: router, experts and the expert-parallel all-to-alls;
    computed nowhere yet).
    ``computes`` names the ones the caller computes (the training loop: ``qk_norm`` and
    ``norm_eps``). Tied input and output embeddings concern only the training loop, which
    computes them.

    Raises:
        WorkloadError: one line naming every field that is not computed.
    """
    missing = []
    if arch.qk_norm and "qk_norm" not in computes:
        missing.append("qk_norm=True (per-head query/key RMSNorm)")
    if arch.qkv_bias and "qkv_bias" not in computes:
        missing.append("qkv_bias=True (a QKV bias)")
    if abs(arch.norm_eps - 1e-5) > 1e-12 and "norm_eps" not in computes:
        missing.append(f"norm_eps={arch.norm_eps:g} (its RMSNorm kernels use 1e-5)")
    if arch.moe is not None and "moe" not in computes:
        missing.append("moe (mixture-of-experts layers: router, experts, expert-parallel "
                       "all-to-alls)")
    if missing:
        raise WorkloadError(f"{where} does not compute {'; '.join(missing)} of model "
                            f"{arch.name!r} yet, and would train another model: plan it (the "
                            "emulator costs these ops), but run it with a model without them")

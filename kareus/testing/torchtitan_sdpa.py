"""A torchtitan 0.3 override (``--override.imports``) that runs attention on a CPU.

torchtitan 0.3's language models attend with ``FlexAttention`` (or ``VarlenAttention``),
masking documents (``block_causal``); FlexAttention has no backward on a CPU
(``NotImplementedError: FlexAttention does not support backward on CPU``). This override
swaps each ``FlexAttention.Config`` for ``ScaledDotProductAttention.Config``: torchtitan's
own SDPA module, causal over the whole packed sequence (the Trainer then builds no
document masks and passes the batch's ``positions`` to RoPE only). It is another model
than the stock one (tokens attend across document boundaries); a plan is checked on it
against torchtitan's own run of the same model. Activate it with::

    --override.imports kareus.testing.torchtitan_sdpa.causal_sdpa

(``kareus.testing.torchtitan_cpu.cpu_trainer_config(..., sdpa=True)`` adds it.) Importing
this module imports torchtitan.
"""

from __future__ import annotations

from typing import Any

from torchtitan.config import override  # type: ignore[import]
from torchtitan.models.common.attention import (  # type: ignore[import]
    FlexAttention,
    ScaledDotProductAttention,
)

__all__ = ["causal_sdpa"]


@override(target=FlexAttention.Config,
          description="kareus.testing: SDPA, causal over the packed sequence (CPU runs)")
def causal_sdpa(cfg: Any) -> Any:
    """torchtitan's ``ScaledDotProductAttention.Config`` in place of ``cfg`` (a
    ``FlexAttention.Config``): causal attention over the whole sequence."""
    del cfg
    return ScaledDotProductAttention.Config()

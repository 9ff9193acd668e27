"""Causal attention of one context-parallel rank on Megatron-Core's load-balanced chunks.

A CP rank holds chunks ``r`` and ``2 CP - 1 - r`` of every sequence (``kareus.model``'s
[`cp_positions`][kareus.model.cp_positions]), ``c`` tokens each, concatenated. Its keys and
values are all-gathered over the CP group (rank-major: each rank's two chunks in its order)
and put back in position order here (``order_kv``). The attention of the rank's queries is
then two causal pieces, one per chunk: the queries of chunk ``j`` attend the keys
``0 .. (j + 1) c``, and within that range query ``i`` of the chunk sees the keys up to its
own position, ``j c + i``: causal attention aligned to the lower right of the score block
(the last query sees every key). Computing the two pieces separately is exact (no masked
score is formed) and skips the score blocks above the diagonal that one masked call over
all keys would compute and discard.

Each piece runs on the existing kernels: a square piece (chunk 0: ``c`` queries over ``c``
keys) through the kernel set's ``attention_fwd`` (the fused op SDPA picks); the others
through the fused flash-attention op called directly, whose ``is_causal`` is aligned to the
lower right (PyTorch's SDPA refuses flash for non-square causal attention because its own
``is_causal`` means the upper left; ``torch.nn.attention.bias.CausalBias`` calls the flash
op directly for the lower-right variant, as here), and where that op does not take the
inputs (the CPU, float32, an unsupported head dimension), SDPA with the lower-right causal
mask under autograd (the same values, slower). The backward of each piece is that op's
backward; the keys' and values' gradients of the two pieces are summed by position and
laid out for the reduce-scatter that returns each chunk's gradient to its rank
(``scatter_kv_grad``).

torch is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

import attrs

from kareus.exec.kernels import SavedAttention, attention_backward, attention_forward
from kareus.model.context_parallel import cp_chunks

__all__: list[str] = []


@attrs.frozen
class _Piece:
    """Query rows ``[q0, q1)`` of the rank's local tokens attend the first ``keys`` keys
    (by position), causally aligned to the lower right."""

    q0: int
    q1: int
    keys: int

    @property
    def square(self) -> bool:
        return self.q1 - self.q0 == self.keys


def attention_pieces(seq_local: int, cp: int, rank: int) -> tuple[_Piece, ...]:
    """The causal pieces of CP rank ``rank``'s attention (``seq_local`` tokens per sequence
    on the rank: its two chunks)."""
    chunks = cp_chunks(cp, rank)
    c = seq_local // len(chunks)
    return tuple(_Piece(i * c, (i + 1) * c, (j + 1) * c) for i, j in enumerate(chunks))


def chunk_piece(c: int, j: int) -> tuple[_Piece, ...]:
    """The causal piece of chunk ``j`` of a sequence split into chunks of ``c`` tokens
    (nanobatches along the sequence, CP = 1): its ``c`` queries over the keys of chunks
    ``0..j``, query ``i`` seeing the keys up to ``j c + i``."""
    return (_Piece(0, c, (j + 1) * c),)


def order_kv(gathered: Any, *, cp: int, b: int, sq: int, kvh: int, hd: int) -> Any:
    """The all-gathered keys and values (``[cp, 2, b, sq, kvh, hd]`` elements, rank-major,
    each rank's chunks in its order) as a new ``[2, b, 2 cp c, kvh, hd]`` tensor in position
    order (a copy: the gathered buffer is reused by the next layer's all-gather)."""
    import torch

    full = gathered.view(cp, 2, b, sq, kvh, hd)
    c = sq // 2
    out = torch.empty((2, b, cp * sq, kvh, hd), device=full.device, dtype=full.dtype)
    for i in range(cp):
        for h, j in enumerate(cp_chunks(cp, i)):
            out[:, :, j * c:(j + 1) * c].copy_(full[i, :, :, h * c:(h + 1) * c])
    return out


def scatter_kv_grad(dkv: Any, buf: Any, *, cp: int, b: int, sq: int, kvh: int,
                    hd: int) -> None:
    """Write the keys' and values' gradients by position (``dkv`` ``[2, b, 2 cp c, kvh,
    hd]``) into the reduce-scatter's input ``buf`` (``[cp, 2, b, sq, kvh, hd]`` elements,
    rank-major, each rank's chunks in its order): ``order_kv``'s adjoint."""
    full = buf.view(cp, 2, b, sq, kvh, hd)
    c = sq // 2
    for i in range(cp):
        for h, j in enumerate(cp_chunks(cp, i)):
            full[i, :, :, h * c:(h + 1) * c].copy_(dkv[:, :, j * c:(j + 1) * c])


def lower_right_attention(ks: Any, q: Any, k: Any, v: Any) -> Any:
    """Causal attention aligned to the lower right (query ``i`` of ``s_q`` sees the keys up
    to ``s_k - s_q + i``) through SDPA with that mask, on the kernel set's SDPA backends:
    ``q`` [b, heads, s_q, hd] over grouped ``k``, ``v`` [b, kv_heads, s_k, hd]."""
    import torch

    if q.shape[2] == k.shape[2]:
        return ks.attention(q, k, v)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    # query i sees keys 0 .. s_k - s_q + i: a boolean mask rather than torch's
    # causal_lower_right bias (a tensor subclass, which cannot be made under a
    # TorchDispatchMode such as the runnable partitions' read tracking)
    sq, sk = q.shape[2], k.shape[2]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
    with ks._sdpa_context():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _piece_fwd(ks: Any, q: Any, k: Any, v: Any, square: bool) -> SavedAttention:
    if square:
        return ks.attention_fwd(q, k, v)  # type: ignore[no-any-return]
    backend = "flash_attention" if q.device.type == "cuda" else "math"
    return attention_forward(q, k, v, backend=backend,
                             fallback=lambda a, b_, c: lower_right_attention(ks, a, b_, c))


def cp_attention(ks: Any, q: Any, k: Any, v: Any, pieces: tuple[_Piece, ...], *,
                 keep: bool) -> tuple[Any, list[SavedAttention]]:
    """The rank's causal attention: ``q`` [b, heads, s_local, hd] (its chunks) over ``k``,
    ``v`` [b, kv_heads, s, hd] (every key, by position). Returns the output
    [b, heads, s_local, hd] (a view of a [b, s_local, heads, hd] tensor, as the fused ops
    return theirs, so that the output projection reads it without another copy) and, with
    ``keep``, each piece's saved state for ``cp_attention_bwd``."""
    b, heads, s_local, hd = q.shape
    out = q.new_empty((b, s_local, heads, hd))
    saved = []
    for p in pieces:
        qp, kp, vp = q[:, :, p.q0:p.q1], k[:, :, :p.keys], v[:, :, :p.keys]
        if keep:
            s = _piece_fwd(ks, qp, kp, vp, p.square)
            saved.append(s)
            o = s.output.detach()
        elif p.square or q.device.type != "cuda":
            o = lower_right_attention(ks, qp, kp, vp)
        else:  # the flash op's forward (its saved state dropped)
            o = _piece_fwd(ks, qp, kp, vp, False).output.detach()
        out[:, p.q0:p.q1].copy_(o.transpose(1, 2))
    return out.transpose(1, 2), saved


def cp_attention_bwd(do: Any, saved: list[SavedAttention], pieces: tuple[_Piece, ...], *,
                     keys: int) -> tuple[Any, Any]:
    """``(dq, dkv)`` of ``cp_attention``: ``dq`` [b, heads, s_local, hd] (a view of a
    [b, s_local, heads, hd] tensor) and the keys' and values' gradients summed over the
    pieces, by position: ``dkv`` [2, b, keys, kv_heads, hd] (zero past the longest piece's
    keys)."""
    b, heads, s_local, hd = do.shape
    dq_out = do.new_empty((b, s_local, heads, hd))
    dkv = None
    # the longest piece first: its gradients are copied, the shorter one's added to them
    for p, s in sorted(zip(pieces, saved, strict=True), key=lambda ps: -ps[0].keys):
        dq, dk, dv = attention_backward(do[:, :, p.q0:p.q1], s)
        dq_out[:, p.q0:p.q1].copy_(dq.transpose(1, 2))
        if dkv is None:
            kvh = dk.shape[1]
            dkv = dk.new_empty((2, b, keys, kvh, hd))
            dkv[:, :, p.keys:].zero_()
            dkv[0, :, :p.keys].copy_(dk.transpose(1, 2))
            dkv[1, :, :p.keys].copy_(dv.transpose(1, 2))
        else:
            dkv[0, :, :p.keys].add_(dk.transpose(1, 2))
            dkv[1, :, :p.keys].add_(dv.transpose(1, 2))
    return dq_out.transpose(1, 2), dkv

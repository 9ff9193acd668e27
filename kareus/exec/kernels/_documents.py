"""Causal attention over packed documents: each token attends to the earlier tokens of its
own document only (torchtitan's FlexAttention / VarlenAttention ``block_causal``).

A batch of packed documents says where each document starts through its RoPE positions:
a document starts where its position is 0, so a token's document is
``cumsum(positions == 0) - 1`` along its sequence (``-1`` for tokens before the first 0).
[`DocumentMask`][kareus.exec.kernels.DocumentMask] holds those ids for one batch and gives
the attention what it needs, built once per batch on the batch's device and shared by every
layer that attends over it:

* **the block-sparse path** (``"flex"``, the default on a CUDA GPU): PyTorch's
  FlexAttention (``torch.nn.attention.flex_attention``, compiled with ``torch.compile`` on
  a GPU) with a ``BlockMask`` of 128 x 128 tiles. A tile of queries and keys that no pair
  of one document connects (above the diagonal, or whose documents do not meet) is
  skipped; a tile inside one document below the diagonal runs unmasked; only the tiles at
  document boundaries and on the diagonal evaluate the mask. The work is the attention
  that runs, about ``sum_i L_i^2 / 2`` score pairs for documents of ``L_i`` tokens,
  instead of ``seq^2 / 2``. The tiles are classified here from the document ids of each
  tile's first and last token (ids never decrease along a sequence), ``O(batch x
  (seq / 128)^2)`` device work, with no host read.
* **the dense path** (``"mask"``, the CPU's default and the fallback): SDPA with a boolean
  ``[batch, 1, seq, seq]`` mask. Every score is computed and the masked ones dropped; the
  mask itself is ``batch x seq^2`` bytes. The same values (the tests compare the two).

**Why FlexAttention and not the varlen flash op.** Block-causal packing is exactly what
varlen flash attention (``aten._flash_attention_forward`` with ``cu_seqlens``) computes,
and it has a direct backward op, but its inputs are the document boundaries themselves:
``cu_seqlens`` has one entry per document and ``max_seqlen`` is a host integer, both
known only after reading the batch (a device-to-host synchronisation per batch, which a
CUDA graph cannot hold, and a shape that changes per batch, which a captured graph cannot
replay). Padding ``cu_seqlens`` to the largest possible count (one document per token)
keeps the shape but launches a grid over ``batch x seq`` sequences, almost all empty.
Planned layers run inside captures (their own graphs, or the framework's step capture,
replayed for every batch), so they need a mask whose shapes depend on the batch's size
only: a ``BlockMask`` of ``batch x (seq / 128)^2`` tiles, computed on the device from the
positions like any other op, is that. Its kernel's backward runs through autograd (the
``"autograd"`` kind of [`SavedAttention`][kareus.exec.kernels.SavedAttention]), which
captures when the forward is captured on the same stream (an enclosing capture of the
forward and backward, as torchtitan's and ``torch.cuda.graph`` around a step are).

torch is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

from kareus.errors import ArgumentError

__all__ = ["DOCUMENT_BACKENDS", "DocumentMask", "document_attention"]

#: The ways ``document_attention`` runs: ``"flex"`` (block-sparse FlexAttention) or
#: ``"mask"`` (SDPA with the dense boolean mask).
DOCUMENT_BACKENDS = ("flex", "mask")

#: Query and key tile of the block mask (FlexAttention's default sparse block size).
BLOCK_TOKENS = 128


class DocumentMask:
    """The packed documents of one batch, as the attention masks them (see the module).

    Args:
        positions: ``[batch, seq]`` RoPE positions of the batch's tokens (integers); a
            document starts where its position is 0.

    The dense mask and the block mask are built on first use and kept (one batch, every
    layer); [`rows`][kareus.exec.kernels.DocumentMask.rows] gives the mask of some of the
    sequences (a nanobatch), also kept.
    """

    def __init__(self, positions: Any) -> None:
        import torch

        if positions.dim() != 2:
            raise ArgumentError(f"positions must be [batch, seq], got "
                                f"{tuple(positions.shape)}")
        #: ``[batch, seq]`` int32 document ids (``cumsum(positions == 0) - 1``); they never
        #: decrease along a sequence.
        self.doc_ids = torch.cumsum((positions == 0).to(torch.int32), dim=1,
                                    dtype=torch.int32) - 1
        self._rows: dict[tuple[int, int], DocumentMask] = {}
        self._dense: Any = None
        self._blocks: dict[int, Any] = {}

    @classmethod
    def _of_ids(cls, doc_ids: Any) -> DocumentMask:
        m = cls.__new__(cls)
        m.doc_ids, m._rows, m._dense, m._blocks = doc_ids, {}, None, {}
        return m

    @property
    def shape(self) -> tuple[int, int]:
        """``(batch, seq)``."""
        return (int(self.doc_ids.shape[0]), int(self.doc_ids.shape[1]))

    def rows(self, start: int, stop: int) -> DocumentMask:
        """The mask of sequences ``start .. stop - 1`` (kept: built once per batch)."""
        if (start, stop) == (0, self.shape[0]):
            return self
        key = (int(start), int(stop))
        m = self._rows.get(key)
        if m is None:
            m = self._rows[key] = DocumentMask._of_ids(self.doc_ids[start:stop])
        return m

    def dense(self) -> Any:
        """The boolean ``[batch, 1, seq, seq]`` mask (True: attend): same document and
        not later."""
        if self._dense is None:
            import torch

            ids = self.doc_ids
            s = ids.shape[1]
            at = torch.arange(s, device=ids.device)
            causal = at[:, None] >= at[None, :]
            self._dense = ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]
        return self._dense

    def tiles(self, block: int = BLOCK_TOKENS) -> tuple[Any, Any]:
        """``(partial, full)``: boolean ``[batch, seq / block, seq / block]`` (rounded up)
        tiles of queries (rows) by keys (columns). ``full``: every pair of the tile is
        attended (below the diagonal, one document throughout, no padding); ``partial``:
        some pair is, not all (the mask is evaluated there). The rest is skipped."""
        import torch

        ids = self.doc_ids
        b, s = ids.shape
        n = -(-s // block)
        pad = n * block - s
        if pad:  # the padding repeats the last token's document (never attended: bounds)
            ids = torch.cat((ids, ids[:, -1:].expand(b, pad)), dim=1)
        tiles = ids.view(b, n, block)
        lo, hi = tiles[..., 0], tiles[..., -1]  # first and last document of each tile
        i = torch.arange(n, device=ids.device)
        below = i[None, :] <= i[:, None]  # key tile j <= query tile i
        # ids never decrease: key tile j <= i meets query tile i's documents iff its last
        # document is at least the query tile's first
        touch = below & (hi[:, None, :] >= lo[:, :, None])
        # one document over both tiles (j < i: every key precedes every query)
        full = (i[None, :] < i[:, None]) & (lo[:, None, :] == hi[:, :, None])
        if pad:  # the last query tile holds padding: evaluated, never full
            full[:, -1, :] = False
        return touch & ~full, full

    def block_mask(self, block: int = BLOCK_TOKENS) -> Any:
        """The FlexAttention ``BlockMask`` (kept per ``block``): the tiles of
        [`tiles`][kareus.exec.kernels.DocumentMask.tiles] and the mask
        ``q >= k and doc[q] == doc[k]`` for the partial ones; one head row, shared by all
        heads."""
        bm = self._blocks.get(block)
        if bm is not None:
            return bm
        import torch
        from torch.nn.attention.flex_attention import BlockMask

        partial, full = self.tiles(block)
        b, s = self.shape
        n = partial.shape[-1]
        # the document ids padded to whole tiles, so the mask reads in bounds everywhere
        ids = self.doc_ids
        if n * block > s:
            ids = torch.cat((ids, ids[:, -1:].expand(b, n * block - s)), dim=1)

        def ordered(t: Any) -> tuple[Any, Any]:
            # per query tile: how many key tiles, and their indices first (ascending)
            t = t.to(torch.int32)[:, None]
            count = t.sum(dim=-1, dtype=torch.int32)
            order = torch.argsort(t, dim=-1, descending=True, stable=True).to(torch.int32)
            return count.contiguous(), order.contiguous()

        def same_document_causal(bi: Any, h: Any, q: Any, k: Any) -> Any:
            return (q >= k) & (ids[bi, q] == ids[bi, k])

        kv_num, kv_idx = ordered(partial)
        full_num, full_idx = ordered(full)
        bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                      mask_mod=same_document_causal, seq_lengths=(s, s))
        self._blocks[block] = bm
        return bm


_COMPILED_FLEX: Any = None


def _flex(device_type: str) -> Any:
    """FlexAttention: compiled once per process on a GPU (its fused, block-sparse kernel;
    ``dynamic=False``: one kernel per shape, as a training job has few); on the CPU the
    eager operator (the same values, unfused)."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        import torch

        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def document_attention(q: Any, k: Any, v: Any, docs: DocumentMask, *, backend: str,
                       dense: Any) -> Any:
    """Block-causal attention of ``q`` ``[b, heads, s, hd]`` over grouped ``k``, ``v``
    ``[b, kv_heads, s, hd]`` within the documents of ``docs``.

    Args:
        q: Queries.
        k: Keys (``heads`` a multiple of ``kv_heads``).
        v: Values.
        docs: The batch's documents (``b`` sequences of ``s`` tokens).
        backend: ``"flex"`` or ``"mask"`` (``DOCUMENT_BACKENDS``).
        dense: ``(q, k, v, mask) -> output``: SDPA with a boolean mask, as the kernel set
            runs it (the ``"mask"`` path).

    Raises:
        ArgumentError: an unknown backend, or ``docs`` of another batch shape.
    """
    if docs.shape != (int(q.shape[0]), int(q.shape[2])) or k.shape[2] != q.shape[2]:
        raise ArgumentError(f"the document mask is for {docs.shape[0]} x {docs.shape[1]} "
                            f"tokens, the attention's queries {q.shape[0]} x {q.shape[2]} "
                            f"and keys {k.shape[0]} x {k.shape[2]}")
    if backend == "mask":
        return dense(q, k, v, docs.dense())
    if backend != "flex":
        raise ArgumentError(f"document attention backend must be one of {DOCUMENT_BACKENDS}, "
                            f"got {backend!r}")
    flex = _flex(q.device.type)
    return flex(q, k, v, block_mask=docs.block_mask(), enable_gqa=q.shape[1] != k.shape[1])

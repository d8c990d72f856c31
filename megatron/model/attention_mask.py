"""The attention mask as an object: causal, causal within documents, or (for what neither says)
an explicit dense mask; and the SDPA calls each allows.

Packed sequences (``--reset-attention-mask``): a sequence holds several documents, each ending
with an end-of-document token; a token attends causally to the tokens of its own document only.
Megatron-LM builds that as a dense bool ``[b, 1, s, s]`` tensor (``get_ltor_masks_and_position_ids``),
which costs ``s^2`` bytes per sample and takes SDPA off its fused causal path. Here the mask is the
documents themselves: ``document_ids [b, s]`` (a document is a contiguous run of equal ids,
non-decreasing along the sequence), from which :meth:`AttentionMask.documents` gives each row's
``(start, end)`` boundaries and :meth:`AttentionMask.cu_seqlens` the cumulative lengths of the
flattened batch (FlashAttention's varlen layout, Megatron-Core's ``PackedSeqParams``).

:func:`masked_attention` runs

* causal (no mask, or no ``--reset-attention-mask``): one SDPA with ``is_causal=True``;
* documents: one SDPA with ``is_causal=True`` per document of each row, outputs concatenated: no
  ``[s, s]`` tensor exists, and each document's attention is the very computation it would get
  alone. FlexAttention (``torch.nn.attention.flex_attention`` with a document ``BlockMask``)
  would do the same in one kernel, but in torch 2.13 on the CPU it has no backward
  ("FlexAttention does not support backward on CPU"), so training cannot use it there;
* dense: SDPA with ``attn_mask`` (the old path; masks of generation's KV cache, and the
  reference the document path is tested against).

Context parallelism keeps the ids of the whole sequence (:meth:`AttentionMask.for_context_parallel`)
and attends over the split with
:func:`megatron.core.context_parallel.context_parallel_attention` (``document_ids=``).

Shapes: b = micro-batch, s = sequence (the whole sequence, before a context-parallel split),
n = query heads, g = key/value groups, d = head width.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F


@dataclass(frozen=True, eq=False)
class AttentionMask:
    """Which keys each query may attend to.

    Attributes:
        document_ids: None, or int64 ``[b, s]``: causal within documents (contiguous runs of
            equal, non-decreasing ids; the ids of the whole sequence under context parallelism).
        dense: None, or bool ``[b or 1, 1, sq, sk]``, True = masked out (Megatron's convention).
        cp_size, cp_rank: the context-parallel split the local tokens are in (1, 0: none).

    Neither set: plain causal attention.
    """

    document_ids: Optional[torch.Tensor] = None
    dense: Optional[torch.Tensor] = None
    cp_size: int = 1
    cp_rank: int = 0

    def __post_init__(self):
        if self.document_ids is not None and self.dense is not None:
            raise ValueError("an AttentionMask holds document ids or a dense mask, not both")

    @classmethod
    def causal(cls) -> "AttentionMask":
        return cls()

    @classmethod
    def from_document_ids(cls, document_ids: torch.Tensor) -> "AttentionMask":
        """Causal within documents of ``document_ids [b, s]`` (int).

        Raises:
            ValueError: not 2-D, or ids decreasing along a row (documents must be contiguous).
        """
        if document_ids.dim() != 2:
            raise ValueError(f"document ids must be [b, s], got shape {tuple(document_ids.shape)}")
        if bool((document_ids[:, 1:] < document_ids[:, :-1]).any()):
            raise ValueError("document ids must not decrease along a sequence: a document is "
                             "one contiguous run of tokens")
        return cls(document_ids=document_ids.long())

    @classmethod
    def from_eod(cls, tokens: torch.Tensor, eod_token: int) -> "AttentionMask":
        """The documents of ``tokens [b, s]``: a new one starts after every ``eod_token`` (the
        end-of-document token belongs to the document it ends, as in Megatron-LM)."""
        after_eod = torch.zeros_like(tokens, dtype=torch.bool)
        after_eod[:, 1:] = tokens[:, :-1] == eod_token
        return cls(document_ids=torch.cumsum(after_eod.long(), dim=1))

    @classmethod
    def from_dense(cls, mask: torch.Tensor) -> "AttentionMask":
        """An explicit bool ``[b or 1, 1, sq, sk]`` mask (True = masked out)."""
        if mask.dtype != torch.bool or mask.dim() != 4:
            raise ValueError(f"a dense attention mask is bool [b, 1, sq, sk], got {mask.dtype} "
                             f"{tuple(mask.shape)}")
        return cls(dense=mask)

    @property
    def kind(self) -> str:
        """``"causal"``, ``"document"`` or ``"dense"``."""
        if self.dense is not None:
            return "dense"
        return "causal" if self.document_ids is None else "document"

    def documents(self, row: int) -> List[Tuple[int, int]]:
        """``[(start, end), ...]`` of the documents of batch row ``row`` in the whole sequence
        (one host synchronisation)."""
        ids = self.document_ids[row]
        _, counts = torch.unique_consecutive(ids, return_counts=True)
        ends = torch.cumsum(counts, 0).tolist()
        return list(zip([0] + ends[:-1], ends))

    def cu_seqlens(self) -> torch.Tensor:
        """int32 ``[documents + 1]``: cumulative document lengths of the flattened ``[b * s]``
        batch (each row's documents in order, rows one after another)."""
        b, s = self.document_ids.shape
        starts = torch.ones_like(self.document_ids, dtype=torch.bool)
        starts[:, 1:] = self.document_ids[:, 1:] != self.document_ids[:, :-1]
        first = torch.nonzero(starts.reshape(-1)).reshape(-1)
        end = torch.tensor([b * s], device=first.device)
        return torch.cat([first, end]).to(torch.int32)

    def to_dense(self) -> torch.Tensor:
        """The bool ``[b, 1, s, s]`` tensor of Megatron-LM (True = masked out) for document or
        causal masks of known ids; the dense mask itself otherwise. For references and
        benchmarks: it is the ``s^2`` tensor the object exists to avoid.

        Raises:
            ValueError: a causal mask (its length is not known to the object).
        """
        if self.dense is not None:
            return self.dense
        if self.document_ids is None:
            raise ValueError("a causal AttentionMask has no length: build the dense mask from s")
        ids = self.document_ids
        s = ids.shape[1]
        arange = torch.arange(s, device=ids.device)
        above = arange.view(1, s) > arange.view(s, 1)
        return (above.unsqueeze(0) | (ids.unsqueeze(2) != ids.unsqueeze(1))).unsqueeze(1)

    def for_context_parallel(self, cp_size: int, cp_rank: int) -> "AttentionMask":
        """The mask of context-parallel rank ``cp_rank``'s tokens: the document ids of the whole
        sequence are kept (a rank's queries see keys of other ranks' chunks).

        Raises:
            ValueError: a dense mask (it cannot be split; build documents instead).
        """
        if self.dense is not None and cp_size > 1:
            raise ValueError("a dense attention mask cannot be split over "
                             "--context-parallel-size; use AttentionMask.from_document_ids")
        return replace(self, cp_size=cp_size, cp_rank=cp_rank)


def _sdpa(q, k, v, *, attn_mask=None, is_causal=False, dropout_p=0.0):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                          dropout_p=dropout_p, enable_gqa=q.shape[1] != k.shape[1])


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: AttentionMask, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention within each document: one fused causal SDPA per document of each row.

    Args:
        q: ``[b, n, s, d]``; k, v: ``[b, g, s, d]``; ``mask.document_ids [b, s]``.

    Returns:
        ``[b, n, s, d]``; a row of one document is a single causal SDPA.
    """
    rows = []
    for r in range(q.shape[0]):
        docs = mask.documents(r)
        one = slice(r, r + 1)
        parts = [_sdpa(q[one, :, a:e], k[one, :, a:e], v[one, :, a:e], is_causal=True,
                       dropout_p=dropout_p) for a, e in docs]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: Optional[AttentionMask], dropout_p: float = 0.0) -> torch.Tensor:
    """Softmax attention ``[b, n, s, d]`` of ``q [b, n, s, d]``, ``k, v [b, g, sk, d]`` under
    ``mask`` (None: causal), on SDPA's fused causal path unless the mask is dense.

    Raises:
        ValueError: a context-parallel mask (attend with the split attention instead).
    """
    if mask is not None and mask.cp_size > 1:
        raise ValueError("a context-parallel attention mask needs the split attention "
                         "(megatron.core.context_parallel.context_parallel_attention)")
    if mask is None or mask.kind == "causal":
        return _sdpa(q, k, v, is_causal=True, dropout_p=dropout_p)
    if mask.kind == "document":
        return document_attention(q, k, v, mask, dropout_p)
    return _sdpa(q, k, v, attn_mask=~mask.dense, dropout_p=dropout_p)

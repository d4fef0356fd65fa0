"""A model called on rows [B, T] together with where documents start in each row, run as one packed row [1, B * T]
cut at every row and document start (`cu_seqlens`), so that no token sees another document (`train --doc-mask`)."""

from __future__ import annotations

from torch import nn

from hybrid_attention.data.loader import cu_seqlens_of_rows


class PackedRows(nn.Module):
    """`forward(input_ids [B, T], labels=None, *, doc_starts=None, **kw)`: without `doc_starts` the model itself;
    with them (one int array per row, `ShardSet.document_starts`) the rows packed, logits back as [B, T, vocab]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels=None, *, doc_starts=None, **kw):
        if doc_starts is None:
            return self.model(input_ids, labels=labels, **kw)
        B, T = input_ids.shape
        cu_seqlens = cu_seqlens_of_rows(doc_starts, T)  # on the CPU: the model reads it without a device sync
        out = self.model(
            input_ids.reshape(1, B * T),
            labels=None if labels is None else labels.reshape(1, B * T),
            cu_seqlens=cu_seqlens,
            **kw,
        )
        if out.logits is not None:
            out.logits = out.logits.view(B, T, -1)
        return out

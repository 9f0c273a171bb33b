"""Token batches for pretraining, in an order fixed by a seed (the same for every comm config and
on every TP rank: TP ranks all read the same batch).

Every batch is a set of rows of seq_len + 1 tokens: inputs row[:-1], targets row[1:] ([B, T]).

Plain rows (bos_id None): the stream is cut into non-overlapping chunks starting at offset 0
(chunk c covers [c*seq_len, c*seq_len + seq_len]; the input and its shifted target share seq_len
tokens).

BOS rows (bos_id given; `pack_documents`): every row starts with BOS and holds whole pieces of
documents. The stream is split into documents at sep_id (the token file's EOS; separators are
dropped, empty documents skipped); each document is cut into pieces of seq_len tokens, its last
piece shorter (its remainder). A full piece fills a row alone: [BOS, seq_len tokens]. The short
pieces (a document's remainder, or a whole short document) are packed in corpus order, each after
its own BOS, into rows of seq_len + 1 tokens; a piece that does not fit in the room left starts
the next row, and the room is padded (input bos_id, target IGNORE, which the loss skips). So a
piece never straddles two rows, every BOS inside a row is followed by a document's start or by a
seq_len-aligned position of it, and every document token is a target once per epoch. Rows are
ordered by where their first piece starts in the stream.

Epoch e visits the rows in torch.randperm(n_rows, seed + e) order; batches take consecutive
entries of that order, running on into the next epoch, so nothing depends on the batch size but
where the batch boundaries fall.
"""
from __future__ import annotations

import numpy as np
import torch

IGNORE = -100
"""Target of a padding position (F.cross_entropy's default ignore_index)."""


def pack_documents(tokens: torch.Tensor, *, seq_len: int, sep_id: int,
                   bos_id: int) -> torch.Tensor:
    """BOS rows (see the module doc): an int32 [n_rows, seq_len + 1] table, IGNORE at padding."""
    T = seq_len
    t = tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    seps = np.flatnonzero(t == sep_id)
    starts = np.concatenate([[0], seps + 1])           # [n_docs]
    lens = np.concatenate([seps, [t.size]]) - starts  # [n_docs]
    starts, lens = starts[lens > 0], lens[lens > 0]
    n_full = lens // T                                 # full pieces per document
    doc_of = np.repeat(np.arange(starts.size), n_full)
    index_in_doc = np.arange(doc_of.size) - np.repeat(np.cumsum(n_full) - n_full, n_full)
    full_starts = starts[doc_of] + index_in_doc * T    # [n_full_rows]
    full = np.empty((full_starts.size, T + 1), dtype=np.int32)
    full[:, 0] = bos_id
    full[:, 1:] = t[full_starts[:, None] + np.arange(T)]
    rest = lens - n_full * T
    short = [(int(s), int(n)) for s, n in zip(starts + n_full * T, rest) if n > 0]
    rows, first, row, room = [], [], [], T + 1
    for s, n in short:
        if n + 1 > room:                               # does not fit: close the row, pad
            rows.append(row + [IGNORE] * room)
            row, room = [], T + 1
        if not row:
            first.append(s)
        row += [bos_id, *t[s:s + n].tolist()]
        room -= n + 1
    if row:
        rows.append(row + [IGNORE] * room)
    packed = np.array(rows, dtype=np.int32).reshape(-1, T + 1)
    table = np.concatenate([full, packed])
    order = np.argsort(np.concatenate([full_starts, first]), kind="stable")
    return torch.from_numpy(table[order])


def _split(rows: torch.Tensor, bos_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) LongTensors [B, T] of rows [B, T + 1]; padded inputs read bos_id."""
    rows = rows.long()
    x, y = rows[:, :-1], rows[:, 1:]
    if bos_id is not None:
        x = x.masked_fill(x == IGNORE, bos_id)
    return x, y


class TokenBatches:
    """Iterator of (inputs [B, T], targets [B, T]) LongTensors on CPU; BOS rows when bos_id is
    given (documents split at sep_id)."""

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, batch_size: int, seed: int,
                 bos_id: int | None = None, sep_id: int | None = None):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        self.rows = None
        if bos_id is not None:
            if sep_id is None:
                raise ValueError("BOS rows need sep_id, the document separator")
            self.rows = pack_documents(tokens, seq_len=seq_len, sep_id=sep_id, bos_id=bos_id)
            self.n_chunks = self.rows.shape[0]
        else:
            self.n_chunks = (tokens.numel() - 1) // seq_len
        if self.n_chunks < 1:
            raise ValueError(f"{tokens.numel()} tokens do not fill one sequence of {seq_len} + 1; "
                             "lower --seq-len or use more data")
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.bos_id = bos_id
        self.epoch, self._order, self._pos = -1, torch.empty(0, dtype=torch.long), 0

    def _next_chunk(self) -> int:
        if self._pos >= self._order.numel():
            self.epoch += 1
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            self._order, self._pos = torch.randperm(self.n_chunks, generator=g), 0
        c = int(self._order[self._pos])
        self._pos += 1
        return c

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        chunks = [self._next_chunk() for _ in range(self.batch_size)]
        if self.rows is not None:
            return _split(self.rows[chunks], self.bos_id)
        seqs = torch.stack([self.tokens[c * T:c * T + T + 1] for c in chunks])  # [B, T + 1]
        return seqs[:, :-1], seqs[:, 1:]


def eval_batches(tokens: torch.Tensor, *, seq_len: int, batch_size: int, max_batches: int,
                 bos_id: int | None = None, sep_id: int | None = None):
    """The first max_batches batches of consecutive non-overlapping windows (a fixed val set);
    with bos_id, the first BOS rows in stream order (documents split at sep_id)."""
    if bos_id is not None:
        if sep_id is None:
            raise ValueError("BOS rows need sep_id, the document separator")
        seqs = pack_documents(tokens, seq_len=seq_len, sep_id=sep_id, bos_id=bos_id)
        seqs = seqs[:max_batches * batch_size]
        n = seqs.shape[0]
    else:
        n = min((tokens.numel() - 1) // seq_len, max_batches * batch_size)
    if n < 1:
        raise ValueError(f"validation file holds {tokens.numel()} tokens, fewer than one "
                         f"sequence of {seq_len} + 1")
    if bos_id is None:
        seqs = torch.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])
    return [_split(b, bos_id) for b in seqs.split(batch_size)]

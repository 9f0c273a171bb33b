"""Token batches for pretraining, in an order fixed by a seed (the same for every comm config and
on every TP rank: TP ranks all read the same batch).

The stream is cut into non-overlapping chunks of seq_len + 1 tokens starting at offset 0 (chunk c
covers [c*seq_len, c*seq_len + seq_len], the input and its shifted target share seq_len tokens).
Epoch e visits the chunks in torch.randperm(n_chunks, seed + e) order; batches take consecutive
entries of that order, running on into the next epoch, so nothing depends on the batch size but
where the batch boundaries fall.
"""
from __future__ import annotations

import torch


class TokenBatches:
    """Iterator of (inputs [B, T], targets [B, T]) LongTensors on CPU."""

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, batch_size: int, seed: int):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        self.n_chunks = (tokens.numel() - 1) // seq_len
        if self.n_chunks < 1:
            raise ValueError(f"{tokens.numel()} tokens do not fill one sequence of {seq_len} + 1; "
                             "lower --seq-len or use more data")
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
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
        starts = [self._next_chunk() * T for _ in range(self.batch_size)]
        seqs = torch.stack([self.tokens[s:s + T + 1] for s in starts])  # [B, T + 1]
        return seqs[:, :-1], seqs[:, 1:]


def eval_batches(tokens: torch.Tensor, *, seq_len: int, batch_size: int, max_batches: int):
    """The first max_batches batches of consecutive non-overlapping windows (a fixed val set)."""
    n = min((tokens.numel() - 1) // seq_len, max_batches * batch_size)
    if n < 1:
        raise ValueError(f"validation file holds {tokens.numel()} tokens, fewer than one "
                         f"sequence of {seq_len} + 1")
    seqs = torch.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])
    return [(b[:, :-1], b[:, 1:]) for b in seqs.split(batch_size)]

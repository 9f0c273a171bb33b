"""A quantized call's length, carried in-band by the reference transport on CPU tensors (gloo).

Ranks must make the same calls. A call's fixed part (collective, dtype, bits, direction,
device) is agreed once per communicator (echo_tp/agreement.py); its length, the numel that
changes with every prefill length and decode batch size of a server, travels with the data
instead of costing a collective and a host read per new length:

  * the packet collectives of the call (the all-to-all and the all-gather of qar.py and
    sharded.py) send rows padded to a width class (`wire_len`: 8 classes per octave, so at most
    1/8 more bytes, and at least FLOOR bytes) that end in a header: the call's numel in
    HEADER_BYTES bytes. The padding never reaches the decoder (the rows are cut back to their
    packets), so the results are bit for bit those of bare rows;
  * a row wider than any the group has sent in that collective is agreed first (one
    3-integer all-gather: collective, width, numel) and its width remembered (`Widths`: one
    number per collective): gloo aborts the process when a collective's sizes differ
    across ranks, so the ranks settle a new widest row before they send it. A server that has
    met its longest length pays no agreement again;
  * after the collective every rank holds every rank's numel (an all-to-all and an all-gather
    deliver every sender's header), and ranks that differ raise CallLengthMismatch on every
    rank, before anything is returned.

The agreed widths are the same on every rank (each is set by a collective that all ranks
ran), so ranks with the same numel always take the same branch. What stays unchecked by
default: ranks whose numels fall in different width classes, unless both rows are wider than
any agreed (one rank sends while the other agrees, or both send rows of different widths: gloo
aborts the process or times out, and run_ranks names the rank); ECHO_DEBUG_CHECKS=1 agrees on every call before it sends. CUDA tensors (NCCL,
p2p) keep the exact agreement per numel (reading a header there would be a host sync per call),
and so do the plain 16-bit collectives (a wider buffer would change gloo's summation order at
P >= 3, and bits=16 is bit for bit torch's own collective).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FLOOR = 256
"""The narrowest wire row, in bytes."""
HEADER_BYTES = 8
"""A row's header: the call's numel as one int64."""
OPS = ("all_to_all", "all_gather")
"""The packet collectives of the reference transport (their codes in the agreement)."""


class CallLengthMismatch(ValueError):
    """Ranks made a call of different lengths: `numels[r]` is rank r's (the same on every
    rank); the communicator turns it into its message naming the call."""

    def __init__(self, numels: list[int], op: str):
        self.numels, self.op = numels, op
        super().__init__(f"call lengths differ across ranks in the {op}: "
                         + ", ".join(f"rank {r} has {n}" for r, n in enumerate(numels)))


@dataclass
class CallLengths:
    """The length of the call in flight, set by the communicator for the transports it shares
    this object with (None between calls: no in-band header)."""

    numel: int | None = None


class Widths:
    """The widest row the group agreed on, per collective: one number each."""

    def __init__(self):
        self._widest: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._widest)

    def knows(self, op: str, width: int) -> bool:
        return width <= self._widest.get(op, -1)

    def add(self, op: str, width: int) -> None:
        self._widest[op] = max(width, self._widest.get(op, -1))


def wire_len(w: int) -> int:
    """The width class of a row of w bytes: FLOOR, or w rounded up to 4 significant bits."""
    if w <= FLOOR:
        return FLOOR
    k = (w - 1).bit_length() - 4           # w / 2^k in (8, 16]
    return -(-w >> k) << k


def byte_row(buf: torch.Tensor, width: int, numel: int) -> torch.Tensor:
    """uint8 [..., nb] -> [..., width + HEADER_BYTES]: buf, zeros, then numel's header (width
    is a class of wire_len: a multiple of 8, so the header is an aligned int64)."""
    nb = buf.shape[-1]
    out = buf.new_empty(*buf.shape[:-1], width + HEADER_BYTES)
    out[..., :nb] = buf
    out[..., nb:width] = 0
    out[..., width:].view(torch.int64).fill_(numel)
    return out


def byte_numels(rows: torch.Tensor, width: int) -> list[int]:
    """[P, width + HEADER_BYTES] received rows -> each sender's numel."""
    return rows[:, width:].view(torch.int64).reshape(-1).tolist()


def check_numels(numels: list[int], op: str) -> None:
    if any(n != numels[0] for n in numels):
        raise CallLengthMismatch(numels, op)

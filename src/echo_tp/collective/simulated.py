"""P virtual ranks in one process: tensors carry a leading rank dim [P, ...] and the transport is
an index shuffle. Runs the very code of the real ranks (collective/qar.py), so its y and
compensator states are bit-identical to the P-process run; one device studies any P.
"""
from __future__ import annotations

import torch


class SimTransport:
    """Packets of P virtual ranks, batch dim first: [P(rank), ...]."""

    name = "simulated"

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size

    def _diag(self, device):
        return torch.arange(self.world_size, device=device)

    def own(self, t: torch.Tensor) -> torch.Tensor:
        i = self._diag(t.device)
        return t[i, i]

    def replace_own(self, t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        i = self._diag(t.device)
        t = t.clone()
        t[i, i] = v
        return t

    def all_to_all(self, buf: torch.Tensor) -> torch.Tensor:
        # buf [P(sender r), P(owner i), nb] -> out [P(owner i), P(sender r), nb]
        return buf.transpose(0, 1).contiguous()

    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        # buf [P(owner), nb] -> every virtual rank receives all owners: [P, P, nb]
        return buf.unsqueeze(0).expand(self.world_size, *buf.shape)

    def all_max(self, t: torch.Tensor) -> torch.Tensor:
        return t.amax(dim=0, keepdim=True).expand_as(t)

    def all_sum(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        # the plain all-reduce: fp32 sum in rank order, cast back to x's dtype (always a new
        # tensor: inplace is only a permission); one fp32 accumulator, summed in place
        acc = x[0].to(torch.float32, copy=True)
        for r in range(1, self.world_size):
            acc.add_(x[r])
        out = torch.empty_like(x)
        out[0].copy_(acc)
        del acc
        out[1:].copy_(out[0].expand_as(out[1:]))
        return out

    def sum_scatter(self, x: torch.Tensor) -> torch.Tensor:
        # x [P(sender), P*m] -> [P(owner), m]: chunk j of every sender summed in fp32 in rank
        # order (as all_sum), cast back to x's dtype
        P = self.world_size
        chunks = x.reshape(P, P, -1)                   # [sender, owner, m]
        acc = chunks[0].to(torch.float32, copy=True)
        for r in range(1, P):
            acc.add_(chunks[r])
        return acc.to(x.dtype)

    def gather_cat(self, x: torch.Tensor) -> torch.Tensor:
        # x [P(owner), m] -> every virtual rank receives all owners' chunks: [P, P*m]
        return x.reshape(1, -1).expand(self.world_size, -1).clone()

"""torch.distributed transport for the quantized all-reduce: one all-to-all of packets and one
all-gather of owner packets. Works on any backend with those collectives (gloo on CPU, NCCL on
GPUs, also across nodes). This is the reference backend every faster one is compared with.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class DistTransport:
    """Moves packet bytes between the ranks of `group` (tensors carry no virtual-rank batch)."""

    name = "reference"

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "dist.init_process_group first (or use SimulatedCommunicator)")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def own(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.rank]

    def replace_own(self, t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[self.rank] = v
        return t

    def all_to_all(self, buf: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(buf)
        dist.all_to_all_single(out, buf.contiguous(), group=self.group)
        return out

    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        out = torch.empty((self.world_size, *buf.shape), dtype=buf.dtype, device=buf.device)
        dist.all_gather(list(out.unbind(0)), buf.contiguous(), group=self.group)
        return out

    def all_max(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def all_sum(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        y = x if inplace else x.clone()
        dist.all_reduce(y, group=self.group)
        return y

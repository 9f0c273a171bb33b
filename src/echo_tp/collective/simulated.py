"""P virtual ranks in one process: tensors carry a leading rank dim [P, ...] and the transport is
an index shuffle. Runs the very code of the real ranks (collective/qar.py), so its y and
compensator states are bit-identical to the P-process run; one device studies any P.
"""
from __future__ import annotations

import torch

from ..compensator import CompState
from ..kernels.fits import fits
from .backend import Backend


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


class FusedSimBackend(Backend):
    """Simulated calls on a GPU through the fused p2p kernels (kernels/simulated_fused.py: the
    entry, reduce and tail stages of every virtual rank over per-rank buffers, bit-identical to
    the reference: tests/test_p2p_gpu.py), with the tile shape the routing policy picks for a
    real group of this size. The reduce-scatter and all-gather halves likewise (entry, reduce
    without requantization / encode, tail: bit-identical to collective/sharded.py,
    tests/test_sharded_kernels.py), on the layout of the all-reduce of the same P*m values,
    as collective/p2p.P2PBackend runs them on real ranks (there on two workspaces per layout
    and kind, used in turn; here the stages of every virtual rank run one after the other, so
    one is enough).
    Everything else goes to `reference` (a TransportBackend over SimTransport, the same bits):
    CPU tensors, bits=16, telemetry (the kernels leave no StepRecord), and calls the kernels
    do not take (kernels/fits.fits of virtual rank 0's row: for the halves chunks of a whole
    number of quantization groups)."""

    name = "simulated-fused"

    def __init__(self, reference):
        self.reference = reference
        self.world_size = reference.world_size
        self._sims: dict = {}

    def run(self, x: torch.Tensor, cfg, *, state, backward: bool, record: bool,
            inplace: bool = False, route=None):
        if record or not self._fits("all_reduce", x, cfg, state):
            return self.reference.run(x, cfg, state=state, backward=backward, record=record,
                                      inplace=inplace)
        return self._sim(x, cfg)(x, cfg, state=state, backward=backward), None

    def reduce_scatter(self, x, cfg, *, state, backward, route=None):
        """x [P, P*m] -> [P, m] (collective/sharded.py's semantics)."""
        if not self._fits("reduce_scatter", x, cfg, state):
            return self.reference.reduce_scatter(x, cfg, state=state, backward=backward)
        return self._sim(x, cfg).reduce_scatter(x, cfg, state=state, backward=backward)

    def all_gather(self, x, cfg, *, state, backward, route=None):
        """x [P, m] -> [P, P*m] (collective/sharded.py's semantics)."""
        if not self._fits("all_gather", x, cfg, state):
            return self.reference.all_gather(x, cfg, state=state, backward=backward)
        return self._sim(x, cfg, self.world_size * x.shape[1]).all_gather(
            x, cfg, state=state, backward=backward)

    def _fits(self, kind: str, x: torch.Tensor, cfg, state) -> bool:
        """The kernels take this call of x [P, n]: a contiguous CUDA tensor whose rows fit."""
        if not (x.is_cuda and x.dim() == 2 and x.is_contiguous()):
            return False
        row = None if state is None else CompState(state.m1[0], state.m2[0])
        return fits(kind, x[0], cfg, world_size=self.world_size, state=row) is None

    def _sim(self, x: torch.Tensor, cfg, numel: int | None = None):
        """The simulation with the routing's tile shape for a call of numel values per rank
        (default x's row: the all-reduce, the reduce-scatter)."""
        from ..kernels.simulated_fused import SimulatedFused
        from . import routing, tuning
        call = routing.Call.of(numel or x.shape[1], x.element_size(), cfg, self.world_size,
                               on_gpu=True)
        plan = routing.p2p_route(call, tuning.DEFAULT, "simulated", form="staged")
        key = (plan.tile, plan.step, plan.num_warps)
        sim = self._sims.get(key)
        if sim is None:
            sim = self._sims[key] = SimulatedFused(self.world_size, tile_elems=plan.tile,
                                                   step_elems=plan.step,
                                                   num_warps=plan.num_warps)
        return sim

    def close(self) -> None:
        self._sims.clear()


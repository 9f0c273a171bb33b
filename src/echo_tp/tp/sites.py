"""Autograd sites where a TP model talks to its communicator.

Forward sites ("g", after o_proj / down_proj): all_reduce(partial, direction='forward') forward,
identity backward. Backward sites ("f", at the input of q/k/v and of gate/up): identity forward,
all_reduce(input_grad, direction='backward') backward. Both take `bits=policy(site)`.

Numbering. Site 2l is layer l's attention block, 2l+1 its MLP block (STATIC index, used by the
bit policy). The communicator numbers calls within a pass in call order:
    forward pass : call k == static site k                     (0, 1, ..., 2L-1)
    backward pass: call k == static site 2L-1-k                (reverse layer order: layer L-1's
                   MLP input gradient is reduced first, layer 0's attention input gradient last)
Passes: every model forward starts with comm.new_pass('forward') (a pre-hook on the model);
its output goes through `BackwardPassStart`, whose backward runs first in the backward pass and
calls comm.new_pass('backward'). So both directions' compensator state and site counters reset
once per pass, and the two directions never share state.

Simulated (P virtual ranks in one process): `SimCopy` hands each virtual shard its own view of
the block input and all-reduces the P input gradients as [P, ...]; `SimReduce` sums the P partial
outputs given as a [P, ...] stack. The communicator's backward direction applies the power-of-two
gradient scaling itself (SPEC §5).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from echo_tp.models.config import ModelConfig


@dataclass
class TPContext:
    """What every site of one parallelized model shares: the communicator and the bit policy
    (both swappable, tp.set_comm), plus the bookkeeping of how parameters are split."""

    comm: object
    policy: object
    world_size: int
    n_layers: int
    rank: int | None  # None when simulated
    cfg: ModelConfig | None = None
    shards: dict = field(default_factory=dict)
    """real parameter name -> (dim, [indices of rank 0..P-1], full size along dim)."""
    replicas: dict = field(default_factory=dict)
    """real parameter name -> groups of ranks holding identical copies (after grad sync)."""
    partial: set = field(default_factory=set)
    """real parameter names whose per-rank gradient is a partial sum over its replica group."""
    sim_names: dict = field(default_factory=dict)
    """simulated only: (rank, real name) -> name in the simulated model."""

    @property
    def simulated(self) -> bool:
        return self.rank is None

    def bits(self, site: int):
        return self.policy(site)


@dataclass(eq=False)
class Site:
    """One block's pair of sites: forward all-reduce of its output, backward of its input grad."""

    tp: TPContext
    index: int

    def forward_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        # the partial (a row-parallel matmul output) is dead after the sum: outside autograd a
        # plain all-reduce may reuse its storage
        return self.tp.comm.all_reduce(partial, direction="forward", bits=self.tp.bits(self.index),
                                       inplace=not partial.requires_grad)

    def forward_reduce_add_norm(self, partial, residual, weight, eps):
        """A block boundary: (normed, residual + all_reduce(partial)), comm.all_reduce_add_rmsnorm
        at this site's bits (simulated: partial [P, ...], outputs of virtual rank 0)."""
        normed, rout = self.tp.comm.all_reduce_add_rmsnorm(
            partial, residual, weight, eps, direction="forward", bits=self.tp.bits(self.index))
        if self.tp.simulated:
            normed, rout = normed[0].clone(), rout[0].clone()
        return normed, rout

    def backward_reduce(self, grad: torch.Tensor) -> torch.Tensor:
        return self.tp.comm.all_reduce(grad, direction="backward", bits=self.tp.bits(self.index))


class CopyToTP(torch.autograd.Function):
    """f: identity forward; the input gradient is all-reduced (backward site)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, site: Site) -> torch.Tensor:
        ctx.site = site
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.site.backward_reduce(grad.contiguous()), None


class ReduceFromTP(torch.autograd.Function):
    """g: the partial outputs are all-reduced (forward site); identity backward."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, site: Site) -> torch.Tensor:
        return site.forward_reduce(partial)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ReduceAddNorm(torch.autograd.Function):
    """g fused with the block boundary after it: (normed, residual_out) = (RMSNorm(residual +
    all_reduce(partial)) * weight, residual + all_reduce(partial)). Backward: the RMSNorm's and
    the add's (the models' RMSNorm formula, by autograd on residual_out); the all-reduce's is the
    identity, as for ReduceFromTP (simulated: every virtual shard's partial gets it)."""

    @staticmethod
    def forward(ctx, partial, residual, weight, eps: float, site: Site):
        normed, rout = site.forward_reduce_add_norm(partial, residual, weight, eps)
        ctx.save_for_backward(rout, weight)
        ctx.eps, ctx.shape = eps, partial.shape
        return normed, rout

    @staticmethod
    def backward(ctx, dnormed, drout):
        rout, weight = ctx.saved_tensors
        if dnormed is None:
            dnormed = torch.zeros_like(rout, dtype=torch.promote_types(weight.dtype, rout.dtype))
        with torch.enable_grad():
            r = rout.detach().requires_grad_()
            w = weight.detach().requires_grad_(weight.requires_grad)
            rf = r.float()
            normed = w * (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + ctx.eps)).to(r.dtype)
            want = (r, w) if w.requires_grad else (r,)
            grads = torch.autograd.grad(normed, want, dnormed, allow_unused=True)
        dr = grads[0] if drout is None else grads[0] + drout
        dw = grads[1] if w.requires_grad else None
        dpartial = dr if len(ctx.shape) == dr.dim() else dr.unsqueeze(0).expand(ctx.shape)
        return dpartial, dr, dw, None, None


class SimCopy(torch.autograd.Function):
    """Simulated f: x -> P views (one per virtual shard); backward all-reduces the stack of the
    P shards' input gradients [P, ...] and returns the (identical) sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, site: Site):
        ctx.site = site
        return tuple(x.view_as(x) for _ in range(site.tp.world_size))

    @staticmethod
    def backward(ctx, *grads):
        ref = next(g for g in grads if g is not None)
        stacked = torch.stack([torch.zeros_like(ref) if g is None else g for g in grads])
        return ctx.site.backward_reduce(stacked)[0], None


class SimReduce(torch.autograd.Function):
    """Simulated g: [P, ...] stack of the shards' partial outputs -> their sum; the gradient of
    every shard's partial is the output gradient (identity, as on a real rank)."""

    @staticmethod
    def forward(ctx, stacked: torch.Tensor, site: Site) -> torch.Tensor:
        ctx.world_size = stacked.shape[0]
        return site.forward_reduce(stacked)[0].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.unsqueeze(0).expand(ctx.world_size, *grad.shape), None


class BackwardPassStart(torch.autograd.Function):
    """Identity on the model output; its backward, the first node of every backward pass,
    starts a new backward pass on the communicator."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.tp.comm.new_pass("backward")
        return grad, None

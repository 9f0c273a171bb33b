"""Autograd sites where a TP model talks to its communicator.

Forward sites ("g", after o_proj / down_proj): all_reduce(partial, direction='forward') forward,
identity backward. Backward sites ("f", at the input of q/k/v and of gate/up): identity forward,
all_reduce(input_grad, direction='backward') backward. Both take `bits=` the site's width
(tp/policy.py: site_width).

Numbering. Site 2l is layer l's attention block, 2l+1 its MLP block (STATIC index, used by the
bit policy). The communicator numbers calls within a pass in call order:
    forward pass : call k == static site k                     (0, 1, ..., 2L-1)
    backward pass: call k == static site 2L-1-k                (reverse layer order: layer L-1's
                   MLP input gradient is reduced first, layer 0's attention input gradient last)
Passes: every model forward starts with comm.new_pass('forward') (a pre-hook on the model);
its output goes through `BackwardPassStart`, whose backward runs first in the backward pass and
calls comm.new_pass('backward'). So both directions' compensator state and site counters reset
once per pass, and the two directions never share state.

Sequence parallelism (Megatron's SP): between blocks the residual stream is sharded over the
sequence dim (SEQ_DIM), each rank holding its T/P positions. The block's f site becomes
`AllGather` (forward: the shards all-gathered into the block's whole input; backward: its
input gradient reduce-scattered) and its g site `ReduceScatter` (forward: the partial output
reduce-scattered into this rank's shard of the sum; backward: the shard's gradient
all-gathered). Outside the blocks: `ScatterToSequence` after the embedding (forward: keep this
rank's shard of a replicated tensor, no communication; backward: the shards' gradients
all-gathered, since the replicated tensor before it needs the whole gradient) and
`GatherFromSequence` before a replicated head (forward: all-gather; backward: keep this rank's
shard of the replicated gradient). Every one of them goes through the communicator at the
site's bits; the reduce-scatters compensated, the all-gathers not (tp/sequence.py says why).
Simulated, a sequence-sharded tensor is held as the P shards side by side: one [B, T, ...]
tensor whose chunk i along SEQ_DIM is virtual rank i's shard.

Simulated (P virtual ranks in one process): `SimCopy` hands each virtual shard its own view of
the block input and all-reduces the P input gradients as [P, ...]; `SimExpand` does the same for
a batched block (tp/batched.py), whose ranks take the input as one [P, ...] expand; `SimReduce`
sums the P partial outputs given as a [P, ...] stack. The communicator's backward direction
applies the power-of-two gradient scaling itself (SPEC §5).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from echo_tp.compensator import NormOutput
from echo_tp.models.config import ModelConfig
from echo_tp.norm import add_rmsnorm

from .batched import compiled_fn
from .policy import WidthPlan, site_width

SEQ_DIM = 1
"""The sequence dim of the activations between blocks ([B, T, hidden])."""


@dataclass
class TPContext:
    """What every site of one parallelized model shares: the communicator and the width plan
    (both swappable, tp.set_comm), plus the bookkeeping of how parameters are split."""

    comm: object
    widths: WidthPlan
    """The width rules (tp/policy.py), their policy resolved for n_layers."""
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
    sequence_parallel: bool = False
    """The residual stream between blocks is sharded over the sequence (tp/sequence.py)."""
    sequence_partial: set = field(default_factory=set)
    """sequence_parallel: real names of replicated parameters used on the sequence shards
    (norms, row-parallel biases): each rank's gradient covers its positions only."""
    sim_path: str = "shards"
    """Simulated only (swappable): 'shards', each block's P shards one after another (the
    reference), or 'batched', the ranks as a batch dim of every op where the block allows it
    (tp/batched.py)."""
    compile_blocks: bool = False
    """sim_path 'batched': the batched block functions run through torch.compile."""
    compiled_blocks: dict = field(default_factory=dict)
    """compile_blocks: the compiled block functions (tp/batched.py), built on first use."""
    sim_fallbacks: set = field(default_factory=set)
    """sim_path 'batched': the reasons blocks ran shard by shard (each logged once)."""
    param_slots: dict = field(default_factory=dict)
    """rank (None: a real rank) -> where its parameters live (tp.rank_parameters' lookup)."""
    output_norms: dict = field(default_factory=dict)
    """static forward site -> the norm module its sum passes before the residual add
    (post-norm models: hf/plan.output_norms); error feedback there works in the residual
    stream's units (compensator.NormOutput)."""

    @property
    def simulated(self) -> bool:
        return self.rank is None

    def bits(self, site: int, kind: str = "reduce"):
        """The site's width (None: the config's), policy.site_width of the plan."""
        return site_width(self.widths, site, bits=self.comm.config.bits, n_layers=self.n_layers,
                          kind=kind)


@dataclass(eq=False)
class Site:
    """One block's pair of sites: forward all-reduce of its output, backward of its input grad."""

    tp: TPContext
    index: int
    dim: int = SEQ_DIM
    """The sequence dim the SP halves split (tp/styles.py: the layout's Shard dim)."""

    def forward_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        # the partial (a row-parallel matmul output) is dead after the sum: outside autograd a
        # plain all-reduce may reuse its storage
        norm = self.tp.output_norms.get(self.index)
        omap = None if norm is None else NormOutput.from_module(norm, partial.shape[-1])
        return self.tp.comm.all_reduce(partial, direction="forward", bits=self.tp.bits(self.index),
                                       inplace=not partial.requires_grad, output_map=omap)

    def forward_reduce_add_norm(self, partial, residual, weight, eps):
        """A block boundary: (normed, residual + all_reduce(partial)), comm.all_reduce_add_rmsnorm
        at this site's bits (simulated: partial [P, ...], outputs of virtual rank 0)."""
        normed, rout = self.tp.comm.all_reduce_add_rmsnorm(
            partial, residual, weight, eps, direction="forward", bits=self.tp.bits(self.index))
        if self.tp.simulated:
            normed, rout = _row0(normed), _row0(rout)
        return normed, rout

    def backward_reduce(self, grad: torch.Tensor) -> torch.Tensor:
        return self.tp.comm.all_reduce(grad, direction="backward", bits=self.tp.bits(self.index))

    # ----- sequence parallelism: the halves, along `dim` (simulated: the shards side by side)
    @property
    def virtual(self) -> bool:
        """The communicator is simulated: tensors hold every virtual rank."""
        return bool(getattr(self.tp.comm, "simulated", False))

    def reduce_scatter(self, partial: torch.Tensor, direction: str) -> torch.Tensor:
        """Real: partial [B, T, ...] -> this rank's shard of the sum [B, T/P, ...]. Simulated:
        the P partials [P, B, T, ...] -> the P shards side by side [B, T, ...]."""
        y = self.tp.comm.reduce_scatter(partial, dim=self.dim, direction=direction,
                                        bits=self.tp.bits(self.index))
        return torch.cat(y.unbind(0), dim=self.dim) if self.virtual else y

    def all_gather(self, x: torch.Tensor, direction: str) -> torch.Tensor:
        """Real: this rank's shard [B, T/P, ...] -> [B, T, ...]. Simulated: the shards side by
        side [B, T, ...] -> what every rank gathers [B, T, ...] (the same on every rank)."""
        if self.virtual:
            x = torch.stack(self.split(x))
        # uncompensated: the gathered input feeds a block, it is not summed into the stream,
        # so a fed-back error would be added to the next block's input instead of cancelled
        y = self.tp.comm.all_gather(x, dim=self.dim, direction=direction,
                                    bits=self.tp.bits(self.index, "gather"), compensate=False)
        return y[0].clone() if self.virtual else y

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, ...] -> the P shards [B, T/P, ...] along dim (ValueError unless T splits)."""
        P, T = self.tp.world_size, x.shape[self.dim]
        if T % P:
            raise ValueError(f"sequence parallelism splits the sequence over the TP group: "
                             f"length {T} is not divisible by P={P}. Pad the batch to a "
                             f"multiple of {P} positions (decoding one token at a time cannot "
                             "run sequence-parallel: generate with a model parallelized "
                             "without sequence_parallel)")
        return x.chunk(P, dim=self.dim)

    def own_shard(self, x: torch.Tensor) -> torch.Tensor:
        """Real: this rank's shard of a replicated [B, T, ...]; simulated: x itself (the
        shards side by side are the whole tensor)."""
        parts = self.split(x)
        return x.view_as(x) if self.virtual else parts[self.tp.rank].contiguous()


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


def _row0(t: torch.Tensor) -> torch.Tensor:
    """Virtual rank 0's row of [P, ...]: of one tensor expanded over the ranks (boundary.
    over_ranks: stride 0) that tensor itself, else a copy (a view would keep the whole [P, ...]
    alive in the backward's saved tensors)."""
    return t[0] if t.stride(0) == 0 else t[0].clone()


class ReduceAddNorm(torch.autograd.Function):
    """g fused with the block boundary after it: (normed, residual_out) = (RMSNorm(residual +
    all_reduce(partial)) * weight, residual + all_reduce(partial)). Backward: the RMSNorm's and
    the add's (the models' RMSNorm formula, by autograd on residual_out); the all-reduce's is the
    identity, as for ReduceFromTP (simulated: every virtual shard's partial gets it)."""

    @staticmethod
    def forward(ctx, partial, residual, weight, eps: float, site: Site):
        normed, rout = site.forward_reduce_add_norm(partial, residual, weight, eps)
        ctx.save_for_backward(rout, weight)
        ctx.eps, ctx.shape, ctx.tp = eps, partial.shape, site.tp
        return normed, rout

    @staticmethod
    def backward(ctx, dnormed, drout):
        rout, weight = ctx.saved_tensors
        grads = None
        if ctx.tp.compile_blocks and ctx.tp.simulated:    # the compiled batched path
            grads = compiled_fn(ctx.tp.compiled_blocks, add_norm_grads)
        dr, dw = _add_norm_backward(rout, weight, ctx.eps, dnormed, drout, grads)
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


class SimExpand(torch.autograd.Function):
    """Simulated f of a batched block (tp/batched.py): x [B, T, ...] -> [P, B, T, ...], virtual
    rank r's copy at index r (an expand, no copy); backward all-reduces the [P, ...] stack of
    the ranks' input gradients, as SimCopy's, and returns the (identical) sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, site: Site):
        ctx.site = site
        return x.unsqueeze(0).expand(site.tp.world_size, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.site.backward_reduce(grad.contiguous())[0], None


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


class ReduceScatter(torch.autograd.Function):
    """SP g: the partial output reduce-scattered over the sequence (forward site); backward:
    the shard's gradient all-gathered (backward site). Simulated: [P, B, T, ...] partials in,
    the shards side by side [B, T, ...] out, every partial's gradient the gathered one."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, site: Site) -> torch.Tensor:
        ctx.site, ctx.shape = site, partial.shape
        return site.reduce_scatter(partial, "forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = ctx.site.all_gather(grad.contiguous(), "backward")
        return (g.unsqueeze(0).expand(ctx.shape) if ctx.site.virtual else g), None


class AllGather(torch.autograd.Function):
    """SP f: the shards all-gathered into the block input (forward site); backward: the input
    gradient reduce-scattered over the sequence (backward site)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, site: Site) -> torch.Tensor:
        ctx.site = site
        return site.all_gather(x, "forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.site.reduce_scatter(grad.contiguous(), "backward"), None


class SimAllGather(torch.autograd.Function):
    """Simulated SP f: the shards side by side [B, T, ...] -> P views of what every rank
    gathers; backward reduce-scatters the stack of the P shards' input gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, site: Site):
        ctx.site = site
        y = site.all_gather(x, "forward")
        return tuple(y.view_as(y) for _ in range(site.tp.world_size))

    @staticmethod
    def backward(ctx, *grads):
        ref = next(g for g in grads if g is not None)
        stacked = torch.stack([torch.zeros_like(ref) if g is None else g for g in grads])
        return ctx.site.reduce_scatter(stacked, "backward"), None


class ScatterToSequence(torch.autograd.Function):
    """A replicated tensor (the embedding output) -> this rank's sequence shard, no
    communication; backward: the shards' gradients all-gathered (backward site)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, site: Site) -> torch.Tensor:
        ctx.site = site
        return site.own_shard(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.site.all_gather(grad.contiguous(), "backward"), None


class GatherFromSequence(torch.autograd.Function):
    """The sequence shards -> the whole tensor, for a replicated module after it (the head):
    all-gather (forward site); backward: this rank's shard of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, site: Site) -> torch.Tensor:
        ctx.site = site
        return site.all_gather(x, "forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.site.own_shard(grad), None


class AddNorm(torch.autograd.Function):
    """The SP block boundary after the reduce-scatter, on this rank's shard: (normed,
    residual_out) = echo_tp.norm.add_rmsnorm(y, residual, weight, eps) (one kernel pass on
    CUDA); backward as ReduceAddNorm's. Simulated (the shards side by side) the backward runs
    shard by shard, the weight's gradients summed in rank order (tp/sequence.py)."""

    @staticmethod
    def forward(ctx, y, residual, weight, eps: float, site: Site):
        # of two dtypes (autocast: a bf16 reduce-scatter output, an fp32 residual) both are
        # taken in the promoted one, as `residual + y` does (autograd casts the gradients back)
        dtype = torch.promote_types(y.dtype, residual.dtype)
        normed, rout = add_rmsnorm(y.to(dtype), residual.to(dtype), weight, eps)
        ctx.save_for_backward(rout, weight)
        ctx.eps, ctx.site = eps, site
        return normed, rout

    @staticmethod
    def backward(ctx, dnormed, drout):
        rout, weight = ctx.saved_tensors
        if not ctx.site.virtual:
            dr, dw = _add_norm_backward(rout, weight, ctx.eps, dnormed, drout)
            return dr, dr, dw, None, None
        split = ctx.site.split
        parts = [split(t) if t is not None else (None,) * ctx.site.tp.world_size
                 for t in (rout, dnormed, drout)]
        drs, dw = [], None
        for r, dn, dro in zip(*parts):
            dr_r, dw_r = _add_norm_backward(r.contiguous(), weight, ctx.eps,
                                            None if dn is None else dn.contiguous(),
                                            None if dro is None else dro.contiguous())
            drs.append(dr_r)
            dw = dw_r if dw is None else dw + dw_r          # rank order, as the sync sums
        dr = torch.cat(drs, dim=ctx.site.dim)
        return dr, dr, dw, None, None


def add_norm_grads(rout, weight, eps: float, dnormed):
    """The gradients (d residual_out, d weight) of normed = weight * (rf * rsqrt(mean(rf^2) +
    eps)).to(r.dtype), rf = rout.float(), written out: what `_add_norm_backward` gets from
    autograd (`_autograd_norm_grads`), in the same dtypes, within float rounding (sums in another order). One graph for
    torch.compile (the compiled batched path); rout [..., H], weight [H], dnormed rout's shape.
        n = (rf * inv).to(r.dtype);  g = (dnormed * weight) as r.dtype, widened
        d weight = sum over rows of dnormed * n;  d rf = g * inv - rf * inv^3 * mean(g * rf)"""
    rf = rout.float()
    inv = torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)
    n = (rf * inv).to(rout.dtype)
    g = (dnormed * weight).to(rout.dtype).float()
    dw = (dnormed * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
    drf = g * inv - rf * (inv * inv * inv) * (g * rf).mean(-1, keepdim=True)
    return drf.to(rout.dtype), dw


def _autograd_norm_grads(rout, weight, eps: float, dnormed):
    """(d residual_out, d weight or None) of the models' RMSNorm formula, by autograd."""
    with torch.enable_grad():
        r = rout.detach().requires_grad_()
        w = weight.detach().requires_grad_(weight.requires_grad)
        rf = r.float()
        normed = w * (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)).to(r.dtype)
        want = (r, w) if w.requires_grad else (r,)
        grads = torch.autograd.grad(normed, want, dnormed, allow_unused=True)
    return grads[0], (grads[1] if w.requires_grad else None)


def _add_norm_backward(rout, weight, eps, dnormed, drout, grads=None):
    """The gradients of residual_out and of the weight of (RMSNorm(r) * weight, r), r =
    residual_out. grads: the (d r, d weight) function of (rout, weight, eps, dnormed); default
    the formula by autograd (the compiled batched path passes add_norm_grads compiled)."""
    if dnormed is None:
        dnormed = torch.zeros_like(rout, dtype=torch.promote_types(weight.dtype, rout.dtype))
    dr, dw = (grads or _autograd_norm_grads)(rout, weight, eps, dnormed)
    return (dr if drout is None else dr + drout), (dw if weight.requires_grad else None)


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

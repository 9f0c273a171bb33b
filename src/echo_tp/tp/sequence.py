"""Sequence parallelism (Megatron's SP) in the TP engine: `parallelize(..., sequence_parallel=
True)` keeps the residual stream between blocks sharded over the sequence.

    h = embed(tokens)                      [B, T, H], replicated
    h = ScatterToSequence(h)               [B, T/P, H], this rank's positions (no communication)
    per block:  x = norm(h) on the shard; AllGather(x) -> [B, T, H] -> column-parallel linears
                -> row-parallel partial [B, T, H] -> ReduceScatter -> [B, T/P, H] (+ bias)
                h = h + that, on the shard (the boundary: echo_tp.norm.add_rmsnorm)
    normed = final_norm(h) on the shard; GatherFromSequence -> [B, T, H] -> lm_head (replicated)

So each all-reduce of plain TP becomes a reduce-scatter and an all-gather (tp/sites.py), both
through the communicator at the block's bits (forward and backward: the backward of a
reduce-scatter is an all-gather and vice versa). The scatter after the embedding takes site 0's
bits (its backward all-gathers the embedding gradient), the gather before the head the last
site's. T must be divisible by P (ValueError otherwise; one-token decoding cannot run SP).

Error feedback: the reduce-scatters (block outputs forward, block-input gradients backward) are
summed into the residual stream, where a fed-back error cancels the last one (SPEC §4), so they
are compensated; the all-gathers deliver a block's input (forward) or its output gradient
(backward) to the block, where nothing sums them, so a fed-back error would only be added to
the next block's input: they run uncompensated (comm.all_gather(compensate=False)). On the
8-layer planted-outlier tiny-llama of tests/test_tp.py (P=4, seeds 0-3, logits vs 16 bits) the
relative error was 0.38 uncompensated, 0.36 with both halves compensated (echo4) and 0.26 with
the reduce-scatters only; the all-reduce's Echo 4-bit on the same models: 0.06 (quantizing a
block's normalized input costs more than quantizing its output).

Width: the all-gathers run at WidthPlan.gather_bits (8 by default; 0: the site's width), the
reduce-scatters at the site's (tp/policy.py: site_width; why 8: the fidelity testbed's SP record,
docs/results/2026-12-01-sp-testbed.md).

Where the hooks go: our Transformer scatters the embedding output and gathers after the final
norm inside the last layer's boundary; transformers' models (pass_root = the base model)
scatter the first decoder layer's input (after the model built its masks and positions from
the whole sequence) and gather the base model's final `norm` output.

Gradients: a replicated parameter used on the shards (the norms, a row-parallel bias) gets a
gradient over this rank's positions only; these are `TPContext.sequence_partial` and
tp.sync_partial_grads sums them over the group in rank order. Simulated, the shards sit side
by side in one [B, T, H] tensor; such a parameter's modules then run shard by shard
(`sim_shardwise`), with one view of the parameter per virtual rank (`SimReplicas`), whose
gradients are summed in rank order in the backward: bit for bit what the real ranks' sync
gives (so sync_partial_grads leaves them alone when simulated).
"""
from __future__ import annotations

import torch
from torch import nn

from echo_tp.models.transformer import Transformer

from .blocks import block_input
from .sites import AddNorm, GatherFromSequence, ScatterToSequence, Site, TPContext


class SimSplit(torch.autograd.Function):
    """x [B, T, ...] -> the P shards along dim, contiguous; backward: their gradients cat."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, site: Site):
        ctx.dim = site.dim
        return tuple(p.contiguous() for p in site.split(x))

    @staticmethod
    def backward(ctx, *grads):
        return torch.cat(grads, dim=ctx.dim), None


class SimCat(torch.autograd.Function):
    """The P shards -> side by side [B, T, ...]; backward: the gradient's shards, contiguous
    (as a real rank's shard gradient is)."""

    @staticmethod
    def forward(ctx, site: Site, *parts):
        ctx.site = site
        return torch.cat(parts, dim=site.dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, *(g.contiguous() for g in ctx.site.split(grad)))


class SimReplicas(torch.autograd.Function):
    """A parameter -> P views, one per virtual rank; backward: their gradients summed in rank
    order (as sync_partial_grads sums the real ranks')."""

    @staticmethod
    def forward(ctx, p: torch.Tensor, n: int):
        return tuple(p.view_as(p) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        acc = None
        for g in grads:
            if g is not None:
                acc = g if acc is None else acc + g
        return acc, None


def sim_shardwise(site: Site, fn, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """Simulated: fn(shard, *params) run on each virtual rank's shard of x (the shards side by
    side), each with its own view of params -> the outputs side by side."""
    P = site.tp.world_size
    shards = SimSplit.apply(x, site)
    views = [SimReplicas.apply(p, P) for p in params]
    return SimCat.apply(site, *(fn(s, *(v[r] for v in views)) for r, s in enumerate(shards)))


def add_bias(site: Site, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y (sequence shards) + a replicated bias: per virtual rank when simulated."""
    if site.virtual:
        return sim_shardwise(site, torch.add, y, [bias])
    return y + bias


def enable(model: nn.Module, tp: TPContext, pass_root: nn.Module, blocks: list[nn.Module],
           param_names: list[str]) -> None:
    """Put the scatter, the gather and the shard-local boundaries into a parallelized model
    (its TP blocks: `blocks`; its parameters' real names: `param_names`) and record the
    parameters whose gradients become partial (module docstring)."""
    names = {id(m): n for n, m in model.named_modules()}
    last = Site(tp, max(0, 2 * tp.n_layers - 1))
    if isinstance(model, Transformer):
        layers, final_norm = model.model.layers, model.model.norm
        model.model.embed_tokens.register_forward_hook(_scatter_output(Site(tp, 0)))
        for layer in layers:
            layer.boundaries = (_boundary(final_norm, last),) * 2
    else:
        layers = getattr(pass_root, "layers", None)
        final_norm = getattr(pass_root, "norm", None)
        if not isinstance(layers, nn.ModuleList) or not len(layers) \
                or not isinstance(final_norm, nn.Module):
            raise ValueError(f"sequence_parallel needs the decoder layers and the final norm at "
                             f"{type(pass_root).__name__}.layers and .norm (where the sequence "
                             "is scattered and gathered)")
        layers[0].register_forward_pre_hook(_scatter_input(Site(tp, 0)), with_kwargs=True)
        final_norm.register_forward_hook(_gather_output(last))
    block_ids = {id(b) for b in blocks}
    on_shards = [final_norm] + [c for layer in layers for c in layer.children()
                                if id(c) not in block_ids]
    for module in on_shards:
        if not list(module.parameters()):
            continue
        if tp.simulated:
            _run_shardwise(module, Site(tp, 0), names.get(id(module), type(module).__name__))
        else:
            module.register_forward_pre_hook(_one_input_node)
    prefixes = tuple(names[id(m)] + "." for m in (*layers, final_norm))
    for name in param_names:    # replicated, under the layers or the final norm, not yet partial
        if name.startswith(prefixes) and name not in tp.shards and name not in tp.partial:
            tp.sequence_partial.add(name)          # the norms between blocks, row-parallel biases
            tp.replicas[name] = [tuple(range(tp.world_size))]


class InputNode(torch.autograd.Function):
    """Identity. A real rank's shard-local module takes its input through it, so the module's
    gradient contributions to its input (a norm uses it twice) are summed here first and then
    added to the residual's, in the grouping the simulated shard split (SimSplit) gives."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad


def _one_input_node(module, args):
    return (InputNode.apply(args[0]), *args[1:]) if args else None


def _run_shardwise(module: nn.Module, site: Site, name: str) -> None:
    """Simulated: module(x) runs on each virtual rank's shard of x, with per-rank parameter
    views (its own parameters only: the norms between the blocks)."""
    if any("." in n for n, _ in module.named_parameters()):
        raise ValueError(f"sequence_parallel: {name} ({type(module).__name__}) runs on the "
                         "sequence shards outside the attention/MLP blocks and holds nested "
                         "parameters; only norm-like modules (own parameters) can")
    forward = module.forward
    pnames = [n for n, _ in module.named_parameters(recurse=False)]

    def per_shard(x, *params):
        saved = {n: module._parameters[n] for n in pnames}
        try:
            module._parameters.update(zip(pnames, params))   # this rank's views
            return forward(x)
        finally:
            module._parameters.update(saved)

    def shardwise(x, *args, **kwargs):
        if args or kwargs:
            raise ValueError(f"sequence_parallel: {name} takes one input on the shards")
        return sim_shardwise(site, per_shard, x, [module._parameters[n] for n in pnames])
    module.forward = shardwise


def _scatter_output(site: Site):
    def hook(module, args, out):
        return ScatterToSequence.apply(out, site)
    return hook


def _scatter_input(site: Site):
    def hook(module, args, kwargs):
        x, put = block_input(args, kwargs)
        return put(ScatterToSequence.apply(x, site))
    return hook


def _gather_output(site: Site):
    def hook(module, args, out):
        return GatherFromSequence.apply(out, site)
    return hook


def _boundary(final_norm: nn.Module, last: Site):
    """(norm, residual, y) -> (norm(residual + y), residual + y) on the shards (y: the block's
    reduce-scattered output); after the final norm, its output all-gathered for the head."""
    def boundary(norm, residual: torch.Tensor, y: torch.Tensor):
        normed, h = AddNorm.apply(y, residual, norm.weight, norm.eps, last)   # any site: dim, P
        if norm is final_norm:
            normed = GatherFromSequence.apply(normed, last)
        return normed, h
    return boundary

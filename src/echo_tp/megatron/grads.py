"""Training a megatron-core model without megatron-core's DistributedDataParallel (a torch
optimizer, e.g. on the CPU, where megatron-core's DDP and optimizers do not run).

Some replicated parameters get rank-partial gradients over the TP group: under sequence
parallelism those used on this rank's sequence shard only (the norms, row-parallel biases;
marked `sequence_parallel`), and with qk_layernorm the query/key norms (used on this rank's
heads only). megatron-core's finalize_model_grads sums them over the TP group, but needs its
DDP wrapper; `sync_tp_partial_grads` applies the same rule to a plain module. It is an exact
all-reduce of parameter gradients, not an activation collective: Echo does not touch it.
`clip_grad_norm_` clips by the whole model's gradient norm, each split parameter's shards
counted on their ranks and each replicated one once (megatron-core's
param_is_not_tensor_parallel_duplicate), so every rank scales by the same factor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def partial_grad_params(model, config) -> list[torch.nn.Parameter]:
    """The parameters whose gradients are rank-partial sums (megatron-core's rule)."""
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        sp = config.sequence_parallel and getattr(p, "sequence_parallel", False)
        qk = config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
        if sp or qk:
            out.append(p)
    return out


@torch.no_grad()
def sync_tp_partial_grads(model, group: dist.ProcessGroup) -> None:
    """Sum the rank-partial gradients (partial_grad_params) over the TP group, in place (one
    all-reduce of all of them). Call once per optimizer step, after the backward passes."""
    if dist.get_world_size(group) == 1:
        return
    params = [p for p in partial_grad_params(model, model.config) if p.grad is not None]
    if not params:
        return
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


@torch.no_grad()
def clip_grad_norm_(model, max_norm: float, group: dist.ProcessGroup) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), norm the 2-norm of the whole
    model's gradient over the TP group (after sync_tp_partial_grads); return the norm."""
    grads = [p.grad for p in model.parameters()
             if p.grad is not None and param_is_not_tensor_parallel_duplicate(p, group)]
    if not grads:
        return torch.zeros(())
    sq = torch.stack([g.detach().float().square().sum() for g in grads]).sum()
    dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None],
                        coef.to(grads[0].dtype))
    return norm

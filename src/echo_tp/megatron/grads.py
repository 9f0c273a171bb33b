"""Training a megatron-core model without megatron-core's DistributedDataParallel (a torch
optimizer, e.g. on the CPU, where megatron-core's DDP and optimizers do not run).

Some replicated parameters get rank-partial gradients over the TP group: under sequence
parallelism those used on this rank's sequence shard only (the norms, row-parallel biases;
marked `sequence_parallel`), and with qk_layernorm the query/key norms (used on this rank's
heads only). megatron-core's finalize_model_grads sums them over the TP group, but needs its
DDP wrapper; `sync_tp_partial_grads` applies the same rule to a plain module. It is an exact
all-reduce of parameter gradients, not an activation collective: Echo does not touch it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
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

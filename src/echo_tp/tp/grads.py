"""What training needs beyond the sites: partial gradients, the global grad norm, whole weights.

- `sync_partial_grads(model)`: parameters kept whole on several ranks but used on each rank's own
  heads only (Qwen3 q_norm/k_norm; k/v rows of replicated kv heads), or under sequence
  parallelism on its own positions only (norms, row-parallel biases), get rank-partial gradients.
  They are summed over their replica group IN RANK ORDER (an all-gather on real ranks, a loop in
  simulation), so the result is bit-identical between the two and identical on every replica.
  Call it once after the backward passes of a step (it is linear, so once per accumulated step).
- `grad_norm(model)` / `clip_grad_norm_(model, max_norm)`: the 2-norm of the WHOLE model's
  gradient. Split parameters contribute every rank's slice; a parameter held by a group of ranks
  (replicated or a replicated kv head) is counted once, by the group's lowest rank.
- `full_state_dict(model)` / `unshard(model)`: gather the shards into the single-device names and
  shapes (a collective on real ranks: every rank must call it), e.g. for save_hf_checkpoint.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from echo_tp.models.hf import build_meta_model
from echo_tp.models.transformer import Transformer

from .parallelize import _context, rank_parameters


def _group_of(groups, rank: int) -> tuple[int, ...]:
    return next(g for g in groups if rank in g)


def _ranks(tp) -> list[int]:
    return list(range(tp.world_size)) if tp.simulated else [tp.rank]


def _grad(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


@torch.no_grad()
def sync_partial_grads(model: nn.Module) -> None:
    """Sum rank-partial gradients over their replica groups (see the module docstring)."""
    tp = _context(model)
    # sequence-parallel partials: simulated, their backward summed them already (tp/sequence.py)
    names = sorted(tp.partial if tp.simulated else tp.partial | tp.sequence_partial)
    if not names:
        return
    if tp.simulated:
        params = {r: rank_parameters(model, r) for r in range(tp.world_size)}
        sums = {}
        for name in names:
            for group in tp.replicas[name]:
                acc = _grad(params[group[0]][name])
                for r in group[1:]:
                    acc = acc + _grad(params[r][name])
                for r in group:
                    sums[(r, name)] = acc
        for (r, name), acc in sums.items():
            _set_grad(params[r][name], acc)
        return
    params = rank_parameters(model)
    flat = torch.cat([_grad(params[n]).reshape(-1) for n in names])
    parts = [torch.empty_like(flat) for _ in range(tp.world_size)]
    dist.all_gather(parts, flat, group=tp.comm.group)
    offset = 0
    for name in names:
        p = params[name]
        n = p.numel()
        group = _group_of(tp.replicas[name], tp.rank)
        acc = parts[group[0]][offset:offset + n]
        for r in group[1:]:
            acc = acc + parts[r][offset:offset + n]
        _set_grad(p, acc.view_as(p))
        offset += n


def _set_grad(p: nn.Parameter, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g.clone()
    else:
        p.grad.copy_(g)


@torch.no_grad()
def grad_norm(model: nn.Module) -> torch.Tensor:
    """2-norm of the whole model's gradient (fp32 scalar, equal on every rank)."""
    tp = _context(model)
    device = next(model.parameters()).device
    seen: set[int] = set()
    per_rank = []  # this rank's sum of squares (every virtual rank's, simulated)
    for r in _ranks(tp):
        grads = []
        for name, p in rank_parameters(model, r if tp.simulated else None).items():
            if id(p) in seen or p.grad is None:  # tied weights once
                continue
            seen.add(id(p))
            if _group_of(tp.replicas[name], r)[0] == r:
                grads.append(p.grad.detach())
        # one foreach launch per rank, not three small ones per parameter
        per_rank.append(torch.stack(torch._foreach_norm(grads)).float().square().sum()
                        if grads else torch.zeros((), device=device))
    total = per_rank[0]
    for t in per_rank[1:]:  # rank order, as an all-reduce of two ranks adds
        total = total + t
    if not tp.simulated:
        dist.all_reduce(total, group=tp.comm.group)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale every local gradient by min(1, max_norm / (norm + 1e-6)); return the norm before."""
    norm = grad_norm(model)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    tp = _context(model)
    params = {id(p): p for r in _ranks(tp)       # every parameter once (the cached lookup)
              for p in rank_parameters(model, r if tp.simulated else None).values()}
    grads = [p.grad for p in params.values() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole tensors under single-device names (collective on real ranks; returned everywhere)."""
    tp = _context(model)
    own = rank_parameters(model, 0 if tp.simulated else None)
    per_rank = ({r: rank_parameters(model, r) for r in range(tp.world_size)}
                if tp.simulated else None)
    out = {}
    for name, p in own.items():
        if name not in tp.shards:
            out[name] = p.detach()
            continue
        dim, idx, full = tp.shards[name]
        if tp.simulated:
            parts = [per_rank[r][name].detach() for r in range(tp.world_size)]
        else:
            parts = [torch.empty_like(p) for _ in range(tp.world_size)]
            dist.all_gather(parts, p.detach().contiguous(), group=tp.comm.group)
        shape = list(p.shape)
        shape[dim] = full
        whole = p.new_empty(shape)
        for r, part in enumerate(parts):
            whole.index_copy_(dim, idx[r].to(p.device), part)
        out[name] = whole
    return out


def unshard(model: nn.Module, device: str | torch.device = "cpu") -> Transformer:
    """A whole single-device Transformer (a copy on device) of a parallelized model."""
    state = {k: v.to(device) for k, v in full_state_dict(model).items()}
    whole = build_meta_model(_context(model).cfg)
    whole.load_state_dict(state, strict=True, assign=True)
    whole.tie_weights()
    return whole

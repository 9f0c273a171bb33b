"""Apply tensor parallelism to a single-device `Transformer` after the fact, from TP_PLAN.

    model = parallelize(model, EchoCommunicator.from_group(group, cfg))      # a real rank
    model = parallelize(model, SimulatedCommunicator(P, cfg))                # P virtual ranks

Real rank r: q/k/v/gate/up keep their output rows (nn.Linear with a smaller weight), o_proj and
down_proj become `RowwiseLinear` (input columns; partial output through a forward site, bias
after it), each block (self_attn, mlp) gets a forward pre-hook that routes its input through a
backward site. Parameter names are unchanged, only shapes shrink.

Simulated: each block is replaced by a `SimTPBlock` holding P copies of the block, each sharded
exactly as rank i would shard it. The block input is computed once (it is identical on every
rank); every shard runs the very modules and F.linear shapes of its real rank, one after the
other, so each partial is bit-identical to that rank's, and the [P, ...] stack of partials goes
through SimulatedCommunicator.all_reduce. Logits and gradients then match the P-process run bit
for bit at bits 4 and 8 (at 16 bits the simulated sum is fp32 in rank order; gloo/NCCL may sum in
another order). Shard i's parameters are named `<block>.shards.<i>.<name>`; tp.rank_parameters
maps them back to the real names.
"""
from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from echo_tp.models.transformer import LayerKVCache, Transformer

from .plan import (TP_PLAN, BlockInput, Colwise, PartialGradReplicate, Rowwise, match_plan,
                   replica_groups, site_index, unit_rows)
from .policy import make_policy
from .sites import (BackwardPassStart, CopyToTP, ReduceFromTP, SimCopy, SimReduce, Site,
                    TPContext)


class RowwiseLinear(nn.Module):
    """Row-parallel linear: y = all_reduce(x @ W_r^T) + b. Without a site (a simulated shard)
    it returns the partial x @ W_r^T and the caller sums and adds the bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, site: Site | None):
        super().__init__()
        self.weight = nn.Parameter(weight)  # [out, in / P]
        self.bias = None if bias is None else nn.Parameter(bias)
        self.site = site
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # [..., out], this rank's share of the sum
        if self.site is None:
            return partial
        y = ReduceFromTP.apply(partial, self.site)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (sharded), out_features={self.out_features}"


_NO_CACHE_ARG = object()


class SimTPBlock(nn.Module):
    """P virtual shards of one block (attention or MLP): f site, shards one by one, g site."""

    def __init__(self, shards: list[nn.Module], site: Site, bias: nn.Parameter | None):
        super().__init__()
        self.shards = nn.ModuleList(shards)
        self.site = site
        self.bias = bias  # the row-parallel layer's bias, added once after the sum
        self._caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def forward(self, x: torch.Tensor, *args, cache=_NO_CACHE_ARG, **kwargs):
        """x [B, T, dim] (same on every virtual rank) -> the block output [B, T, dim]."""
        xs = SimCopy.apply(x, self.site)
        partials = []  # P x [B, T, dim]
        for r, (shard, xr) in enumerate(zip(self.shards, xs)):
            if cache is not _NO_CACHE_ARG:  # attention: each shard caches its own kv heads
                kwargs["cache"] = None if cache is None else self._sub_caches(cache)[r]
            partials.append(shard(xr, *args, **kwargs))
        y = SimReduce.apply(torch.stack(partials), self.site)
        return y if self.bias is None else y + self.bias

    def _sub_caches(self, cache: LayerKVCache) -> list[LayerKVCache]:
        subs = self._caches.get(cache)
        if subs is None:
            subs = [LayerKVCache(cache.batch_size, cache.max_len) for _ in self.shards]
            self._caches[cache] = subs
        return subs


def parallelize(model: Transformer, comm, rank: int | None = None, *, policy=None,
                plan: dict | None = None) -> Transformer:
    """Shard `model` in place for `rank` of comm's group (or for all P virtual ranks when comm is
    a SimulatedCommunicator) and route its TP sites through comm with bits=policy(site).

    policy: None (the config's bits), a preset name ('uniform4', 'uniform8', '16', 'early8'),
    a {site: bits} table, a per-site list or a callable (tp.policy.make_policy)."""
    if getattr(model, "echo_tp", None) is not None:
        raise ValueError("model is already parallelized; build a fresh one")
    plan = TP_PLAN if plan is None else plan
    cfg = model.cfg
    P = comm.world_size
    simulated = bool(getattr(comm, "simulated", False))
    if not simulated:
        if rank is None:
            import torch.distributed as dist
            rank = dist.get_rank(comm.group)
        if not 0 <= rank < P:
            raise ValueError(f"rank {rank} is outside the TP group of {P}")
    tp = TPContext(comm=comm, policy=make_policy(policy, cfg.n_layers), world_size=P,
                   n_layers=cfg.n_layers, rank=None if simulated else rank, cfg=cfg)
    blocks = [(n, m, s) for n, m in model.named_modules()
              if isinstance(s := match_plan(plan, n), BlockInput)]
    if simulated:
        for name, block, style in blocks:
            _set_submodule(model, name, _sim_block(tp, plan, name, block, style))
    else:
        for name, module in list(model.named_modules()):
            _shard(tp, plan, name, module, rank, model)
        for name, block, style in blocks:
            site = Site(tp, site_index(name, style.slot))
            block.register_forward_pre_hook(_copy_hook(site))
            for child in block.modules():
                if isinstance(child, RowwiseLinear):
                    child.site = site
        orphans = [n for n, m in model.named_modules() if isinstance(m, RowwiseLinear)
                   and m.site is None]
        if orphans:
            raise ValueError(f"row-parallel modules outside any BlockInput entry of the plan: "
                             f"{orphans}; their partial outputs would never be summed")
    _record_replicas(tp, model)
    model.echo_tp = tp
    model.register_forward_pre_hook(_forward_pass_hook(tp))
    model.register_forward_hook(_backward_pass_hook(tp))
    return model


def set_comm(model: Transformer, comm, *, policy=None) -> None:
    """Point a parallelized model at another communicator / bit policy (same group size)."""
    tp = _context(model)
    if comm.world_size != tp.world_size or bool(getattr(comm, "simulated", False)) != tp.simulated:
        raise ValueError(f"model was parallelized for {tp.world_size} "
                         f"{'virtual' if tp.simulated else 'real'} ranks; got a communicator of "
                         f"{comm.world_size} ({'simulated' if comm.simulated else 'real'})")
    tp.comm = comm
    tp.policy = make_policy(policy, tp.n_layers)


def _context(model) -> TPContext:
    tp = getattr(model, "echo_tp", None)
    if tp is None:
        raise ValueError("model is not parallelized: call echo_tp.tp.parallelize first")
    return tp


def _copy_hook(site: Site):
    def hook(module, args):
        return (CopyToTP.apply(args[0], site), *args[1:])
    return hook


def _forward_pass_hook(tp: TPContext):
    def hook(module, args):
        tp.comm.new_pass("forward")
    return hook


def _backward_pass_hook(tp: TPContext):
    def hook(module, args, out):
        if torch.is_grad_enabled() and out.requires_grad:
            return BackwardPassStart.apply(out, tp)
        return None
    return hook


def _sim_block(tp: TPContext, plan, name: str, block: nn.Module, style: BlockInput) -> SimTPBlock:
    site = Site(tp, site_index(name, style.slot))
    shards, bias = [], None
    for r in range(tp.world_size):
        shard = copy.deepcopy(block)
        for child_name, child in list(shard.named_modules()):
            full = f"{name}.{child_name}" if child_name else name
            b = _shard(tp, plan, full, child, r, shard, local_name=child_name)
            if b is not None and r == 0:
                bias = b
        shards.append(shard)
    for r in range(tp.world_size):
        for pname, _ in shards[r].named_parameters(remove_duplicate=False):
            tp.sim_names[(r, f"{name}.{pname}")] = f"{name}.shards.{r}.{pname}"
    if bias is not None:
        for r in range(tp.world_size):
            tp.sim_names[(r, bias[0])] = f"{name}.bias"
        bias = bias[1]
    return SimTPBlock(shards, site, bias)


def _shard(tp: TPContext, plan, name: str, module: nn.Module, rank: int, root: nn.Module, *,
           local_name: str | None = None):
    """Shard one module in place for `rank` (root contains it at `local_name`, default `name`).
    Returns (real bias name, bias Parameter) when a simulated row-parallel bias moves out."""
    style = match_plan(plan, name)
    local_name = name if local_name is None else local_name
    cfg, P = tp.cfg, tp.world_size
    if isinstance(style, Colwise):
        idx = unit_rows(cfg, style.unit, module.out_features, P, rank).to(module.weight.device)
        _record_shard(tp, f"{name}.weight", 0, style.unit, module.out_features)
        module.weight = nn.Parameter(module.weight.detach().index_select(0, idx))
        if module.bias is not None:
            _record_shard(tp, f"{name}.bias", 0, style.unit, module.out_features)
            module.bias = nn.Parameter(module.bias.detach().index_select(0, idx))
        module.out_features = idx.numel()
    elif isinstance(style, Rowwise):
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{name}: a row-parallel module must be an nn.Linear")
        idx = unit_rows(cfg, style.unit, module.in_features, P, rank).to(module.weight.device)
        _record_shard(tp, f"{name}.weight", 1, style.unit, module.in_features)
        weight = module.weight.detach().index_select(1, idx)
        bias = None if module.bias is None else module.bias.detach()
        moved = None
        if tp.simulated and bias is not None:
            moved = (f"{name}.bias", nn.Parameter(bias))  # summed once, after the shards
            bias = None
        _set_submodule(root, local_name, RowwiseLinear(weight, bias, site=None))
        return moved
    elif isinstance(style, PartialGradReplicate):
        for pname, _ in module.named_parameters():
            tp.partial.add(f"{name}.{pname}")
            tp.replicas[f"{name}.{pname}"] = [tuple(range(P))]
    elif style is not None and not isinstance(style, BlockInput):
        raise ValueError(f"unknown TP style {style!r} for {name}")
    return None


def _record_shard(tp: TPContext, pname: str, dim: int, unit: str, full: int) -> None:
    if pname in tp.shards:
        return
    idx = [unit_rows(tp.cfg, unit, full, tp.world_size, r) for r in range(tp.world_size)]
    tp.shards[pname] = (dim, idx, full)
    groups = replica_groups(tp.cfg, unit, tp.world_size)
    tp.replicas[pname] = groups
    if any(len(g) > 1 for g in groups):
        tp.partial.add(pname)  # replicated kv heads: each rank's grad covers its q heads only


def _record_replicas(tp: TPContext, model: nn.Module) -> None:
    """Every parameter the plan did not split is whole and identical on every rank."""
    for name in rank_parameters(model, 0 if tp.simulated else None, tp):
        tp.replicas.setdefault(name, [tuple(range(tp.world_size))])


def _set_submodule(root: nn.Module, dotted: str, new: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


def rank_parameters(model: nn.Module, rank: int | None = None,
                    tp: TPContext | None = None) -> dict[str, nn.Parameter]:
    """Rank's parameters under their real (single-rank) names, tied names included.
    Real model: its own parameters (rank must be None or its rank). Simulated: virtual rank's."""
    tp = tp if tp is not None else _context(model)
    named = dict(model.named_parameters(remove_duplicate=False))
    if not tp.simulated:
        if rank not in (None, tp.rank):
            raise ValueError(f"this process holds rank {tp.rank}, not {rank}")
        return named
    if rank is None or not 0 <= rank < tp.world_size:
        raise ValueError(f"name a virtual rank in [0, {tp.world_size})")
    sim_to_real = {sim: real for (r, real), sim in tp.sim_names.items() if r == rank}
    out = {}
    for name, p in named.items():
        if ".shards." in name:
            if name in sim_to_real:
                out[sim_to_real[name]] = p
        elif name in sim_to_real:
            out[sim_to_real[name]] = p  # a moved row-parallel bias
        else:
            out[name] = p
    return out

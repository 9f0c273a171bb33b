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
another order), on the CPU at equal intra-op thread counts: a simulated model's forward and
backward run at ECHO_RANK_THREADS (echo_tp.threads), the count run_ranks gives each rank.
Shard i's parameters are named `<block>.shards.<i>.<name>`; tp.rank_parameters maps them back
to the real names. sim_path='batched' runs the project's attention and MLP
blocks with the P ranks as a batch dim of each op instead (tp/batched.py: the same parameters,
sites and communicator calls; bit for bit on the CPU, within float tolerance on GPUs).

sequence_parallel=True (tp/sequence.py): between blocks the residual stream is sharded over
the sequence; each block input is all-gathered and each row-parallel output reduce-scattered
through the communicator (the boundaries are then a local add + RMSNorm, not fused with a
collective).

Models built elsewhere (transformers' own modules, echo_tp.hf) go through the same function with
their plan, a `HeadLayout`, their layer count and the module whose forward is one pass
(`pass_root`). Block inputs may come positionally or as `hidden_states=`; a block may return a
tuple (its output first: transformers attention returns (output, weights)). A block whose partial
output comes from `SplitParams` modules (fused MoE experts) is all-reduced at its output, once.
"""
from __future__ import annotations

import copy
import logging
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from echo_tp.models.transformer import LayerKVCache, Transformer
from echo_tp.threads import at_rank_threads

from . import batched, sequence
from .agree import check_same_widths
from .blocks import block_input as _block_input
from .blocks import join_heads as _join_heads
from .blocks import set_local_heads as _set_local_heads
from .plan import (TP_PLAN, BlockInput, Colwise, PartialGradReplicate, Rowwise, SplitParams,
                   match_plan, replica_groups, site_index, unit_rows)
from .policy import WidthPlan
from .sites import (AllGather, BackwardPassStart, CopyToTP, ReduceAddNorm, ReduceFromTP,
                    ReduceScatter, SimAllGather, SimCopy, SimExpand, SimReduce, Site, TPContext)

log = logging.getLogger(__name__)

SIM_PATHS = ("shards", "batched")
"""How a simulated model runs its blocks: shard by shard (the reference) or batched over the
virtual ranks (tp/batched.py)."""


class RowwiseLinear(nn.Module):
    """Row-parallel linear: y = all_reduce(x @ W_r^T) + b. Without a site (a simulated shard)
    it returns the partial x @ W_r^T and the caller sums and adds the bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, site: Site | None):
        super().__init__()
        self.weight = nn.Parameter(weight)  # [out, in / P]
        self.bias = None if bias is None else nn.Parameter(bias)
        self.site = site
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.partial_out = False
        """True: the layer's boundary sums the partial (fused with its add and RMSNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # [..., out], this rank's share of the sum
        if self.site is None or self.partial_out:
            return partial
        if self.site.tp.sequence_parallel:     # [B, T/P, out]: this rank's shard of the sum
            y = ReduceScatter.apply(partial, self.site)
        else:
            y = ReduceFromTP.apply(partial, self.site)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (sharded), out_features={self.out_features}"


class SimTPBlock(nn.Module):
    """P virtual shards of one block (attention or MLP): f site, shards one by one, g site; or,
    under TPContext.sim_path 'batched' and where tp/batched.py takes the block, every shard's
    ops at once over a leading rank dim (the same sites, the same [P, ...] stacks).

    split_cache(cache, n_shards, shard) -> n_shards caches, one per shard: each shard keeps its
    own kv heads (default: the project's LayerKVCache)."""

    def __init__(self, shards: list[nn.Module], site: Site, bias: nn.Parameter | None,
                 split_cache=None):
        super().__init__()
        self.shards = nn.ModuleList(shards)
        self.site = site
        self.bias = bias  # the row-parallel layer's bias, added once after the sum
        self.split_cache = _split_layer_cache if split_cache is None else split_cache
        self._caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.partial_out = False
        """True: return the [P, ...] stack of partials (first of the tuple when the block
        returns one); the layer's boundary sums it."""
        self.kind = batched.block_kind(shards[0])
        """'attention' / 'mlp' where the batched path can run the block (tp/batched.py)."""

    def forward(self, *args, **kwargs):
        """x [B, T, dim] (same on every virtual rank; first positional or `hidden_states=`)
        -> the block output [B, T, dim] (or the block's tuple with its output first)."""
        tp = self.site.tp
        if tp.sim_path == "batched":
            why = batched.unfit(self.kind, args, kwargs, tp.sequence_parallel)
            if why is None:
                return self._batched(args)
            if why not in tp.sim_fallbacks:
                tp.sim_fallbacks.add(why)
                log.info("echo-tp: sim_path='batched': blocks run shard by shard for %s", why)
        x, put = _block_input(args, kwargs)
        sp = self.site.tp.sequence_parallel   # x: the P sequence shards side by side
        xs = (SimAllGather if sp else SimCopy).apply(x, self.site)
        cache_key = next((k for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
        subs = None if cache_key is None else self._sub_caches(kwargs[cache_key])
        outs = []  # P block outputs (tensors or tuples)
        for r, (shard, xr) in enumerate(zip(self.shards, xs)):
            a, kw = put(xr)
            if subs is not None:  # attention: each shard caches its own kv heads
                kw[cache_key] = subs[r]
            outs.append(shard(*a, **kw))
        tup = isinstance(outs[0], tuple)
        partials = [o[0] if tup else o for o in outs]  # P x [B, T, dim]
        if self.partial_out:
            if not tup:
                return torch.stack(partials)
            return (torch.stack(partials), *(_join_heads([o[i] for o in outs])
                                             for i in range(1, len(outs[0]))))
        if sp:                                # the P shards of the sum, side by side
            y = ReduceScatter.apply(torch.stack(partials), self.site)
            y = y if self.bias is None else sequence.add_bias(self.site, y, self.bias)
        else:
            y = SimReduce.apply(torch.stack(partials), self.site)
            y = y if self.bias is None else y + self.bias
        if not tup:
            return y
        return (y, *(_join_heads([o[i] for o in outs]) for i in range(1, len(outs[0]))))

    def _batched(self, args: tuple) -> torch.Tensor:
        """The batched path: args[0] x [B, T, dim] -> the block output (the [P, ...] partials
        under partial_out)."""
        xs = SimExpand.apply(args[0], self.site)                  # [P, B, T, dim]
        tp = self.site.tp
        partials = batched.partials(self.kind, self.shards, xs, args,
                                    tp.compiled_blocks if tp.compile_blocks else None)
        if self.partial_out:
            return partials
        y = SimReduce.apply(partials, self.site)
        return y if self.bias is None else y + self.bias

    def _sub_caches(self, cache) -> list:
        subs = self._caches.get(cache)
        if subs is None:
            subs = self.split_cache(cache, len(self.shards), self.shards[0])
            self._caches[cache] = subs
        return subs


_CACHE_KWARGS = ("cache", "past_key_values")


def _split_layer_cache(cache: LayerKVCache, n_shards: int, shard: nn.Module):
    return [LayerKVCache(cache.batch_size, cache.max_len) for _ in range(n_shards)]


def parallelize(model: Transformer, comm, rank: int | None = None, *, policy=None,
                plan: dict | None = None, layout=None, n_layers: int | None = None,
                pass_root: nn.Module | None = None, split_cache=None,
                sequence_parallel: bool = False, sim_path: str = "shards") -> Transformer:
    """Shard `model` in place for `rank` of comm's group (or for all P virtual ranks when comm is
    a SimulatedCommunicator) and route its TP sites through comm, each at its width
    (tp.policy.site_width).

    policy: a tp.policy.WidthPlan (the per-site policy, the edge and gather rules), or its
    per-site policy alone under the rules of comm.config's preset (EchoConfig.from_name('4'):
    every site at 4 bits, as the comm spec '4'; a config of no preset: the default rules):
    None (the config's bits), a preset name ('uniform4', 'uniform8', '16', 'early8', ...), a
    {site: bits} table, a per-site list or a callable (tp.policy.make_policy).
    Real ranks agree on the resolved per-site widths here, once (tp/agree.py: a ValueError on
    every rank naming each rank's widths when they differ).
    sequence_parallel: the residual stream between blocks sharded over the sequence, each
    all-reduce a reduce-scatter and an all-gather through comm (tp/sequence.py; the sequence
    length must be divisible by P; a group of one runs as without it).
    sim_path (simulated only): 'shards' (default, the reference: each block's shards one after
    another) or 'batched' (tp/batched.py: the virtual ranks as a batch dim of every op where
    the block allows it; swappable later through model.echo_tp.sim_path).
    Models other than `Transformer` name their `plan`, head `layout` (plan.HeadLayout),
    `n_layers`, `pass_root` (the module whose forward is one pass; default model) and, for
    simulated KV caches, `split_cache` (see SimTPBlock)."""
    if getattr(model, "echo_tp", None) is not None:
        raise ValueError("model is already parallelized; build a fresh one")
    if sim_path not in SIM_PATHS:
        raise ValueError(f"sim_path must be one of {SIM_PATHS}, got {sim_path!r}")
    plan = TP_PLAN if plan is None else plan
    cfg = model.cfg if layout is None else layout
    n_layers = cfg.n_layers if n_layers is None else n_layers
    pass_root = model if pass_root is None else pass_root
    P = comm.world_size
    simulated = bool(getattr(comm, "simulated", False))
    if sim_path != "shards" and not simulated:
        raise ValueError(f"sim_path={sim_path!r} is a way of running virtual ranks; a real "
                         "rank runs its own shard: leave sim_path at 'shards'")
    if not simulated:
        if rank is None:
            rank = dist.get_rank(comm.group)
        if not 0 <= rank < P:
            raise ValueError(f"rank {rank} is outside the TP group of {P}")
    tp = TPContext(comm=comm, widths=WidthPlan.of(policy, comm.config).resolved(n_layers),
                   world_size=P, n_layers=n_layers, rank=None if simulated else rank, cfg=cfg,
                   sequence_parallel=bool(sequence_parallel) and P > 1, sim_path=sim_path)
    check_same_widths(tp)
    blocks = [(n, m, s) for n, m in model.named_modules()
              if isinstance(s := match_plan(plan, n), BlockInput)]
    if simulated:
        for name, block, style in blocks:
            _set_submodule(model, name, _sim_block(tp, plan, name, block, style, split_cache))
    else:
        for name, module in list(model.named_modules()):
            _shard(tp, plan, name, module, rank, model)
        for name, block, style in blocks:
            site = Site(tp, site_index(name, style.slot))
            block.register_forward_pre_hook(_copy_hook(site), with_kwargs=True)
            if style.local_heads:
                _set_local_heads(tp, block, rank)
            if _reduces_at_output(plan, name, block):
                _check_no_rowwise_bias(name, block)
                block.register_forward_hook(_reduce_hook(site))
                continue
            for child in block.modules():
                if isinstance(child, RowwiseLinear):
                    child.site = site
        orphans = [n for n, m in model.named_modules() if isinstance(m, RowwiseLinear)
                   and m.site is None and not _in_output_reduced_block(plan, n, model)]
        if orphans:
            raise ValueError(f"row-parallel modules outside any BlockInput entry of the plan: "
                             f"{orphans}; their partial outputs would never be summed")
    if tp.sequence_parallel:
        sequence.enable(model, tp, pass_root, [model.get_submodule(n) for n, _, _ in blocks],
                        list(rank_parameters(model, 0 if simulated else None, tp)))
    elif isinstance(model, Transformer) and plan is TP_PLAN and P > 1:
        _fuse_boundaries(model, simulated)
    _record_replicas(tp, model)
    model.echo_tp = tp
    pass_root.register_forward_pre_hook(_forward_pass_hook(tp))
    pass_root.register_forward_hook(_backward_pass_hook(tp))
    if simulated and P > 1:   # at a rank's thread count (P = 1: the plain model, as it was)
        for root in {id(m): m for m in (model, pass_root)}.values():
            at_rank_threads(root)
    return model


def _fuse_boundaries(model: Transformer, simulated: bool) -> None:
    """Each layer's two block boundaries become comm.all_reduce_add_rmsnorm calls (the
    all-reduce of the block's partial, the residual add and the next RMSNorm: one kernel pass
    on CUDA, bit for bit echo_tp.norm's reference): the attention's and MLP's row-parallel
    output then stays a partial. Blocks with a row-parallel bias keep the plain path."""
    for layer in model.model.layers:
        boundaries = fuse_block_outputs((layer.self_attn, layer.mlp), simulated)
        if boundaries is not None:
            layer.boundaries = boundaries


def fuse_block_outputs(blocks, simulated: bool) -> tuple | None:
    """Blocks (parallelized; in the order their outputs are added to the residual stream) whose
    partial outputs a fused boundary can sum: each with one row-parallel output without a bias
    (not a block all-reduced at its output, such as fused MoE experts). Returns one boundary
    function per block, (norm, residual, partial) -> (norm(residual + all_reduce(partial)),
    residual + all_reduce(partial)), and switches the blocks to return their partials; None
    (nothing changed) when a block does not qualify."""
    sites = []
    for block in blocks:
        if simulated:   # as a real rank would decide (simulated == real ranks, bit for bit)
            ok = isinstance(block, SimTPBlock) and block.bias is None and \
                len([m for m in block.shards[0].modules() if isinstance(m, RowwiseLinear)]) == 1
            sites.append(block.site if ok else None)
            continue
        rows = [m for m in block.modules() if isinstance(m, RowwiseLinear)]
        ok = len(rows) == 1 and rows[0].bias is None and rows[0].site is not None
        sites.append(rows[0].site if ok else None)
    if None in sites:
        return None
    for block in blocks:
        targets = [block] if simulated else \
            [m for m in block.modules() if isinstance(m, RowwiseLinear)]
        for t in targets:
            t.partial_out = True
    return tuple(_fused_boundary(site) for site in sites)


def _fused_boundary(site: Site):
    def boundary(norm, residual: torch.Tensor, partial: torch.Tensor):
        return ReduceAddNorm.apply(partial, residual, norm.weight, _norm_eps(norm), site)
    return boundary


def _norm_eps(norm: nn.Module) -> float:
    """The epsilon of an RMSNorm module: `eps` (echo_tp.models) or `variance_epsilon`
    (transformers)."""
    eps = getattr(norm, "eps", None)
    return norm.variance_epsilon if eps is None else eps


def set_comm(model: Transformer, comm, *, policy=None) -> None:
    """Point a parallelized model at another communicator / width plan (same group size;
    policy as parallelize's)."""
    tp = _context(model)
    if comm.world_size != tp.world_size or bool(getattr(comm, "simulated", False)) != tp.simulated:
        raise ValueError(f"model was parallelized for {tp.world_size} "
                         f"{'virtual' if tp.simulated else 'real'} ranks; got a communicator of "
                         f"{comm.world_size} ({'simulated' if comm.simulated else 'real'})")
    tp.comm = comm
    tp.widths = WidthPlan.of(policy, comm.config).resolved(tp.n_layers)
    check_same_widths(tp)


def _context(model) -> TPContext:
    tp = getattr(model, "echo_tp", None)
    if tp is None:
        raise ValueError("model is not parallelized: call echo_tp.tp.parallelize first")
    return tp


def _copy_hook(site: Site):
    """The block input: copied to the TP region (f), or under sequence parallelism the shards
    all-gathered."""
    f = AllGather if site.tp.sequence_parallel else CopyToTP

    def hook(module, args, kwargs):
        x, put = _block_input(args, kwargs)
        return put(f.apply(x, site))
    return hook


def _reduce_hook(site: Site):
    """Real rank, a block of SplitParams experts: all-reduce (SP: reduce-scatter) the block
    output (its first item)."""
    f = ReduceScatter if site.tp.sequence_parallel else ReduceFromTP

    def hook(module, args, out):
        if isinstance(out, tuple):
            return (f.apply(out[0], site), *out[1:])
        return f.apply(out, site)
    return hook


def _reduces_at_output(plan, name: str, block: nn.Module) -> bool:
    return any(isinstance(match_plan(plan, f"{name}.{c}" if c else name), SplitParams)
               for c, _ in block.named_modules())


def _in_output_reduced_block(plan, name: str, model: nn.Module) -> bool:
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if isinstance(match_plan(plan, prefix), BlockInput):
            return _reduces_at_output(plan, prefix, model.get_submodule(prefix))
    return False


def _check_no_rowwise_bias(name: str, block: nn.Module) -> None:
    biased = [n for n, m in block.named_modules() if isinstance(m, RowwiseLinear)
              and m.bias is not None]
    if biased:
        raise ValueError(f"{name}: a row-parallel bias inside a block reduced at its output "
                         f"({biased}) would be summed P times; such blocks are not supported")


def _forward_pass_hook(tp: TPContext):
    def hook(module, args):
        tp.comm.new_pass("forward")
    return hook


def _backward_pass_hook(tp: TPContext):
    def hook(module, args, out):
        if isinstance(out, torch.Tensor):
            h = out
        elif hasattr(out, "last_hidden_state"):  # a transformers ModelOutput
            h = out.last_hidden_state
        else:
            raise ValueError(f"pass_root returned {type(out).__name__}; it must return the "
                             "hidden states (a tensor or an output with last_hidden_state)")
        if not (torch.is_grad_enabled() and h.requires_grad):
            return None
        h = BackwardPassStart.apply(h, tp)
        if isinstance(out, torch.Tensor):
            return h
        out.last_hidden_state = h
        return out
    return hook


def _sim_block(tp: TPContext, plan, name: str, block: nn.Module, style: BlockInput,
               split_cache=None) -> SimTPBlock:
    site = Site(tp, site_index(name, style.slot))
    shards, bias = [], None
    for r in range(tp.world_size):
        shard = copy.deepcopy(block)
        for child_name, child in list(shard.named_modules()):
            full = f"{name}.{child_name}" if child_name else name
            b = _shard(tp, plan, full, child, r, shard, local_name=child_name)
            if b is not None and r == 0:
                bias = b
        if style.local_heads:
            _set_local_heads(tp, shard, r)
        shards.append(shard)
    if bias is not None and _reduces_at_output(plan, name, block):
        raise ValueError(f"{name}: a row-parallel bias inside a block reduced at its output "
                         "is not supported")
    for r in range(tp.world_size):
        for pname, _ in shards[r].named_parameters(remove_duplicate=False):
            tp.sim_names[(r, f"{name}.{pname}")] = f"{name}.shards.{r}.{pname}"
    if bias is not None:
        for r in range(tp.world_size):
            tp.sim_names[(r, bias[0])] = f"{name}.bias"
        bias = bias[1]
    return SimTPBlock(shards, site, bias, split_cache)


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
    elif isinstance(style, SplitParams):
        for pname, dim, unit in style.params:
            param = getattr(module, pname, None)
            if not isinstance(param, nn.Parameter):
                raise ValueError(f"{name}: the plan splits parameter {pname!r}, which it lacks")
            full = param.shape[dim]
            idx = unit_rows(cfg, unit, full, P, rank).to(param.device)
            _record_shard(tp, f"{name}.{pname}", dim, unit, full)
            setattr(module, pname, nn.Parameter(param.detach().index_select(dim, idx)))
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
    Real model: its own parameters (rank must be None or its rank). Simulated: virtual rank's.
    Where each name lives (module, attribute) is looked up once per model and rank, so a call is
    a dict read per parameter (training calls it every step); Parameters reassigned since are
    seen, modules replaced after parallelize are not."""
    cached = tp is None       # tp given: parallelize itself, while the tree is still changing
    tp = tp if tp is not None else _context(model)
    if not tp.simulated:
        if rank not in (None, tp.rank):
            raise ValueError(f"this process holds rank {tp.rank}, not {rank}")
    elif rank is None or not 0 <= rank < tp.world_size:
        raise ValueError(f"name a virtual rank in [0, {tp.world_size})")
    slots = tp.param_slots.get(rank) if cached else None
    if slots is None:
        slots = _rank_slots(model, rank, tp)
        if cached:
            tp.param_slots[rank] = slots
    return {name: module._parameters[leaf] for name, module, leaf in slots}


def _rank_slots(model: nn.Module, rank: int | None, tp: TPContext) -> list[tuple]:
    """(real name, module, attribute) of each of rank's parameters, in named_parameters order
    (remove_duplicate=False: tied names included)."""
    named = [(f"{m}.{leaf}" if m else leaf, module, leaf)
             for m, module in model.named_modules(remove_duplicate=False)
             for leaf, p in module._parameters.items() if p is not None]
    if not tp.simulated:
        return named
    sim_to_real = {sim: real for (r, real), sim in tp.sim_names.items() if r == rank}
    out = []
    for name, module, leaf in named:
        if ".shards." in name:
            if name in sim_to_real:
                out.append((sim_to_real[name], module, leaf))
        elif name in sim_to_real:
            out.append((sim_to_real[name], module, leaf))  # a moved row-parallel bias
        else:
            out.append((name, module, leaf))
    return out

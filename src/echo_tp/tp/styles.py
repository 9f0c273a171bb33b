"""torch-native TP with Echo: ParallelStyles for torch.distributed.tensor.parallel's
parallelize_module.

    comm = EchoCommunicator.from_group(mesh.get_group(), EchoConfig(bits=4))   # one per model
    parallelize_module(model, mesh, {
        "layers.*.attention": EchoBlockInput(comm),             # f: input gradient all-reduced
        "layers.*.attention.wq": EchoColwiseParallel(),         # (and wk, wv)
        "layers.*.attention.wo": EchoRowwiseParallel(comm),     # g: partial output all-reduced
        "layers.*.feed_forward.w1": EchoColwiseParallel(comm),  # standalone: its own f site
        ...})
    parallelize_module(model, mesh, EchoPasses(comm))           # one pass per model forward

The same Megatron pair as torch's ColwiseParallel / RowwiseParallel, with the two collectives
going through the Echo communicator (tp/sites.py) instead of DTensor redistributes:
- EchoColwiseParallel(comm=None, bits=None): weight (and bias) -> DTensor Shard(0); forward
  y = x @ W_r^T on the local shard, output left sharded on its last dim (a plain tensor, as
  torch's use_local_output=True). With comm, the input gradient is all-reduced through it (one
  backward site per layer); without, the enclosing EchoBlockInput does it once for q/k/v together.
- EchoRowwiseParallel(comm, bits=None): weight -> Shard(1), bias Replicate; the input is this
  rank's slice of the features (the colwise output); the partial x_r @ W_r^T is summed by
  comm.all_reduce(direction='forward') (one forward site), the bias added after.
- EchoBlockInput(comm, bits=None): identity forward, input gradient all-reduced backward (a
  block's one f site, for blocks whose colwise layers share one input).
- EchoPasses(comm): on the root module: each forward starts a forward pass (fresh compensator
  state), and the backward of its output starts a backward pass.
Sequence parallelism (torch's SequenceParallel + RowwiseParallel(output_layouts=Shard(1)) +
ColwiseParallel(input_layouts=Shard(1)), Megatron's SP), the residual stream between blocks
sharded over the sequence, each all-reduce a reduce-scatter and an all-gather through Echo:
- EchoRowwiseParallel(comm, output_layouts=Shard(1)): the partial output reduce-scattered
  along dim 1 (this rank's positions of the sum; backward: the gradient all-gathered), the
  bias after it.
- EchoColwiseParallel(comm, input_layouts=Shard(1)) / EchoBlockInput(comm, input_layouts=
  Shard(1)): the input shards all-gathered (backward: the input gradient reduce-scattered).
- EchoSequenceParallel(): a norm (any module of replicated parameters) runs on the local shard;
  local tensors in and out. Its parameters are Replicate DTensors and the forward runs on
  DTensors (torch's SequenceParallel): their gradients, over this rank's positions only, are
  Partial DTensors (summed by DTensor where they are used, e.g. full_tensor() or the optimizer
  step), and so is the gradient of an EchoRowwiseParallel(output_layouts=Shard(d)) bias.
- EchoShardOutput(comm): a replicated module's output (the embedding's) -> this rank's shard
  along dim 1, no communication; backward: the shards' gradients all-gathered through Echo.
- EchoGatherInput(comm): a replicated module's input (the head's) all-gathered through Echo;
  backward: this rank's shard of its (replicated) gradient.
The all-gathers run uncompensated and the reduce-scatters compensated, as in the TP engine
(tp/sequence.py says why). The sequence length must be divisible by P.
`bits` is the site's width (None: the communicator's config; e.g. 8 on early layers = early8).
Parameters are DTensors, so state_dict / DCP / full_tensor() see whole tensors; the forward runs
on their local shards (to_local is differentiable: gradients arrive as DTensors of the same
placement). Linear layers only (what attention and MLP blocks need); heads must be contiguous
blocks of rows (n_heads divisible by P), as with torch's own styles.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from .parallelize import _backward_pass_hook, _forward_pass_hook
from .policy import WidthPlan
from .sites import (AllGather, CopyToTP, GatherFromSequence, ReduceFromTP, ReduceScatter,
                    ScatterToSequence, Site, TPContext)


def _site(comm, bits: int | None, dim: int = 1) -> Site:
    """A standalone site of width `bits` (no model layers: no edge rule; the default gather
    rule)."""
    rank = dist.get_rank(comm.group)
    tp = TPContext(comm=comm, widths=WidthPlan(policy=lambda site: bits),
                   world_size=comm.world_size, n_layers=0, rank=rank)
    return Site(tp, 0, dim=dim)


def _or_seq(dim: int | None) -> int:
    """The dim a site splits: the layout's Shard dim, else (unused) the sequence dim 1."""
    return 1 if dim is None else dim


def _shard_dim(layout, style: str, what: str) -> int | None:
    """None / Replicate() -> None (replicated); Shard(d) -> d; anything else: ValueError."""
    if layout is None or isinstance(layout, Replicate):
        return None
    if isinstance(layout, Shard):
        return layout.dim
    raise ValueError(f"{style}({what}=...) takes Replicate() or Shard(dim) (sequence "
                     f"parallelism), got {layout!r}")


def _needs_comm(comm, style: str) -> None:
    if comm is None:
        raise ValueError(f"{style} needs the EchoCommunicator its collective goes through")


def _check(comm, module: nn.Module, mesh, style: str) -> None:
    if not isinstance(module, nn.Linear):
        raise ValueError(f"{style} shards nn.Linear layers, got {type(module).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"{style} needs a 1-D (TP) DeviceMesh, got {mesh.ndim} dims: pass "
                         "mesh['tp']")
    if comm is not None and comm.world_size != mesh.size():
        raise ValueError(f"{style}: the communicator spans {comm.world_size} ranks, the mesh "
                         f"{mesh.size()}; build it over mesh.get_group()")


def _distribute(style, module: nn.Module, mesh, placements: dict) -> None:
    for name, placement in placements.items():
        p = getattr(module, name)
        if p is None:
            continue
        dt = distribute_tensor(p.detach(), mesh, [placement], src_data_rank=style.src_data_rank)
        setattr(module, name, nn.Parameter(dt, requires_grad=p.requires_grad))


def _local(p):
    return None if p is None else p.to_local()


class EchoColwiseParallel(ParallelStyle):
    """Column-parallel nn.Linear; with comm, its input gradient goes through Echo.
    input_layouts=Shard(d): the input is this rank's shard of dim d, all-gathered through comm
    first (sequence parallelism; backward: the input gradient reduce-scattered)."""

    def __init__(self, comm=None, *, bits: int | None = None, input_layouts=None):
        self.comm, self.bits = comm, bits
        self.dim = _shard_dim(input_layouts, type(self).__name__, "input_layouts")
        if self.dim is not None:
            _needs_comm(comm, f"{type(self).__name__}(input_layouts=Shard(...))")

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check(self.comm, module, device_mesh, type(self).__name__)
        _distribute(self, module, device_mesh, {"weight": Shard(0), "bias": Shard(0)})
        site = None if self.comm is None else _site(self.comm, self.bits, _or_seq(self.dim))
        enter = AllGather if self.dim is not None else CopyToTP

        def forward(mod, x: torch.Tensor) -> torch.Tensor:
            if site is not None:
                x = enter.apply(x, site)
            return F.linear(x, _local(mod.weight), _local(mod.bias))  # [..., out / P]
        module.forward = types.MethodType(forward, module)
        return module


class EchoRowwiseParallel(ParallelStyle):
    """Row-parallel nn.Linear; the partial output is all-reduced through Echo, bias after.
    output_layouts=Shard(d): reduce-scattered along dim d instead (sequence parallelism)."""

    def __init__(self, comm, *, bits: int | None = None, output_layouts=None):
        _needs_comm(comm, "EchoRowwiseParallel")
        self.comm, self.bits = comm, bits
        self.dim = _shard_dim(output_layouts, type(self).__name__, "output_layouts")

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check(self.comm, module, device_mesh, type(self).__name__)
        _distribute(self, module, device_mesh, {"weight": Shard(1), "bias": Replicate()})
        site = _site(self.comm, self.bits, _or_seq(self.dim))
        reduce = ReduceScatter if self.dim is not None else ReduceFromTP

        def forward(mod, x: torch.Tensor) -> torch.Tensor:
            partial = F.linear(x, _local(mod.weight))  # [..., out], this rank's share
            y = reduce.apply(partial, site)            # SP: this rank's positions of the sum
            return y if mod.bias is None else y + _bias(mod.bias, self.dim)
        module.forward = types.MethodType(forward, module)
        return module


def _bias(bias, dim: int | None) -> torch.Tensor:
    """The replicated bias as a local tensor; added to sequence shards (dim), each rank's
    gradient covers its positions only: a Partial DTensor gradient (as SequenceParallel's)."""
    if dim is None:
        return bias.to_local()
    return bias.to_local(grad_placements=[Partial()])


class EchoBlockInput(ParallelStyle):
    """A block's f site: identity forward, its input gradient all-reduced through Echo.
    input_layouts=Shard(d): the input shards all-gathered along d (sequence parallelism)."""

    def __init__(self, comm, *, bits: int | None = None, input_layouts=None):
        _needs_comm(comm, "EchoBlockInput")
        self.comm, self.bits = comm, bits
        self.dim = _shard_dim(input_layouts, type(self).__name__, "input_layouts")

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        site = _site(self.comm, self.bits, _or_seq(self.dim))
        enter = AllGather if self.dim is not None else CopyToTP

        def hook(mod, args, kwargs):
            if args:
                return (enter.apply(args[0], site), *args[1:]), kwargs
            raise ValueError(f"EchoBlockInput: {type(mod).__name__} got no positional input")
        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class EchoSequenceParallel(SequenceParallel):
    """A norm (replicated parameters) on the local sequence shard: torch's SequenceParallel
    with local tensors in and out (its parameters' partial gradients summed by DTensor)."""

    def __init__(self, *, sequence_dim: int = 1):
        super().__init__(sequence_dim=sequence_dim, use_local_output=True)


class EchoShardOutput(ParallelStyle):
    """A replicated module's output -> this rank's shard along dim (no communication); the
    backward all-gathers the shards' gradients through Echo (sequence parallelism: the
    embedding)."""

    def __init__(self, comm, *, bits: int | None = None, dim: int = 1):
        _needs_comm(comm, "EchoShardOutput")
        self.comm, self.bits, self.dim = comm, bits, dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        site = _site(self.comm, self.bits, self.dim)
        module.register_forward_hook(lambda mod, args, out: ScatterToSequence.apply(out, site))
        return module


class EchoGatherInput(ParallelStyle):
    """A replicated module's input, sharded along dim, all-gathered through Echo; backward:
    this rank's shard of the (replicated) gradient (sequence parallelism: the head)."""

    def __init__(self, comm, *, bits: int | None = None, dim: int = 1):
        _needs_comm(comm, "EchoGatherInput")
        self.comm, self.bits, self.dim = comm, bits, dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        site = _site(self.comm, self.bits, self.dim)

        def hook(mod, args, kwargs):
            if args:
                return (GatherFromSequence.apply(args[0], site), *args[1:]), kwargs
            raise ValueError(f"EchoGatherInput: {type(mod).__name__} got no positional input")
        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class EchoPasses(ParallelStyle):
    """Pass boundaries on the root module: forward pass per call, backward pass per backward
    (the root returns the hidden states or logits: a tensor, or an output with
    last_hidden_state)."""

    def __init__(self, comm):
        self.comm = comm

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        tp = _site(self.comm, None).tp
        module.register_forward_pre_hook(_forward_pass_hook(tp))
        module.register_forward_hook(_backward_pass_hook(tp))
        return module

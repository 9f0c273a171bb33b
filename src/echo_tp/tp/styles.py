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
`bits` is the site's width (None: the communicator's config; e.g. 8 on early layers = early8).
Parameters are DTensors, so state_dict / DCP / full_tensor() see whole tensors; the forward runs
on their local shards (to_local is differentiable: gradients arrive as DTensors of the same
placement). Linear layers only (what attention and MLP blocks need); heads must be contiguous
blocks of rows (n_heads divisible by P), as with torch's own styles.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from .parallelize import _backward_pass_hook, _forward_pass_hook
from .sites import CopyToTP, ReduceFromTP, Site, TPContext


def _site(comm, bits: int | None) -> Site:
    tp = TPContext(comm=comm, policy=lambda site: bits, world_size=comm.world_size, n_layers=0,
                   rank=None)
    return Site(tp, 0)


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
    """Column-parallel nn.Linear; with comm, its input gradient goes through Echo."""

    def __init__(self, comm=None, *, bits: int | None = None):
        self.comm, self.bits = comm, bits

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check(self.comm, module, device_mesh, type(self).__name__)
        _distribute(self, module, device_mesh, {"weight": Shard(0), "bias": Shard(0)})
        site = None if self.comm is None else _site(self.comm, self.bits)

        def forward(mod, x: torch.Tensor) -> torch.Tensor:
            if site is not None:
                x = CopyToTP.apply(x, site)
            return F.linear(x, _local(mod.weight), _local(mod.bias))  # [..., out / P]
        module.forward = types.MethodType(forward, module)
        return module


class EchoRowwiseParallel(ParallelStyle):
    """Row-parallel nn.Linear; the partial output is all-reduced through Echo, bias after."""

    def __init__(self, comm, *, bits: int | None = None):
        if comm is None:
            raise ValueError("EchoRowwiseParallel needs the EchoCommunicator that sums its output")
        self.comm, self.bits = comm, bits

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check(self.comm, module, device_mesh, type(self).__name__)
        _distribute(self, module, device_mesh, {"weight": Shard(1), "bias": Replicate()})
        site = _site(self.comm, self.bits)

        def forward(mod, x: torch.Tensor) -> torch.Tensor:
            partial = F.linear(x, _local(mod.weight))  # [..., out], this rank's share
            y = ReduceFromTP.apply(partial, site)
            return y if mod.bias is None else y + _local(mod.bias)
        module.forward = types.MethodType(forward, module)
        return module


class EchoBlockInput(ParallelStyle):
    """A block's f site: identity forward, its input gradient all-reduced through Echo."""

    def __init__(self, comm, *, bits: int | None = None):
        self.comm, self.bits = comm, bits

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        site = _site(self.comm, self.bits)

        def hook(mod, args, kwargs):
            if args:
                return (CopyToTP.apply(args[0], site), *args[1:]), kwargs
            raise ValueError(f"EchoBlockInput: {type(mod).__name__} got no positional input")
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

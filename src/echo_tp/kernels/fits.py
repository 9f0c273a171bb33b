"""Which calls the fast kernels take, and why not: one answer, without Triton.

    fits(kind, x, cfg, world_size=P, state=, residual=, device=) -> None | why not

is what the quantized kernels (kernels/allreduce_plan.py: collective/p2p.py on real ranks,
collective/simulated_fused.py for virtual ones) can run, for each kind of call:

    tensor_unfit(x, device)   any fast kernel (the one-shot's too): x on the group's GPU, of a
                              dtype in config.DTYPES, a contiguous 1-D tensor
    config_unfit(cfg)         the quantized kernels: bits 4 or 8, a packet they can write
                              (spec_unfit: every QuantSpec today); compensated calls keep their
                              state in a dtype of STATE_DTYPES
    fits(kind, ...)           both, then the call itself: the state tensors of that dtype and
                              x's shape, a residual of x's shape, dtype and device; the halves
                              (reduce_scatter x [P*m], all_gather x [m]) on chunks of whole
                              quantization groups: the kernels run the layout of the all-reduce
                              of P*m values, whose segment is ceil(P*m/(P*g))*g, and the
                              reference (collective/sharded.py) pads each m-value chunk to
                              ceil(m/g)*g on its own; the two agree only when g divides m

Routing (collective/routing.py) reads tensor_unfit and config_unfit through `Call`, the
dispatcher computes `fits` for the halves, and the backends check `fits` again before a launch.
Imports torch and the config only, so the routing decision runs where Triton is missing.
"""
from __future__ import annotations

import torch

from ..compensator import CompState
from ..config import DTYPES, KINDS, EchoConfig, QuantSpec

HALVES = KINDS[1:]
"""The two halves of the all-reduce (sequence parallelism)."""

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Compensator state dtypes the quantized kernels read and write (EchoConfig.state_dtype)."""


def tensor_unfit(x: torch.Tensor, device: torch.device | None = None) -> str | None:
    """Why no fast kernel can take x on a group whose GPU is `device` (None: they can; device
    None: not checked)."""
    if device is not None and x.device != device:
        return f"x is on {x.device}, the group's GPU is {device}"
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype}"
    if x.dim() != 1 or not x.is_contiguous():
        return "x is not a contiguous 1-D tensor"
    return None


def spec_unfit(spec: QuantSpec) -> str | None:
    """Why the Triton quantizer (quant_kernels) and the stage kernels cannot take a packet of
    spec (None: they can). They take every QuantSpec: bits 4 and 8, the three policies, any
    group size, with or without the outlier word (the constexpr OUTLIER; tests/test_kernels.py
    and tests/test_sharded_kernels.py hold them to quant.py bit for bit). The one-shot kernels
    (oneshot_kernels.py) never meet a spec: they sum 16-bit values, no quantizer."""
    return None


def config_unfit(cfg: EchoConfig) -> str | None:
    """Why the quantized kernels cannot run a call of cfg (None: they can)."""
    if cfg.bits not in (4, 8):
        return f"bits={cfg.bits} is the plain all-reduce"
    why = spec_unfit(cfg.quant_spec())
    if why is not None:
        return why
    if cfg.compensated and cfg.state_dtype not in STATE_DTYPES:
        return f"state_dtype {cfg.state_dtype!r} (the kernels keep fp32 or bf16 state)"
    return None


def fits(kind: str, x: torch.Tensor, cfg: EchoConfig, *, world_size: int,
         state: CompState | None = None, residual: torch.Tensor | None = None,
         device: torch.device | None = None) -> str | None:
    """Why the quantized kernels cannot run this call of one rank (None when they can): kind
    'all_reduce' (x [n]), 'reduce_scatter' (x [P*m]) or 'all_gather' (x [m]); state: the call's
    compensator state (None: uncompensated); residual: the all-reduce's block-boundary residual
    (p2p adds it where y is decoded)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    why = config_unfit(cfg) or tensor_unfit(x, device)
    if why is not None:
        return why
    if state is not None:
        if state.m1.dtype != STATE_DTYPES.get(cfg.state_dtype) or state.m2.dtype != state.m1.dtype:
            return "compensator state must be fp32 or bf16, as the config says"
        if state.m1.shape != x.shape or state.m2.shape != x.shape:
            return "the compensator state must have x's shape"
    if residual is not None:
        if kind != "all_reduce":
            return f"a {kind} adds no residual"
        if (residual.shape != x.shape or residual.dtype != x.dtype
                or not residual.is_contiguous() or residual.device != x.device):
            return "residual must be a contiguous tensor of x's shape, dtype and device"
    if kind == "all_reduce":
        return None
    n = x.numel()
    if kind == "reduce_scatter" and n % world_size:
        return f"{n} values do not split into {world_size} equal chunks"
    m = n // world_size if kind == "reduce_scatter" else n
    g = cfg.group_size
    if m == 0:
        return "an empty chunk"
    if m % g:
        return (f"a chunk of {m} values is not a whole number of {g}-value groups (the "
                "kernels' segments would not be the reference's per-chunk padding)")
    return None

"""The two halves of the quantized all-reduce as collectives of their own, compensated: the
reduce-scatter (QAR steps 1-2) and the all-gather (step 3) that sequence parallelism puts at
each block boundary instead of one all-reduce. Written once for any Transport, like qar.py: the
same function runs on a real rank ([N]) and on P virtual ranks ([P, N]), so the simulated run
is bit-identical to the real one by construction.

Reduce-scatter, x [*B, P*m] -> y [*B, m] (chunk j = elements [j*m, (j+1)*m) goes to rank j):

    x' = x + c                          c from this rank's reduce-scatter state [*B, P*m]
    x' *= 2^e (backward)                e from the group-wide max |x'| (qar.grad_scale)
    chunks [*B, P, m] -> pad each to seg = ceil(m/g)*g -> qar.scatter_sum
        every chunk j != own encoded once, all-to-all, decoded; owner sum in fp32 in rank
        order, the own chunk unquantized                         -> acc [*B, seg]
    y = saturate(acc[:m] / 2^e, x.dtype)
    u = x'_j - decode(encode(x'_j)) for j != own, 0 on the own chunk (unscaled units)
    state <- update_(state, u)

All-gather, x [*B, m] -> y [*B, P*m] (rank j's shard at chunk j):

    x' = x + c                          c from this rank's all-gather state [*B, m]
    x' *= 2^e (backward)
    pad to seg -> qar.gather_decode: x' encoded once, the packets all-gathered, every rank (the
        owner too) decodes the same codes                        -> y32 [*B, P, seg]
    y = saturate(y32[..., :m] / 2^e, x.dtype)  (flattened in rank order)
    u = x'_own - decode(encode(x'_own)) (unscaled units)
    state <- update_(state, u)

Group sums: for the reduce-scatter, summed over the ranks u is exactly -delta of each owner's
chunk (delta = y - sum of the x'); for the all-gather u = -delta of the rank's own shard. So
the closed form of SPEC §4 and Theorem 1's bound hold for a pass of either kind, as for the
all-reduce with the 'local' residual (the only residual these halves have: there is no
all-reduce output to form 'output' from). The output cast to x's dtype is not fed back (it is
the rounding any tensor of that dtype carries). bits=16: the transport's plain reduce-scatter
and all-gather. The padding of a chunk never reaches the caller.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import quant
from ..compensator import CompState, apply_correction, correction, update_
from ..config import CompensatorConstants, EchoConfig
from .qar import Transport, codec_of, gather_decode, grad_scale, scatter_sum


def chunk_len(numel: int, world_size: int) -> int:
    """m: the elements of one rank's chunk of a reduce-scatter of numel values (ValueError
    unless numel splits into world_size equal chunks)."""
    if numel % world_size:
        raise ValueError(f"a reduce-scatter over {world_size} ranks splits its input into "
                         f"{world_size} equal chunks: {numel} values do not split")
    return numel // world_size


def _apply(x: torch.Tensor, cfg: EchoConfig, t: Transport, state: CompState | None,
           backward: bool):
    """-> (x' [*B, n] fp32, the backward power of two [*B, 1] or None, constants)."""
    k = CompensatorConstants.from_config(cfg)
    xf = x.to(torch.float32)
    xp = apply_correction(xf, correction(state, k).to(torch.float32)) if state is not None \
        else xf
    f = grad_scale(xp, t) if backward and cfg.grad_scaling else None
    return xp, f, k


def compensated_reduce_scatter(x: torch.Tensor, cfg: EchoConfig, t: Transport, *,
                               state: CompState | None, backward: bool = False,
                               codec=None) -> torch.Tensor:
    """x [*B, P*m] (bf16/fp16/fp32) -> this rank's chunk of the sum, y [*B, m] in x's dtype;
    updates state [*B, P*m] in place (module docstring)."""
    P = t.world_size
    m = chunk_len(x.shape[-1], P)
    if not cfg.quantized:
        return t.sum_scatter(x)
    spec = cfg.quant_spec()
    g = spec.group_size
    seg = -(-m // g) * g
    batch = x.shape[:-1]
    xp, f, k = _apply(x, cfg, t, state, backward)
    xs = xp if f is None else xp * f
    xpad = F.pad(xs.reshape(*batch, P, m), (0, seg - m))                # [*B, P, seg]
    acc, sent_err = scatter_sum(xpad, spec, t, codec or codec_of(xpad, spec))
    inv = None if f is None else 1.0 / f                                 # exact: 2^-e
    acc = acc[..., :m]
    y = quant.saturate(acc if inv is None else acc * inv, x.dtype)      # [*B, m]
    if state is not None:
        err = sent_err[..., :m]                                          # [*B, P, m]
        if inv is not None:
            err = err * inv.unsqueeze(-1)
        err = t.replace_own(err, torch.zeros_like(t.own(err)))          # own chunk: exact
        update_(state, err.reshape(*batch, P * m), k)
    return y


def compensated_all_gather(x: torch.Tensor, cfg: EchoConfig, t: Transport, *,
                           state: CompState | None, backward: bool = False,
                           codec=None) -> torch.Tensor:
    """x [*B, m] (this rank's shard) -> y [*B, P*m] in x's dtype, the same on every rank;
    updates state [*B, m] in place (module docstring)."""
    if not cfg.quantized:
        return t.gather_cat(x)
    P = t.world_size
    spec = cfg.quant_spec()
    g = spec.group_size
    m = x.shape[-1]
    seg = -(-m // g) * g
    batch = x.shape[:-1]
    xp, f, k = _apply(x, cfg, t, state, backward)
    xs = xp if f is None else xp * f
    xpad = F.pad(xs, (0, seg - m))                                       # [*B, seg]
    y32 = gather_decode(xpad, spec, t, codec or codec_of(xpad, spec))[..., :m]   # [*B, P, m]
    inv = None if f is None else (1.0 / f).unsqueeze(-1)
    if state is not None:
        err = xs - t.own(y32)                                            # [*B, m]
        update_(state, err if inv is None else err * inv[..., 0, :], k)
    if inv is not None:
        y32 = y32 * inv
    return quant.saturate(y32.reshape(*batch, P * m), x.dtype)


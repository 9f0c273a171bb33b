"""The quantized all-reduce (SPEC.md §2) and its compensated form, written once for any transport.

The same function runs on a real rank (tensors [N], transport = torch.distributed) and on P
virtual ranks at once (tensors [P, N], transport = index shuffles), so the simulated run is
bit-identical to the real one by construction: every per-element operation is the same.

Shapes: B = batch of virtual ranks, () on a real rank, (P,) in simulation.
    x' [*B, N] fp32 -> pad -> [*B, P, seg] (segment j goes to owner j; seg a multiple of g)
    1. encode every segment, all-to-all the packets        -> recv [*B, P(sender), nbytes]
    2. owner sum, in rank order, own segment unquantized    -> acc [*B, seg] fp32
    3. encode acc once, all-gather, everyone decodes        -> y32 [*B, P, seg] fp32
Steps 1-2 are a reduce-scatter (`scatter_sum`) and step 3 an all-gather (`gather_decode`);
collective/sharded.py offers each half as a collective of its own (sequence parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from .. import quant
from ..compensator import CompState, apply_correction, correction, output_residual, update_
from ..config import CompensatorConstants, EchoConfig, QuantSpec
from ..kernels.fits import spec_unfit

GRAD_SCALE_TARGET = 2.0 ** 12
"""Backward scaling: the group-wide max |x'| is brought to [2^11, 2^12) by a power of two."""


class Transport(Protocol):
    """How one step of the algorithm moves bytes between the P ranks of a group."""

    world_size: int

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """[*B, P, ...] -> [*B, ...]: the entry of this rank (segment it owns / its own slot)."""

    def replace_own(self, t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A copy of t [*B, P, ...] whose own entry is v [*B, ...]."""

    def all_to_all(self, buf: torch.Tensor) -> torch.Tensor:
        """[*B, P, nb] -> [*B, P, nb] with out[i][r] = in[r][i] (rank r's packet for owner i)."""

    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        """[*B, nb] -> [*B, P, nb]: everyone receives every owner's packet."""

    def all_max(self, t: torch.Tensor) -> torch.Tensor:
        """[*B] -> [*B]: group-wide maximum (one scalar per rank)."""

    def all_sum(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """[*B, N] -> [*B, N]: the plain 16-bit all-reduce, in x's dtype (inplace: x's storage
        may be reused)."""

    def sum_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """[*B, P*m] -> [*B, m]: the plain 16-bit reduce-scatter (chunk j summed on rank j), in
        x's dtype."""

    def gather_cat(self, x: torch.Tensor) -> torch.Tensor:
        """[*B, m] -> [*B, P*m]: the plain 16-bit all-gather (rank j's x at chunk j)."""


def segment_len(numel: int, world_size: int, group_size: int) -> int:
    """Per-owner segment length: ceil(N / (P*g)) * g (padding never reaches the caller)."""
    return -(-numel // (world_size * group_size)) * group_size


@dataclass
class QAROut:
    y32: torch.Tensor        # [*B, P, seg] fp32, the decoded owners' codes (same on every rank)
    acc: torch.Tensor        # [*B, seg] fp32, this rank's owner sum s
    sent_err: torch.Tensor   # [*B, P, seg] fp32, x'_j - decode(encode(x'_j)); own slot unused


def codec_for(x: torch.Tensor):
    """The group quantizer implementation for x's device: the Triton kernels on CUDA (one pass,
    bit-identical to quant.py: tests/test_kernels.py, and on GPUs docs/results), quant.py
    elsewhere. Both expose encode(x, spec) and decode(packet, spec)."""
    if x.is_cuda:
        try:
            from ..kernels import quant_kernels
        except ImportError:  # no triton: the torch reference
            return quant
        return quant_kernels
    return quant


def codec_of(x: torch.Tensor, spec: QuantSpec):
    """codec_for(x), or the torch reference where the kernels do not take the spec
    (kernels/fits.spec_unfit)."""
    return quant if spec_unfit(spec) is not None else codec_for(x)


def scatter_sum(xpad: torch.Tensor, spec: QuantSpec, t: Transport,
                codec) -> tuple[torch.Tensor, torch.Tensor]:
    """QAR steps 1-2, a quantized reduce-scatter. xpad fp32 [*B, P, seg] (segment j for owner j,
    seg a multiple of g) -> (acc [*B, seg] fp32, this rank's owner sum; sent_err [*B, P, seg]
    fp32, x_j - decode(encode(x_j)), the own slot unused).

    Unfused: acc = x_own + sum_{r != own} decode(encode(x_r[own])), added in rank order."""
    P, seg = xpad.shape[-2:]
    # 1. quantize every segment (the own one is never used), send segment j to owner j
    packets = codec.encode(xpad, spec)
    sent_err = xpad - codec.decode(packets, spec)
    recv = t.all_to_all(quant.to_bytes(packets))
    contrib = codec.decode(quant.from_bytes(recv, seg, spec), spec)      # [*B, P(sender), seg]
    # 2. owner sum in fp32, in rank order, the own segment unquantized
    own = t.own(xpad)
    contrib = t.replace_own(contrib, own)
    acc = contrib[..., 0, :]
    for r in range(1, P):
        acc = acc + contrib[..., r, :]
    acc = torch.where(torch.isfinite(own), quant.clamp_finite(acc), acc)  # a finite own
    return acc, sent_err                                                  # segment saturates


def gather_decode(v: torch.Tensor, spec: QuantSpec, t: Transport, codec) -> torch.Tensor:
    """QAR step 3, a quantized all-gather. v fp32 [*B, seg] (seg a multiple of g) -> y32
    [*B, P, seg] fp32: every rank's v, each encoded once by its rank and decoded by every rank
    (the owner too), so every rank holds the same values.

    Unfused: y32[r] = decode(encode(v_r))."""
    seg = v.shape[-1]
    gathered = t.all_gather(quant.to_bytes(codec.encode(v, spec)))
    return codec.decode(quant.from_bytes(gathered, seg, spec), spec)


def qar(xq: torch.Tensor, spec: QuantSpec, t: Transport, codec=None) -> QAROut:
    """xq fp32 [*B, N] -> QAROut. Each element is quantized at most twice.
    codec: quant (the reference) or kernels.quant_kernels; default codec_for(xq)."""
    codec = codec or codec_of(xq, spec)
    P = t.world_size
    n = xq.shape[-1]
    seg = segment_len(n, P, spec.group_size)
    xpad = F.pad(xq, (0, P * seg - n)).reshape(*xq.shape[:-1], P, seg)
    acc, sent_err = scatter_sum(xpad, spec, t, codec)                     # steps 1-2
    y32 = gather_decode(acc, spec, t, codec)                              # step 3
    return QAROut(y32=y32, acc=acc, sent_err=sent_err)


def grad_scale(xp: torch.Tensor, t: Transport) -> torch.Tensor:
    """xp fp32 [*B, N] -> the group-shared power of two 2^e [*B, 1] (SPEC §5)."""
    local = xp.abs().amax(dim=-1) if xp.shape[-1] else xp.new_zeros(xp.shape[:-1])
    # NaN counts as +inf (a MAX reduction may drop NaN): either way the scale falls back to 1
    # (posinf too: nan_to_num's default would turn +inf into fp32 max, and the scale into 2^-100)
    inf = float("inf")
    amax = t.all_max(torch.nan_to_num(local, nan=inf, posinf=inf))
    ok = torch.isfinite(amax) & (amax > 0)
    e = torch.floor(torch.log2(GRAD_SCALE_TARGET / torch.where(ok, amax, torch.ones_like(amax))))
    e = torch.where(ok, e.clamp(-100, 100), torch.zeros_like(e))
    return torch.exp2(e).unsqueeze(-1)


@dataclass
class StepRecord:
    """What one compensated call leaves for telemetry (fp32 tensors, no host sync)."""

    x_prime: torch.Tensor    # [*B, N]
    correction: torch.Tensor | None
    sent_err_sq: torch.Tensor  # [*B] this rank's send rounding energy (real elements only)
    requant_err_sq: torch.Tensor  # [*B] owner requantization energy (real elements only)


def compensated_all_reduce(x: torch.Tensor, cfg: EchoConfig, t: Transport, *,
                           state: CompState | None, backward: bool = False,
                           record: bool = False, codec=None,
                           scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, StepRecord | None]:
    """x [*B, N] (bf16/fp16/fp32) -> y [*B, N] in x's dtype; updates state in place.
    scale: the backward power of two [*B, 1] when the caller took it over a larger call
    (collective/chunked.py); default grad_scale of this call's x'.

    Unfused equivalent of the fused p2p kernels: c from state, x' = x + c, optional power-of-two
    scaling (backward), QAR, residual u (output or local mode), state update.
    """
    if not cfg.quantized:
        return t.all_sum(x), None
    spec = cfg.quant_spec()
    k = CompensatorConstants.from_config(cfg)
    P = t.world_size
    n = x.shape[-1]
    xf = x.to(torch.float32)
    c = correction(state, k).to(torch.float32) if state is not None else None
    xp = apply_correction(xf, c) if c is not None else xf
    f = (grad_scale(xp, t) if scale is None else scale) if backward and cfg.grad_scaling else None
    out = qar(xp * f if f is not None else xp, spec, t, codec)
    seg = out.y32.shape[-1]
    y32 = out.y32.reshape(*x.shape[:-1], P * seg)
    if f is not None:
        y32 = y32 * (1.0 / f)  # exact: 1/f is a power of two
    y_pad = quant.saturate(y32, x.dtype)      # finite input: a finite y
    y = y_pad[..., :n]
    rec = None
    if state is not None or record:
        local = _local_residual(out, y_pad, f, t) if (cfg.residual == "local" or record) else None
        if state is not None:
            u = local[..., :n] if cfg.residual == "local" else output_residual(xp, y, P)
            update_(state, u, k)
        if record:
            rec = _record(xp, c, out, local, t, n)
    return y, rec


def _local_residual(out: QAROut, y_pad: torch.Tensor, f: torch.Tensor | None,
                    t: Transport) -> torch.Tensor:
    """This rank's own rounding errors, [*B, P*seg] fp32, in unscaled units:
    non-owned segment j: x'_j - decode(encode(x'_j)); owned segment: s - y_own."""
    P, seg = out.sent_err.shape[-2:]
    inv = None if f is None else (1.0 / f).unsqueeze(-1)
    sent = out.sent_err if inv is None else out.sent_err * inv
    acc = out.acc if inv is None else out.acc * inv[..., 0, :]
    y_own = t.own(y_pad.reshape(*y_pad.shape[:-1], P, seg)).to(torch.float32)
    res = t.replace_own(sent, acc - y_own)
    return res.reshape(*res.shape[:-2], P * seg)


def _record(xp, c, out: QAROut, local: torch.Tensor, t: Transport, n: int) -> StepRecord:
    P, seg = out.sent_err.shape[-2:]
    real = torch.zeros(P * seg, dtype=torch.bool, device=xp.device)
    real[:n] = True
    sq = (local * real).square().reshape(*local.shape[:-1], P, seg).sum(-1)  # [*B, P]
    own_sq = t.own(sq)
    return StepRecord(x_prime=xp, correction=c, sent_err_sq=sq.sum(-1) - own_sq,
                      requant_err_sq=own_sq)


def wire_bytes(numel: int, world_size: int, spec: QuantSpec) -> int:
    """Bytes one rank sends per call: (P-1) segment packets out, and its owner packet to P-1."""
    seg = segment_len(numel, world_size, spec.group_size)
    return 2 * (world_size - 1) * spec.packet_bytes(seg)


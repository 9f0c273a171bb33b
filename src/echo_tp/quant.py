"""Group quantizers and 4-bit packing, pure torch: THE reference every kernel is compared with.

SPEC.md §3. Values are quantized in groups of g consecutive elements. Each group sends its codes
plus fp16 parameters (a scale, and a zero-point for the asymmetric policies); codes are computed
from the fp16-rounded parameters, so every receiver dequantizes exactly what the sender meant.
All arithmetic is fp32, one rounding per operation (no fused multiply-add), round-half-to-even,
IEEE division on every device (see _const).

Policies (L = 2^b - 1, Q = 2^(b-1) - 1):
  symmetric   s = max|x| / Q            q = clip(rint(x/s), -Q, Q)      x^ = s * q
  naive       s = (hi-lo)/L, z = -lo/s  q = clip(rint(x/s + z), 0, L)   x^ = s * (q - z)
  zero_aware  as naive, with z = z_naive + lam*(rint(z_naive) - z_naive),
              lam = clamp(1 - d/s, 0, 1), d = distance from 0 to [lo, hi]

Edge cases, defined here once (kernels copy them):
  * Constant groups (lo == hi = v): s = |v| so that v is code 0 with z = -sign(v) (asymmetric) or
    code sign(v) (symmetric); exact whenever |v| is an fp16 value. All-zero groups use s = 1.
  * Far-from-zero groups: s is widened to at least d / Z_MAX so the zero-point magnitude stays
    <= Z_MAX = 256, where fp16 holds it to within 1/16 of a step; the extra error is then bounded
    by |lo| * 2^-9, below bf16's own rounding of the values.
  * The scale is rounded UP to fp16 (the grid always covers [lo, hi]) and kept in
    [2^-24, 65504]: groups narrower than 2^-24 * L get fp16's finest step (absolute error at most
    2^-25, ~3e-8); groups wider than 65504 * L saturate at the largest step (values clip to the
    grid ends; `range_report` counts such groups). Finite input never becomes inf or NaN.
  * A group holding NaN or +-Inf gets a NaN scale: all its elements dequantize to NaN.
Codes: asymmetric q in [0, L]; symmetric q + 2^(b-1) in [1, 2^b - 1]. At b = 4 element 2t sits in
the low nibble of byte t and element 2t+1 in the high nibble.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .config import QuantSpec

Z_MAX = 256.0
"""Largest zero-point magnitude; far-from-zero groups widen their step to respect it."""
FP16_MAX = 65504.0
SCALE_MIN = 2.0 ** -24
"""Smallest positive fp16 (subnormal) value: the finest step a group can have."""


class Packet(NamedTuple):
    """Quantized values, [..., n] -> codes [..., n*b/8] uint8, scale/zero [..., n/g] fp16."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None


def _const(like: torch.Tensor, v: float) -> torch.Tensor:
    """v as a 0-dim tensor on like's device: torch on CUDA divides by a Python scalar as a
    multiply by its fp32 reciprocal, by a tensor it divides (IEEE) as the CPU always does."""
    return like.new_full((), float(v))


def round_up_fp16(s: torch.Tensor) -> torch.Tensor:
    """fp32 [..] positive finite -> the smallest fp16 >= s (so the grid never shrinks)."""
    s16 = s.to(torch.float16)
    below = s16.to(torch.float32) < s
    bumped = (s16.view(torch.int16) + 1).view(torch.float16)
    return torch.where(below, bumped, s16)


def group_params(xg: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """xg fp32 [..., G, g] -> (scale fp16 [..., G], zero fp16 [..., G] or None)."""
    lo = xg.amin(dim=-1)
    hi = xg.amax(dim=-1)
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    constant = lo == hi
    if spec.quantizer == "symmetric":
        amax = torch.maximum(lo.abs(), hi.abs())
        s = amax / _const(amax, spec.qmax)
        d = None
    else:
        # d = distance from 0 to [lo, hi] (0 when the group straddles 0)
        d = torch.clamp_min(torch.maximum(lo, -hi), 0.0)
        s = (hi - lo) / _const(lo, spec.levels)
        s = torch.maximum(s, d / Z_MAX)
    s = torch.where(constant, lo.abs(), s)
    s = torch.where(s == 0, torch.ones_like(s), s)
    s = torch.where(finite, s.clamp(SCALE_MIN, FP16_MAX), torch.ones_like(s))
    s16 = round_up_fp16(s)
    s16 = torch.where(finite, s16, torch.full_like(s16, float("nan")))
    if spec.quantizer == "symmetric":
        return s16, None
    sf = s16.to(torch.float32)
    z_naive = -lo / sf
    if spec.quantizer == "zero_aware":
        z_round = torch.round(z_naive)
        lam = torch.clamp(1.0 - d / sf, 0.0, 1.0)
        z = z_naive + lam * (z_round - z_naive)
    else:
        z = z_naive
    z = z + 0.0  # -0.0 -> +0.0: one zero-point byte pattern, however amin broke a +-0 tie
    z16 = torch.clamp(z, -FP16_MAX, FP16_MAX).to(torch.float16)
    return s16, z16


def quantize_groups(xg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    spec: QuantSpec) -> torch.Tensor:
    """xg fp32 [..., G, g] with fp16 params [..., G] -> unpacked codes uint8 [..., G, g]."""
    sf = scale.to(torch.float32).unsqueeze(-1)
    if zero is None:
        q = torch.clamp(torch.round(xg / sf), -spec.qmax, spec.qmax) + (1 << (spec.bits - 1))
    else:
        q = torch.clamp(torch.round(xg / sf + zero.to(torch.float32).unsqueeze(-1)), 0, spec.levels)
    q = torch.nan_to_num(q, nan=0.0)
    return q.to(torch.uint8)


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                      spec: QuantSpec) -> torch.Tensor:
    """codes uint8 [..., G, g] -> fp32 [..., G, g]: s * (q - z), or s * (q - 2^(b-1))."""
    sf = scale.to(torch.float32).unsqueeze(-1)
    q = codes.to(torch.float32)
    if zero is None:
        return sf * (q - float(1 << (spec.bits - 1)))
    return sf * (q - zero.to(torch.float32).unsqueeze(-1))


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] (values < 16, n even) -> [..., n/2]: low nibble = element 2t."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> [..., n]: inverse of pack4."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _as_groups(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    n = x.shape[-1]
    if n % spec.group_size:
        raise ValueError(f"last dim {n} is not a multiple of group_size {spec.group_size}")
    return x.to(torch.float32).reshape(*x.shape[:-1], n // spec.group_size, spec.group_size)


def encode(x: torch.Tensor, spec: QuantSpec) -> Packet:
    """x [..., n] (n a multiple of g, any float dtype) -> Packet."""
    xg = _as_groups(x, spec)
    scale, zero = group_params(xg, spec)
    codes = quantize_groups(xg, scale, zero, spec).flatten(-2)
    if spec.bits == 4:
        codes = pack4(codes)
    return Packet(codes, scale, zero)


def decode(packet: Packet, spec: QuantSpec) -> torch.Tensor:
    """Packet -> fp32 [..., n]."""
    codes = unpack4(packet.codes) if spec.bits == 4 else packet.codes
    groups = packet.scale.shape[-1]
    codes = codes.reshape(*codes.shape[:-1], groups, spec.group_size)
    return dequantize_groups(codes, packet.scale, packet.zero, spec).flatten(-2)


def quant_dequant(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """x [..., n] -> fp32 x^ [..., n], the value every receiver of encode(x) reconstructs."""
    return decode(encode(x, spec), spec)


def range_report(x: torch.Tensor, spec: QuantSpec) -> dict[str, int]:
    """Counts of groups of x [..., n] at fp16's limits: 'saturated' (step clipped at 65504),
    'floored' (step raised to 2^-24 on a non-constant group) and 'nonfinite' groups."""
    xg = _as_groups(x, spec)
    lo, hi = xg.amin(-1), xg.amax(-1)
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    width = torch.maximum(lo.abs(), hi.abs()) / spec.qmax if spec.quantizer == "symmetric" \
        else (hi - lo) / spec.levels
    return {"saturated": int((finite & (width > FP16_MAX)).sum()),
            "floored": int((finite & (lo != hi) & (width < SCALE_MIN)).sum()),
            "nonfinite": int((~finite).sum())}


# ----- wire format: one contiguous uint8 buffer per packet -----

def packet_nbytes(n: int, spec: QuantSpec) -> int:
    return spec.packet_bytes(n)


def to_bytes(p: Packet) -> torch.Tensor:
    """Packet with leading dims [...] -> uint8 [..., nbytes]: codes | scale bytes | zero bytes."""
    parts = [p.codes, p.scale.contiguous().view(torch.uint8)]
    if p.zero is not None:
        parts.append(p.zero.contiguous().view(torch.uint8))
    return torch.cat(parts, dim=-1)


def from_bytes(buf: torch.Tensor, n: int, spec: QuantSpec) -> Packet:
    """uint8 [..., nbytes] -> Packet of n values (inverse of to_bytes)."""
    ncode = n * spec.bits // 8
    groups = n // spec.group_size
    codes = buf[..., :ncode]
    scale = buf[..., ncode:ncode + 2 * groups].contiguous().view(torch.float16)
    zero = None
    if spec.has_zero:
        zero = buf[..., ncode + 2 * groups:ncode + 4 * groups].contiguous().view(torch.float16)
    return Packet(codes, scale, zero)

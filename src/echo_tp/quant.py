"""Group quantizers and 4-bit packing, pure torch: THE reference every kernel is compared with.

SPEC.md §3. Values are quantized in groups of g consecutive elements. Each group sends its codes
plus 16-bit parameter words (a scale word, and an fp16 zero-point for the asymmetric policies);
codes are computed from the rounded parameters, so every receiver dequantizes exactly what the
sender meant. All arithmetic is fp32, one rounding per operation (no fused multiply-add),
round-half-to-even, IEEE division on every device (see _const).

Policies (L = 2^b - 1, Q = 2^(b-1) - 1):
  symmetric   s = max|x| / Q            q = clip(rint(x/s), -Q, Q)      x^ = s * q
  naive       s = (hi-lo)/L, z = -lo/s  q = clip(rint(x/s + z), 0, L)   x^ = s * (q - z)
  zero_aware  as naive, with z = z_naive + lam*(rint(z_naive) - z_naive),
              lam = clamp(1 - d/s, 0, 1), d = distance from 0 to [lo, hi]

The scale word (16 bits, sent where an fp16 would be; read it with `scale_value`):
  * sign bit 0: the word is the fp16 scale. Every group whose step s lies in fp16's range of
    steps [2^-24, 65504] uses it (the common case, with the same bits as before the tagged
    form existed).
  * sign bit 1: the low 15 bits are the bf16 bit pattern of the scale (bf16's 8-bit exponent:
    steps in [2^-126, 2^126), which covers every finite fp32/bf16 group), for groups wider than
    65504 * L or narrower than 2^-24 * L. The scale is always positive, so the sign bit is
    free; the wire cost is unchanged (68 bytes per 128 values at 4 bits).
  Either way the scale is rounded UP (the grid always covers [lo, hi]), so every finite group's
  error is bounded by its own step, s/2 (+ the zero-point rounding below), at any magnitude.
  The zero-point stays fp16 at every scale: it counts steps, and |z| <= Z_MAX + L.

Edge cases, defined here once (kernels copy them):
  * Constant groups (lo == hi = v): s = |v| so that v is code 0 with z = -sign(v) (asymmetric) or
    code sign(v) (symmetric); exact whenever |v| is an fp16 value in [2^-24, 65504] or a bf16
    value outside it (|v| > 2^126: s = |v|/4 and v is code 0 with z = -4 sign(v), or code
    4 sign(v), so that every step is below 2^126 and 1/s a normal fp32). All-zero groups use
    s = 1.
  * Far-from-zero groups: s is widened to at least d / Z_MAX so the zero-point magnitude stays
    <= Z_MAX + L < 512 (Z_MAX = 256), where fp16 holds it to within half its ulp, 1/8 of a
    step, at every scale; the extra error is then bounded by |lo| * 2^-9, below bf16's own
    rounding of the values.
  * Steps are at least 2^-126 (fp32's smallest normal): a group narrower than 2^-126 * L (fp32
    subnormal values) has an absolute error of at most 2^-127.
  * Groups whose width hi - lo overflows fp32 take s = hi/L - lo/L; decoded values, the owner
    sum of the all-reduce and its output saturate at the largest finite value of their dtype
    (`saturate`) instead of overflowing: finite input never becomes inf or NaN.
  * A group holding NaN or +-Inf gets a NaN scale word (fp16 NaN 0x7E00, zero-point NaN): all
    its elements dequantize to NaN.
Codes: asymmetric q in [0, L]; symmetric q + 2^(b-1) in [1, 2^b - 1]. At b = 4 element 2t sits in
the low nibble of byte t and element 2t+1 in the high nibble.

Outlier word (QuantSpec.outlier): each group's largest |value| v (v = hi where hi >= -lo, else
lo: +|v| before -|v| where both occur; its slot the first index holding v) travels as its fp16
value (round to nearest even) in a 16-bit word beside the scale word, and its code slot holds
the marker code (2^b - 1 asymmetric, where the grid then tops out at L = 2^b - 2; 0 symmetric, a
code the symmetric grid never uses). lo, hi and so the grid are those of the other g - 1 values.
A receiver decodes the grid and puts v at the marked slot of a group whose word is not 0 (a NaN
group's codes are 0, the symmetric marker: its values stay NaN).
A group takes no outlier (no marked slot, word 0, the grid over all g values) when v is not an
fp16 normal value (|v| < 2^-14 or |v| > 65504: fp16 would round it coarser than the grid) or
the group holds NaN/Inf. Massive activations (one channel of a token 100-1000x the rest) are
what it is for: with v on the grid, the other values of its group share a step ~|v|/L.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .config import QuantSpec

Z_MAX = 256.0
"""Largest zero-point magnitude; far-from-zero groups widen their step to respect it."""
FP16_MAX = 65504.0
SCALE_MIN = 2.0 ** -24
"""Smallest positive fp16 (subnormal) value: the finest step an fp16 scale word holds."""
WIDE_MIN = 2.0 ** -126
"""Smallest normal fp32/bf16 value: the finest step a bf16 scale word holds."""
CONST_BIG = 2.0 ** 126
"""Constant groups with |v| above this use s = |v|/4: every step stays below 2^126, so 1/s is
a normal fp32 (what the kernels' division by a scale needs)."""
F32_MAX = float(torch.finfo(torch.float32).max)
BF16_TAG = 0x8000
"""Sign bit of a scale word: set = the low 15 bits are a bf16 scale, clear = an fp16 scale."""
NAN_WORD = 0x7E00
"""The scale word of a group holding NaN/Inf: fp16's canonical NaN."""


OUTLIER_MIN = 2.0 ** -14
"""Smallest |v| an outlier word takes: fp16's smallest normal value."""


class Packet(NamedTuple):
    """Quantized values, [..., n] -> codes [..., n*b/8] uint8, scale words [..., n/g] (16-bit
    words held as fp16 bits: read them with `scale_value`), zero [..., n/g] fp16, outlier
    [..., n/g] fp16 (QuantSpec.outlier)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    outlier: torch.Tensor | None = None


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


def round_up_bf16_bits(s: torch.Tensor) -> torch.Tensor:
    """fp32 [..] positive finite -> int32 [..]: bit pattern of the smallest bf16 >= s."""
    return (s.view(torch.int32) + 0xFFFF) >> 16


def scale_word(s: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """fp32 steps [..] (positive where finite) -> scale words [..] (fp16 bits, module docstring):
    fp16 rounded up inside [SCALE_MIN, FP16_MAX], else BF16_TAG | bf16 rounded up (>= WIDE_MIN);
    NAN_WORD where not finite."""
    fits = (s >= SCALE_MIN) & (s <= FP16_MAX)
    w16 = round_up_fp16(s.clamp(SCALE_MIN, FP16_MAX)).view(torch.int16)
    wbf = (round_up_bf16_bits(s.clamp_min(WIDE_MIN)) - BF16_TAG).to(torch.int16)  # tag bit set
    w = torch.where(fits, w16, wbf)
    return torch.where(finite, w, torch.full_like(w, NAN_WORD)).view(torch.float16)


def scale_value(word: torch.Tensor) -> torch.Tensor:
    """Scale words [..] (fp16 bits) -> the fp32 steps they hold [..] (NaN for NAN_WORD)."""
    w = word.view(torch.int16)
    bf = ((w.to(torch.int32) & 0x7FFF) << 16).view(torch.float32)   # tagged: bf16 -> fp32
    return torch.where(w < 0, bf, word.to(torch.float32))


def clamp_finite(v: torch.Tensor) -> torch.Tensor:
    """fp32 [..] -> [..] with +-inf saturated at +-F32_MAX (NaN stays NaN)."""
    return v.clamp(-F32_MAX, F32_MAX)


def saturate(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 [..] -> dtype [..], round to nearest even, values beyond dtype's finite range
    saturated at its largest finite value (NaN stays NaN): the output cast of the all-reduce."""
    big = torch.finfo(dtype).max
    return v.clamp(-big, big).to(dtype)


def _step(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Group min, max fp32 [..] -> the fp32 step s [..] before rounding (module docstring);
    meaningless where lo or hi is not finite."""
    if spec.quantizer == "symmetric":
        amax = torch.maximum(lo.abs(), hi.abs())
        s = amax / _const(amax, spec.qmax)
    else:
        d = torch.clamp_min(torch.maximum(lo, -hi), 0.0)
        width = hi - lo
        lv = _const(lo, spec.levels)
        s = torch.where(torch.isinf(width), hi / lv - lo / lv, width / lv)   # no overflow
        s = torch.maximum(s, d / Z_MAX)
    v = lo.abs()
    s = torch.where(lo == hi, torch.where(v > CONST_BIG, v * 0.25, v), s)   # constant group
    return torch.where(s == 0, torch.ones_like(s), s)


def outlier_slots(xg: torch.Tensor) -> torch.Tensor:
    """xg fp32 [..., G, g] -> bool [..., G, g]: each group's outlier slot (module docstring:
    v = hi where hi >= -lo, else lo, at the first index holding it, where v is an fp16 normal
    and the group finite)."""
    lo = xg.amin(dim=-1, keepdim=True)
    hi = xg.amax(dim=-1, keepdim=True)
    v = torch.where(hi >= -lo, hi, lo)        # the largest |value|; +v before -v (NaN: NaN)
    idx = (xg == v).to(torch.uint8).argmax(dim=-1, keepdim=True)   # its first index
    finite = torch.isfinite(xg).all(dim=-1, keepdim=True)
    ok = finite & (v.abs() >= OUTLIER_MIN) & (v.abs() <= FP16_MAX)
    return torch.zeros_like(xg, dtype=torch.bool).scatter_(-1, idx, ok)


def group_params(xg: torch.Tensor, spec: QuantSpec, slots: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """xg fp32 [..., G, g] -> (scale words [..., G] (fp16 bits), zero fp16 [..., G] or None);
    slots (bool [..., G, g], outlier_slots): values left out of lo and hi."""
    if slots is None:
        lo = xg.amin(dim=-1)
        hi = xg.amax(dim=-1)
    else:
        lo = torch.where(slots, torch.full_like(xg, float("inf")), xg).amin(dim=-1)
        hi = torch.where(slots, torch.full_like(xg, float("-inf")), xg).amax(dim=-1)
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    s = torch.where(finite, _step(lo, hi, spec), torch.ones_like(lo))
    sw = scale_word(s, finite)
    if spec.quantizer == "symmetric":
        return sw, None
    sf = scale_value(sw)
    d = torch.clamp_min(torch.maximum(lo, -hi), 0.0)   # distance from 0 to [lo, hi]
    z_naive = -lo / sf
    if spec.quantizer == "zero_aware":
        z_round = torch.round(z_naive)
        lam = torch.clamp(1.0 - d / sf, 0.0, 1.0)
        z = z_naive + lam * (z_round - z_naive)
    else:
        z = z_naive
    z = z + 0.0  # -0.0 -> +0.0: one zero-point byte pattern, however amin broke a +-0 tie
    z16 = torch.clamp(z, -FP16_MAX, FP16_MAX).to(torch.float16)
    return sw, z16


def quantize_groups(xg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    spec: QuantSpec) -> torch.Tensor:
    """xg fp32 [..., G, g] with scale words, fp16 zeros [..., G] -> unpacked codes uint8
    [..., G, g]."""
    sf = scale_value(scale).unsqueeze(-1)
    if zero is None:
        q = torch.clamp(torch.round(xg / sf), -spec.qmax, spec.qmax) + (1 << (spec.bits - 1))
    else:
        q = torch.clamp(torch.round(xg / sf + zero.to(torch.float32).unsqueeze(-1)), 0, spec.levels)
    q = torch.nan_to_num(q, nan=0.0)
    return q.to(torch.uint8)


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                      spec: QuantSpec) -> torch.Tensor:
    """codes uint8 [..., G, g] -> fp32 [..., G, g]: s * (q - z), or s * (q - 2^(b-1)),
    saturated at +-F32_MAX (a grid rounded up past fp32's largest value)."""
    sf = scale_value(scale).unsqueeze(-1)
    q = codes.to(torch.float32)
    if zero is None:
        return clamp_finite(sf * (q - float(1 << (spec.bits - 1))))
    return clamp_finite(sf * (q - zero.to(torch.float32).unsqueeze(-1)))


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
    slots = outlier_slots(xg) if spec.outlier else None
    scale, zero = group_params(xg, spec, slots)
    codes = quantize_groups(xg, scale, zero, spec)
    outlier = None
    if slots is not None:
        codes = torch.where(slots, torch.full_like(codes, spec.marker), codes)
        v = torch.where(slots, xg, torch.zeros_like(xg)).sum(dim=-1)   # the one value, or 0
        outlier = v.to(torch.float16)
    codes = codes.flatten(-2)
    if spec.bits == 4:
        codes = pack4(codes)
    return Packet(codes, scale, zero, outlier)


def decode(packet: Packet, spec: QuantSpec) -> torch.Tensor:
    """Packet -> fp32 [..., n]."""
    codes = unpack4(packet.codes) if spec.bits == 4 else packet.codes
    groups = packet.scale.shape[-1]
    codes = codes.reshape(*codes.shape[:-1], groups, spec.group_size)
    y = dequantize_groups(codes, packet.scale, packet.zero, spec)
    if spec.outlier:   # word 0: no outlier (a NaN group's codes are 0, the symmetric marker)
        v = packet.outlier.to(torch.float32).unsqueeze(-1)
        y = torch.where((codes == spec.marker) & (v != 0), v.expand_as(y), y)
    return y.flatten(-2)


def quant_dequant(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """x [..., n] -> fp32 x^ [..., n], the value every receiver of encode(x) reconstructs."""
    return decode(encode(x, spec), spec)


def range_report(x: torch.Tensor, spec: QuantSpec) -> dict[str, int]:
    """Counts of the groups of x [..., n] whose scale word leaves fp16's range of steps: 'wide'
    (step above 65504: a bf16 scale word), 'tiny' (step below 2^-24: a bf16 scale word),
    'floored' (step raised to 2^-126 on a non-constant group), and 'nonfinite' groups."""
    xg = _as_groups(x, spec)
    lo, hi = xg.amin(-1), xg.amax(-1)
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    s = _step(lo, hi, spec)
    return {"wide": int((finite & (s > FP16_MAX)).sum()),
            "tiny": int((finite & (s < SCALE_MIN)).sum()),
            "floored": int((finite & (lo != hi) & (s < WIDE_MIN)).sum()),
            "nonfinite": int((~finite).sum())}


# ----- wire format: one contiguous uint8 buffer per packet -----

def packet_nbytes(n: int, spec: QuantSpec) -> int:
    return spec.packet_bytes(n)


def to_bytes(p: Packet) -> torch.Tensor:
    """Packet with leading dims [...] -> uint8 [..., nbytes]: codes | scale bytes | zero bytes
    | outlier bytes."""
    parts = [p.codes, p.scale.contiguous().view(torch.uint8)]
    for words in (p.zero, p.outlier):
        if words is not None:
            parts.append(words.contiguous().view(torch.uint8))
    return torch.cat(parts, dim=-1)


def from_bytes(buf: torch.Tensor, n: int, spec: QuantSpec) -> Packet:
    """uint8 [..., nbytes] -> Packet of n values (inverse of to_bytes)."""
    ncode = n * spec.bits // 8
    groups = n // spec.group_size
    codes = buf[..., :ncode]
    scale = _words(buf[..., ncode:ncode + 2 * groups])
    zero = outlier = None
    at = ncode + 2 * groups
    if spec.has_zero:
        zero = _words(buf[..., at:at + 2 * groups])
        at += 2 * groups
    if spec.outlier:
        outlier = _words(buf[..., at:at + 2 * groups])
    return Packet(codes, scale, zero, outlier)


def _words(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2k] -> its k 16-bit words as fp16 bits [..., k] (k = 0: an empty packet)."""
    if b.shape[-1] == 0:
        return torch.empty(b.shape, dtype=torch.float16, device=b.device)
    return b.contiguous().view(torch.float16)

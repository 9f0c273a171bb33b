"""Triton group quantizer and dequantizer, bit-exact with the torch reference (quant.py).

Device helpers (`_rint`, `_group_params`, `_codes`, `_dequant`, packing, dtype casts) are shared
by the fused all-reduce kernels (allreduce_kernels.py); `quantize_kernel` / `dequantize_kernel`
with their host wrappers `encode` / `decode` are the standalone form, tested against
quant.encode / quant.decode on fresh random inputs (tests/test_kernels.py).

Exactness rules every helper follows (quant.py's docstring is the authority):
  * one fp32 rounding per operation: kernels launch with enable_fp_fusion=False (no FMA
    contraction; the only FMAs are the explicit ones of the division's fast path, which is
    what the GPU's own div.rn runs); tensor/tensor divisions are IEEE (tl.math.div_rn, or
    _div_by_scale), never Triton's approximate `/`;
  * rint is round-half-to-even, computed with the 2^23 trick (exact for |v| < 2^23; larger
    values are integers already), because libdevice is unavailable under TRITON_INTERPRET;
    codes are clipped first, then rounded by one add of 1.5*2^23 (see _codes);
  * fp32 -> bf16 rounds to nearest even (the conversion instruction when compiled; integer bit
    operations under the interpreter, which truncates); bf16 -> fp32 by a shift; fp16
    conversions use tl's RNE casts;
  * negation is `v * -1.0` (Triton's unary minus is `0 - v`, which loses the sign of zero);
  * scale words (quant.scale_word: fp16, or BF16_TAG | bf16) are handled as int16 only, stored
    and loaded through int16 pointers: no float operation ever sees a word's bits;
  * NaN/Inf groups: the scale word is the canonical fp16 NaN 0x7E00 (as quant.NAN_WORD), the
    zero-point that NaN too (torch's NaN bit pattern depends on the device and the input NaN;
    only NaN-ness is part of the zero-point's contract), codes 0;
  * saturation (quant.clamp_finite / quant.saturate) compares and selects, so NaN passes and
    the interpreter (numpy min/max propagate NaN) and compiled code (PTX min/max drop it) agree.
  * quant.py divides by 0-dim tensors (IEEE on every device; torch on CUDA would turn a Python
    scalar divisor into a reciprocal multiply), so every division here is div_rn too.
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl
from triton import knobs

from ..config import QuantSpec
from ..quant import Packet

ZERO_AWARE, NAIVE, SYMMETRIC = 0, 1, 2
QUANT_CODE = {"zero_aware": ZERO_AWARE, "naive": NAIVE, "symmetric": SYMMETRIC}
KIND_F32, KIND_F16, KIND_BF16 = 0, 1, 2
DTYPE_KIND = {torch.float32: KIND_F32, torch.float16: KIND_F16, torch.bfloat16: KIND_BF16}
LAUNCH_OPTS = dict(enable_fp_fusion=False)
"""Every kernel of this package launches with these options (no FMA contraction)."""

F32_MAX = tl.constexpr(3.4028234663852886e38)
BF16_MAX = tl.constexpr(3.3895313892515355e38)
"""Largest finite fp32 and bf16 values (fp16: 65504), the saturation bounds."""

HW_FORMS = tl.constexpr(not getattr(knobs.runtime, "interpret", False))
"""Compiled kernels round fp32 -> bf16 with the conversion instruction, divide by a group scale
with the fast path of the GPU's IEEE division (3 FMAs a value instead of ~10 instructions) and
find a group's min, max and finiteness in two NaN-propagating reductions; the interpreter (CI
on the CPU) has no inline PTX, truncates fp32 -> bf16 and runs custom reductions element by
element in Python, so it computes the same bits the arithmetic way. Every helper that branches
on HW_FORMS gives identical results both ways: tests/test_kernels.py checks the interpreter
forms, tests/test_kernels_gpu.py the compiled ones, each against torch."""


def f32(v: float) -> float:
    """v rounded to the nearest fp32 value (as a Python float)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def spec_constexprs(spec: QuantSpec) -> dict:
    """The quantizer's compile-time constants for a spec."""
    return dict(BITS=spec.bits, QUANT=QUANT_CODE[spec.quantizer], GS=spec.group_size,
                LEVELS=float(spec.levels), QMAX=float(spec.qmax))


# ----------------------------------------------------------------------------- device helpers

@triton.jit
def _rint(v):
    """Round half to even, fp32 -> fp32 (sign of zero kept; NaN/Inf pass through)."""
    a = tl.abs(v)
    r = (a + 8388608.0) - 8388608.0          # 2^23: the sum's ulp is 1, so RNE rounds a
    r = tl.where(a < 8388608.0, r, a)         # |v| >= 2^23 is already an integer (or NaN/Inf)
    sign = v.to(tl.uint32, bitcast=True) & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _div_by_scale(x, sf):
    """x [BG, GS] / sf [BG] (sf the value of a finite scale word, in [2^-126, 2^126) so that
    1/sf is a normal fp32), IEEE round to nearest.

    Compiled: the instruction sequence the GPU's own `div.rn.f32` runs on its fast path, with
    the reciprocal refined once per group instead of once per value (3 FMAs per value instead of
    ~10 instructions). That path (rcp.approx, one Newton step, q0 = a*y, one correction) is what
    div.rn returns whenever its range check (FCHK) passes; the check can only fail where the
    quotient is subnormal, zero, or has |a| near the fp32 limits, and there the code
    round(x/s + z), clipped, is the same either way (|quotient| < 2^-100 or clipped).
    tests/test_kernels_gpu.py checks it against torch's division for every positive fp16 s.
    Interpreted: tl.math.div_rn."""
    if HW_FORMS:
        # Tiny steps (tagged words below fp16's 2^-24): x and s times 2^64, exactly, so that
        # no dividend or residual below is subnormal (the fast path's range; the quotient is
        # the same real number, so IEEE rounds it the same). |x| <= (L + 2 Z_MAX) s there.
        f = tl.where(sf < 5.9604644775390625e-08, 18446744073709551616.0, 1.0)   # [BG]
        sf = sf * f
        x = x * f[:, None]
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [sf],
                                      dtype=tl.float32, is_pure=True, pack=1)
        nb = sf * -1.0
        y = tl.fma(r, tl.fma(nb, r, 1.0), r)[:, None]    # refined 1/s  [BG, 1]
        q0 = tl.fma(x, y, 0.0)
        v = tl.fma(y, tl.fma(nb[:, None], q0, x), q0)
    else:
        v = tl.math.div_rn(x, sf[:, None])
    return v


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _div(a, DEN: tl.constexpr):
    """a / DEN, IEEE round-to-nearest (torch's tensor / 0-dim tensor on any device)."""
    return tl.math.div_rn(a, tl.full(a.shape, DEN, tl.float32))


@triton.jit
def _load_f32(ptr, mask, X_KIND: tl.constexpr):
    """Load fp32/fp16/bf16 values as fp32 (masked lanes read 0.0), exactly."""
    if X_KIND == 2:
        h = tl.load(ptr, mask=mask, other=0.0).to(tl.uint16, bitcast=True)
        v = (h.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        v = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _sat(v, BIG: tl.constexpr):
    """v fp32 with values beyond +-BIG set to +-BIG, NaN passing (min/max with NaN
    propagation: two instructions compiled, numpy's clip interpreted)."""
    return tl.clamp(v, BIG * -1.0, BIG, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _sat_out(v, X_KIND: tl.constexpr):
    """v fp32 saturated at the output dtype's largest finite value (quant.saturate's clamp)."""
    if X_KIND == 2:
        out = _sat(v, BF16_MAX)
    elif X_KIND == 1:
        out = _sat(v, 65504.0)
    else:
        out = _sat(v, F32_MAX)
    return out


@triton.jit
def _cast_sat(v, X_KIND: tl.constexpr):
    """fp32 -> the output dtype, saturating (quant.saturate): finite v, finite result."""
    return _cast_out(_sat_out(v, X_KIND), X_KIND)


@triton.jit
def _cast_out(v, X_KIND: tl.constexpr):
    """fp32 -> the output dtype, round to nearest even (bf16 by bit arithmetic)."""
    if X_KIND == 2:
        if HW_FORMS:
            out = v.to(tl.bfloat16)               # cvt.rn.bf16.f32
        else:
            b = v.to(tl.uint32, bitcast=True)
            r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
            r = tl.where(v != v, 0x7FC0, r)
            out = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif X_KIND == 1:
        out = v.to(tl.float16)
    else:
        out = v
    return out


@triton.jit
def _nan16(like):
    """The canonical fp16 NaN (0x7E00) broadcast to like's shape."""
    return (tl.zeros_like(like).to(tl.int16) + 0x7E00).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _scale_word(s, finite):
    """fp32 steps s [BG] (positive; 1.0 where not finite) -> scale words int16 [BG]
    (quant.scale_word): the fp16 rounded up inside [2^-24, 65504], else 0x8000 | the bf16
    rounded up (>= 2^-126); 0x7E00 where not finite."""
    fits = (s >= 5.9604644775390625e-08) & (s <= 65504.0)
    sc = tl.minimum(tl.maximum(s, 5.9604644775390625e-08), 65504.0)
    s16 = sc.to(tl.float16)
    bumped = (s16.to(tl.int16, bitcast=True) + 1).to(tl.int16).to(tl.float16, bitcast=True)
    s16 = tl.where(s16.to(tl.float32) < sc, bumped, s16)  # round UP to fp16
    sb = tl.maximum(s, 1.1754943508222875e-38)             # >= 2^-126
    cb = (sb.to(tl.int32, bitcast=True) + 0xFFFF) >> 16     # bf16 bits, rounded UP
    w = tl.where(fits, s16.to(tl.int16, bitcast=True).to(tl.int32), cb - 32768)  # tag: bit 15
    w = tl.where(finite, w, 0x7E00)
    return w.to(tl.int16)


@triton.jit
def _word_scale(w):
    """Scale words int16 [BG] -> their fp32 steps [BG] (quant.scale_value; NaN for 0x7E00)."""
    bf = ((w.to(tl.int32) & 0x7FFF) << 16).to(tl.float32, bitcast=True)   # tagged: bf16
    return tl.where(w < 0, bf, w.to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _group_params(x, QUANT: tl.constexpr, LEVELS: tl.constexpr, QMAX: tl.constexpr,
):
    """x fp32 [BG, GS] -> (scale words int16 [BG], sf [BG] fp32, z16 [BG] fp16, zf [BG] fp32,
    finite [BG] bool); the zero outputs are unused for the symmetric policy."""
    if HW_FORMS:                                         # NaN in the group -> lo, hi NaN
        lo = tl.reduce(x, 1, _min_nan)
        hi = tl.reduce(x, 1, _max_nan)
        finite = (lo >= -3.4028234663852886e38) & (hi <= 3.4028234663852886e38)
    else:   # the interpreter runs custom reductions element by element in Python: 3 builtins
        finite = tl.min((tl.abs(x) <= 3.4028234663852886e38).to(tl.int32), axis=1) > 0
        lo = tl.min(x, axis=1)
        hi = tl.max(x, axis=1)
    d = tl.maximum(tl.maximum(lo, hi * -1.0), 0.0)    # distance from 0 to [lo, hi]
    if QUANT == 2:
        amax = tl.maximum(tl.abs(lo), tl.abs(hi))
        s = _div(amax, QMAX)
    else:
        width = hi - lo
        s = tl.where(width > F32_MAX, _div(hi, LEVELS) - _div(lo, LEVELS),
                     _div(width, LEVELS))                # a width past fp32: no overflow
        s = tl.maximum(s, d * 0.00390625)              # d / Z_MAX, Z_MAX = 256 (exact)
    v = tl.abs(lo)
    s = tl.where(lo == hi, tl.where(v > 8.507059173023462e37, v * 0.25, v), s)  # constant:
    s = tl.where(s == 0.0, 1.0, s)                     # |v| (|v|/4 above 2^126); all-zero: 1
    s = tl.where(finite, s, 1.0)
    sw = _scale_word(s, finite)
    sf = _word_scale(sw)
    if QUANT == 2:
        z16 = sw.to(tl.float16, bitcast=True)          # unused
    else:
        zn = tl.math.div_rn(lo * -1.0, sf)             # z_naive = -lo / s
        if QUANT == 0:
            lam = 1.0 - tl.math.div_rn(d, sf)
            lam = tl.minimum(tl.maximum(lam, 0.0), 1.0)
            z = zn + lam * (_rint(zn) - zn)
        else:
            z = zn
        z = z + 0.0                                     # -0.0 -> +0.0, as quant.py
        z16 = tl.minimum(tl.maximum(z, -65504.0), 65504.0).to(tl.float16)
        z16 = tl.where(finite, z16, _nan16(z16))
    return sw, sf, z16, z16.to(tl.float32), finite


@triton.jit
def _codes(x, sf, zf, finite, QUANT: tl.constexpr, LEVELS: tl.constexpr, QMAX: tl.constexpr):
    """x fp32 [BG, GS] with fp32 params [BG] -> codes uint8 [BG, GS] (0 in non-finite groups).

    Unfused form (quant.py): q = clip(round(x/s + z), 0, L), or clip(round(x/s), -Q, Q) + Q+1.
    Clipping to integer bounds commutes with rounding, so the value is clipped first; then one
    add of K = 1.5*2^23 (+ Q+1, K even) rounds it half-to-even (the sum's ulp is 1) and leaves
    the code in the low mantissa bits: no float -> int conversion instruction."""
    v = _div_by_scale(x, sf)
    if QUANT == 2:
        t = tl.minimum(tl.maximum(v, QMAX * -1.0), QMAX) + (12582912.0 + QMAX + 1.0)
    else:
        t = tl.minimum(tl.maximum(v + zf[:, None], 0.0), LEVELS) + 12582912.0
    q = t.to(tl.int32, bitcast=True) - 0x4B400000          # bits of 1.5*2^23
    q = tl.where(finite[:, None], q, 0)
    return q.to(tl.uint8)


@triton.jit
def _code_f32(q):
    """uint8 codes -> their fp32 values (exact: 2^23 + q has ulp 1; no int -> float convert)."""
    return (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _dequant(q, sf, zf, QUANT: tl.constexpr, QMAX: tl.constexpr):
    """codes uint8 [BG, GS], fp32 params [BG] -> fp32 [BG, GS]: s * (q - z), saturated at
    +-fp32 max (quant.dequantize_groups)."""
    qf = _code_f32(q)
    if QUANT == 2:
        out = sf[:, None] * (qf - (QMAX + 1.0))
    else:
        out = sf[:, None] * (qf - zf[:, None])
    return _sat(out, F32_MAX)


@triton.jit
def _store_codes(ptr, grp, q, mask, GS: tl.constexpr, BITS: tl.constexpr, BG: tl.constexpr):
    """Write codes [BG, GS] of groups grp [BG] at ptr (uint8*, group-major; 4-bit packed)."""
    if BITS == 4:
        lo, hi = tl.split(tl.reshape(q, (BG, GS // 2, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        offs = grp[:, None] * (GS // 2) + tl.arange(0, GS // 2)[None, :]
        tl.store(ptr + offs, packed, mask=mask[:, None])
    else:
        offs = grp[:, None] * GS + tl.arange(0, GS)[None, :]
        tl.store(ptr + offs, q, mask=mask[:, None])


@triton.jit
def _load_codes(ptr, grp, mask, GS: tl.constexpr, BITS: tl.constexpr, BG: tl.constexpr):
    """Read codes [BG, GS] uint8 of groups grp [BG] from ptr (inverse of _store_codes)."""
    if BITS == 4:
        offs = grp[:, None] * (GS // 2) + tl.arange(0, GS // 2)[None, :]
        p = tl.load(ptr + offs, mask=mask[:, None], other=0, cache_modifier=".cg")
        q = tl.reshape(tl.join(p & 0xF, p >> 4), (BG, GS))
    else:
        offs = grp[:, None] * GS + tl.arange(0, GS)[None, :]
        q = tl.load(ptr + offs, mask=mask[:, None], other=0, cache_modifier=".cg")
    return q


@triton.jit
def _load_params(scale_ptr, zero_ptr, grp, mask, QUANT: tl.constexpr):
    """Scale word (fp16-sized, at scale_ptr) and fp16 zero of groups grp [BG] -> fp32 (sf, zf)
    (masked lanes: 1.0, 0.0)."""
    w = tl.load(scale_ptr.to(tl.pointer_type(tl.int16)) + grp, mask=mask, other=0x3C00,
                cache_modifier=".cg")
    sf = _word_scale(w)
    if QUANT == 2:
        zf = sf
    else:
        zf = tl.load(zero_ptr + grp, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return sf, zf


# ----------------------------------------------------------------------------- standalone kernels

@triton.jit
def quantize_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, n_groups,
                    X_KIND: tl.constexpr, BG: tl.constexpr, GS: tl.constexpr,
                    BITS: tl.constexpr, QUANT: tl.constexpr, LEVELS: tl.constexpr,
                    QMAX: tl.constexpr):
    """x [n_groups*GS] -> codes (packed at 4 bits), scale words [n_groups] (fp16-sized),
    fp16 zero [n_groups]."""
    grp = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG)     # group ids [BG]
    gmask = grp < n_groups
    offs = grp[:, None] * GS + tl.arange(0, GS)[None, :]            # element ids [BG, GS]
    x = _load_f32(x_ptr + offs, gmask[:, None], X_KIND)
    sw, sf, z16, zf, finite = _group_params(x, QUANT, LEVELS, QMAX)
    q = _codes(x, sf, zf, finite, QUANT, LEVELS, QMAX)
    _store_codes(codes_ptr, grp, q, gmask, GS, BITS, BG)
    tl.store(scale_ptr.to(tl.pointer_type(tl.int16)) + grp, sw, mask=gmask)
    if QUANT != 2:
        tl.store(zero_ptr + grp, z16, mask=gmask)


@triton.jit
def dequantize_kernel(codes_ptr, scale_ptr, zero_ptr, out_ptr, n_groups,
                      BG: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr,
                      QUANT: tl.constexpr, QMAX: tl.constexpr):
    """codes, scale words, fp16 zero -> fp32 out [n_groups*GS] = s * (q - z)."""
    grp = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG)
    gmask = grp < n_groups
    q = _load_codes(codes_ptr, grp, gmask, GS, BITS, BG)
    sf, zf = _load_params(scale_ptr, zero_ptr, grp, gmask, QUANT)
    offs = grp[:, None] * GS + tl.arange(0, GS)[None, :]
    tl.store(out_ptr + offs, _dequant(q, sf, zf, QUANT, QMAX), mask=gmask[:, None])


# ----------------------------------------------------------------------------- host wrappers

def _block_groups(group_size: int) -> int:
    """Groups per program: about 2048 values a program."""
    return max(1, 2048 // group_size)


def encode(x: torch.Tensor, spec: QuantSpec) -> Packet:
    """x [..., n] (n a multiple of g; fp32/fp16/bf16) -> Packet, byte-identical to quant.encode
    (NaN parameters canonical)."""
    if x.dtype not in DTYPE_KIND:
        raise ValueError(f"encode supports {list(DTYPE_KIND)}, got {x.dtype}")
    n = x.shape[-1] if x.dim() else 1
    if x.dim() == 0 or n % spec.group_size:
        raise ValueError(f"last dim {n} is not a multiple of group_size {spec.group_size}")
    lead = x.shape[:-1]
    xf = x.contiguous().reshape(-1)
    n_groups = xf.numel() // spec.group_size
    codes = torch.empty(xf.numel() * spec.bits // 8, dtype=torch.uint8, device=x.device)
    scale = torch.empty(n_groups, dtype=torch.float16, device=x.device)
    zero = torch.empty(n_groups, dtype=torch.float16, device=x.device) if spec.has_zero else None
    bg = _block_groups(spec.group_size)
    if n_groups:
        quantize_kernel[(triton.cdiv(n_groups, bg),)](
            xf, codes, scale, zero if zero is not None else scale, n_groups,
            X_KIND=DTYPE_KIND[x.dtype], BG=bg,
            **spec_constexprs(spec), **LAUNCH_OPTS)
    g_lead = n // spec.group_size
    return Packet(codes.reshape(*lead, n * spec.bits // 8), scale.reshape(*lead, g_lead),
                  zero.reshape(*lead, g_lead) if zero is not None else None)


def decode(packet: Packet, spec: QuantSpec) -> torch.Tensor:
    """Packet -> fp32 [..., n], identical to quant.decode."""
    codes, scale = packet.codes.contiguous(), packet.scale.contiguous()
    if spec.has_zero and packet.zero is None:
        raise ValueError(f"quantizer {spec.quantizer!r} needs a zero-point in the packet")
    zero = packet.zero.contiguous() if spec.has_zero else scale
    groups = scale.shape[-1]
    n = groups * spec.group_size
    lead = scale.shape[:-1]
    n_groups = scale.numel()
    if codes.numel() != n_groups * spec.group_size * spec.bits // 8:
        raise ValueError(f"codes hold {codes.numel()} bytes, expected "
                         f"{n_groups * spec.group_size * spec.bits // 8} for {n_groups} groups")
    out = torch.empty(*lead, n, dtype=torch.float32, device=codes.device)
    bg = _block_groups(spec.group_size)
    if n_groups:
        k = spec_constexprs(spec)
        dequantize_kernel[(triton.cdiv(n_groups, bg),)](
            codes, scale, zero, out, n_groups, BG=bg, GS=k["GS"], BITS=k["BITS"],
            QUANT=k["QUANT"], QMAX=k["QMAX"], **LAUNCH_OPTS)
    return out

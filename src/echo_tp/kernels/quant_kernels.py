"""Triton group quantizer and dequantizer, bit-exact with the torch reference (quant.py).

Device helpers (`_rint`, `_group_params` / `_range_params`, `_codes`, `_dequant`, packing, dtype
casts) are shared by the fused all-reduce kernels (allreduce_kernels.py); `quantize_kernel` /
`dequantize_kernel` with their host wrappers `encode` / `decode` are the standalone form, tested
against quant.encode / quant.decode on fresh random inputs (tests/test_kernels.py).

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
    scalar divisor into a reciprocal multiply), so every division here is div_rn too;
  * the outlier word (QuantSpec.outlier) is the constexpr OUTLIER: off, every helper compiles
    to the code it had before the word existed. On: `_outlier_slots` finds each group's slot
    and word and the other values' lo and hi, `_mark` writes the marker code
    there, `_put_outlier` / `_decode_regs` put the word back on decode.
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
    """The quantizer's compile-time constants for a spec (LEVELS: spec.levels, 2^b - 2 for an
    asymmetric spec with the outlier word)."""
    return dict(BITS=spec.bits, QUANT=QUANT_CODE[spec.quantizer], GS=spec.group_size,
                LEVELS=float(spec.levels), QMAX=float(spec.qmax), OUTLIER=spec.outlier)


# ----------------------------------------------------------------------------- tiling
# Every kernel that quantizes holds a step of SG groups as a 4-D block [V, SG, T, 8]: element
# (v, g, t, k) is value t*VT + v*8 + k of group g (VT values per thread, V = VT/8 runs of 8
# values, T = GS/VT threads per group). Triton's coalescing gives each thread the runs of one
# (g, t): the contiguous values [t*VT, (t+1)*VT) of its group, in V 16-byte accesses (2-byte
# values). So a group's min and max are VT-1 operations in the thread and log2(T) shuffles, and
# the per-group work (scale word, zero-point) runs once per VT values, not once per 8 (the 2-D
# [SG, GS] block put 16 threads on each group). Per-group values keep the rank: [1, SG, 1, 1].
# 4-bit codes travel as 32-bit words [V, SG, T], one per run of 8 values (element 8w+k in bits
# 4k..4k+3: byte t of a group holds elements 2t (low nibble) and 2t+1, as quant.pack4).

KMAGIC = tl.constexpr(12582912.0)
"""1.5 * 2^23: v + KMAGIC (|v| < 2^22) rounds v to an integer half-to-even, held in the low
mantissa bits (the sum's ulp is 1); its bit pattern is 0x4B400000 + the integer."""
WORD_OFFSET = tl.constexpr(0x3F400000)
"""sum_k (0x4B400000 << 4k) mod 2^32, k < 8: what 8 magic-rounded codes contribute to a
packed word beyond the codes themselves (see _pack4)."""


@triton.jit
def _lanes(GS: tl.constexpr, VT: tl.constexpr):
    """Offsets within a group, [V, 1, T, 8] int32: element (v, ., t, k) is value t*VT + v*8 + k."""
    V: tl.constexpr = VT // 8
    T: tl.constexpr = GS // VT
    return (tl.arange(0, V)[:, None, None, None] * 8 + tl.arange(0, T)[None, None, :, None] * VT
            + tl.arange(0, 8)[None, None, None, :])


@triton.jit
def _word_lanes(GS: tl.constexpr, VT: tl.constexpr):
    """Offsets within a group's 4-bit codes in 32-bit words, [V, 1, T]: word t*VT/8 + v holds
    the 8 codes of run (v, t)."""
    V: tl.constexpr = VT // 8
    T: tl.constexpr = GS // VT
    return tl.arange(0, V)[:, None, None] + tl.arange(0, T)[None, None, :] * V


@triton.jit
def _groups(first, SG: tl.constexpr):
    """Group ids first, ..., first+SG-1 as [1, SG, 1, 1] (first: int32 or int64 scalar)."""
    return first + tl.arange(0, SG)[None, :, None, None]


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _group_min_nan(x):
    """x [V, SG, T, 8] -> [1, SG, 1, 1] minimum per group, NaN if the group holds one
    (in-thread axes first, then the T threads of a group)."""
    r = tl.reduce(x, 3, _min_nan, keep_dims=True)
    r = tl.reduce(r, 0, _min_nan, keep_dims=True)
    return tl.reduce(r, 2, _min_nan, keep_dims=True)


@triton.jit
def _group_max_nan(x):
    """x [V, SG, T, 8] -> [1, SG, 1, 1] maximum per group, NaN if the group holds one."""
    r = tl.reduce(x, 3, _max_nan, keep_dims=True)
    r = tl.reduce(r, 0, _max_nan, keep_dims=True)
    return tl.reduce(r, 2, _max_nan, keep_dims=True)


@triton.jit
def _group_min(x):
    """x [V, SG, T, 8] -> [1, SG, 1, 1] minimum per group (tl.min: a builtin the interpreter
    runs as one numpy call)."""
    return tl.min(tl.min(tl.min(x, 3, keep_dims=True), 0, keep_dims=True), 2, keep_dims=True)


@triton.jit
def _group_max(x):
    """x [V, SG, T, 8] -> [1, SG, 1, 1] maximum per group (builtin, as _group_min)."""
    return tl.max(tl.max(tl.max(x, 3, keep_dims=True), 0, keep_dims=True), 2, keep_dims=True)


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
    """x [..] / sf (per group, broadcastable to x; the value of a finite scale word, in
    [2^-126, 2^126) so that 1/sf is a normal fp32), IEEE round to nearest.

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
        f = tl.where(sf < 5.9604644775390625e-08, 18446744073709551616.0, 1.0)   # per group
        sf = sf * f
        x = x * f
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [sf],
                                      dtype=tl.float32, is_pure=True, pack=1)
        nb = sf * -1.0
        y = tl.fma(r, tl.fma(nb, r, 1.0), r)             # refined 1/s, per group
        q0 = tl.fma(x, y, 0.0)
        v = tl.fma(y, tl.fma(nb, q0, x), q0)
    else:
        v = tl.math.div_rn(x, sf)
    return v


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
    """fp32 -> the output dtype, saturating (quant.saturate: clamp at the dtype's largest
    finite value, then round to nearest even; NaN stays NaN). Compiled, 16-bit outputs: one
    `cvt.rn.satfinite` per two values, which rounds and saturates the same way (a value past
    the largest finite one, infinities included, becomes it)."""
    if X_KIND == 0:
        out = _sat(v, F32_MAX)
    elif HW_FORMS:
        if X_KIND == 2:
            out = tl.inline_asm_elementwise("cvt.rn.satfinite.bf16x2.f32 $0, $2, $1;",
                                            "=r,r,r", [v], dtype=tl.bfloat16, is_pure=True,
                                            pack=2)
        else:
            out = tl.inline_asm_elementwise("cvt.rn.satfinite.f16x2.f32 $0, $2, $1;",
                                            "=r,r,r", [v], dtype=tl.float16, is_pure=True,
                                            pack=2)
    else:
        out = _cast_out(_sat_out(v, X_KIND), X_KIND)
    return out


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
    """fp32 steps s (per group; positive, 1.0 where not finite) -> int16 scale words
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
    """int16 scale words -> their fp32 steps (quant.scale_value; NaN for 0x7E00)."""
    bf = ((w.to(tl.int32) & 0x7FFF) << 16).to(tl.float32, bitcast=True)   # tagged: bf16
    return tl.where(w < 0, bf, w.to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _group_range(x):
    """x fp32 [V, SG, T, 8] -> per group [1, SG, 1, 1]: (lo, hi, finite); compiled, NaN in
    the group makes lo and hi NaN."""
    if HW_FORMS:
        lo = _group_min_nan(x)
        hi = _group_max_nan(x)
        finite = (lo >= -3.4028234663852886e38) & (hi <= 3.4028234663852886e38)
    else:   # the interpreter runs custom reductions element by element in Python: builtins
        finite = _group_min((tl.abs(x) <= 3.4028234663852886e38).to(tl.int32)) > 0
        lo = _group_min(x)
        hi = _group_max(x)
    return lo, hi, finite


@triton.jit
def _group_params(x, QUANT: tl.constexpr, LEVELS: tl.constexpr, QMAX: tl.constexpr):
    """x fp32 [V, SG, T, 8] -> per group [1, SG, 1, 1]: (scale words int16, sf fp32, z16 fp16,
    zf fp32, finite bool) (quant.group_params); the zero outputs are unused for the symmetric
    policy."""
    lo, hi, finite = _group_range(x)
    sw, sf, z16, zf = _range_params(lo, hi, finite, QUANT, LEVELS, QMAX)
    return sw, sf, z16, zf, finite


@triton.jit
def _range_params(lo, hi, finite, QUANT: tl.constexpr, LEVELS: tl.constexpr,
                  QMAX: tl.constexpr):
    """A group's lo, hi, finite ([1, SG, 1, 1]) -> (scale words int16, sf fp32, z16 fp16, zf
    fp32): quant.group_params' arithmetic after the min and max."""
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
    return sw, sf, z16, z16.to(tl.float32)


@triton.jit
def _codes(x, sf, zf, finite, QUANT: tl.constexpr, LEVELS: tl.constexpr, QMAX: tl.constexpr):
    """x fp32 [V, SG, T, 8] with per-group params -> the codes as magic-rounded fp32 (KMAGIC +
    code, exactly; code 0 in non-finite groups): `_code_bits` / `_pack4` store them, `- KMAGIC`
    is the code's value.

    Unfused form (quant.py): q = clip(round(x/s + z), 0, L), or clip(round(x/s), -Q, Q) + Q+1.
    Clipping to integer bounds commutes with rounding, so the value is clipped first; then one
    add of KMAGIC (+ Q+1, KMAGIC even) rounds it half-to-even: no float -> int conversion.
    Non-finite groups (NaN scale and zero-point): compiled, the asymmetric clip's PTX max/min
    return the bound for NaN, i.e. code 0 with no select; the interpreter (numpy's min/max
    propagate NaN) and the symmetric form select the code."""
    v = _div_by_scale(x, sf)
    if QUANT == 2:
        t = tl.minimum(tl.maximum(v, QMAX * -1.0), QMAX) + (KMAGIC + QMAX + 1.0)
        t = tl.where(finite, t, KMAGIC)
    else:
        t = tl.minimum(tl.maximum(v + zf, 0.0), LEVELS) + KMAGIC
        if not HW_FORMS:
            t = tl.where(finite, t, KMAGIC)
    return t


@triton.jit
def _dequant(qf, sf, zf, QUANT: tl.constexpr, QMAX: tl.constexpr, SAT: tl.constexpr):
    """Codes as exact fp32 values qf [V, SG, T, 8], per-group params -> fp32 s * (q - z)
    (quant.dequantize_groups); SAT: saturated at +-fp32 max, as the reference. Off only where
    every use saturates at the output dtype's smaller bound anyway (the tail's y)."""
    if QUANT == 2:
        out = sf * (qf - (QMAX + 1.0))
    else:
        out = sf * (qf - zf)
    if SAT:
        out = _sat(out, F32_MAX)
    return out


@triton.jit
def _inner_lanes(VT: tl.constexpr):
    """[V, 1, 1, 8] int32: a value's index among the VT a thread holds of its group (_lanes
    without the thread's base t*VT): a constant per register."""
    return tl.arange(0, VT // 8)[:, None, None, None] * 8 + tl.arange(0, 8)[None, None, None, :]


@triton.jit
def _outlier_slots(x, lo, hi, finite, GS: tl.constexpr, VT: tl.constexpr):
    """x fp32 [V, SG, T, 8] and its groups' lo, hi, finite ([1, SG, 1, 1], _group_range) ->
    (xo [V, SG, T, 8]: x with NaN at the outlier's slot, word fp16, lo', hi' [1, SG, 1, 1])
    (quant.outlier_slots): the outlier v = hi where hi >= -lo, else lo, taken where |v| is an
    fp16 normal and the group finite; its slot the first index holding v; its word fp16(v)
    (round to nearest even; +0.0 where the group takes none); lo' and hi' those of the other
    values, the min and max of xo that drop NaN (a group with a slot is finite).

    The slot travels as that NaN (`_mark` finds it), not as a predicate per value held live
    from here to the codes. One min reduction finds it (over the lane where x == v; a lane's
    in-thread part is a constant per register, `_inner_lanes`, so the min is a chain of
    selects; the thread's part base is added once)."""
    pos = hi >= lo * -1.0                                 # v = hi (NaN groups: v = lo, NaN)
    v = tl.where(pos, hi, lo)
    a = tl.abs(v)
    ok = (a >= 6.103515625e-05) & (a <= 65504.0) & finite   # fp16 normal: false for NaN, Inf
    inner = _inner_lanes(VT)
    base = tl.arange(0, GS // VT)[None, None, :, None] * VT   # [1, 1, T, 1]: the thread's
    first = tl.min(tl.min(tl.where(x == v, inner, GS), 3, keep_dims=True), 0, keep_dims=True)
    k = tl.min(first + base, 2, keep_dims=True)           # [1, SG, 1, 1]: v's first index
    slot = tl.where(ok, k, GS) - base                     # no slot: >= GS - base >= VT
    xo = tl.where(inner == slot, float("nan"), x)
    if HW_FORMS:                                          # PTX min / max drop NaN
        lo2 = _group_min(xo)
        hi2 = _group_max(xo)
    else:
        lo2 = _group_min(tl.where(xo == xo, xo, float("inf")))
        hi2 = _group_max(tl.where(xo == xo, xo, float("-inf")))
    return xo, tl.where(ok, v, 0.0).to(tl.float16), lo2, hi2


@triton.jit
def _marker(BITS: tl.constexpr, QUANT: tl.constexpr):
    """The marker code as an fp32 value (QuantSpec.marker): 2^b - 1 asymmetric, 0 symmetric."""
    if QUANT == 2:
        m = 0.0
    else:
        m = (1 << BITS) - 1.0
    return m


@triton.jit
def _mark(t, xo, finite, BITS: tl.constexpr, QUANT: tl.constexpr):
    """Magic-rounded codes t [V, SG, T, 8] with the marker code at the outlier slots: the NaN
    of xo (`_outlier_slots`) in a finite group."""
    return tl.where((xo != xo) & finite, KMAGIC + _marker(BITS, QUANT), t)


@triton.jit
def _put_outlier(out, qf, word, BITS: tl.constexpr, QUANT: tl.constexpr):
    """Decoded values out [V, SG, T, 8] with the outlier word (fp16 [1, SG, 1, 1]) at the
    slots whose code qf is the marker, in groups whose word is not 0 (quant.decode): a group
    without an outlier has word 0 and, when finite, no marker code; a NaN group's codes are
    0, the symmetric marker, and its values stay NaN."""
    wf = word.to(tl.float32)
    return tl.where((qf == _marker(BITS, QUANT)) & (wf != 0.0), wf, out)


@triton.jit
def _quantize(x, GS: tl.constexpr, VT: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
              LEVELS: tl.constexpr, QMAX: tl.constexpr, OUTLIER: tl.constexpr):
    """x fp32 [V, SG, T, 8] -> (scale words, sf, z16, zf, finite, magic-rounded codes t,
    word) (quant.encode's arithmetic). OUTLIER: the word of `_outlier_slots`, the marker code
    at the slot; off: word is a placeholder (z16), never read."""
    lo, hi, finite = _group_range(x)
    if OUTLIER:                                     # x: NaN at the slot, coded as the marker
        x, word, lo, hi = _outlier_slots(x, lo, hi, finite, GS, VT)
    sw, sf, z16, zf = _range_params(lo, hi, finite, QUANT, LEVELS, QMAX)
    t = _codes(x, sf, zf, finite, QUANT, LEVELS, QMAX)
    if OUTLIER:
        t = _mark(t, x, finite, BITS, QUANT)
    else:
        word = z16
    return sw, sf, z16, zf, finite, t, word


@triton.jit
def _decode_regs(t, sf, zf, word, BITS: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr,
                 SAT: tl.constexpr, OUTLIER: tl.constexpr):
    """What a receiver decodes from `_quantize`'s outputs, from registers: `_dequant` of the
    codes, OUTLIER: the word where the code is the marker (`_put_outlier`, as the receiver)."""
    qf = t - KMAGIC
    out = _dequant(qf, sf, zf, QUANT, QMAX, SAT)
    if OUTLIER:
        out = _put_outlier(out, qf, word, BITS, QUANT)
    return out


@triton.jit
def _pack4(t):
    """Magic-rounded codes [V, SG, T, 8] -> uint32 words [V, SG, T], code k in bits 4k..4k+3.
    Each code's bit pattern is 0x4B400000 + code, so sum_k bits_k << 4k (mod 2^32) is the word
    plus the constant WORD_OFFSET: one shift-add per code, one subtraction per word."""
    b = t.to(tl.uint32, bitcast=True)
    shifts = (tl.arange(0, 8) * 4).to(tl.uint32)[None, None, None, :]
    return (tl.sum(b << shifts, axis=3) - WORD_OFFSET).to(tl.uint32)


@triton.jit
def _unpack4(w):
    """uint32 words [V, SG, T] -> the codes' exact fp32 values [V, SG, T, 8] (2^23 + code has
    ulp 1: or the nibble into 2^23's bits, subtract 2^23)."""
    shifts = (tl.arange(0, 8) * 4).to(tl.uint32)[None, None, None, :]
    q = ((w[:, :, :, None] >> shifts) & 0xF) | 0x4B000000
    return q.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _store_codes(ptr, grp, gmask, t, GS: tl.constexpr, BITS: tl.constexpr, VT: tl.constexpr):
    """Write the magic-rounded codes t [V, SG, T, 8] of groups grp [1, SG, 1, 1] at ptr
    (uint8*, group-major; 4-bit: packed words)."""
    if BITS == 4:
        words = tl.reshape(grp, (1, grp.shape[1], 1)) * (GS // 8) + _word_lanes(GS, VT)
        wmask = tl.reshape(gmask, (1, gmask.shape[1], 1))
        tl.store(ptr.to(tl.pointer_type(tl.uint32)) + words, _pack4(t), mask=wmask)
    else:
        q = (t.to(tl.int32, bitcast=True) & 0xFF).to(tl.uint8)
        tl.store(ptr + grp * GS + _lanes(GS, VT), q, mask=gmask)


@triton.jit
def _load_codes(ptr, grp, gmask, GS: tl.constexpr, BITS: tl.constexpr, VT: tl.constexpr):
    """Read the codes of groups grp [1, SG, 1, 1] at ptr as exact fp32 values [V, SG, T, 8]
    (inverse of _store_codes; masked groups read code 0)."""
    if BITS == 4:
        words = tl.reshape(grp, (1, grp.shape[1], 1)) * (GS // 8) + _word_lanes(GS, VT)
        wmask = tl.reshape(gmask, (1, gmask.shape[1], 1))
        w = tl.load(ptr.to(tl.pointer_type(tl.uint32)) + words, mask=wmask, other=0,
                    cache_modifier=".cg")
        qf = _unpack4(w)
    else:
        q = tl.load(ptr + grp * GS + _lanes(GS, VT), mask=gmask, other=0, cache_modifier=".cg")
        qf = (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return qf


@triton.jit
def _store_words(ptr, v, mask):
    """Per-group 16-bit words v ([1, SG, 1, 1], int16 or fp16) at ptr (same shape) where mask.
    Compiled: one st.global.b16 per element in v's own layout (the T threads of a group store
    the same word, harmlessly), where tl.store would first move v through shared memory into
    a layout of its own (a barrier per store); interpreted: tl.store."""
    if HW_FORMS:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b16 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,h,r", [ptr.to(tl.int64), v.to(tl.int16, bitcast=True), mask.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, v, mask=mask)


@triton.jit
def _load_word(ptr, grp, mask):
    """The fp16 outlier words of groups grp at ptr (fp16*; masked lanes: 0.0, no outlier)."""
    return tl.load(ptr + grp, mask=mask, other=0.0, cache_modifier=".cg")


@triton.jit
def _load_params(scale_ptr, zero_ptr, grp, mask, QUANT: tl.constexpr):
    """Scale word (fp16-sized, at scale_ptr) and fp16 zero of groups grp -> fp32 (sf, zf)
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
def quantize_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, n_groups, outlier_ptr,
                    X_KIND: tl.constexpr, BG: tl.constexpr, GS: tl.constexpr, VT: tl.constexpr,
                    BITS: tl.constexpr, QUANT: tl.constexpr, LEVELS: tl.constexpr,
                    QMAX: tl.constexpr, OUTLIER: tl.constexpr):
    """x [n_groups*GS] -> codes (packed at 4 bits), scale words [n_groups] (fp16-sized),
    fp16 zero [n_groups], OUTLIER: fp16 outlier words [n_groups]; BG groups a program (module
    tiling)."""
    grp = _groups(tl.program_id(0).to(tl.int64) * BG, BG)           # [1, BG, 1, 1]
    gmask = grp < n_groups
    x = _load_f32(x_ptr + grp * GS + _lanes(GS, VT), gmask, X_KIND)  # [V, BG, T, 8]
    sw, sf, z16, zf, finite, t, word = _quantize(x, GS, VT, BITS, QUANT, LEVELS, QMAX,
                                                       OUTLIER)
    _store_codes(codes_ptr, grp, gmask, t, GS, BITS, VT)
    _store_words(scale_ptr.to(tl.pointer_type(tl.int16)) + grp, sw, gmask)
    if QUANT != 2:
        _store_words(zero_ptr + grp, z16, gmask)
    if OUTLIER:
        _store_words(outlier_ptr + grp, word, gmask)


@triton.jit
def dequantize_kernel(codes_ptr, scale_ptr, zero_ptr, out_ptr, n_groups, outlier_ptr,
                      BG: tl.constexpr, GS: tl.constexpr, VT: tl.constexpr, BITS: tl.constexpr,
                      QUANT: tl.constexpr, QMAX: tl.constexpr, OUTLIER: tl.constexpr):
    """codes, scale words, fp16 zero (OUTLIER: and outlier words) -> fp32 out [n_groups*GS] =
    s * (q - z), the outlier word at a marked slot."""
    grp = _groups(tl.program_id(0).to(tl.int64) * BG, BG)
    gmask = grp < n_groups
    qf = _load_codes(codes_ptr, grp, gmask, GS, BITS, VT)
    sf, zf = _load_params(scale_ptr, zero_ptr, grp, gmask, QUANT)
    dst = out_ptr + grp * GS + _lanes(GS, VT)
    out = _dequant(qf, sf, zf, QUANT, QMAX, True)
    if OUTLIER:
        out = _put_outlier(out, qf, _load_word(outlier_ptr, grp, gmask), BITS, QUANT)
    tl.store(dst, out, mask=gmask)


# ----------------------------------------------------------------------------- host wrappers

def values_per_thread(group_size: int, step: int, num_warps: int) -> int:
    """VT of the module tiling for a step of `step` values on num_warps warps: the step spread
    over every thread, at least 8 (one 16-byte run) and at most the group."""
    vt = max(8, step // (32 * num_warps))
    return min(group_size, 1 << (vt.bit_length() - 1))


def _block_groups(group_size: int) -> int:
    """Groups per program: about 4096 values a program."""
    return max(1, 4096 // group_size)


def _block_launch(group_size: int) -> dict:
    """BG, VT and num_warps of the standalone kernels (32 values a thread where groups allow)."""
    bg = _block_groups(group_size)
    vt = min(group_size, 32)
    return dict(BG=bg, VT=vt, num_warps=max(1, min(8, bg * group_size // vt // 32)))


def encode(x: torch.Tensor, spec: QuantSpec) -> Packet:
    """x [..., n] (n a multiple of g; fp32/fp16/bf16) -> Packet (with outlier words for an
    outlier spec), byte-identical to quant.encode (NaN parameters canonical)."""
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
    outlier = torch.empty(n_groups, dtype=torch.float16, device=x.device) \
        if spec.outlier else None
    blk = _block_launch(spec.group_size)
    if n_groups:
        quantize_kernel[(triton.cdiv(n_groups, blk["BG"]),)](
            xf, codes, scale, zero if zero is not None else scale, n_groups,
            outlier if outlier is not None else scale,
            X_KIND=DTYPE_KIND[x.dtype], **blk, **spec_constexprs(spec), **LAUNCH_OPTS)
    g_lead = n // spec.group_size
    words = [None if w is None else w.reshape(*lead, g_lead) for w in (zero, outlier)]
    return Packet(codes.reshape(*lead, n * spec.bits // 8), scale.reshape(*lead, g_lead),
                  *words)


def decode(packet: Packet, spec: QuantSpec) -> torch.Tensor:
    """Packet -> fp32 [..., n], identical to quant.decode."""
    codes, scale = packet.codes.contiguous(), packet.scale.contiguous()
    if spec.has_zero and packet.zero is None:
        raise ValueError(f"quantizer {spec.quantizer!r} needs a zero-point in the packet")
    zero = packet.zero.contiguous() if spec.has_zero else scale
    if spec.outlier and (packet.outlier is None or packet.outlier.shape != scale.shape):
        raise ValueError("a packet of an outlier spec needs its outlier words, one per group")
    outlier = packet.outlier.contiguous() if spec.outlier else scale
    groups = scale.shape[-1]
    n = groups * spec.group_size
    lead = scale.shape[:-1]
    n_groups = scale.numel()
    if codes.numel() != n_groups * spec.group_size * spec.bits // 8:
        raise ValueError(f"codes hold {codes.numel()} bytes, expected "
                         f"{n_groups * spec.group_size * spec.bits // 8} for {n_groups} groups")
    out = torch.empty(*lead, n, dtype=torch.float32, device=codes.device)
    blk = _block_launch(spec.group_size)
    if n_groups:
        k = spec_constexprs(spec)
        dequantize_kernel[(triton.cdiv(n_groups, blk["BG"]),)](
            codes, scale, zero, out, n_groups, outlier, GS=k["GS"], BITS=k["BITS"],
            QUANT=k["QUANT"], QMAX=k["QMAX"], OUTLIER=k["OUTLIER"], **blk, **LAUNCH_OPTS)
    return out

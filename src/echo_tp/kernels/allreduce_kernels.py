"""Fused compensated quantized all-reduce: the entry, reduce and tail stages as Triton kernels.

Unfused equivalent: collective/qar.py `compensated_all_reduce` (same operations, same order, so
y and the compensator state are bit-identical). Per rank r, with P ranks, segment length seg:

  entry  (grid tiles x P-1)  x' = x + eta*(a*m1 + (1-a)*m2) [* 2^e]; quantize tile t of every
         segment j != r; write it into rank j's receive slot r; signal rank j's flag recv[r][t].
         residual 'local': m1, m2 of the sent elements are updated here with x'_j - x^_j.
  reduce (grid tiles)        wait recv[s][t] for every sender s; acc = contrib_0 + contrib_1 + ...
         in rank order (own contribution = x', unquantized); requantize once; write the packet
         into every rank's gather slot r; signal gath[r][t] on every rank. y of the own
         segment = the decode of that packet, from registers (OWN_Y; not when the tail updates
         the output residual). residual 'local': m1, m2 of the own segment are updated with
         s - y_own.
  tail   (grid tiles x P, or P-1 owners with OWN_Y)    wait gath[j][t]; decode;
         y = cast(y32 [/ 2^e]) (saturating); residual 'output': u = x' - y/P and the m1, m2 update.
  ADD (reduce's own y, tail; a constexpr: off, the kernels are as without it): the store is
         cast(residual + y) instead of y, torch's `residual + y` bit for bit (the block
         boundary's residual add, done where y is decoded: norm.add_rmsnorm_reference's
         `r = residual + y`); every compensator update still reads y itself.
  reduce_tail (overlap 'launch'): reduce and tail in one launch, the tails trailing the reduces
         by `lag` tiles (work items in ticket order).
  fused  (grid G programs): entry, reduce and tail of tiles c, c+G, ... in one launch.
  HALF (the reduce kernel's constexpr; 0: the all-reduce, as above) runs the two halves of the
         all-reduce on the layout of P*m values (segment = chunk of m, m a multiple of g),
         unfused equivalent collective/sharded.py:
         reduce-scatter = entry, then reduce with HALF=1: y [m] = cast(acc [/ 2^e]), no
           requantization; the own chunk's m1, m2 updated with u = 0 (LOCAL);
         all-gather = reduce with HALF=2 (x [m], no waits, no sum: x' encoded, pushed into
           every rank's gather slot RANK, u = x' - x^), then tail over all P owners (FIRST=0).

Every rank owns one byte buffer (`Layout`), symmetric across ranks; `table` [P+1] int64 holds the
P buffers' addresses as seen from this rank, then the address of its error record. Flag arrays
have `stride` tiles (the room's: calls of any length share the buffer, `tiles` is the call's).
Header: before each release a sender stores its call word (flags.call_word: n, GS, BITS,
QUANT, OUTLIER, X_KIND) beside the flag (recv by the entry, gath by the reduce); the reduce and
the tail compare the word of every packet they waited for with their own (flags.refuse):
a different call records the mismatch and aborts the rank, and y is NaN where the tile's
waits or checks failed (`_store_y_or_nan`). The same
kernels run on P GPUs (collective/p2p.py, buffers in symmetric memory) and on P simulated ranks
in one process (collective/simulated_fused.py, the CPU test under TRITON_INTERPRET=1): stages
launched in order entry(all ranks), reduce(all), tail(all) find every flag already set.
Host side (buffer layout, the per-call launch plan): kernels/allreduce_plan.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .flags import call_word, first_other_call, gated, refuse, same_call, signal, wait_geq
from .quant_kernels import (F32_MAX, _cast_out, _cast_sat, _decode_regs, _dequant, _groups,
                            _lanes, _load_codes, _load_f32, _load_word, _put_outlier, _quantize,
                            _sat, _store_codes, _store_words, _word_scale)



# ----------------------------------------------------------------------------- device helpers

@triton.jit
def _x_prime(x_ptr, m1_ptr, m2_ptr, e, emask, eta, a, oma, X_KIND: tl.constexpr,
             COMP: tl.constexpr):
    """x' = x + (m1*a + m2*(1-a))*eta at element ids e (masked lanes 0) -> (x', m1, m2);
    x' of a finite x saturates at +-fp32 max (compensator.apply_correction)."""
    x = _load_f32(x_ptr + e, emask, X_KIND)
    if COMP:
        m1 = _load_state(m1_ptr + e, emask)
        if COMP == 1:                                      # one state tensor (beta1 == beta2)
            m2 = m1
        else:
            m2 = _load_state(m2_ptr + e, emask)
        xp = x + (m1 * a + m2 * oma) * eta
        xp = tl.where(tl.abs(x) <= F32_MAX, _sat(xp, F32_MAX), xp)
    else:
        m1 = x
        m2 = x
        xp = x
    return xp, m1, m2


@triton.jit
def _x_scaled(x_ptr, m1_ptr, m2_ptr, fs_ptr, e, emask, eta, a, oma, X_KIND: tl.constexpr,
              COMP: tl.constexpr, SCALED: tl.constexpr):
    """_x_prime, plus xs = x' * 2^e and f = 2^e under backward scaling (xs = x', f = 1 else)
    -> (x', m1, m2, xs, f)."""
    xp, m1, m2 = _x_prime(x_ptr, m1_ptr, m2_ptr, e, emask, eta, a, oma, X_KIND, COMP)
    if SCALED:
        f = tl.load(fs_ptr)
        xs = xp * f
    else:
        f = tl.full([], 1.0, tl.float32)
        xs = xp
    return xp, m1, m2, xs, f


@triton.jit
def _load_state(ptr, mask):
    """Compensator state as fp32: fp32 as is, bf16 widened exactly (the pointer's dtype,
    a compile-time choice)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        v = _load_f32(ptr, mask, 2)
    else:
        v = tl.load(ptr, mask=mask, other=0.0)
    return v


@triton.jit
def _store_state(ptr, v, mask):
    """fp32 values into the state: as is, or rounded once to bf16 (RNE, saturating)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        tl.store(ptr, _cast_sat(v, 2), mask=mask)
    else:
        tl.store(ptr, v, mask=mask)


@triton.jit
def _update(m1_ptr, m2_ptr, e, emask, m1, m2, u, b1, omb1, b2, omb2, COMP: tl.constexpr):
    """m1 = m1*beta1 + u*(1-beta1); m2 = m2*beta2 + u*(1-beta2) at element ids e, 0 where the
    new value is not finite (compensator.update_; COMP 1, one state tensor: one store, beta1
    == beta2 makes both updates the same value)."""
    _store_state(m1_ptr + e, _finite_or_0(m1 * b1 + u * omb1), emask)
    if COMP != 1:
        _store_state(m2_ptr + e, _finite_or_0(m2 * b2 + u * omb2), emask)


@triton.jit
def _finite_or_0(v):
    """v fp32 with NaN and +-Inf replaced by 0 (the state never holds a non-finite value)."""
    return tl.where(tl.abs(v) <= F32_MAX, v, 0.0)


@triton.jit
def _as_f32_of_out(v, X_KIND: tl.constexpr):
    """fp32 value of the saturating cast of v to the output dtype (what y.to(float32) reads
    back)."""
    return _cast_sat(v, X_KIND).to(tl.float32)


@triton.jit
def _store_y(y_ptr, res_ptr, e, emask, y32, X_KIND: tl.constexpr, ADD: tl.constexpr):
    """y = cast_sat(y32) [V, SG, T, 8] at element ids e; ADD: residual + y there instead, i.e.
    torch's `residual + y` of the two output-dtype tensors: their fp32 values added, rounded
    once to the dtype (RNE, inf on overflow: no saturation, as torch)."""
    if ADD:
        s = _load_f32(res_ptr + e, emask, X_KIND) + _as_f32_of_out(y32, X_KIND)
        tl.store(y_ptr + e, _cast_out(s, X_KIND), mask=emask)
    else:
        tl.store(y_ptr + e, _cast_sat(y32, X_KIND), mask=emask)


@triton.jit
def _headers(flags, P: tl.constexpr, stride):
    """int64* of a buffer's call words (Layout: after recv, gath and the abort word):
    recv headers [P][stride], then gath headers [P][stride]."""
    return flags + 2 * P * stride + 1


@triton.jit
def _store_y_or_nan(y_ptr, res_ptr, e, emask, y32, ok, X_KIND: tl.constexpr,
                    ADD: tl.constexpr):
    """_store_y where ok (a scalar: the tile's waits and header checks), else NaN at e: a
    failed call's output is NaN, never stale memory. The path that runs when ok is the gated
    store alone (the NaN stores sit behind a branch on the scalar)."""
    _store_y(y_ptr, res_ptr, e, gated(emask, ok), y32, X_KIND, ADD)
    failed = ok == 0
    if failed:
        _store_y(y_ptr, res_ptr, e, emask, tl.full(y32.shape, float("nan"), tl.float32),
                 X_KIND, ADD)


@triton.jit
def _depart(count_ptr, programs, word_ptr, value):
    """This program is done with the call: count it; the last of `programs` sets *word_ptr =
    value and the count back to 0 (every program read *word_ptr before it departed, and the
    next call starts after this launch ends: stream order)."""
    tl.debug_barrier()
    d = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if d == programs - 1:
        tl.store(word_ptr, value)
        tl.store(count_ptr, d * 0)


@triton.jit
def _slot(k, slot):
    """Byte offset of slot k (int64: buffers of large messages pass 2^31 bytes)."""
    return (tl.zeros([], tl.int64) + k) * slot


@triton.jit
def _buffer(table_ptr, rank):
    """uint8* base of `rank`'s buffer (16-byte aligned)."""
    return tl.multiple_of(tl.load(table_ptr + rank).to(tl.pointer_type(tl.uint8)), 16)


@triton.jit
def _outlier_off(scale_off, zero_off, QUANT: tl.constexpr):
    """Byte offset of a slot's outlier words (Layout.outlier_off): the region after the zeros,
    which are as long as the scale words' region (asymmetric), or at zero_off (symmetric: no
    zeros there)."""
    if QUANT == 2:
        off = zero_off
    else:
        off = zero_off + (zero_off - scale_off)
    return off


@triton.jit
def _store_packet(dst, scale_off, zero_off, grp, gmask, t, sw, z16, word, GS: tl.constexpr,
                  BITS: tl.constexpr, VT: tl.constexpr, QUANT: tl.constexpr,
                  OUTLIER: tl.constexpr):
    """Write one step (groups grp [1, SG, 1, 1], magic-rounded codes t [V, SG, T, 8]) of a
    packet into the slot at dst: codes | scale words (int16) | fp16 zeros | OUTLIER: fp16
    outlier words."""
    _store_codes(dst, grp, gmask, t, GS, BITS, VT)
    _store_words((dst + scale_off).to(tl.pointer_type(tl.int16)) + grp, sw, gmask)
    if QUANT != 2:
        _store_words((dst + zero_off).to(tl.pointer_type(tl.float16)) + grp, z16, gmask)
    if OUTLIER:
        _store_words((dst + _outlier_off(scale_off, zero_off, QUANT)).to(
            tl.pointer_type(tl.float16)) + grp, word, gmask)


@triton.jit
def _decode_slot(src, scale_off, zero_off, grp, gmask, GS: tl.constexpr, BITS: tl.constexpr,
                 VT: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr, SAT: tl.constexpr,
                 OUTLIER: tl.constexpr):
    """One step of the packet in the slot at src -> fp32 [V, SG, T, 8] (SAT: _dequant's;
    OUTLIER: the outlier words put back at the marked slots)."""
    qf = _load_codes(src, grp, gmask, GS, BITS, VT)
    sf = _word_scale(tl.load((src + scale_off).to(tl.pointer_type(tl.int16)) + grp, mask=gmask,
                             other=0x3C00, cache_modifier=".cg"))         # masked lanes: 1.0
    if QUANT == 2:
        zf = sf
    else:
        zf = tl.load((src + zero_off).to(tl.pointer_type(tl.float16)) + grp, mask=gmask,
                     other=0.0, cache_modifier=".cg").to(tl.float32)
    out = _dequant(qf, sf, zf, QUANT, QMAX, SAT)
    if OUTLIER:
        word = _load_word((src + _outlier_off(scale_off, zero_off, QUANT)).to(
            tl.pointer_type(tl.float16)), grp, gmask)
        out = _put_outlier(out, qf, word, BITS, QUANT)
    return out


# ----------------------------------------------------------------------------- backward scale

@triton.jit
def amax_kernel(x_ptr, m1_ptr, m2_ptr, out_ptr, n, eta, a, oma, X_KIND: tl.constexpr,
                COMP: tl.constexpr, BLOCK: tl.constexpr):
    """out[pid] = max |x'| over a block (NaN counts as +inf: both make the scale factor 1)."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    emask = e < n
    xp, m1, m2 = _x_prime(x_ptr, m1_ptr, m2_ptr, e, emask, eta, a, oma, X_KIND, COMP)
    inf = tl.full([BLOCK], 0x7F800000, tl.int32).to(tl.float32, bitcast=True)
    v = tl.abs(xp)
    v = tl.where(v != v, inf, v)
    tl.store(out_ptr + tl.program_id(0), tl.max(tl.where(emask, v, 0.0), axis=0))


@triton.jit
def _step_ids(t, c, j, seg, groups, n, BG: tl.constexpr, SG: tl.constexpr, GS: tl.constexpr,
              VT: tl.constexpr):
    """Step c of tile t in segment j (quant_kernels' tiling): its groups grp [1, SG, 1, 1]
    (within a segment), their mask, the element ids e [V, SG, T, 8] (int64, within x) and
    theirs."""
    grp = _groups(t * BG + c * SG, SG)
    gmask = grp < groups
    e = (tl.zeros([], tl.int64) + j) * seg + grp * GS + _lanes(GS, VT)
    return grp, gmask, e, gmask & (e < n)


# ----------------------------------------------------------------------------- per-tile stages
# One tile of one stage; the stage kernels below run one per program, the fused kernel runs all
# three in a loop. `ep` is the call's epoch (what flags are set to and waited for).

@triton.jit
def _entry_tile(t, j, ep, x_ptr, m1_ptr, m2_ptr, fs_ptr, table_ptr,
                n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride,
                eta, a, oma, b1, omb1, b2, omb2,
                RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                SG: tl.constexpr, GS: tl.constexpr, VT: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                LEVELS: tl.constexpr, QMAX: tl.constexpr, COMP: tl.constexpr,
                SCALED: tl.constexpr, LOCAL: tl.constexpr, OUTLIER: tl.constexpr):
    """Quantize tile t of segment j (!= RANK) and push it to owner j; signal recv[RANK][t].
    The tile's BG groups go in steps of SG: each step's remote stores stay in flight while the
    next step computes, and one release (a system-scope fence) covers the whole tile."""
    peer = _buffer(table_ptr, j)
    for c in tl.range(0, BG // SG):
        grp, gmask, e, emask = _step_ids(t, c, j, seg, groups, n, BG, SG, GS, VT)
        sw, z16, word, q, m1, m2, err = _entry_step(
            x_ptr, m1_ptr, m2_ptr, fs_ptr, e, emask, eta, a, oma, X_KIND, GS, VT, BITS, QUANT,
            LEVELS, QMAX, COMP, SCALED, LOCAL, OUTLIER)
        _store_packet(peer + _slot(RANK, slot), scale_off, zero_off, grp, gmask, q, sw, z16,
                      word, GS, BITS, VT, QUANT, OUTLIER)  # peer j's receive slot of RANK
        if LOCAL:
            _update(m1_ptr, m2_ptr, e, emask, m1, m2, err, b1, omb1, b2, omb2, COMP)
    pf = (peer + flags_off).to(tl.pointer_type(tl.int64))
    tl.store(_headers(pf, P, stride) + RANK * stride + t,
             call_word(n, GS, BITS, QUANT, OUTLIER, X_KIND))     # recv header, then its flag
    signal(pf + RANK * stride + t, ep)


@triton.jit
def _entry_step(x_ptr, m1_ptr, m2_ptr, fs_ptr, e, emask, eta, a, oma, X_KIND: tl.constexpr,
                GS: tl.constexpr, VT: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                LEVELS: tl.constexpr, QMAX: tl.constexpr, COMP: tl.constexpr,
                SCALED: tl.constexpr, LOCAL: tl.constexpr, OUTLIER: tl.constexpr):
    """The arithmetic of one entry step: x', its group parameters and codes and, LOCAL, the
    rounding error x' - x^ [/ 2^e] -> (scale words, z16, outlier words, codes, m1, m2,
    error)."""
    xp, m1, m2, xs, f = _x_scaled(x_ptr, m1_ptr, m2_ptr, fs_ptr, e, emask, eta, a, oma,
                                  X_KIND, COMP, SCALED)
    sw, sf, z16, zf, finite, q, word = _quantize(xs, GS, VT, BITS, QUANT, LEVELS, QMAX,
                                                       OUTLIER)
    if LOCAL:
        err = xs - _decode_regs(q, sf, zf, word, BITS, QUANT, QMAX, True, OUTLIER)  # x' - x^
        if SCALED:
            err = err * tl.math.div_rn(tl.full([], 1.0, tl.float32), f)
    else:
        err = xs
    return sw, z16, word, q, m1, m2, err


@triton.jit
def _reduce_tile(t, ep, x_ptr, m1_ptr, m2_ptr, y_ptr, res_ptr, fs_ptr, table_ptr,
                 n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride, timeout,
                 eta, a, oma, b1, omb1, b2, omb2,
                 RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                 SG: tl.constexpr, GS: tl.constexpr, VT: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                 LEVELS: tl.constexpr, QMAX: tl.constexpr, COMP: tl.constexpr,
                 SCALED: tl.constexpr, LOCAL: tl.constexpr, USE_TIMER: tl.constexpr,
                 OWN_Y: tl.constexpr, ADD: tl.constexpr, HALF: tl.constexpr,
                 OUTLIER: tl.constexpr):
    """Owner sum of tile t of the own segment, requantized and pushed to every rank's gather
    slot RANK; signal gath[RANK][t] everywhere. Waits once, then steps of SG groups.
    OWN_Y: also y of these elements, decoded from the registers exactly as the tail would
    decode the own gather slot (the tail then skips the own segment); ADD: residual + y.
    HALF (0: the all-reduce's reduce, as described) selects a half of it instead:
      1  reduce-scatter: the owner sum (saturated, [/ 2^e]) is this rank's output y [seg]
         (at e - RANK*seg); no requantization, no push, no gath signal; LOCAL: m1, m2 of the
         own segment updated with u = 0 (it was never quantized).
      2  all-gather's entry: no waits and no sum; x [seg] is the own shard (ids from 0):
         x' encoded once, pushed into every rank's gather slot RANK and gath[RANK][t]
         signalled; LOCAL: m1, m2 updated with x' - decode(encode(x')) [/ 2^e]."""
    own = _buffer(table_ptr, RANK)
    flags = (own + flags_off).to(tl.pointer_type(tl.int64))   # recv [P][tiles], gath [P][tiles]
    abort = flags + 2 * P * stride
    err_rec = tl.load(table_ptr + P).to(tl.pointer_type(tl.int64))
    ok = ep == ep
    mine = call_word(n, GS, BITS, QUANT, OUTLIER, X_KIND)
    if HALF != 2:
        for r in tl.static_range(P):
            if r != RANK:
                ok = ok & wait_geq(flags + r * stride + t, ep, abort, err_rec, RANK, 1, t, r,
                                   timeout, USE_TIMER)
        peer, seen = first_other_call(_headers(flags, P, stride), stride, t, mine, RANK, P)
        ok = refuse(ok, peer, seen, mine, abort, err_rec, RANK, 4, t)   # the senders' calls
    for c in tl.range(0, BG // SG):
        if HALF == 2:
            grp, gmask, e, emask = _step_ids(t, c, 0, seg, groups, n, BG, SG, GS, VT)
        else:
            grp, gmask, e, emask = _step_ids(t, c, RANK, seg, groups, n, BG, SG, GS, VT)
        m1, m2, xs, f, acc = _owner_sum(
            x_ptr, m1_ptr, m2_ptr, fs_ptr, own, e, emask, grp, gmask, slot, scale_off, zero_off,
            eta, a, oma, RANK, P, X_KIND, GS, VT, BITS, QUANT, QMAX, COMP, SCALED, HALF,
            OUTLIER)
        if HALF == 1:
            if SCALED:
                acc = acc * tl.math.div_rn(tl.full([], 1.0, tl.float32), f)
            _store_y_or_nan(y_ptr, res_ptr, e - _slot(RANK, seg), emask, acc, ok, X_KIND,
                            False)                                # y [seg]: chunk RANK of the sum
            if LOCAL:
                _update(m1_ptr, m2_ptr, e, gated(emask, ok), m1, m2, tl.zeros_like(acc), b1,
                        omb1, b2, omb2, COMP)
        else:
            sw, sf, z16, zf, finite, q, word = _quantize(acc, GS, VT, BITS, QUANT,
                                                                LEVELS, QMAX, OUTLIER)
            pmask = gated(gmask, ok)
            for i in tl.static_range(P):                   # own slot last
                dst = _buffer(table_ptr, (RANK + 1 + i) % P) + _slot(P + RANK, slot)
                _store_packet(dst, scale_off, zero_off, grp, pmask, q, sw, z16, word, GS, BITS,
                              VT, QUANT, OUTLIER)
            if HALF == 2:
                if LOCAL:
                    u = xs - _decode_regs(q, sf, zf, word, BITS, QUANT, QMAX, True,
                                          OUTLIER)                    # x' - x^
                    if SCALED:
                        u = u * tl.math.div_rn(tl.full([], 1.0, tl.float32), f)
                    _update(m1_ptr, m2_ptr, e, emask, m1, m2, u, b1, omb1, b2, omb2, COMP)
            elif LOCAL or OWN_Y:
                y32 = _decode_regs(q, sf, zf, word, BITS, QUANT, QMAX, SCALED,
                                   OUTLIER)                       # the packet's decode
                if SCALED:
                    inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), f)
                    y32 = y32 * inv
                if OWN_Y:
                    _store_y_or_nan(y_ptr, res_ptr, e, emask, y32, ok, X_KIND, ADD)
                if LOCAL:
                    if SCALED:
                        u = acc * inv - _as_f32_of_out(y32, X_KIND)
                    else:
                        u = acc - _as_f32_of_out(y32, X_KIND)
                    _update(m1_ptr, m2_ptr, e, gated(emask, ok), m1, m2, u, b1, omb1, b2,
                            omb2, COMP)
    if HALF != 1:
        if ok:
            for i in tl.static_range(P):
                pf = (_buffer(table_ptr, (RANK + 1 + i) % P) + flags_off).to(
                    tl.pointer_type(tl.int64))
                tl.store(_headers(pf, P, stride) + (P + RANK) * stride + t, mine)
                signal(pf + (P + RANK) * stride + t, ep)


@triton.jit
def _owner_sum(x_ptr, m1_ptr, m2_ptr, fs_ptr, own, e, emask, grp, gmask, slot, scale_off,
               zero_off, eta, a, oma, RANK: tl.constexpr, P: tl.constexpr,
               X_KIND: tl.constexpr, GS: tl.constexpr, VT: tl.constexpr, BITS: tl.constexpr,
               QUANT: tl.constexpr, QMAX: tl.constexpr, COMP: tl.constexpr,
               SCALED: tl.constexpr, HALF: tl.constexpr, OUTLIER: tl.constexpr):
    """One reduce step's x' [* 2^e] and owner sum acc = c_0 + c_1 + ... in rank order (the own
    contribution x' unquantized, each decoded packet and the sum of a finite x' saturated at
    +-fp32 max; HALF 2: acc = x') -> (m1, m2, xs, f, acc)."""
    xp, m1, m2, xs, f = _x_scaled(x_ptr, m1_ptr, m2_ptr, fs_ptr, e, emask, eta, a, oma,
                                  X_KIND, COMP, SCALED)
    if HALF == 2:
        acc = xs                                           # the own shard, quantized once
    else:
        for r in tl.static_range(P):                       # acc = c_0; acc = acc + c_1; ...
            if r == RANK:
                v = xs
            else:
                v = _decode_slot(own + _slot(r, slot), scale_off, zero_off, grp, gmask,
                                 GS, BITS, VT, QUANT, QMAX, True, OUTLIER)
            if r == 0:
                acc = v
            else:
                acc = acc + v
        acc = tl.where(tl.abs(xs) <= F32_MAX, _sat(acc, F32_MAX), acc)   # a finite own x':
    return m1, m2, xs, f, acc                                              # no overflow


@triton.jit
def _tail_tile(t, j, ep, x_ptr, m1_ptr, m2_ptr, y_ptr, res_ptr, fs_ptr, table_ptr,
               n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride, timeout,
               eta, a, oma, b1, omb1, b2, omb2,
               RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
               SG: tl.constexpr, GS: tl.constexpr, VT: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
               QMAX: tl.constexpr, PF: tl.constexpr, COMP: tl.constexpr,
               SCALED: tl.constexpr, OUTPUT: tl.constexpr, USE_TIMER: tl.constexpr,
               ADD: tl.constexpr, OUTLIER: tl.constexpr):
    """Wait gath[j][t]; decode tile t of owner j's packet into y (ADD: residual + y), and the
    output-residual update (from y), in steps of SG groups."""
    own = _buffer(table_ptr, RANK)
    flags = (own + flags_off).to(tl.pointer_type(tl.int64))
    err_rec = tl.load(table_ptr + P).to(tl.pointer_type(tl.int64))
    ok = wait_geq(flags + (P + j) * stride + t, ep, flags + 2 * P * stride, err_rec, RANK, 2,
                  t, j, timeout, USE_TIMER)
    ok = same_call(_headers(flags, P, stride) + (P + j) * stride + t,
                   call_word(n, GS, BITS, QUANT, OUTLIER, X_KIND), ok, flags + 2 * P * stride,
                   err_rec, RANK, 5, t, j)                # the owner made this call
    for c in tl.range(0, BG // SG):
        grp, gmask, e, ymask = _step_ids(t, c, j, seg, groups, n, BG, SG, GS, VT)
        emask = gated(ymask, ok)
        y32 = _decode_slot(own + _slot(P + j, slot), scale_off, zero_off, grp, gmask, GS,
                           BITS, VT, QUANT, QMAX, SCALED, OUTLIER)   # unsaturated: every use
        #                                                         saturates below
        if SCALED:
            y32 = y32 * tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.load(fs_ptr))
        _store_y_or_nan(y_ptr, res_ptr, e, ymask, y32, ok, X_KIND, ADD)
        if OUTPUT:
            xp, m1, m2 = _x_prime(x_ptr, m1_ptr, m2_ptr, e, emask, eta, a, oma, X_KIND, COMP)
            yf = _as_f32_of_out(y32, X_KIND)
            u = xp - tl.math.div_rn(yf, tl.full(yf.shape, PF, tl.float32))   # x' - y/P
            _update(m1_ptr, m2_ptr, e, emask, m1, m2, u, b1, omb1, b2, omb2, COMP)


# ----------------------------------------------------------------------------- stage kernels

@triton.jit
def entry_kernel(x_ptr, m1_ptr, m2_ptr, fs_ptr, epoch_ptr, table_ptr,
                 n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride,
                 eta, a, oma, b1, omb1, b2, omb2,
                 RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                 SG: tl.constexpr, GS: tl.constexpr, VT: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                 LEVELS: tl.constexpr, QMAX: tl.constexpr, COMP: tl.constexpr,
                 SCALED: tl.constexpr, LOCAL: tl.constexpr, OUTLIER: tl.constexpr):
    """grid (tiles, P-1): program (t, i) pushes tile t of segment RANK+1+i (mod P)."""
    j = (RANK + 1 + tl.program_id(1)) % P                 # destination owner, never RANK
    _entry_tile(tl.program_id(0), j, tl.load(epoch_ptr), x_ptr, m1_ptr, m2_ptr, fs_ptr,
                table_ptr, n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride,
                eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG, GS, VT, BITS, QUANT, LEVELS,
                QMAX, COMP, SCALED, LOCAL, OUTLIER)


@triton.jit
def reduce_kernel(x_ptr, m1_ptr, m2_ptr, y_ptr, res_ptr, fs_ptr, epoch_ptr, table_ptr,
                  n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride, timeout,
                  eta, a, oma, b1, omb1, b2, omb2,
                  RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                  SG: tl.constexpr, GS: tl.constexpr, VT: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                  LEVELS: tl.constexpr, QMAX: tl.constexpr, COMP: tl.constexpr,
                  SCALED: tl.constexpr, LOCAL: tl.constexpr, USE_TIMER: tl.constexpr,
                  OWN_Y: tl.constexpr, ADD: tl.constexpr, HALF: tl.constexpr,
                  OUTLIER: tl.constexpr):
    """grid (tiles,): program t reduces tile t of the own segment (OWN_Y: and writes its y,
    ADD: residual + y); HALF 1: the reduce-scatter's reduce, 2: the all-gather's entry
    (`_reduce_tile`)."""
    _reduce_tile(tl.program_id(0), tl.load(epoch_ptr), x_ptr, m1_ptr, m2_ptr, y_ptr, res_ptr,
                 fs_ptr, table_ptr, n, seg, groups, slot, scale_off, zero_off, flags_off, tiles,
                 stride,
                 timeout, eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG, GS, VT, BITS,
                 QUANT, LEVELS, QMAX, COMP, SCALED, LOCAL, USE_TIMER, OWN_Y, ADD, HALF, OUTLIER)


@triton.jit
def tail_kernel(x_ptr, m1_ptr, m2_ptr, y_ptr, res_ptr, fs_ptr, epoch_ptr, table_ptr,
                n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride, timeout,
                eta, a, oma, b1, omb1, b2, omb2,
                RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                SG: tl.constexpr, GS: tl.constexpr, VT: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                QMAX: tl.constexpr, PF: tl.constexpr, COMP: tl.constexpr,
                SCALED: tl.constexpr, OUTPUT: tl.constexpr, USE_TIMER: tl.constexpr,
                FIRST: tl.constexpr, ADD: tl.constexpr, OUTLIER: tl.constexpr):
    """grid (tiles, P - FIRST): program (t, i) decodes tile t of owner RANK+FIRST+i (mod P):
    FIRST=0 every owner, own first; FIRST=1 the others (the reduce wrote the own y).
    ADD: stores residual + y."""
    j = (RANK + FIRST + tl.program_id(1)) % P
    _tail_tile(tl.program_id(0), j, tl.load(epoch_ptr), x_ptr, m1_ptr, m2_ptr, y_ptr, res_ptr,
               fs_ptr, table_ptr, n, seg, groups, slot, scale_off, zero_off, flags_off, tiles,
               stride,
               timeout, eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG, GS, VT, BITS, QUANT,
               QMAX, PF, COMP, SCALED, OUTPUT, USE_TIMER, ADD, OUTLIER)


@triton.jit
def _ticket_item(k, tiles, lag, RANK: tl.constexpr, P: tl.constexpr, FIRST: tl.constexpr):
    """Work item of ticket k of `reduce_tail_kernel` -> (is_reduce, tile t, owner j). With
    NT = P - FIRST tails per tile (owners RANK+FIRST, ..., mod P), the order is: the reduce of
    tiles 0..lag-1, then blocks of [reduce of tile b, the NT tails of tile b-lag], then the
    tails of the last lag tiles:

        R0 .. R(lag-1) | R(lag) T(0,.) x NT | R(lag+1) T(1,.) x NT | ... | T(tiles-lag..)

    (0 <= lag <= tiles). A tail only waits on reduces of lower tickets (on every rank), and a
    reduce only on the peers' entry kernels, so waits never form a cycle."""
    NT: tl.constexpr = P - FIRST
    mid = (tiles - lag) * (NT + 1)
    k2 = k - lag
    k3 = k2 - mid
    b = lag + k2 // (NT + 1)
    r = k2 % (NT + 1)
    is_reduce = (k < lag) | ((k2 < mid) & (r == 0))
    t = tl.where(k < lag, k, tl.where(k2 < mid, tl.where(r == 0, b, b - lag),
                                      tiles - lag + k3 // NT))
    i = tl.where(k2 < mid, r - 1, k3 % NT)
    return is_reduce, t, (RANK + FIRST + i) % P


@triton.jit
def reduce_tail_kernel(x_ptr, m1_ptr, m2_ptr, y_ptr, res_ptr, fs_ptr, epoch_ptr, table_ptr,
                       ticket_ptr,
                       n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride, timeout,
                       lag, eta, a, oma, b1, omb1, b2, omb2,
                       RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr,
                       BG: tl.constexpr, SG: tl.constexpr, GS: tl.constexpr,
                       VT: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                       LEVELS: tl.constexpr, QMAX: tl.constexpr, PF: tl.constexpr, COMP: tl.constexpr,
                       SCALED: tl.constexpr, LOCAL: tl.constexpr, OUTPUT: tl.constexpr,
                       USE_TIMER: tl.constexpr, OWN_Y: tl.constexpr, ADD: tl.constexpr,
                       OUTLIER: tl.constexpr):
    """Reduce and tail in one launch, overlapped: grid ((NT+1) x tiles,) with NT = P - OWN_Y
    tails per tile, one work item per program, taken in ticket order (`_ticket_item`) from a
    per-rank counter (ticket = counter++: exactly one per program; the last program to finish
    sets it back to 0 for the next call, whatever its tile count). ticket_ptr [3]: the
    counters for NT = P and P-1 (OWN_Y or not), then the departure count (`_depart`).
    Tickets, not program ids, set the order, so a waiting program's producers hold lower
    tickets and are running or done whatever order the GPU starts programs in. Equivalent to
    reduce_kernel then tail_kernel (ADD: both store residual + y); the tails of early tiles
    (HBM-bound) run while later tiles are still reduced and pushed (link-bound)."""
    FIRST: tl.constexpr = 1 if OWN_Y else 0
    k = tl.atomic_add(ticket_ptr + FIRST, 1, sem="relaxed", scope="gpu") % \
        ((P - FIRST + 1) * tiles)
    is_reduce, t, j = _ticket_item(k.to(tl.int32), tiles, lag, RANK, P, FIRST)
    ep = tl.load(epoch_ptr)
    if is_reduce:
        _reduce_tile(t, ep, x_ptr, m1_ptr, m2_ptr, y_ptr, res_ptr, fs_ptr, table_ptr,
                     n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride, timeout,
                     eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG, GS, VT, BITS, QUANT,
                     LEVELS, QMAX, COMP, SCALED, LOCAL, USE_TIMER, OWN_Y, ADD, 0, OUTLIER)
    else:
        _tail_tile(t, j, ep, x_ptr, m1_ptr, m2_ptr, y_ptr, res_ptr, fs_ptr, table_ptr,
                   n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride, timeout,
                   eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG, GS, VT, BITS, QUANT,
                   QMAX, PF, COMP, SCALED, OUTPUT, USE_TIMER, ADD, OUTLIER)
    _depart(ticket_ptr + 2, tl.num_programs(0), ticket_ptr + FIRST, 0)


@triton.jit
def fused_kernel(x_ptr, m1_ptr, m2_ptr, y_ptr, res_ptr, fs_ptr, epochs_ptr, table_ptr,
                 n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride, timeout,
                 eta, a, oma, b1, omb1, b2, omb2,
                 RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                 SG: tl.constexpr, GS: tl.constexpr, VT: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                 LEVELS: tl.constexpr, QMAX: tl.constexpr, PF: tl.constexpr,
                 COMP: tl.constexpr, SCALED: tl.constexpr, LOCAL: tl.constexpr,
                 OUTPUT: tl.constexpr, USE_TIMER: tl.constexpr, ADD: tl.constexpr,
                 OUTLIER: tl.constexpr):
    """The whole call in one launch (ADD: the tails store residual + y). grid (G,),
    G = min(tiles, programs) with `programs` the same on every rank (p2p: 4 x the group's
    smallest SM count), so program c of each rank handles the same tiles t = c, c+G, ....
    Program c: entry of its tiles, then their reduce, then their tail, i.e.

        for t in tiles(c): for i < P-1: _entry_tile(t, RANK+1+i)
        for t in tiles(c): _reduce_tile(t)
        for t in tiles(c): for i < P: _tail_tile(t, RANK+i)

    Program c waits only on program c of the other ranks, which do the same tiles in the same
    order, and the GPUs start programs in index order, so a waiting program's partner is
    running or done (no deadlock when not all G are resident); by the time it reduces its
    first tile, its peers pushed their whole share, so the
    flag latency is paid about once per stage, not per tile. Programs in different stages
    overlap. epochs_ptr [2]: the workspace's epoch (the stage kernels' too) and a departure
    count: every program runs with epoch + 1, and the last one to finish stores it (`_depart`;
    no host launch per call, graph replays advance it too), so calls of any tile count and
    form share one workspace and its flags only grow."""
    c = tl.program_id(0)
    G = tl.num_programs(0)
    ep = tl.load(epochs_ptr, volatile=True) + 1
    t = c                                                  # t = c, c+G, ... < tiles
    while t < tiles:
        for i in tl.static_range(P - 1):
            _entry_tile(t, (RANK + 1 + i) % P, ep, x_ptr, m1_ptr, m2_ptr, fs_ptr,
                        table_ptr, n, seg, groups, slot, scale_off, zero_off, flags_off,
                        tiles, stride, eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG,
                        GS, VT,
                        BITS, QUANT, LEVELS, QMAX, COMP, SCALED, LOCAL, OUTLIER)
        t += G
    t = c
    while t < tiles:
        _reduce_tile(t, ep, x_ptr, m1_ptr, m2_ptr, y_ptr, res_ptr, fs_ptr, table_ptr,
                     n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride, timeout,
                     eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG, GS, VT, BITS, QUANT,
                     LEVELS, QMAX, COMP, SCALED, LOCAL, USE_TIMER, False, False, 0, OUTLIER)
        t += G
    t = c
    while t < tiles:
        for i in tl.static_range(P):
            _tail_tile(t, (RANK + i) % P, ep, x_ptr, m1_ptr, m2_ptr, y_ptr, res_ptr, fs_ptr,
                       table_ptr, n, seg, groups, slot, scale_off, zero_off, flags_off,
                       tiles, stride, timeout, eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND,
                       BG, SG, GS, VT, BITS, QUANT, QMAX, PF, COMP, SCALED, OUTPUT, USE_TIMER, ADD,
                       OUTLIER)
        t += G
    _depart(epochs_ptr + 1, G, epochs_ptr, ep)

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
  reduce_tail: reduce and tail in one launch, the tails trailing the reduces by `lag` tiles
         (work items in ticket order); or the tail as a few persistent programs on a second
         stream beside the reduce (tail_loop_kernel); as measured fastest (p2p.overlap_mode).

Every rank owns one byte buffer (`Layout`), symmetric across ranks; `table` [P+1] int64 holds the
P buffers' addresses as seen from this rank, then the address of its error record. The same
kernels run on P GPUs (collective/p2p.py, buffers in symmetric memory) and on P simulated ranks
in one process (kernels/simulated_fused.py, the CPU test under TRITON_INTERPRET=1): stages
launched in order entry(all ranks), reduce(all), tail(all) find every flag already set.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs

from .. import envs
from ..compensator import CompState
from ..config import CompensatorConstants, EchoConfig, QuantSpec
from .flags import gated, signal, wait_geq
from .quant_kernels import (DTYPE_KIND, F32_MAX, HW_FORMS, LAUNCH_OPTS, _cast_sat, _codes,
                            _dequant, _group_params, _load_codes, _load_f32, _sat, _sat_out,
                            _store_codes, _word_scale, spec_constexprs)

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Compensator state dtypes the kernels read and write (EchoConfig.state_dtype)."""

TILE_ELEMS = 2048
"""Values per tile (one program, one flag): a multiple of the group size."""

STEP_ELEMS = 2048
"""Values a program holds in registers at once: a tile larger than this goes in steps
(a power of two, at least one group; capped at the tile)."""


# ----------------------------------------------------------------------------- device helpers

@triton.jit
def _x_prime(x_ptr, m1_ptr, m2_ptr, e, emask, eta, a, oma, X_KIND: tl.constexpr,
             COMP: tl.constexpr):
    """x' = x + (m1*a + m2*(1-a))*eta at element ids e (masked lanes 0) -> (x', m1, m2);
    x' of a finite x saturates at +-fp32 max (compensator.apply_correction)."""
    x = _load_f32(x_ptr + e, emask, X_KIND)
    if COMP:
        m1 = _load_state(m1_ptr + e, emask)
        if m2_ptr.to(tl.int64) == m1_ptr.to(tl.int64):   # one state tensor (beta1 == beta2)
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
    """_x_prime, plus xs = x' * 2^e and f = 2^e under backward scaling (xs = x', f = 1 else)."""
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
def _update(m1_ptr, m2_ptr, e, emask, m1, m2, u, b1, omb1, b2, omb2):
    """m1 = m1*beta1 + u*(1-beta1); m2 = m2*beta2 + u*(1-beta2) at element ids e, 0 where the
    new value is not finite (compensator.update_; one store when m2 is m1: beta1 == beta2
    makes both updates the same value)."""
    _store_state(m1_ptr + e, _finite_or_0(m1 * b1 + u * omb1), emask)
    if m2_ptr.to(tl.int64) != m1_ptr.to(tl.int64):
        _store_state(m2_ptr + e, _finite_or_0(m2 * b2 + u * omb2), emask)


@triton.jit
def _finite_or_0(v):
    """v fp32 with NaN and +-Inf replaced by 0 (the state never holds a non-finite value)."""
    return tl.where(tl.abs(v) <= F32_MAX, v, 0.0)


@triton.jit
def _as_f32_of_out(v, X_KIND: tl.constexpr):
    """fp32 value of the saturating cast of v to the output dtype (what y.to(float32) reads
    back)."""
    v = _sat_out(v, X_KIND)
    if X_KIND == 2:
        if HW_FORMS:
            out = v.to(tl.bfloat16).to(tl.float32)
        else:
            b = v.to(tl.uint32, bitcast=True)
            r = ((b + (0x7FFF + ((b >> 16) & 1))) >> 16) << 16
            out = tl.where(v != v, v, r.to(tl.float32, bitcast=True))
    elif X_KIND == 1:
        out = v.to(tl.float16).to(tl.float32)
    else:
        out = v
    return out


@triton.jit
def _slot(k, slot):
    """Byte offset of slot k (int64: buffers of large messages pass 2^31 bytes)."""
    return (tl.zeros([], tl.int64) + k) * slot


@triton.jit
def _buffer(table_ptr, rank):
    """uint8* base of `rank`'s buffer (16-byte aligned)."""
    return tl.multiple_of(tl.load(table_ptr + rank).to(tl.pointer_type(tl.uint8)), 16)


@triton.jit
def _store_packet(dst, scale_off, zero_off, grp, gmask, q, sw, z16, GS: tl.constexpr,
                  BITS: tl.constexpr, BG: tl.constexpr, QUANT: tl.constexpr):
    """Write one tile (groups grp) of a packet into the slot at dst: codes | scale words (int16)
    | fp16 zeros."""
    _store_codes(dst, grp, q, gmask, GS, BITS, BG)
    tl.store((dst + scale_off).to(tl.pointer_type(tl.int16)) + grp, sw, mask=gmask)
    if QUANT != 2:
        tl.store((dst + zero_off).to(tl.pointer_type(tl.float16)) + grp, z16, mask=gmask)


@triton.jit
def _decode_slot(src, scale_off, zero_off, grp, gmask, GS: tl.constexpr, BITS: tl.constexpr,
                 BG: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr):
    """One tile of the packet in the slot at src -> fp32 [BG, GS]."""
    q = _load_codes(src, grp, gmask, GS, BITS, BG)
    sf = _word_scale(tl.load((src + scale_off).to(tl.pointer_type(tl.int16)) + grp, mask=gmask,
                             other=0x3C00, cache_modifier=".cg"))         # masked lanes: 1.0
    if QUANT == 2:
        zf = sf
    else:
        zf = tl.load((src + zero_off).to(tl.pointer_type(tl.float16)) + grp, mask=gmask,
                     other=0.0, cache_modifier=".cg").to(tl.float32)
    return _dequant(q, sf, zf, QUANT, QMAX)


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
def _step_ids(t, c, j, seg, groups, n, BG: tl.constexpr, SG: tl.constexpr, GS: tl.constexpr):
    """Step c of tile t in segment j: its groups grp [SG] (within a segment), their mask, the
    element ids e [SG, GS] (int64, within x) and theirs."""
    grp = t * BG + c * SG + tl.arange(0, SG)
    gmask = grp < groups
    e = (tl.zeros([], tl.int64) + j) * seg + grp[:, None] * GS + tl.arange(0, GS)[None, :]
    return grp, gmask, e, gmask[:, None] & (e < n)


# ----------------------------------------------------------------------------- per-tile stages
# One tile of one stage; the stage kernels below run one per program, the fused kernel runs all
# three in a loop. `ep` is the call's epoch (what flags are set to and waited for).

@triton.jit
def _entry_tile(t, j, ep, x_ptr, m1_ptr, m2_ptr, fs_ptr, table_ptr,
                n, seg, groups, slot, scale_off, zero_off, flags_off, tiles,
                eta, a, oma, b1, omb1, b2, omb2,
                RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                SG: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                LEVELS: tl.constexpr, QMAX: tl.constexpr, COMP: tl.constexpr,
                SCALED: tl.constexpr, LOCAL: tl.constexpr):
    """Quantize tile t of segment j (!= RANK) and push it to owner j; signal recv[RANK][t].
    The tile's BG groups go in steps of SG: each step's remote stores stay in flight while the
    next step computes, and one release (a system-scope fence) covers the whole tile."""
    peer = _buffer(table_ptr, j)
    for c in tl.range(0, BG // SG):
        grp, gmask, e, emask = _step_ids(t, c, j, seg, groups, n, BG, SG, GS)
        xp, m1, m2, xs, f = _x_scaled(x_ptr, m1_ptr, m2_ptr, fs_ptr, e, emask, eta, a, oma,
                                      X_KIND, COMP, SCALED)
        sw, sf, z16, zf, finite = _group_params(xs, QUANT, LEVELS, QMAX)
        q = _codes(xs, sf, zf, finite, QUANT, LEVELS, QMAX)
        _store_packet(peer + _slot(RANK, slot), scale_off, zero_off, grp, gmask, q, sw, z16,
                      GS, BITS, SG, QUANT)                 # peer j's receive slot of RANK
        if LOCAL:
            err = xs - _dequant(q, sf, zf, QUANT, QMAX)    # x'_j - decode(encode(x'_j))
            if SCALED:
                err = err * tl.math.div_rn(tl.full([], 1.0, tl.float32), f)
            _update(m1_ptr, m2_ptr, e, emask, m1, m2, err, b1, omb1, b2, omb2)
    signal((peer + flags_off).to(tl.pointer_type(tl.int64)) + RANK * tiles + t, ep)


@triton.jit
def _reduce_tile(t, ep, x_ptr, m1_ptr, m2_ptr, y_ptr, fs_ptr, table_ptr,
                 n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, timeout,
                 eta, a, oma, b1, omb1, b2, omb2,
                 RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                 SG: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                 LEVELS: tl.constexpr, QMAX: tl.constexpr, COMP: tl.constexpr,
                 SCALED: tl.constexpr, LOCAL: tl.constexpr, USE_TIMER: tl.constexpr,
                 OWN_Y: tl.constexpr):
    """Owner sum of tile t of the own segment, requantized and pushed to every rank's gather
    slot RANK; signal gath[RANK][t] everywhere. Waits once, then steps of SG groups.
    OWN_Y: also y of these elements, decoded from the registers exactly as the tail would
    decode the own gather slot (the tail then skips the own segment)."""
    own = _buffer(table_ptr, RANK)
    flags = (own + flags_off).to(tl.pointer_type(tl.int64))   # recv [P][tiles], gath [P][tiles]
    abort = flags + 2 * P * tiles
    err_rec = tl.load(table_ptr + P).to(tl.pointer_type(tl.int64))
    ok = ep == ep
    for r in tl.static_range(P):
        if r != RANK:
            ok = ok & wait_geq(flags + r * tiles + t, ep, abort, err_rec, RANK, 1, t, r,
                               timeout, USE_TIMER)
    for c in tl.range(0, BG // SG):
        grp, gmask, e, emask = _step_ids(t, c, RANK, seg, groups, n, BG, SG, GS)
        xp, m1, m2, xs, f = _x_scaled(x_ptr, m1_ptr, m2_ptr, fs_ptr, e, emask, eta, a, oma,
                                      X_KIND, COMP, SCALED)
        for r in tl.static_range(P):                       # acc = c_0; acc = acc + c_1; ...
            if r == RANK:
                v = xs
            else:
                v = _decode_slot(own + _slot(r, slot), scale_off, zero_off, grp, gmask, GS,
                                 BITS, SG, QUANT, QMAX)
            if r == 0:
                acc = v
            else:
                acc = acc + v
        acc = tl.where(tl.abs(xs) <= F32_MAX, _sat(acc, F32_MAX), acc)  # finite own x': no
        sw, sf, z16, zf, finite = _group_params(acc, QUANT, LEVELS, QMAX)   # overflowed sum
        q = _codes(acc, sf, zf, finite, QUANT, LEVELS, QMAX)
        pmask = gated(gmask, ok)
        for i in tl.static_range(P):                       # own slot last
            dst = _buffer(table_ptr, (RANK + 1 + i) % P) + _slot(P + RANK, slot)
            _store_packet(dst, scale_off, zero_off, grp, pmask, q, sw, z16, GS, BITS, SG,
                          QUANT)
        if LOCAL or OWN_Y:
            y32 = _dequant(q, sf, zf, QUANT, QMAX)         # = decode of the packet just sent
            if SCALED:
                inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), f)
                y32 = y32 * inv
            if OWN_Y:
                tl.store(y_ptr + e, _cast_sat(y32, X_KIND), mask=gated(emask, ok))
            if LOCAL:
                if SCALED:
                    u = acc * inv - _as_f32_of_out(y32, X_KIND)
                else:
                    u = acc - _as_f32_of_out(y32, X_KIND)
                _update(m1_ptr, m2_ptr, e, gated(emask, ok), m1, m2, u, b1, omb1, b2, omb2)
    if ok:
        for i in tl.static_range(P):
            peer = _buffer(table_ptr, (RANK + 1 + i) % P)
            signal((peer + flags_off).to(tl.pointer_type(tl.int64)) + (P + RANK) * tiles + t,
                   ep)


@triton.jit
def _tail_tile(t, j, ep, x_ptr, m1_ptr, m2_ptr, y_ptr, fs_ptr, table_ptr,
               n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, timeout,
               eta, a, oma, b1, omb1, b2, omb2,
               RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
               SG: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
               QMAX: tl.constexpr, PF: tl.constexpr, COMP: tl.constexpr,
               SCALED: tl.constexpr, OUTPUT: tl.constexpr, USE_TIMER: tl.constexpr,
               UPDATE_ONLY: tl.constexpr = False):
    """Wait gath[j][t]; decode tile t of owner j's packet into y (+ output-residual update),
    in steps of SG groups. UPDATE_ONLY: the deferred output-residual update after the call
    (no wait: the call's tail already saw every flag; no y store: y = the decoded packet)."""
    own = _buffer(table_ptr, RANK)
    if UPDATE_ONLY:
        ok = ep == ep
    else:
        flags = (own + flags_off).to(tl.pointer_type(tl.int64))
        err_rec = tl.load(table_ptr + P).to(tl.pointer_type(tl.int64))
        ok = wait_geq(flags + (P + j) * tiles + t, ep, flags + 2 * P * tiles, err_rec, RANK, 2,
                      t, j, timeout, USE_TIMER)
    for c in tl.range(0, BG // SG):
        grp, gmask, e, emask = _step_ids(t, c, j, seg, groups, n, BG, SG, GS)
        emask = gated(emask, ok)
        y32 = _decode_slot(own + _slot(P + j, slot), scale_off, zero_off, grp, gmask, GS, BITS,
                           SG, QUANT, QMAX)
        if SCALED:
            y32 = y32 * tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.load(fs_ptr))
        if not UPDATE_ONLY:
            tl.store(y_ptr + e, _cast_sat(y32, X_KIND), mask=emask)
        if OUTPUT:
            xp, m1, m2 = _x_prime(x_ptr, m1_ptr, m2_ptr, e, emask, eta, a, oma, X_KIND, COMP)
            yf = _as_f32_of_out(y32, X_KIND)
            u = xp - tl.math.div_rn(yf, tl.full(yf.shape, PF, tl.float32))   # x' - y/P
            _update(m1_ptr, m2_ptr, e, emask, m1, m2, u, b1, omb1, b2, omb2)


# ----------------------------------------------------------------------------- stage kernels

@triton.jit
def entry_kernel(x_ptr, m1_ptr, m2_ptr, fs_ptr, epoch_ptr, table_ptr,
                 n, seg, groups, slot, scale_off, zero_off, flags_off, tiles,
                 eta, a, oma, b1, omb1, b2, omb2,
                 RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                 SG: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                 LEVELS: tl.constexpr, QMAX: tl.constexpr, COMP: tl.constexpr,
                 SCALED: tl.constexpr, LOCAL: tl.constexpr):
    """grid (tiles, P-1): program (t, i) pushes tile t of segment RANK+1+i (mod P)."""
    j = (RANK + 1 + tl.program_id(1)) % P                 # destination owner, never RANK
    _entry_tile(tl.program_id(0), j, tl.load(epoch_ptr), x_ptr, m1_ptr, m2_ptr, fs_ptr,
                table_ptr, n, seg, groups, slot, scale_off, zero_off, flags_off, tiles,
                eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG, GS, BITS, QUANT, LEVELS,
                QMAX, COMP, SCALED, LOCAL)


@triton.jit
def reduce_kernel(x_ptr, m1_ptr, m2_ptr, y_ptr, fs_ptr, epoch_ptr, table_ptr,
                  n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, timeout,
                  eta, a, oma, b1, omb1, b2, omb2,
                  RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                  SG: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                  LEVELS: tl.constexpr, QMAX: tl.constexpr, COMP: tl.constexpr,
                  SCALED: tl.constexpr, LOCAL: tl.constexpr, USE_TIMER: tl.constexpr,
                  OWN_Y: tl.constexpr):
    """grid (tiles,): program t reduces tile t of the own segment (OWN_Y: and writes its y)."""
    _reduce_tile(tl.program_id(0), tl.load(epoch_ptr), x_ptr, m1_ptr, m2_ptr, y_ptr, fs_ptr,
                 table_ptr, n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, timeout,
                 eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG, GS, BITS, QUANT, LEVELS,
                 QMAX, COMP, SCALED, LOCAL, USE_TIMER, OWN_Y)


@triton.jit
def tail_kernel(x_ptr, m1_ptr, m2_ptr, y_ptr, fs_ptr, epoch_ptr, table_ptr,
                n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, timeout,
                eta, a, oma, b1, omb1, b2, omb2,
                RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                SG: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                QMAX: tl.constexpr, PF: tl.constexpr, COMP: tl.constexpr,
                SCALED: tl.constexpr,
                OUTPUT: tl.constexpr, USE_TIMER: tl.constexpr, UPDATE_ONLY: tl.constexpr,
                FIRST: tl.constexpr):
    """grid (tiles, P - FIRST): program (t, i) decodes tile t of owner RANK+FIRST+i (mod P):
    FIRST=0 every owner, own first; FIRST=1 the others (the reduce wrote the own y).
    UPDATE_ONLY (with OUTPUT): the output-residual update alone, after the call."""
    j = (RANK + FIRST + tl.program_id(1)) % P
    _tail_tile(tl.program_id(0), j, tl.load(epoch_ptr), x_ptr, m1_ptr, m2_ptr, y_ptr, fs_ptr,
               table_ptr, n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, timeout,
               eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG, GS, BITS, QUANT, QMAX, PF,
               COMP, SCALED, OUTPUT, USE_TIMER, UPDATE_ONLY)


@triton.jit
def tail_loop_kernel(x_ptr, m1_ptr, m2_ptr, y_ptr, fs_ptr, epoch_ptr, table_ptr,
                     n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, timeout,
                     eta, a, oma, b1, omb1, b2, omb2,
                     RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr,
                     BG: tl.constexpr, SG: tl.constexpr, GS: tl.constexpr,
                     BITS: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr,
                     PF: tl.constexpr, COMP: tl.constexpr, SCALED: tl.constexpr,
                     OUTPUT: tl.constexpr, USE_TIMER: tl.constexpr, FIRST: tl.constexpr):
    """tail_kernel as a few persistent programs (grid (G,), G small), run on a second stream
    beside reduce_kernel: program c decodes items c, c+G, ... in tile order, item i = tile
    i // NT of owner RANK+FIRST+(i mod NT), NT = P - FIRST, i.e.

        for i in range(c, tiles * NT, G): _tail_tile(i // NT, (RANK + FIRST + i % NT) % P)

    Its programs wait for tiles the reduce is still producing; being few (and the reduce's
    programs needing no tail to finish), they never keep the reduce from the SMs."""
    NT: tl.constexpr = P - FIRST
    ep = tl.load(epoch_ptr)
    i = tl.program_id(0)
    while i < tiles * NT:
        _tail_tile(i // NT, (RANK + FIRST + i % NT) % P, ep, x_ptr, m1_ptr, m2_ptr, y_ptr,
                   fs_ptr, table_ptr, n, seg, groups, slot, scale_off, zero_off, flags_off,
                   tiles, timeout, eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG,
                   GS, BITS, QUANT, QMAX, PF, COMP, SCALED, OUTPUT, USE_TIMER)
        i += tl.num_programs(0)


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
def reduce_tail_kernel(x_ptr, m1_ptr, m2_ptr, y_ptr, fs_ptr, epoch_ptr, table_ptr, ticket_ptr,
                       n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, timeout,
                       lag, eta, a, oma, b1, omb1, b2, omb2,
                       RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr,
                       BG: tl.constexpr, SG: tl.constexpr, GS: tl.constexpr,
                       BITS: tl.constexpr, QUANT: tl.constexpr, LEVELS: tl.constexpr,
                       QMAX: tl.constexpr, PF: tl.constexpr, COMP: tl.constexpr,
                       SCALED: tl.constexpr, LOCAL: tl.constexpr, OUTPUT: tl.constexpr,
                       USE_TIMER: tl.constexpr, OWN_Y: tl.constexpr):
    """Reduce and tail in one launch, overlapped: grid ((NT+1) x tiles,) with NT = P - OWN_Y
    tails per tile, one work item per program, taken in ticket order (`_ticket_item`) from a
    per-rank counter that only grows (ticket = counter++ mod (NT+1) tiles: exactly one per
    program, so each call starts at 0). ticket_ptr [2]: one counter per NT (OWN_Y or not), so
    calls with different NT on one workspace never shift each other's start.
    Tickets, not program ids, set the order, so a waiting program's producers hold lower
    tickets and are running or done whatever order the GPU starts programs in. Equivalent to
    reduce_kernel then tail_kernel; the tails of early tiles (HBM-bound) run while later tiles
    are still reduced and pushed (link-bound)."""
    FIRST: tl.constexpr = 1 if OWN_Y else 0
    k = tl.atomic_add(ticket_ptr + FIRST, 1, sem="relaxed", scope="gpu") % \
        ((P - FIRST + 1) * tiles)
    is_reduce, t, j = _ticket_item(k.to(tl.int32), tiles, lag, RANK, P, FIRST)
    ep = tl.load(epoch_ptr)
    if is_reduce:
        _reduce_tile(t, ep, x_ptr, m1_ptr, m2_ptr, y_ptr, fs_ptr, table_ptr,
                     n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, timeout,
                     eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG, GS, BITS, QUANT,
                     LEVELS, QMAX, COMP, SCALED, LOCAL, USE_TIMER, OWN_Y)
    else:
        _tail_tile(t, j, ep, x_ptr, m1_ptr, m2_ptr, y_ptr, fs_ptr, table_ptr,
                   n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, timeout,
                   eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG, GS, BITS, QUANT,
                   QMAX, PF, COMP, SCALED, OUTPUT, USE_TIMER)


@triton.jit
def fused_kernel(x_ptr, m1_ptr, m2_ptr, y_ptr, fs_ptr, epochs_ptr, table_ptr,
                 n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, timeout,
                 eta, a, oma, b1, omb1, b2, omb2,
                 RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                 SG: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                 LEVELS: tl.constexpr, QMAX: tl.constexpr, PF: tl.constexpr,
                 COMP: tl.constexpr, SCALED: tl.constexpr, LOCAL: tl.constexpr,
                 OUTPUT: tl.constexpr, USE_TIMER: tl.constexpr):
    """The whole call in one launch. grid (G,), G = min(tiles, programs) with `programs` the
    same on every rank (p2p: 4 x the group's smallest SM count), so program c of each rank
    handles the same tiles t = c, c+G, ....
    Program c: entry of its tiles, then their reduce, then their tail, i.e.

        for t in tiles(c): for i < P-1: _entry_tile(t, RANK+1+i)
        for t in tiles(c): _reduce_tile(t)
        for t in tiles(c): for i < P: _tail_tile(t, RANK+i)

    Program c waits only on program c of the other ranks, which do the same tiles in the same
    order, and the GPUs start programs in index order, so a waiting program's partner is
    running or done (no deadlock when not all G are resident); by the time it reduces its
    first tile, its peers pushed their whole share, so the
    flag latency is paid about once per stage, not per tile. Programs in different stages
    overlap. Epochs are per program (epochs_ptr[c], bumped here: no host launch per call;
    graph replays advance them too); a flag of tile t is only ever set by and waited for
    with program (t mod G)'s epoch."""
    c = tl.program_id(0)
    G = tl.num_programs(0)
    ep = tl.load(epochs_ptr + c) + 1
    t = c                                                  # t = c, c+G, ... < tiles
    while t < tiles:
        for i in tl.static_range(P - 1):
            _entry_tile(t, (RANK + 1 + i) % P, ep, x_ptr, m1_ptr, m2_ptr, fs_ptr,
                        table_ptr, n, seg, groups, slot, scale_off, zero_off, flags_off,
                        tiles, eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG, GS,
                        BITS, QUANT, LEVELS, QMAX, COMP, SCALED, LOCAL)
        t += G
    t = c
    while t < tiles:
        _reduce_tile(t, ep, x_ptr, m1_ptr, m2_ptr, y_ptr, fs_ptr, table_ptr,
                     n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, timeout,
                     eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND, BG, SG, GS, BITS, QUANT,
                     LEVELS, QMAX, COMP, SCALED, LOCAL, USE_TIMER, False)
        t += G
    t = c
    while t < tiles:
        for i in tl.static_range(P):
            _tail_tile(t, (RANK + i) % P, ep, x_ptr, m1_ptr, m2_ptr, y_ptr, fs_ptr,
                       table_ptr, n, seg, groups, slot, scale_off, zero_off, flags_off,
                       tiles, timeout, eta, a, oma, b1, omb1, b2, omb2, RANK, P, X_KIND,
                       BG, SG, GS, BITS, QUANT, QMAX, PF, COMP, SCALED, OUTPUT, USE_TIMER)
        t += G
    tl.debug_barrier()
    tl.store(epochs_ptr + c, ep)


# ----------------------------------------------------------------------------- host side

def _align(v: int, a: int) -> int:
    return -(-v // a) * a


@dataclass(frozen=True)
class Layout:
    """One rank's buffer: receive slots [P(sender)], gather slots [P(owner)], then int64 flags
    recv [P][tiles], gath [P][tiles] and the abort word. A slot holds one segment packet:
    codes at 0, 16-bit scale words at scale_off, fp16 zeros at zero_off (16-byte aligned
    regions)."""

    world_size: int
    seg: int
    groups: int
    bg: int
    tiles: int
    slot: int
    scale_off: int
    zero_off: int
    flags_off: int
    nbytes: int

    @classmethod
    def build(cls, numel: int, world_size: int, spec: QuantSpec,
              tile_elems: int = TILE_ELEMS) -> "Layout":
        g = spec.group_size
        seg = -(-numel // (world_size * g)) * g              # qar.segment_len
        groups = seg // g
        bg = max(1, tile_elems // g)
        if bg & (bg - 1):
            raise ValueError(f"tile_elems {tile_elems} / group_size {g} must be a power of two")
        tiles = -(-groups // bg)
        scale_off = _align(seg * spec.bits // 8, 16)
        zero_off = scale_off + _align(2 * groups, 16)
        end = zero_off + (_align(2 * groups, 16) if spec.has_zero else 0)
        slot = _align(end, 256)
        flags_off = 2 * world_size * slot
        nbytes = flags_off + 8 * _align(2 * world_size * tiles + 1, 32)
        return cls(world_size, seg, groups, bg, tiles, slot, scale_off, zero_off, flags_off,
                   nbytes)

    def flag_words(self, buf: torch.Tensor) -> torch.Tensor:
        """The int64 flag words (recv, gath, abort) of a rank's uint8 buffer."""
        return buf[self.flags_off:self.nbytes].view(torch.int64)

    def packet(self, buf: torch.Tensor, region: int, idx: int, spec: QuantSpec):
        """(codes, scale, zero) views of slot idx of region 0 (receive) or 1 (gather)."""
        base = (region * self.world_size + idx) * self.slot
        codes = buf[base:base + self.seg * spec.bits // 8]
        scale = buf[base + self.scale_off:base + self.scale_off + 2 * self.groups]
        zero = buf[base + self.zero_off:base + self.zero_off + 2 * self.groups] \
            if spec.has_zero else None
        return codes, scale.view(torch.float16), None if zero is None else zero.view(torch.float16)


def launch(kernel, grid: tuple, args: tuple, meta: dict) -> None:
    """kernel[grid](*args, **meta) with LAUNCH_OPTS. On CUDA, after the first launch of a
    specialization (the JIT path), later launches go straight to the compiled kernel's own
    launcher, skipping triton's per-call argument binding and cache lookup (host time on every
    call of the collective: ~25 us per launch of these kernels measured on an H200 host). The
    cache key holds every value triton specializes on (non-tensor arguments and constexprs
    exactly; tensors by dtype and 16-byte alignment), so a hit launches the binary triton itself
    would pick. Under TRITON_INTERPRET (no compiled kernel), with ECHO_FAST_LAUNCH=0, or while
    triton launch hooks are installed (profilers), every launch takes the JIT path."""
    key = None
    if _FAST_OK and args[0].is_cuda and _no_hooks():
        key = (kernel, args[0].get_device(),
               *[(a.dtype, a.data_ptr() & 15) if isinstance(a, torch.Tensor) else a
                 for a in args], *meta.values())
        hit = _FAST.get(key)
        if hit is not None:
            compiled, tail, device, stream_of = hit
            g = (*grid, 1, 1)
            compiled.run(g[0], g[1], g[2], stream_of(device),
                         compiled.function, compiled.packed_metadata, None, None, None,
                         *args, *tail)
            return
    compiled = kernel[grid](*args, **meta, **LAUNCH_OPTS)
    if key is not None and compiled is not None and hasattr(compiled, "packed_metadata"):
        names = kernel.arg_names[len(args):]
        if set(names) == set(meta) - _OPTIONS:   # the other parameters are constexprs given here
            _FAST[key] = (compiled, tuple(meta[k] for k in names), args[0].get_device(),
                          triton.runtime.driver.active.get_current_stream)


def _no_hooks() -> bool:
    """No triton launch hooks installed (None, or an empty HookChain in triton >= 3.4)."""
    for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return False
    return True


_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas"})
_FAST: dict = {}
_FAST_OK = envs.fast_launch() and not getattr(knobs.runtime, "interpret", False)


@functools.lru_cache(maxsize=1024)
def _static_args(lay: Layout, cfg: EchoConfig, rank: int, dtype: torch.dtype, comp: bool,
                 scaled: bool, step_elems: int = STEP_ELEMS) -> tuple:
    """The launch arguments fixed by (layout, config, rank, dtype): built once, not per call.
    -> (layout scalars, compensator constants, constexprs common to the kernels, extra
    constexprs by kernel name)."""
    spec = cfg.quant_spec()
    k = CompensatorConstants.from_config(cfg)
    scal = (lay.seg, lay.groups, lay.slot, lay.scale_off, lay.zero_off, lay.flags_off, lay.tiles)
    consts = (k.eta, k.a, k.one_minus_a, k.beta1, k.one_minus_beta1, k.beta2, k.one_minus_beta2)
    ce = spec_constexprs(spec)
    sg = min(lay.bg, max(1, step_elems // spec.group_size))
    if sg & (sg - 1):
        raise ValueError(f"step_elems {step_elems} / group_size {spec.group_size} must be a "
                         "power of two")
    meta = dict(RANK=rank, P=lay.world_size, X_KIND=DTYPE_KIND[dtype], BG=lay.bg, SG=sg,
                GS=ce["GS"], BITS=ce["BITS"], QUANT=ce["QUANT"])
    local = comp and cfg.residual == "local"
    output = comp and cfg.residual == "output"
    per = {
        "entry": dict(LEVELS=ce["LEVELS"], QMAX=ce["QMAX"], COMP=comp, SCALED=scaled,
                      LOCAL=local),
        "reduce": dict(LEVELS=ce["LEVELS"], QMAX=ce["QMAX"], COMP=comp, SCALED=scaled,
                       LOCAL=local),
        "tail": dict(QMAX=ce["QMAX"], PF=float(lay.world_size), COMP=comp, SCALED=scaled,
                     OUTPUT=output),
        "fused": dict(LEVELS=ce["LEVELS"], QMAX=ce["QMAX"], PF=float(lay.world_size), COMP=comp,
                      SCALED=scaled, LOCAL=local, OUTPUT=output),
    }
    per["reduce_tail"] = per["fused"]
    return scal, consts, meta, per


@dataclass
class CallPlan:
    """Everything one rank's launches of one call need (built per call, no device sync):
    either the three stage kernels (entry, reduce, tail: `epoch` bumped by the host) or the
    single fused kernel (`fused`: per-program epochs bumped by the kernel)."""

    rank: int
    lay: Layout
    cfg: EchoConfig
    x: torch.Tensor               # [n] bf16/fp16/fp32, contiguous
    state: CompState | None       # m1, m2 fp32 [n], updated in place
    fs: torch.Tensor | None       # [1] fp32 backward scale factor 2^e, or None
    epoch: torch.Tensor           # [1] int64, already bumped for this call (stage kernels);
                                  # [G] int64 per-program epochs (fused kernel)
    table: torch.Tensor           # [P+1] int64: the P buffers, then the error record
    timeout: int
    use_timer: bool
    num_warps: int = 4
    step_elems: int = STEP_ELEMS  # values per step of a tile (registers); see STEP_ELEMS
    defer_output: bool = False    # residual 'output': tail/fused leave the state alone;
                                  # `output_update` does it afterwards (on a side stream)

    @functools.cached_property
    def _parts(self):
        st = self.state
        scal, consts, meta, per = _static_args(self.lay, self.cfg, self.rank, self.x.dtype,
                                               st is not None, self.fs is not None,
                                               self.step_elems)
        x = self.x
        ptrs = (x, st.m1, st.m2) if st is not None else (x, x, x)
        return ptrs, (x.numel(), *scal), consts, meta, per

    def _fs(self):
        return self.fs if self.fs is not None else self.epoch

    def entry(self) -> None:
        if self.lay.world_size == 1:
            return
        ptrs, scal, consts, meta, per = self._parts
        launch(entry_kernel, (self.lay.tiles, self.lay.world_size - 1),
               (*ptrs, self._fs(), self.epoch, self.table, *scal, *consts),
               dict(**meta, **per["entry"], num_warps=self.num_warps))

    @property
    def own_y(self) -> bool:
        """The reduce writes y of the own segment (from the codes in its registers) and the
        tail decodes only the P-1 other owners' packets: a 1/P of the tail's HBM traffic moves
        into the link-bound reduce. Not when the tail updates the output-residual state,
        which needs every element there."""
        per = self._parts[-1]                             # constexprs by kernel
        return not (per["tail"]["OUTPUT"] and not self.defer_output)

    def reduce(self, y: torch.Tensor) -> None:
        ptrs, scal, consts, meta, per = self._parts
        launch(reduce_kernel, (self.lay.tiles,),
               (*ptrs, y, self._fs(), self.epoch, self.table, *scal, self.timeout, *consts),
               dict(**meta, **per["reduce"], USE_TIMER=self.use_timer, OWN_Y=self.own_y,
                    num_warps=self.num_warps))

    def _deferred(self, consts: dict) -> dict:
        return dict(consts, OUTPUT=False) if self.defer_output else consts

    def tail(self, y: torch.Tensor) -> None:
        """After reduce(y): y of the other owners' segments (and of the own one unless the
        reduce wrote it)."""
        ptrs, scal, consts, meta, per = self._parts
        first = int(self.own_y)
        launch(tail_kernel, (self.lay.tiles, self.lay.world_size - first),
               (*ptrs, y, self._fs(), self.epoch, self.table, *scal, self.timeout, *consts),
               dict(**meta, **self._deferred(per["tail"]), USE_TIMER=self.use_timer,
                    UPDATE_ONLY=False, FIRST=first, num_warps=self.num_warps))

    def tail_loop(self, y: torch.Tensor, programs: int) -> None:
        """tail(y) as `programs` persistent programs (`tail_loop_kernel`), for a second
        stream beside reduce(y): same result, its waits overlap the reduce."""
        ptrs, scal, consts, meta, per = self._parts
        first = int(self.own_y)
        launch(tail_loop_kernel, (max(1, programs),),
               (*ptrs, y, self._fs(), self.epoch, self.table, *scal, self.timeout, *consts),
               dict(**meta, **self._deferred(per["tail"]), USE_TIMER=self.use_timer,
                    FIRST=first, num_warps=self.num_warps))

    def output_update(self) -> None:
        """The output-residual state update of a call whose tail/fused kernel ran with
        defer_output: u = x' - y/P (y decoded again from the gather slots, exactly as the tail
        decoded it), m1, m2 updated. Needs the call's gather slots unchanged: the next call on
        this workspace must not start before it (P2PBackend orders them with an event)."""
        ptrs, scal, consts, meta, per = self._parts
        launch(tail_kernel, (self.lay.tiles, self.lay.world_size),
               (*ptrs, self.x, self._fs(), self.epoch, self.table, *scal, self.timeout,
                *consts),
               dict(**meta, **dict(per["tail"], OUTPUT=True), USE_TIMER=self.use_timer,
                    UPDATE_ONLY=True, FIRST=0, num_warps=self.num_warps))

    def reduce_tail(self, y: torch.Tensor, ticket: torch.Tensor, lag: int) -> None:
        """reduce() then tail(y) as one overlapped launch (`reduce_tail_kernel`): the tails of
        tile t run beside the reduces of tiles t + lag on. ticket: [2] int64, this rank's
        counters for this layout (only ever advanced by this kernel; one per tails-per-tile
        count, which own_y sets)."""
        ptrs, scal, consts, meta, per = self._parts
        tiles = self.lay.tiles
        own = self.own_y
        launch(reduce_tail_kernel, ((self.lay.world_size - own + 1) * tiles,),
               (*ptrs, y, self._fs(), self.epoch, self.table, ticket, *scal, self.timeout,
                max(0, min(lag, tiles)), *consts),
               dict(**meta, **self._deferred(per["reduce_tail"]), USE_TIMER=self.use_timer,
                    OWN_Y=own, num_warps=self.num_warps))

    def fused(self, y: torch.Tensor, programs: int) -> None:
        """The whole call in one launch of `programs` programs (<= epoch.numel(); the same on
        every rank of a workspace, for its whole life)."""
        ptrs, scal, consts, meta, per = self._parts
        grid = max(1, min(programs, self.lay.tiles))
        launch(fused_kernel, (grid,),
               (*ptrs, y, self._fs(), self.epoch, self.table, *scal, self.timeout, *consts),
               dict(**meta, **self._deferred(per["fused"]), USE_TIMER=self.use_timer,
                    num_warps=self.num_warps))


def local_amax(x: torch.Tensor, state: CompState | None, cfg: EchoConfig,
               block: int = 4096) -> torch.Tensor:
    """Per-block max |x'| of x' = x + c, fp32 [blocks] (feeds qar.grad_scale unchanged)."""
    k = CompensatorConstants.from_config(cfg)
    n = x.numel()
    out = torch.empty(max(1, triton.cdiv(n, block)), dtype=torch.float32, device=x.device)
    m1 = state.m1 if state is not None else x
    m2 = state.m2 if state is not None else x
    amax_kernel[(out.numel(),)](x, m1, m2, out, n, k.eta, k.a, k.one_minus_a,
                                X_KIND=DTYPE_KIND[x.dtype], COMP=state is not None, BLOCK=block,
                                **LAUNCH_OPTS)
    return out


def supported(x: torch.Tensor, cfg: EchoConfig, state: CompState | None = None) -> str | None:
    """Why the fused kernels cannot run this call (None when they can)."""
    if not cfg.quantized:
        return "bits=16 is the plain all-reduce"
    if x.dtype not in DTYPE_KIND:
        return f"dtype {x.dtype} is not bf16/fp16/fp32"
    if cfg.state_dtype not in STATE_DTYPES or (
            state is not None and state.m1.dtype != STATE_DTYPES[cfg.state_dtype]):
        return "compensator state must be fp32 or bf16, as the config says"
    if x.dim() != 1 or not x.is_contiguous():
        return "input must be a contiguous 1-D tensor"
    return None

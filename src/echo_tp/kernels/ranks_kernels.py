"""The stage kernels of every simulated rank in one launch (P virtual ranks on one device).

collective/simulated_fused.py runs a call's stages as entry(all ranks) -> reduce(all) ->
tail(all). Launched rank by rank, each launch covers 1/P of the work, and at training sizes
(a few million values a rank) the grid is too small to fill the GPU. These kernels take a
rank axis in the grid (program_id(2)) and run, for program (t, i, r), exactly what the stage
kernel of kernels/allreduce_kernels.py runs for program (t, i) of rank r, with RANK=r a
constexpr (one copy of the tile code per rank, chosen by a branch on the program id):

    entry_ranks_kernel   grid (tiles, P-1, P)        == entry_kernel[(tiles, P-1)](RANK=r)
    reduce_ranks_kernel  grid (tiles, 1, P)          == reduce_kernel[(tiles,)](RANK=r)
    tail_ranks_kernel    grid (tiles, P-FIRST, P)    == tail_kernel[(tiles, P-FIRST)](RANK=r)

so y, the state and every buffer byte are bit-identical to the rank-by-rank launches. Rank r's
tensors are found at ptr + r * stride (strides in elements, one per pointer argument, after the
pointers): x, m1, m2 [P, n] rows, y / residual rows, fs, the epochs [P] and the pointer tables
[P, P+1] (kernels/allreduce_plan.launch_ranks builds them from the ranks' CallPlans). The stages
of one call still run as three launches in order, so every flag a kernel waits for is set by
an earlier launch.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .allreduce_kernels import _entry_tile, _reduce_tile, _tail_tile


@triton.jit
def _row(ptr, r, stride):
    """Rank r's row of a [P, ...] argument: ptr + r * stride (int64 offset)."""
    return ptr + (tl.zeros([], tl.int64) + stride) * r


@triton.jit
def entry_ranks_kernel(x_ptr, m1_ptr, m2_ptr, fs_ptr, epoch_ptr, table_ptr,
                       sx, sm1, sm2, sfs, sep, stab,
                       n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride,
                       eta, a, oma, b1, omb1, b2, omb2,
                       P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                       SG: tl.constexpr, GS: tl.constexpr, VT: tl.constexpr,
                       BITS: tl.constexpr, QUANT: tl.constexpr, LEVELS: tl.constexpr,
                       QMAX: tl.constexpr, COMP: tl.constexpr, SCALED: tl.constexpr,
                       LOCAL: tl.constexpr, OUTLIER: tl.constexpr):
    """grid (tiles, P-1, P): program (t, i, r) is entry_kernel's (t, i) of rank r."""
    rank = tl.program_id(2)
    for R in tl.static_range(P):
        if rank == R:
            j = (R + 1 + tl.program_id(1)) % P
            _entry_tile(tl.program_id(0), j, tl.load(_row(epoch_ptr, R, sep)),
                        _row(x_ptr, R, sx), _row(m1_ptr, R, sm1), _row(m2_ptr, R, sm2),
                        _row(fs_ptr, R, sfs), _row(table_ptr, R, stab),
                        n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride,
                        eta, a, oma, b1, omb1, b2, omb2, R, P, X_KIND, BG, SG, GS, VT, BITS,
                        QUANT, LEVELS, QMAX, COMP, SCALED, LOCAL, OUTLIER)


@triton.jit
def reduce_ranks_kernel(x_ptr, m1_ptr, m2_ptr, y_ptr, res_ptr, fs_ptr, epoch_ptr, table_ptr,
                        sx, sm1, sm2, sy, sres, sfs, sep, stab,
                        n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride,
                        timeout, eta, a, oma, b1, omb1, b2, omb2,
                        P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                        SG: tl.constexpr, GS: tl.constexpr, VT: tl.constexpr,
                        BITS: tl.constexpr, QUANT: tl.constexpr, LEVELS: tl.constexpr,
                        QMAX: tl.constexpr, COMP: tl.constexpr, SCALED: tl.constexpr,
                        LOCAL: tl.constexpr, USE_TIMER: tl.constexpr, OWN_Y: tl.constexpr,
                        ADD: tl.constexpr, HALF: tl.constexpr, OUTLIER: tl.constexpr):
    """grid (tiles, 1, P): program (t, 0, r) is reduce_kernel's program t of rank r."""
    rank = tl.program_id(2)
    for R in tl.static_range(P):
        if rank == R:
            _reduce_tile(tl.program_id(0), tl.load(_row(epoch_ptr, R, sep)),
                         _row(x_ptr, R, sx), _row(m1_ptr, R, sm1), _row(m2_ptr, R, sm2),
                         _row(y_ptr, R, sy), _row(res_ptr, R, sres), _row(fs_ptr, R, sfs),
                         _row(table_ptr, R, stab),
                         n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride,
                         timeout, eta, a, oma, b1, omb1, b2, omb2, R, P, X_KIND, BG, SG, GS,
                         VT, BITS, QUANT, LEVELS, QMAX, COMP, SCALED, LOCAL, USE_TIMER, OWN_Y,
                         ADD, HALF, OUTLIER)


@triton.jit
def tail_ranks_kernel(x_ptr, m1_ptr, m2_ptr, y_ptr, res_ptr, fs_ptr, epoch_ptr, table_ptr,
                      sx, sm1, sm2, sy, sres, sfs, sep, stab,
                      n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride,
                      timeout, eta, a, oma, b1, omb1, b2, omb2,
                      P: tl.constexpr, X_KIND: tl.constexpr, BG: tl.constexpr,
                      SG: tl.constexpr, GS: tl.constexpr, VT: tl.constexpr,
                      BITS: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr,
                      PF: tl.constexpr, COMP: tl.constexpr, SCALED: tl.constexpr,
                      OUTPUT: tl.constexpr, USE_TIMER: tl.constexpr, FIRST: tl.constexpr,
                      ADD: tl.constexpr, OUTLIER: tl.constexpr):
    """grid (tiles, P-FIRST, P): program (t, i, r) is tail_kernel's (t, i) of rank r."""
    rank = tl.program_id(2)
    for R in tl.static_range(P):
        if rank == R:
            j = (R + FIRST + tl.program_id(1)) % P
            _tail_tile(tl.program_id(0), j, tl.load(_row(epoch_ptr, R, sep)),
                       _row(x_ptr, R, sx), _row(m1_ptr, R, sm1), _row(m2_ptr, R, sm2),
                       _row(y_ptr, R, sy), _row(res_ptr, R, sres), _row(fs_ptr, R, sfs),
                       _row(table_ptr, R, stab),
                       n, seg, groups, slot, scale_off, zero_off, flags_off, tiles, stride,
                       timeout, eta, a, oma, b1, omb1, b2, omb2, R, P, X_KIND, BG, SG, GS, VT,
                       BITS, QUANT, QMAX, PF, COMP, SCALED, OUTPUT, USE_TIMER, ADD, OUTLIER)

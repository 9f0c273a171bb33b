"""16-bit one-shot all-reduce for small messages: one kernel, no quantization.

Unfused equivalent (`oneshot_reference`): every rank computes

    acc = x_0.float(); acc = acc + x_1.float(); ...; y = acc.to(x.dtype)

over the P ranks' inputs in rank order, so y is the same on every rank (fp32 accumulation,
one rounding to the input dtype: at least as accurate as NCCL's bf16 ring). No error is
injected beyond that rounding, so the compensator state is left untouched (like the plain
all-reduce the dispatcher uses elsewhere).

Per call and rank r (grid G programs; program c handles tiles t = c, c+G, ... of TILE values):

    push   for each peer j != r: store tile t of x into rank j's slot [parity][r], then signal
           rank j's flag [r][t] = epoch
    sum    wait flag [s][t] >= epoch for every peer s; acc over the P tiles in rank order
           (own tile from x, the others from the own buffer); store y

Buffers (`OneShotLayout`): per rank one symmetric byte buffer of 2 parities x P sender slots of
`cap` bytes, then int64 flags [P][max_tiles] and an abort word. The slot parity is the epoch's:
rank r can start call k+1 (and overwrite parity (k+1) % 2) while a slower peer still reads
call k's data (parity k % 2); call k+2 cannot start before that peer pushed call k+1, i.e.
finished reading call k. Epochs are per program (bumped by the kernel; every program bumps its
own on every call, idle or not), so a flag of tile t always carries program (t mod G)'s count.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .allreduce_kernels import _buffer
from .launcher import launch
from .flags import gated, signal, wait_geq
from .quant_kernels import DTYPE_KIND, _cast_out, _load_f32

TILE = 2048
"""Values per tile (one flag)."""


@triton.jit
def _typed(p, X_KIND: tl.constexpr):
    """A uint8 pointer as a pointer to the input dtype."""
    if X_KIND == 2:
        out = p.to(tl.pointer_type(tl.bfloat16))
    elif X_KIND == 1:
        out = p.to(tl.pointer_type(tl.float16))
    else:
        out = p.to(tl.pointer_type(tl.float32))
    return out


@triton.jit
def oneshot_kernel(x_ptr, y_ptr, epochs_ptr, table_ptr, n, tiles, slot, flags_off, max_tiles,
                   timeout, RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr,
                   TILE: tl.constexpr, USE_TIMER: tl.constexpr):
    """y = sum over ranks of x (rank order, fp32), as in the module docstring."""
    c = tl.program_id(0)
    G = tl.num_programs(0)
    ep = tl.load(epochs_ptr + c) + 1
    par = ep % 2
    own = _buffer(table_ptr, RANK)
    flags = (own + flags_off).to(tl.pointer_type(tl.int64))       # [P][max_tiles]
    abort = flags + P * max_tiles
    err_rec = tl.load(table_ptr + P).to(tl.pointer_type(tl.int64))
    t = c
    while t < tiles:                                               # push
        e = t.to(tl.int64) * TILE + tl.arange(0, TILE)
        m = e < n
        v = tl.load(x_ptr + e, mask=m)
        for i in tl.static_range(P - 1):
            j = (RANK + 1 + i) % P
            peer = _buffer(table_ptr, j)
            dst = _typed(peer + (par * P + RANK) * slot, X_KIND)
            tl.store(dst + e, v, mask=m)
            signal((peer + flags_off).to(tl.pointer_type(tl.int64)) + RANK * max_tiles + t, ep)
        t += G
    t = c
    while t < tiles:                                               # sum
        ok = ep == ep
        for r in tl.static_range(P):
            if r != RANK:
                ok = ok & wait_geq(flags + r * max_tiles + t, ep, abort, err_rec, RANK, 3, t, r,
                                   timeout, USE_TIMER)
        e = t.to(tl.int64) * TILE + tl.arange(0, TILE)
        m = e < n
        for r in tl.static_range(P):                               # acc = x_0; acc += x_1; ...
            if r == RANK:
                v = _load_f32(x_ptr + e, m, X_KIND)
            else:
                v = _load_f32(_typed(own + (par * P + r) * slot, X_KIND) + e, m, X_KIND)
            if r == 0:
                acc = v
            else:
                acc = acc + v
        tl.store(y_ptr + e, _cast_out(acc, X_KIND), mask=gated(m, ok))
        t += G
    tl.debug_barrier()
    tl.store(epochs_ptr + c, ep)


@dataclass(frozen=True)
class OneShotLayout:
    """One rank's buffer: 2 parities x P sender slots of `slot` bytes, then int64 flags
    [P][max_tiles] and the abort word. Takes messages of up to `cap_bytes` bytes per rank."""

    world_size: int
    cap_bytes: int
    slot: int
    max_tiles: int
    flags_off: int
    nbytes: int

    @classmethod
    def build(cls, world_size: int, cap_bytes: int) -> "OneShotLayout":
        slot = -(-cap_bytes // 256) * 256
        max_tiles = -(-(cap_bytes // 2) // TILE)              # 2-byte values: the most tiles
        flags_off = 2 * world_size * slot
        words = -(-(world_size * max_tiles + 1) // 32) * 32
        return cls(world_size, cap_bytes, slot, max_tiles, flags_off, flags_off + 8 * words)

    def flag_words(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.flags_off:self.nbytes].view(torch.int64)

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.cap_bytes


def oneshot(x: torch.Tensor, y: torch.Tensor, *, rank: int, lay: OneShotLayout,
            epochs: torch.Tensor, table: torch.Tensor, timeout: int, use_timer: bool,
            num_warps: int = 4) -> None:
    """Launch one call: x, y [n] contiguous (bf16/fp16/fp32, n*size <= lay.cap_bytes);
    epochs [G] int64 (G programs, the same G on every rank for the layout's whole life)."""
    n = x.numel()
    launch(oneshot_kernel, (epochs.numel(),),
           (x, y, epochs, table, n, -(-n // TILE), lay.slot, lay.flags_off, lay.max_tiles,
            timeout),
           dict(RANK=rank, P=lay.world_size, X_KIND=DTYPE_KIND[x.dtype], TILE=TILE,
                USE_TIMER=use_timer, num_warps=num_warps))


def oneshot_reference(xs: list[torch.Tensor]) -> torch.Tensor:
    """The pure-torch form: the P inputs summed in rank order in fp32, cast once."""
    acc = xs[0].float()
    for v in xs[1:]:
        acc = acc + v.float()
    return acc.to(xs[0].dtype)

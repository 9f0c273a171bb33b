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

The block boundary at decode sizes (`oneshot_add_rmsnorm_kernel`): the same push and sum with
rows as tiles (one flag a row), and the sum not stored but added to the residual and
normalized where it is (norm.add_rmsnorm_reference of oneshot_reference's y, bit for bit):

    for each row: acc = x_0 + x_1 + ... (fp32, rank order); y = cast(acc)
                  residual_out = cast(residual + y); normed = RMSNorm(residual_out) * weight

i.e. the all-reduce and kernels/norm_kernels.rmsnorm_kernel (ADD) in one launch, y never
written or read back.

Header: beside each flag the sender writes its call word (flags.call_word of a 16-bit call:
the numel, the input dtype, the form), and every wait compares it with its own call's; ranks
whose calls differ record the mismatch (stage 6) and abort, their y (residual_out and normed)
is NaN where a refused tile was summed, and the backend raises a ValueError at its next call.

PHASES (both kernels): 3 is the call; 1 only the push (bumping the epochs) and 2 only the sum
(at the epochs the push left), so P ranks simulated in one stream (tests, one-GPU timing) run
push(every rank), then sum(every rank), and every wait finds its flag set.

Buffers (`OneShotLayout`): per rank one symmetric byte buffer of 2 parities x P sender slots of
`cap` bytes, then int64 flags [P][max_tiles], an abort word and the call words [2][P][max_tiles]
(by parity, as the slots). The slot and header parity is the epoch's:
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

from ..norm_reference import LANES, MAX_HIDDEN, add_rmsnorm_reference
from .allreduce_kernels import _buffer
from .launcher import launch
from .flags import call_word, first_other_call, gated, refuse, signal, wait_geq
from .norm_kernels import _as_f32, _inv_rms, _normalize_row
from .quant_kernels import DTYPE_KIND, _cast_out, _load_f32

TILE = 2048
"""Values per tile (one flag)."""
ROW_MIN = 512
"""The layout has a flag per row of the decode boundary for rows of at least this many values
(shorter rows, in messages of more rows than flags, take the two-launch path)."""


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
def _epoch(epochs_ptr, c, PHASES: tl.constexpr):
    """This call's epoch of program c: the stored one + 1, or (PHASES 2: the sum of a push
    already run) the stored one."""
    ep = tl.load(epochs_ptr + c)
    if PHASES != 2:
        ep = ep + 1
    return ep


@triton.jit
def _word(n, FORM: tl.constexpr, X_KIND: tl.constexpr):
    """The call word a one-shot call writes beside its flags (flags.call_word of a 16-bit call:
    n values, FORM 0 the all-reduce, 1 the decode boundary, in the quantizer field)."""
    return call_word(n, 0, 16, FORM, 0, X_KIND)


@triton.jit
def _signal_peer(peer, t, ep, word, flags_off, max_tiles, RANK: tl.constexpr, P: tl.constexpr):
    """Write this call's word into peer's header [ep parity][RANK][t], then set its flag
    [RANK][t] to ep (after this CTA's pushes). The headers have the slots' parity: a peer one
    call ahead writes the other parity, so the word a slower rank checks is still its call's."""
    flags = (peer + flags_off).to(tl.pointer_type(tl.int64))
    tl.store(_parity_headers(flags, ep, max_tiles, P) + RANK * max_tiles + t, word)
    signal(flags + RANK * max_tiles + t, ep)


@triton.jit
def _parity_headers(flags, ep, max_tiles, P: tl.constexpr):
    """int64* of the call words [P][max_tiles] of epoch ep's parity (after the flags
    [P][max_tiles] and the abort word: headers [2][P][max_tiles])."""
    return flags + P * max_tiles + 1 + (ep % 2) * P * max_tiles


@triton.jit
def _push(x_ptr, e, m, t, ep, word, table_ptr, slot, flags_off, max_tiles, RANK: tl.constexpr,
          P: tl.constexpr, X_KIND: tl.constexpr, SIGNAL: tl.constexpr):
    """Store x at element ids e into every peer's slot [epoch parity][RANK]; SIGNAL: then write
    the call word and set each peer's flag [RANK][t] = ep."""
    v = tl.load(x_ptr + e, mask=m)
    for i in tl.static_range(P - 1):
        peer = _buffer(table_ptr, (RANK + 1 + i) % P)
        tl.store(_typed(peer + ((ep % 2) * P + RANK) * slot, X_KIND) + e, v, mask=m)
        if SIGNAL:
            _signal_peer(peer, t, ep, word, flags_off, max_tiles, RANK, P)


@triton.jit
def _signal_peers(t, ep, word, table_ptr, flags_off, max_tiles, RANK: tl.constexpr,
                  P: tl.constexpr):
    """Write the call word and set every peer's flag [RANK][t] = ep (after this CTA's
    pushes)."""
    for i in tl.static_range(P - 1):
        _signal_peer(_buffer(table_ptr, (RANK + 1 + i) % P), t, ep, word, flags_off, max_tiles,
                     RANK, P)


@triton.jit
def _wait_peers(t, ep, word, table_ptr, flags_off, max_tiles, timeout, RANK: tl.constexpr,
                P: tl.constexpr, USE_TIMER: tl.constexpr):
    """Wait until every peer's flag [s][t] in this rank's buffer reaches ep, then check the
    peer's call word against this call's (word) -> ok (scalar; False after a timeout or a
    mismatch, both recorded)."""
    own = _buffer(table_ptr, RANK)
    flags = (own + flags_off).to(tl.pointer_type(tl.int64))       # [P][max_tiles]
    abort = flags + P * max_tiles
    err_rec = tl.load(table_ptr + P).to(tl.pointer_type(tl.int64))
    ok = ep == ep
    for r in tl.static_range(P):
        if r != RANK:
            ok = ok & wait_geq(flags + r * max_tiles + t, ep, abort, err_rec,
                               RANK, 3, t, r, timeout, USE_TIMER)
    peer, seen = first_other_call(_parity_headers(flags, ep, max_tiles, P), max_tiles, t, word,
                                  RANK, P)
    return refuse(ok, peer, seen, word, abort, err_rec, RANK, 6, t)


@triton.jit
def _rank_sum(x_ptr, own, e, m, ep, slot, RANK: tl.constexpr, P: tl.constexpr,
              X_KIND: tl.constexpr):
    """acc = x_0 + x_1 + ... in rank order, fp32 (own values from x, the others from the own
    buffer's slots of this parity)."""
    for r in tl.static_range(P):
        if r == RANK:
            v = _load_f32(x_ptr + e, m, X_KIND)
        else:
            v = _load_f32(_typed(own + ((ep % 2) * P + r) * slot, X_KIND) + e, m, X_KIND)
        if r == 0:
            acc = v
        else:
            acc = acc + v
    return acc


@triton.jit
def oneshot_kernel(x_ptr, y_ptr, epochs_ptr, table_ptr, n, tiles, slot, flags_off, max_tiles,
                   timeout, RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr,
                   TILE: tl.constexpr, USE_TIMER: tl.constexpr, PHASES: tl.constexpr):
    """y = sum over ranks of x (rank order, fp32), as in the module docstring."""
    c = tl.program_id(0)
    G = tl.num_programs(0)
    ep = _epoch(epochs_ptr, c, PHASES)
    own = _buffer(table_ptr, RANK)
    word = _word(n, 0, X_KIND)
    if PHASES != 2:
        t = c
        while t < tiles:                                           # push
            e = t.to(tl.int64) * TILE + tl.arange(0, TILE)
            _push(x_ptr, e, e < n, t, ep, word, table_ptr, slot, flags_off, max_tiles, RANK,
                  P, X_KIND, True)
            t += G
    if PHASES != 1:
        t = c
        while t < tiles:                                           # sum
            ok = _wait_peers(t, ep, word, table_ptr, flags_off, max_tiles, timeout, RANK, P,
                             USE_TIMER)
            e = t.to(tl.int64) * TILE + tl.arange(0, TILE)
            m = e < n
            acc = _rank_sum(x_ptr, own, e, m, ep, slot, RANK, P, X_KIND)
            tl.store(y_ptr + e, _cast_out(acc, X_KIND), mask=gated(m, ok))
            if ok == 0:                                            # a refused tile: NaN
                tl.store(y_ptr + e, _cast_out(acc * float("nan"), X_KIND), mask=m)
            t += G
    if PHASES != 2:
        tl.debug_barrier()
        tl.store(epochs_ptr + c, ep)


@triton.jit
def oneshot_add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, rout_ptr, epochs_ptr, table_ptr,
                               rows, H, chunks, eps, slot, flags_off, max_tiles, timeout,
                               RANK: tl.constexpr, P: tl.constexpr, X_KIND: tl.constexpr,
                               W_KIND: tl.constexpr, O_KIND: tl.constexpr, L: tl.constexpr,
                               USE_TIMER: tl.constexpr, PHASES: tl.constexpr):
    """The decode block boundary (module docstring): rows t = c, c+G, ... of x [rows, H],
    each pushed to every peer in chunks of L values, then (all peers' row t in) summed, added
    to residual and normalized: residual_out [rows, H] (x's dtype), normed [rows, H]."""
    c = tl.program_id(0)
    G = tl.num_programs(0)
    ep = _epoch(epochs_ptr, c, PHASES)
    own = _buffer(table_ptr, RANK)
    lanes = tl.arange(0, L)
    word = _word(rows * H, 1, X_KIND)
    if PHASES != 2:
        t = c
        while t < rows:                                            # push row t
            k = 0
            while k < chunks:
                offs = k * L + lanes
                _push(x_ptr, t.to(tl.int64) * H + offs, offs < H, t, ep, word, table_ptr, slot,
                      flags_off, max_tiles, RANK, P, X_KIND, False)
                k += 1
            _signal_peers(t, ep, word, table_ptr, flags_off, max_tiles, RANK, P)
            t += G
    if PHASES != 1:
        t = c
        while t < rows:
            ok = _wait_peers(t, ep, word, table_ptr, flags_off, max_tiles, timeout, RANK, P,
                             USE_TIMER)
            row = t.to(tl.int64) * H
            acc = tl.zeros([L], tl.float32)
            k = 0
            while k < chunks:                  # pass 1: y, residual_out, sum of squares
                offs = k * L + lanes
                m = offs < H
                y = _cast_out(_rank_sum(x_ptr, own, row + offs, m, ep, slot, RANK, P, X_KIND),
                              X_KIND)
                r = _as_f32(y, X_KIND) + _load_f32(res_ptr + row + offs, m, X_KIND)
                r = _cast_out(tl.where(ok, r, float("nan")), X_KIND)   # a refused row: NaN
                tl.store(rout_ptr + row + offs, r, mask=m)
                v = _as_f32(r, X_KIND)
                acc = acc + tl.where(m, v * v, 0.0)
                k += 1
            _normalize_row(rout_ptr, w_ptr, out_ptr, row, H, chunks, _inv_rms(acc, H, eps, L),
                           ep == ep, X_KIND, W_KIND, O_KIND, L)   # pass 2: normalize, scale
            #                                                (L2-hot; NaN rows stay NaN)
            t += G
    if PHASES != 2:
        tl.debug_barrier()
        tl.store(epochs_ptr + c, ep)


@dataclass(frozen=True)
class OneShotLayout:
    """One rank's buffer: 2 parities x P sender slots of `slot` bytes, then int64 flags
    [P][max_tiles], the abort word and the call words beside the flags, by parity as the slots
    [2][P][max_tiles]. Takes messages of up to `cap_bytes` bytes per rank."""

    world_size: int
    cap_bytes: int
    slot: int
    max_tiles: int
    flags_off: int
    nbytes: int

    @classmethod
    def build(cls, world_size: int, cap_bytes: int) -> "OneShotLayout":
        slot = -(-cap_bytes // 256) * 256
        max_tiles = -(-(cap_bytes // 2) // ROW_MIN)           # 2-byte values: tiles or rows
        flags_off = 2 * world_size * slot
        words = -(-(3 * world_size * max_tiles + 1) // 32) * 32
        return cls(world_size, cap_bytes, slot, max_tiles, flags_off, flags_off + 8 * words)

    def flag_words(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.flags_off:self.nbytes].view(torch.int64)

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.cap_bytes


def oneshot(x: torch.Tensor, y: torch.Tensor, *, rank: int, lay: OneShotLayout,
            epochs: torch.Tensor, table: torch.Tensor, timeout: int, use_timer: bool,
            num_warps: int = 4, phases: int = 3) -> None:
    """Launch one call: x, y [n] contiguous (bf16/fp16/fp32, n*size <= lay.cap_bytes);
    epochs [G] int64 (G programs, the same G on every rank for the layout's whole life);
    phases: the module docstring's PHASES."""
    n = x.numel()
    launch(oneshot_kernel, (epochs.numel(),),
           (x, y, epochs, table, n, -(-n // TILE), lay.slot, lay.flags_off, lay.max_tiles,
            timeout),
           dict(RANK=rank, P=lay.world_size, X_KIND=DTYPE_KIND[x.dtype], TILE=TILE,
                USE_TIMER=use_timer, PHASES=phases, num_warps=num_warps))


def add_rmsnorm_unfit(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      lay: OneShotLayout) -> str | None:
    """Why oneshot_add_rmsnorm cannot take this boundary (None when it can): x, residual
    [..., H] of one dtype, contiguous; weight [H]; a row a flag."""
    h = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or h == 0 or h > MAX_HIDDEN:
        return f"rows of {h} values (the kernel takes 1 to {MAX_HIDDEN})"
    if not lay.fits(x):
        return f"{x.numel() * x.element_size()} bytes exceed the one-shot buffer"
    if x.numel() // h > lay.max_tiles:
        return f"{x.numel() // h} rows exceed the buffer's {lay.max_tiles} row flags"
    if residual.shape != x.shape or residual.dtype != x.dtype or weight.shape != (h,):
        return "residual must match x, weight be [H]"
    if not (x.is_contiguous() and residual.is_contiguous()):
        return "x and residual must be contiguous"
    return None


def oneshot_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float, *, rank: int, lay: OneShotLayout, epochs: torch.Tensor,
                        table: torch.Tensor, timeout: int, use_timer: bool,
                        num_warps: int = 4, phases: int = 3,
                        out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode boundary call (where add_rmsnorm_unfit says None): x, residual [..., H],
    weight [H] -> (normed, residual_out), normed in torch's promotion of weight and x. out:
    (normed, residual_out) to write instead of new tensors."""
    h = x.shape[-1]
    if out is None:
        normed = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                             device=x.device)
        rout = torch.empty_like(x)
    else:
        normed, rout = out
    launch(oneshot_add_rmsnorm_kernel, (epochs.numel(),),
           (x, residual, weight, normed, rout, epochs, table, x.numel() // h, h,
            -(-h // LANES), float(eps), lay.slot, lay.flags_off, lay.max_tiles, timeout),
           dict(RANK=rank, P=lay.world_size, X_KIND=DTYPE_KIND[x.dtype],
                W_KIND=DTYPE_KIND[weight.dtype], O_KIND=DTYPE_KIND[normed.dtype], L=LANES,
                USE_TIMER=use_timer, PHASES=phases, num_warps=num_warps))
    return normed, rout


def oneshot_reference(xs: list[torch.Tensor]) -> torch.Tensor:
    """The pure-torch form: the P inputs summed in rank order in fp32, cast once."""
    acc = xs[0].float()
    for v in xs[1:]:
        acc = acc + v.float()
    return acc.to(xs[0].dtype)


def oneshot_add_rmsnorm_reference(xs: list[torch.Tensor], residual: torch.Tensor,
                                  weight: torch.Tensor, eps: float):
    """The pure-torch form of the decode boundary: (normed, residual_out) of
    norm.add_rmsnorm_reference(oneshot_reference(xs), residual, weight, eps)."""
    return add_rmsnorm_reference(oneshot_reference(xs), residual, weight, eps)

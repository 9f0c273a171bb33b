"""Cross-GPU readiness flags: release-signal, acquire-wait with a bounded spin, error records.

Flags are int64 words in a rank's symmetric buffer whose values only grow: call k of a
workspace writes and waits for the value k (the epoch, a device counter the host bumps with one
`add_` per call, so CUDA-graph replays advance it too; a pair of workspaces used in turn, the
p2p halves', shares one counter bumped by `next_call_kernel`, which also picks the call's
workspace). A flag is never cleared, so no stage ever has to reset one, and a stale value from
an earlier call can never satisfy a later one.

    signal(ptr, epoch)   after a CTA barrier: one thread stores epoch with release, system scope
    wait_geq(ptr, epoch) one thread polls with acquire loads (atomic add of 0, system scope)
                         until the flag reaches epoch, the deadline passes, or the rank's abort
                         word is set; returns False on timeout, after writing the error record

Error record: int64 words at an address the host can read without a device sync (pinned host
memory, reached through unified addressing): [set, rank, stage, tile, peer, seen, wanted]; a
timeout (stages 1-3: seen/wanted are flag values) or a call mismatch (stages 4-6: the peer's
call word and this rank's, `call_word` / `refuse`).
The rank's abort word (device memory) is claimed with a CAS, so one record is written and every
other wait of that rank stops at once; the host raises at its next call (`check_error`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant_kernels import DTYPE_KIND, QUANT_CODE

ERR_WORDS = 8
STAGES = {1: "reduce: waiting for a sender's segment packet",
          2: "tail: waiting for an owner's reduced packet",
          3: "one-shot: waiting for a peer's input tile"}
MISMATCH_STAGES = {4: "reduce: a sender's packet header names another call",
                   5: "tail: an owner's packet header names another call",
                   6: "one-shot: a peer's tile header names another call"}
"""Stages whose record is a call mismatch (seen: the peer's call word, wanted: this rank's)."""
POLL_NS = 500
"""Assumed cost of one poll when %globaltimer is not used: the timeout becomes a poll count."""


@triton.jit
def _now(USE_TIMER: tl.constexpr):
    """%globaltimer in ns (0 when USE_TIMER is off: the caller counts polls instead)."""
    if USE_TIMER:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                      is_pure=False, pack=1)
    else:
        t = tl.full([], 0, tl.int64)
    return t


@triton.jit
def signal(flag_ptr, value):
    """Make this CTA's earlier stores visible, then set *flag_ptr = value (release, system)."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def record_error(abort_ptr, err_ptr, rank, stage, tile, peer, seen, wanted):
    """Claim this rank's abort word (every wait of the rank stops at once); the first claim
    writes the error record [1, rank, stage, tile, peer, seen, wanted]."""
    zero64 = tl.zeros([], tl.int64)
    first = tl.atomic_cas(abort_ptr, zero64, zero64 + 1, sem="relaxed", scope="gpu")
    if first == 0:
        tl.store(err_ptr + 1, zero64 + rank)
        tl.store(err_ptr + 2, zero64 + stage)
        tl.store(err_ptr + 3, zero64 + tile)
        tl.store(err_ptr + 4, zero64 + peer)
        tl.store(err_ptr + 5, zero64 + seen)
        tl.store(err_ptr + 6, zero64 + wanted)
        tl.debug_barrier()
        tl.atomic_xchg(err_ptr, zero64 + 1, sem="release", scope="sys")


@triton.jit
def wait_geq(flag_ptr, wanted, abort_ptr, err_ptr, rank, stage, tile, peer, timeout,
             USE_TIMER: tl.constexpr):
    """Spin until *flag_ptr >= wanted. Returns a scalar bool: False after `timeout` (ns with
    USE_TIMER, else polls) or once this rank aborted; the first timeout writes the record."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    start = _now(USE_TIMER)
    spins = tl.full([], 0, tl.int64)
    go = seen < wanted
    while go:
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        spins += 1
        if USE_TIMER:
            elapsed = _now(USE_TIMER) - start
        else:
            elapsed = spins
        aborted = tl.load(abort_ptr, volatile=True)
        go = (seen < wanted) & (elapsed < timeout) & (aborted == 0)
    ok = seen >= wanted
    if seen < wanted:
        record_error(abort_ptr, err_ptr, rank, stage, tile, peer, seen, wanted)
    tl.debug_barrier()
    return ok


@triton.jit
def call_word(n, GS: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
              OUTLIER: tl.constexpr, X_KIND: tl.constexpr):
    """The header a sender writes beside each flag: the call's length n and packet width as one
    int64, ((n * 2^16 + GS) * 2^6 + BITS) * 2^8 + QUANT * 16 + OUTLIER * 8 + X_KIND (`call_word`
    on the host; `describe_call` reads it back)."""
    w = (tl.zeros([], tl.int64) + n) * 65536 + GS
    return (w * 64 + BITS) * 256 + QUANT * 16 + OUTLIER * 8 + X_KIND


@triton.jit
def first_other_call(hdr_ptr, stride, t, mine, RANK: tl.constexpr, P: tl.constexpr):
    """The call words hdr_ptr[r * stride + t] of the peers r != RANK (each written before the
    flag this rank waited for) against this rank's (mine) -> (the first peer whose word
    differs, or -1; its word, or mine)."""
    peer = tl.full([], -1, tl.int32)
    seen = mine
    for r in tl.static_range(P):
        if r != RANK:
            w = tl.load(hdr_ptr + r * stride + t, volatile=True)
            first = (w != mine) & (peer < 0)
            peer = tl.where(first, r, peer)
            seen = tl.where(first, w, seen)
    return peer, seen


@triton.jit
def refuse(ok, peer, seen, mine, abort_ptr, err_ptr, rank, stage, tile):
    """After waits that saw their flags (ok): a peer (>= 0) whose call word (seen) differs from
    this rank's (mine) is recorded (stage, tile, peer, seen, wanted = mine) and aborts this
    rank. Returns ok and no such peer."""
    if ok:
        if peer >= 0:
            record_error(abort_ptr, err_ptr, rank, stage, tile, peer, seen, mine)
    tl.debug_barrier()
    return ok & (peer < 0)


@triton.jit
def same_call(hdr_ptr, mine, ok, abort_ptr, err_ptr, rank, stage, tile, peer):
    """`refuse` for one peer's call word at hdr_ptr -> ok and the words equal."""
    seen = tl.load(hdr_ptr, volatile=True)
    return refuse(ok, tl.where(seen != mine, peer, -1), seen, mine, abort_ptr, err_ptr, rank,
                  stage, tile)


@triton.jit
def next_call_kernel(epoch_ptr, tables_ptr, table_ptr, WORDS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """One new call of a pair of workspaces used in turn (the p2p halves): epoch += 1, then
    table [WORDS] = tables[epoch % 2] (tables [2, WORDS] int64: each workspace's pointer
    table). One program; on the device, so CUDA-graph replays alternate too."""
    ep = tl.load(epoch_ptr) + 1
    i = tl.arange(0, BLOCK)
    m = i < WORDS
    tl.store(table_ptr + i, tl.load(tables_ptr + (ep % 2) * WORDS + i, mask=m), mask=m)
    tl.store(epoch_ptr, ep)


@triton.jit
def gated(mask, ok):
    """`mask & ok` for a block mask and a scalar bool (a wait's result), written as a select.
    Triton 3.9's interpreter splats a scalar comparison with its operands' dtype (int64 for a
    flag), so `mask & ok` there is no bool mask and stores reject it; compiled, both are one
    select."""
    return tl.where(ok, mask, False)


def timeout_units(timeout_s: float, use_timer: bool) -> int:
    """ECHO_FLAG_TIMEOUT_S -> the `timeout` argument of wait_geq (ns, or a poll count)."""
    return int(timeout_s * 1e9) if use_timer else max(1, int(timeout_s * 1e9 / POLL_NS))


def new_error_buffer(device_is_cuda: bool) -> torch.Tensor:
    """Zeroed int64 [ERR_WORDS] the kernels write and the host reads without a device sync:
    pinned (device-addressable) host memory when CUDA is used, plain CPU memory otherwise."""
    return torch.zeros(ERR_WORDS, dtype=torch.int64, pin_memory=device_is_cuda)


def raise_if_set(err: torch.Tensor, err_np) -> None:
    """Raise the recorded error, if any (err_np: a numpy view of err, read without a sync): a
    ValueError for a call mismatch, a RuntimeError for a timeout."""
    if err_np[0] != 0:
        raise (ValueError if int(err_np[2]) in MISMATCH_STAGES else RuntimeError)(
            describe_error(err))


def host_call_word(n: int, group_size: int, bits: int, quant: int, outlier: bool,
                   x_kind: int) -> int:
    """`call_word` on the host (what a rank's kernels write for this call)."""
    return (((n << 16) + group_size) * 64 + bits) * 256 + quant * 16 + int(outlier) * 8 + x_kind


def describe_call(word: int) -> str:
    """A call word -> 'N values, B-bit packets (group G, quantizer Q[, outlier word]), dtype'
    (16 bits: 'N values, 16-bit one-shot FORM, dtype')."""
    kinds = {v: str(k).removeprefix("torch.") for k, v in DTYPE_KIND.items()}
    quants = {v: k for k, v in QUANT_CODE.items()}
    low, rest = word & 255, word >> 8
    bits, rest = rest & 63, rest >> 6
    gs, n = rest & 65535, rest >> 16
    q, outlier, xk = low >> 4, (low >> 3) & 1, low & 7
    if bits == 16:                                     # a one-shot call (oneshot_kernels._word)
        form = "decode boundary (add + RMSNorm)" if q else "all-reduce"
        return f"{n} values, 16-bit one-shot {form}, {kinds.get(xk, xk)}"
    return (f"{n} values, {bits}-bit packets (group {gs}, {quants.get(q, q)}"
            f"{', outlier word' if outlier else ''}), {kinds.get(xk, xk)}")


def describe_error(err: torch.Tensor) -> str | None:
    """The host-readable error record -> a message, or None when nothing was recorded."""
    if int(err[0]) == 0:
        return None
    rank, stage, tile, peer, seen, wanted = (int(v) for v in err[1:7])
    if stage in MISMATCH_STAGES:
        return (f"echo-tp p2p: collective calls differ across ranks: rank {rank} called "
                f"{describe_call(wanted)}, rank {peer} called {describe_call(seen)} (stage "
                f"{stage}: {MISMATCH_STAGES[stage]}, tile {tile}). Every rank must make the same "
                f"calls in the same order; the mismatched call's output is NaN where it "
                f"failed. The p2p workspace is unusable now: rebuild the communicator.")
    what = STAGES.get(stage, f"stage {stage}")
    return (f"echo-tp p2p: rank {rank} timed out in stage {stage} ({what}) on tile {tile}, "
            f"peer {peer}: flag is {seen}, wanted {wanted}. A peer rank is stalled, crashed, or "
            f"called the collective with a different size/config; raise ECHO_FLAG_TIMEOUT_S if "
            f"the peers are merely slow. The p2p workspace is unusable now: rebuild the "
            f"communicator.")

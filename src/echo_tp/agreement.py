"""Ranks make the same calls: the cross-rank agreement check of one communicator.

A call's signature is (kind, numel, dtype, bits, direction, device). `Agreement.check(...)`
runs before any packet moves:

  * quantized CPU calls (the reference transport carries their length in-band:
    collective/inband.py) agree on the fixed part, the signature without the numel, once per
    communicator with one small all-gather of 6 integers (the first call's numel among them);
    the numel is compared after the call's first collective, where `in_band(...)` turns the
    transport's CallLengthMismatch into the ValueError naming every rank's call, before
    anything is returned. A call whose rows are wider than any before pays one 3-integer
    agreement (inband.py);
  * CUDA calls on the p2p and one-shot kernels (`carried`) agree on the fixed part once, like
    the CPU calls: their packets carry the call's length and width in a header beside each
    flag, and every kernel that receives a packet compares it with its own call on the GPU
    (no host sync); ranks that differ get an error record on every rank, NaN outputs for that
    call and a ValueError naming both calls at their next call on the backend (or at
    `check_error()`; collective/p2p.py, kernels/oneshot_kernels.py). What the header cannot
    see: calls that take different buffers (a p2p call on one rank, a one-shot or NCCL call
    on another; an all-reduce against a half) or a p2p call that grows the workspace on one
    rank only; those time out in the kernels, naming rank and stage;
  * other CUDA calls (NCCL's plain route: NCCL checks nothing and carries no header) and the
    16-bit CPU collectives agree on each new whole signature once,
    remembering at most MAX_CHECKED of them, the least recently used dropped first (every
    rank forgets the same one);
  * ECHO_DEBUG_CHECKS=1 agrees on the whole signature on every call. The default cannot tell
    when a rank repeats a remembered signature while a peer makes a new one, or when two
    ranks' numels fall in different width classes unless both rows are wider than any sent
    before (gloo then aborts or times out).

Ranks that disagree get a ValueError on every rank. `check_same_config` is the setup-time
check of the EchoConfig itself.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
import torch.distributed as dist

from . import envs
from .collective.inband import CallLengthMismatch, CallLengths
from .collective.reference import DistTransport
from .config import DIRECTIONS, DTYPES, KINDS, EchoConfig

MAX_CHECKED = 4096
"""Exact call signatures (CUDA and 16-bit calls) one communicator remembers; the least recently
used beyond (it is checked again when it comes back: every rank forgets the same one)."""


class Agreement:
    """The calls one communicator's ranks agreed on (the module docstring). lengths: the
    CallLengths the reference transport reads (None: no in-band lengths)."""

    def __init__(self, group: dist.ProcessGroup | None, lengths: CallLengths | None):
        self.group = group
        self.lengths = lengths
        self.debug = envs.debug_checks()
        self._agreed: set[tuple] = set()                           # fixed parts (in-band)
        self._checked: OrderedDict[tuple, None] = OrderedDict()     # whole ones (CUDA, 16-bit)
        self._transport: DistTransport | None = None

    def check(self, flat: torch.Tensor, cfg: EchoConfig, direction: str, kind: str,
              carried: bool = False) -> bool:
        """Every rank makes this call (flat [n] of one rank) with the same signature: a
        ValueError on every rank otherwise. carried: the call's packets carry its length and
        width on the GPU (a p2p route: Dispatcher.carries_call), so only its fixed part is
        agreed, once. Returns whether the numel is checked in-band by the reference transport
        (then run the call inside `in_band`)."""
        sig = signature(kind, flat.shape[-1], flat.dtype, cfg.bits, direction, flat.is_cuda)
        inband = (self.lengths is not None and cfg.quantized and not flat.is_cuda
                  and not self.debug)
        fixed_only = inband or (carried and not self.debug)
        if fixed_only:
            key = sig[:1] + sig[2:]                       # without the numel
            if key in self._agreed:
                return True
        elif sig in self._checked:
            self._checked.move_to_end(sig)
            return False
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"echo-tp: the first call of signature {describe(sig)} "
                "is inside CUDA graph capture; its once-per-signature check across ranks needs "
                "a collective and a host read. Make one eager call of each signature before "
                "capturing (the usual warm-up).")
        if self._transport is None:
            self._transport = DistTransport(self.group)
        check_same_call(sig, self._transport, flat.device)
        if fixed_only:
            self._agreed.add(key)
        elif not self.debug:
            self._checked[sig] = None
            if len(self._checked) > MAX_CHECKED:
                self._checked.popitem(last=False)
        return inband

    @contextlib.contextmanager
    def in_band(self, inband: bool, flat: torch.Tensor, cfg: EchoConfig, direction: str,
                kind: str):
        """The call's numel handed to the transport (when inband), and a length mismatch the
        transport found turned into the ValueError naming every rank's call."""
        if not inband:
            yield
            return
        self.lengths.numel = flat.shape[-1]
        try:
            yield
        except CallLengthMismatch as e:
            sigs = [signature(kind, n, flat.dtype, cfg.bits, direction, False)
                    for n in e.numels]
            raise ValueError(_mismatch(sigs, "the call returned nothing on any rank")) from None
        finally:
            self.lengths.numel = None


def signature(kind: str, numel: int, dtype: torch.dtype, bits: int, direction: str,
              cuda: bool) -> tuple[int, ...]:
    """A call's 6 integers (what every rank must agree on)."""
    return (KINDS.index(kind), numel, DTYPES.index(dtype), bits, DIRECTIONS.index(direction),
            int(cuda))


def check_same_call(sig: tuple, transport, device) -> None:
    """One small all-gather (6 integers a rank): every rank makes the same call (kind, numel,
    dtype, bits, direction, device); ValueError on every rank, naming each rank's call,
    otherwise."""
    got = transport.all_gather_ints(list(sig), device=device, stage="call-signature check")
    if any(g != got[0] for g in got):
        raise ValueError(_mismatch(got, "nothing was sent"))


def check_same_config(config: EchoConfig, group=None) -> None:
    """One small all-gather at setup: every rank must hold the same EchoConfig."""
    world = dist.get_world_size(group)
    sigs: list = [None] * world
    dist.all_gather_object(sigs, config.signature(), group=group)
    bad = [r for r, s in enumerate(sigs) if s != sigs[0]]
    if bad:
        raise ValueError(f"EchoConfig differs across ranks: rank 0 has {sigs[0]}, "
                         + ", ".join(f"rank {r} has {sigs[r]}" for r in bad))


def describe(sig) -> str:
    kind, n, dt, bits, d, cuda = (int(v) for v in sig)
    name = KINDS[kind] if 0 <= kind < len(KINDS) else f"collective#{kind}"
    dtype = DTYPES[dt] if 0 <= dt < len(DTYPES) else f"dtype#{dt}"
    direction = DIRECTIONS[d] if 0 <= d < len(DIRECTIONS) else f"direction#{d}"
    return (f"{name}(numel={n}, dtype={dtype}, bits={bits}, direction={direction!r}"
            + (", on CUDA)" if cuda else ")"))


def _mismatch(sigs: list[tuple], what: str) -> str:
    bad = [r for r, g in enumerate(sigs) if g != sigs[0]]
    return ("collective calls differ across ranks: rank 0 calls " + describe(sigs[0]) + ", "
            + ", ".join(f"rank {r} calls {describe(sigs[r])}" for r in bad)
            + ". Every rank must make the same calls in the same order (same collective, numel, "
            f"dtype, bits and direction); {what}")

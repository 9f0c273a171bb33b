"""Intra-node fast path: the fused compensated all-reduce, and its two halves, over CUDA
symmetric memory.

The dispatcher asks collective/routing.py whether a call comes here and with which kernel plan
(`Route`: form, tile, step, warps, overlap); this backend runs it:

    fused   one launch: entry, reduce and tail of every tile, the epoch bumped by
            the kernel itself (no host work per call beyond the launch);
    staged  epoch += 1 (device), entry (quantize + push), then reduce (owner sum, requantize,
            push to all, y of the own segment) and tail (decode the other owners' packets),
            one after the other (overlap 'off') or in one launch (overlap 'launch').

With `residual=` (a block boundary: comm.all_reduce_add_rmsnorm) the kernels that write y (the
reduce's own segment, the tail) write residual + y instead, torch's `residual + y` bit for bit,
so the boundary's add costs no pass of its own (the state updates still read y).

The halves (sequence parallelism; routing.route of a half's Call; unfused equivalent
collective/sharded.py) run the stage kernels on the layout of the all-reduce of P*m values
(kernels/allreduce_plan.py), always staged:

    reduce_scatter  x [P*m] -> y [m]      epoch += 1, entry, then reduce (HALF=1)
    all_gather      x [m]   -> y [P*m]    epoch += 1, encode, then tail over all P owners

each kind on two workspaces per layout of its own, used in turn (`_HalfWorkspaces` says why).

Everything runs on the current stream without a host synchronization, so calls are CUDA-graph
safe (warm each call signature up eagerly before capture). Backward calls with grad_scaling add
one kernel for the local max |x'| and the reference's `grad_scale` (one scalar MAX all-reduce
over the group) before entry. Bit-identical to the reference backend (collective/qar.py over
DistTransport) for the same inputs, state and config; calls with record=True (telemetry) run
the reference itself. Waits are bounded by ECHO_FLAG_TIMEOUT_S: a timed-out kernel writes
(rank, stage, tile, peer) to pinned host memory and the next call raises RuntimeError
(`check_error()` syncs and raises at once).

Every call carries its length and width: beside each flag the sender writes its call word
(numel, bits, group size, quantizer, input dtype: flags.call_word), and every kernel that waits
for a packet compares it with its own call's. Ranks whose calls differ each record the
mismatch (both call words) and abort, the call's y is NaN where it used a refused packet, and
the next call (or `check_error()`) raises a ValueError naming both calls. So no host check of
a call's length is needed (agreement.py agrees on the fixed part once). For that, calls of any
length, width, form and tile run on the same buffers: one workspace for the all-reduce, a pair
per half (kernels/allreduce_plan.Room: slots and flag arrays sized for the largest call so
far); a call larger than the room grows it first, with one small all-gather of every rank's
need (at least doubling what grows), the old buffers kept alive for CUDA graphs captured on
them. Buffers live in symmetric memory (collective/symm.py).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .. import envs
from ..compensator import CompState
from ..config import EchoConfig
from ..kernels import allreduce_plan, flags
from ..kernels.fits import fits
from . import tuning
from .backend import COLLECTIVES, Backend
from .qar import StepRecord, compensated_all_reduce, grad_scale
from .reference import DistTransport
from .routing import Route
from .symm import SymmetricBuffer, agreed_sm_count, select_symm_backend

log = logging.getLogger(__name__)
_KIND_NAMES = {code: (half or "all_reduce") for half, code in
               allreduce_plan.HALF_CODES.items()}


class _Workspace(SymmetricBuffer):
    """The all-reduce's buffer (every call of the backend, whatever its length, width, form
    and tile: allreduce_plan.Room) with its counters: epoch [2] (the epoch, bumped by the host
    for the stage kernels and by the fused kernel itself, then the fused kernel's departure
    count) and ticket [3] (reduce_tail_kernel's)."""

    def __init__(self, room: allreduce_plan.Room, group, rank: int, world: int, device,
                 err: torch.Tensor):
        super().__init__(room.nbytes(world), room.flags_off(world), group, rank, world, device,
                         err)
        self.room = room
        self.epoch = torch.zeros(2, dtype=torch.int64, device=device)
        self.ticket = torch.zeros(3, dtype=torch.int64, device=device)


class _HalfWorkspaces:
    """The two workspaces of one kind of the halves (one room), used in turn: call k of the
    pair has epoch k+1 and runs on workspace (k+1) % 2. `advance` (flags.next_call_kernel)
    bumps the pair's one epoch counter and points `table` at the call's workspace on the
    device, so a CUDA graph that captured an odd number of calls alternates on replay too.

    Why two. Every stage kernel stores only into the peers' buffers (and the own) and reads
    only its own; slot s of a buffer is only ever written by rank s. A half's readers wait for
    flags: the reduce-scatter's reduce for recv[s][t] of the P-1 peers s, the all-gather's tail
    for gath[j][t] of all P owners j (the own one included), every tile t; its writers (the
    reduce-scatter's entry, the all-gather's encode) wait for nothing. So on one workspace, a
    rank's next call of the kind could store into a peer's slot while that peer still reads
    it for the previous call: unlike the all-reduce's, a half alone is not a round trip.
    With two: rank r starts call k+2 (on the workspace of call k) only after it finished call
    k+1 (stream order). Its last kernel of call k+1 saw, in every tile, the flag of call k+1 of
    every peer it reads from, which is every peer; so every peer has started call k+1 and, in
    its own stream order, finished call k, its reads of that workspace included. Call k+2's
    stores there meet no reader of call k; call k+1 ran on the other workspace. Flags: those of
    a workspace are only set by its own calls, with epochs of one parity that only grow, so a
    stale flag (epoch - 2 or less) never satisfies a wait; both start zeroed behind a barrier.
    Nothing else is needed: the all-gather's own gather slot is written by this rank's encode
    and read by its own tail (stream order; the tail's wait on it passes at once), the
    reduce-scatter's own chunk goes through no slot. What the argument assumes, as the
    all-reduce's: each rank's calls on one stream, the same calls on every rank, and waits that
    saw their flags; a timed-out wait (ECHO_FLAG_TIMEOUT_S) gave up without, but left the error
    record, so the calls after it raise (`raise_if_set`)."""

    def __init__(self, room: allreduce_plan.Room, group, rank: int, world: int, device,
                 err: torch.Tensor):
        self.room = room
        self.bufs = [SymmetricBuffer(room.nbytes(world), room.flags_off(world), group, rank,
                                     world, device, err) for _ in range(2)]
        self.tables = torch.stack([b.table for b in self.bufs])      # [2, P+1] int64
        self.table = self.tables[0].clone()                           # [P+1]: this call's
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)

    def advance(self) -> None:
        """A new call: epoch += 1, table = tables[epoch % 2] (one launch, no host sync)."""
        allreduce_plan.next_call(self.epoch, self.tables, self.table)


class P2PBackend(Backend):
    """Runs the calls routed to 'p2p' (`run`, `reduce_scatter`, `all_gather`); `close` drops
    the buffers. Offers 'residual' too: run(residual=r) returns r + y, the add done by the
    kernels that write y."""

    name = "p2p"
    offers = COLLECTIVES | {"residual"}

    def __init__(self, group: dist.ProcessGroup | None = None,
                 shape: tuning.KernelShape = tuning.DEFAULT.shape):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.transport = DistTransport(group)        # grad-scale MAX; record=True calls
        self.symm_backend = select_symm_backend(self.device)
        sms = agreed_sm_count(group, self.device)
        self.programs = shape.programs_per_sm.value * sms
        """Programs of the fused kernel, the same on every rank (the smallest SM count of the
        group); the ones not resident start as others finish (each waits only on the same
        program of the peers, which the GPUs start in the same order)."""
        self.overlap_lag = shape.overlap_lag_per_sm.value * sms
        """overlap 'launch': the tails trail the reduces by this many tiles."""
        self.use_timer = True                         # %globaltimer; poll count if it fails
        self._err = flags.new_error_buffer(True)
        self._err_np = self._err.numpy()
        self._ws: dict = {}
        """Kind (None: the all-reduce; 'reduce_scatter', 'all_gather') -> its workspace."""
        self._retired: list = []
        self._timeouts: dict[bool, int] = {}

    def run(self, x: torch.Tensor, cfg: EchoConfig, *, route: Route,
            state: CompState | None, backward: bool, record: bool,
            inplace: bool = False, residual: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, StepRecord | None]:
        """-> (y, None), or (residual + y, None) with residual ([n], x's dtype, contiguous);
        record=True: the reference's (y, StepRecord)."""
        if record:   # telemetry needs the unfused intermediates: same numbers, reference path
            flags.raise_if_set(self._err, self._err_np)
            y, rec = compensated_all_reduce(x, cfg, self.transport, state=state,
                                            backward=backward, record=True)
            return (y if residual is None else residual + y), rec
        plan, ws, y = self.prepare(x, cfg, route, state=state, backward=backward,
                                   residual=residual)
        if route.form == "fused":
            self._launch(plan, lambda: plan.fused(y, self.programs))
            return y, None
        plan.entry()
        if route.overlap == "launch":
            self._launch(plan, lambda: plan.reduce_tail(y, ws.ticket, self.overlap_lag))
        else:
            self._launch(plan, lambda: plan.reduce(y))
            self._launch(plan, lambda: plan.tail(y))
        return y, None

    def reduce_scatter(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None,
                       backward: bool, route: Route) -> torch.Tensor:
        """x [P*m] -> this rank's chunk of the sum, y [m] in x's dtype; state (m1, m2 [P*m])
        updated in place: sharded.compensated_reduce_scatter over DistTransport, bit for bit
        (route: routing.route's for the half, staged)."""
        plan, _, y = self.prepare(x, cfg, route, state=state, backward=backward,
                                  half="reduce_scatter")
        plan.entry()
        self._launch(plan, lambda: plan.reduce(y))
        return y

    def all_gather(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None,
                   backward: bool, route: Route) -> torch.Tensor:
        """x [m] (this rank's shard) -> y [P*m], every shard in rank order, the same on every
        rank; state (m1, m2 [m]) updated in place: sharded.compensated_all_gather over
        DistTransport, bit for bit (route: routing.route's for the half, staged)."""
        plan, _, y = self.prepare(x, cfg, route, state=state, backward=backward,
                                  half="all_gather")
        plan.encode()
        self._launch(plan, lambda: plan.tail(y))
        return y

    def prepare(self, x: torch.Tensor, cfg: EchoConfig, route: Route, *,
                state: CompState | None, backward: bool, residual: torch.Tensor | None = None,
                half: str | None = None):
        """A call's launch plan, workspace and output, epochs bumped (benchmarks time the
        stages of the plan one by one) -> (CallPlan, workspace, y; residual + y with
        residual). half: 'reduce_scatter' (y [m] of x [P*m]) or 'all_gather' (y [P*m] of
        x [m]) on the kind's workspace pair, the call's workspace picked."""
        flags.raise_if_set(self._err, self._err_np)
        P = self.world_size
        why = fits(half or "all_reduce", x, cfg, world_size=P, state=state, residual=residual)
        fused = route.form == "fused"
        if why is None and half is not None and fused:
            why = "the halves run the stage kernels only (route form 'staged')"
        if why is not None:
            raise ValueError(f"p2p backend cannot run this {half or 'all_reduce'}: {why}")
        ws, lay = self._workspace(x, cfg, route.tile, half)
        fs = None
        if backward and cfg.grad_scaling:
            fs = grad_scale(allreduce_plan.local_amax(x, state, cfg), self.transport)   # [1]
        if half is not None:
            ws.advance()
        elif not fused:
            ws.epoch[:1].add_(1)
        plan = allreduce_plan.CallPlan(
            rank=self.rank, lay=lay, cfg=cfg, x=x, state=state, fs=fs,
            epoch=ws.epoch, table=ws.table,
            timeout=self._timeout_units(), use_timer=self.use_timer,
            num_warps=route.num_warps, step_elems=route.step, residual=residual, half=half)
        if half is None:
            return plan, ws, torch.empty_like(x)
        n = x.numel()
        return plan, ws, x.new_empty(n // P if half == "reduce_scatter" else n * P)

    def close(self) -> None:
        self._ws.clear()
        self._retired.clear()

    def check_error(self) -> None:
        """Synchronize the device and raise if any wait of this backend timed out."""
        torch.cuda.synchronize(self.device)
        flags.raise_if_set(self._err, self._err_np)

    # ----- helpers -----
    def _workspace(self, x: torch.Tensor, cfg: EchoConfig, tile: int, half: str | None = None
                   ) -> tuple[_Workspace | _HalfWorkspaces, allreduce_plan.Layout]:
        """The workspace of the call's kind (the all-reduce's: half None; the pair of a half's
        kind) and the call's layout in it. A call the room does not hold grows it first (one
        agreement across ranks, `_grow`); other calls need no host step, whatever their
        length: the packet headers carry it (module docstring)."""
        spec = cfg.quant_spec()
        numel = x.numel() * (self.world_size if half == "all_gather" else 1)
        lay = allreduce_plan.Layout.build(numel, self.world_size, spec, tile)
        ws = self._ws.get(half)
        if ws is None or not ws.room.holds(lay.room):
            ws = self._grow(half, lay.room, ws)
        return ws, lay.within(ws.room)

    def _grow(self, half: str | None, need: allreduce_plan.Room,
              old: _Workspace | _HalfWorkspaces | None) -> _Workspace | _HalfWorkspaces:
        """A larger workspace for `half`'s calls: every rank's need agreed in one small
        all-gather (the ranks reach this with the same call: a rank whose call fits while a
        peer's does not times out in its kernels instead, naming rank and stage), the room
        grown to hold all of them (at least doubling what grows), the new buffers allocated
        (a collective) and the old ones kept alive (CUDA graphs captured on them replay)."""
        kind = allreduce_plan.HALF_CODES[half]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"echo-tp p2p: a {_KIND_NAMES[kind]} call needs {need}, more than the "
                f"workspace holds ({old.room if old is not None else 'none yet'}), inside CUDA "
                "graph capture; growing it needs an agreement across ranks and a new buffer. "
                "Make one eager call of the largest size before capturing.")
        got = self.transport.all_gather_ints([kind, need.slot, need.tiles], device=self.device,
                                             stage="p2p workspace agreement")
        if any(g[0] != kind for g in got):
            raise ValueError("collective calls differ across ranks: "
                             + ", ".join(f"rank {r} grows the workspace of "
                                         f"{_KIND_NAMES[g[0]]}" for r, g in enumerate(got)))
        for _, slot, tiles in got:
            need = need.union(allreduce_plan.Room(slot, tiles))
        room = old.room.grown(need) if old is not None else need
        if old is not None:
            self._retired.append(old)
        args = (room, self.group, self.rank, self.world_size, self.device, self._err)
        ws = self._ws[half] = _Workspace(*args) if half is None else _HalfWorkspaces(*args)
        log.debug("echo-tp p2p: %s workspace of %s", _KIND_NAMES[kind], room)
        return ws

    def _timeout_units(self) -> int:
        """ECHO_FLAG_TIMEOUT_S in the kernels' units, read once per timer mode."""
        units = self._timeouts.get(self.use_timer)
        if units is None:
            units = self._timeouts[self.use_timer] = flags.timeout_units(
                envs.flag_timeout_s(), self.use_timer)
        return units

    def _launch(self, plan, launch) -> None:
        try:
            launch()
        except Exception as e:  # noqa: BLE001 - a compile failure of the %globaltimer asm
            if not plan.use_timer:
                raise
            log.warning("echo-tp p2p: %%globaltimer wait failed to build (%s); counting polls",
                        e)
            self.use_timer = plan.use_timer = False
            plan.timeout = flags.timeout_units(envs.flag_timeout_s(), False)
            launch()

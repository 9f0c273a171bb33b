"""Host side of the fused all-reduce kernels: one rank's buffer layout and the per-call plan.

`Layout` places a call's receive slots, gather slots and flags in one rank's byte buffer;
`CallPlan` holds everything one rank's launches of one call need and launches the kernels of
kernels/allreduce_kernels.py (entry, reduce, tail; reduce_tail; fused) through
kernels/launcher.py. Which of them a call runs, with which tile: collective/routing.py.

The halves (sequence parallelism; collective/sharded.py is their reference) run the same
kernels on the layout of the all-reduce of P*m values, whose segments are the m-value chunks
when the group size g divides m (kernels/fits.py: `fits`, which says which calls the kernels
take):

    reduce-scatter  x [P*m] -> y [m]     entry(), then reduce(y)    (the reduce: HALF=1)
    all-gather      x [m]   -> y [P*m]   encode(), then tail(y)     (encode: the reduce's
                                                                     kernel with HALF=2)

with CallPlan(half='reduce_scatter' | 'all_gather'); the compensator residual is always the
halves' own rounding errors ('local'), whatever cfg.residual says.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

from ..compensator import CompState
from ..config import CompensatorConstants, EchoConfig, QuantSpec
from ..quant import Packet
from .allreduce_kernels import (amax_kernel, entry_kernel, fused_kernel, reduce_kernel,
                                reduce_tail_kernel, tail_kernel)
from .flags import next_call_kernel
from .launcher import launch
from .ranks_kernels import entry_ranks_kernel, reduce_ranks_kernel, tail_ranks_kernel
from .quant_kernels import DTYPE_KIND, LAUNCH_OPTS, spec_constexprs, values_per_thread

HALF_CODES = {None: 0, "reduce_scatter": 1, "all_gather": 2}
"""CallPlan.half -> the reduce kernel's HALF constexpr."""

STAGES = ("entry", "reduce", "encode", "tail")
"""The stage kernels' launches of a call (CallPlan.stage)."""

RANKS_KERNELS = {entry_kernel: entry_ranks_kernel, reduce_kernel: reduce_ranks_kernel,
                 tail_kernel: tail_ranks_kernel}
"""Each stage kernel -> its form with every simulated rank in one launch
(kernels/ranks_kernels.py)."""


def _align(v: int, a: int) -> int:
    return -(-v // a) * a


@dataclass(frozen=True)
class Room:
    """What one workspace's buffers hold, whatever call runs on them: slots of `slot` bytes and
    flag arrays of `tiles` tiles. Every call whose own layout fits runs on the same buffers
    (`Layout.build(..., room=)`), so calls of any length, width and tile share one workspace
    and their packet headers can be compared."""

    slot: int
    tiles: int

    def holds(self, other: "Room") -> bool:
        return other.slot <= self.slot and other.tiles <= self.tiles

    def union(self, other: "Room") -> "Room":
        return Room(max(self.slot, other.slot), max(self.tiles, other.tiles))

    def grown(self, need: "Room") -> "Room":
        """A room that holds this one and need, at least doubling what grows (a sequence of
        growing calls reallocates a logarithmic number of times)."""
        return Room(self.slot if need.slot <= self.slot else max(need.slot, 2 * self.slot),
                    self.tiles if need.tiles <= self.tiles else max(need.tiles, 2 * self.tiles))

    def flags_off(self, world_size: int) -> int:
        return 2 * world_size * self.slot

    def nbytes(self, world_size: int) -> int:
        """Slots, then the int64 words: flags [2P][tiles], abort, call words [2P][tiles]."""
        return self.flags_off(world_size) + 8 * _align(4 * world_size * self.tiles + 1, 32)


@dataclass(frozen=True)
class Layout:
    """One call's view of one rank's buffer: receive slots [P(sender)], gather slots
    [P(owner)], then int64 words: flags recv [P][stride], gath [P][stride], the abort word,
    then the call words (headers) beside the flags, recv [P][stride] and gath [P][stride]. A
    slot holds one segment packet: codes at 0, 16-bit scale words at scale_off, fp16 zeros at
    zero_off, fp16 outlier words (QuantSpec.outlier) at outlier_off (16-byte aligned regions in
    quant.to_bytes' order; the kernels find outlier_off from the other two:
    allreduce_kernels._outlier_off). slot, stride, flags_off and nbytes are the room's (the
    workspace's); seg, groups, tiles and the offsets inside a slot are the call's."""

    world_size: int
    seg: int
    groups: int
    bg: int
    tiles: int
    slot: int
    scale_off: int
    zero_off: int
    outlier_off: int
    flags_off: int
    nbytes: int
    stride: int
    """Tiles per flag array (the room's)."""

    @property
    def room(self) -> Room:
        return Room(self.slot, self.stride)

    @classmethod
    def build(cls, numel: int, world_size: int, spec: QuantSpec, tile_elems: int,
              room: Room | None = None) -> "Layout":
        """The layout of a call of numel values in a buffer of `room` (None: the call's own
        room, `needs`); ValueError when the call does not fit the room."""
        g = spec.group_size
        seg = -(-numel // (world_size * g)) * g              # qar.segment_len
        groups = seg // g
        bg = max(1, tile_elems // g)
        if bg & (bg - 1):
            raise ValueError(f"tile_elems {tile_elems} / group_size {g} must be a power of two")
        tiles = -(-groups // bg)
        scale_off = _align(seg * spec.bits // 8, 16)
        words = _align(2 * groups, 16)                       # one region of 16-bit words
        zero_off = scale_off + words
        outlier_off = zero_off + (words if spec.has_zero else 0)
        end = outlier_off + (words if spec.outlier else 0)
        own = Room(_align(end, 256), tiles)
        lay = cls(world_size, seg, groups, bg, tiles, own.slot, scale_off, zero_off,
                  outlier_off, own.flags_off(world_size), own.nbytes(world_size), own.tiles)
        return lay if room is None else lay.within(room)

    def within(self, room: Room) -> "Layout":
        """This call's layout in a buffer of `room` (its slot, flag stride and bytes);
        ValueError when the call does not fit."""
        if not room.holds(self.room):
            raise ValueError(f"a call of {self.world_size} segments of {self.seg} values needs "
                             f"{self.room}, the workspace has {room}")
        P = self.world_size
        return replace(self, slot=room.slot, flags_off=room.flags_off(P),
                       nbytes=room.nbytes(P), stride=room.tiles)

    @staticmethod
    def needs(numel: int, world_size: int, spec: QuantSpec, tile_elems: int) -> Room:
        """The room a call of numel values needs."""
        return Layout.build(numel, world_size, spec, tile_elems).room

    def flag_words(self, buf: torch.Tensor) -> torch.Tensor:
        """The int64 words after the slots (flags, abort word, call words) of a rank's uint8
        buffer."""
        return buf[self.flags_off:self.nbytes].view(torch.int64)

    def packet(self, buf: torch.Tensor, region: int, idx: int, spec: QuantSpec) -> Packet:
        """quant.Packet of views of slot idx of region 0 (receive) or 1 (gather)."""
        base = (region * self.world_size + idx) * self.slot
        codes = buf[base:base + self.seg * spec.bits // 8]

        def words(off: int) -> torch.Tensor:
            return buf[base + off:base + off + 2 * self.groups].view(torch.float16)
        return Packet(codes, words(self.scale_off),
                      words(self.zero_off) if spec.has_zero else None,
                      words(self.outlier_off) if spec.outlier else None)


def step_warps(group_size: int, step: int, num_warps: int) -> tuple[int, int]:
    """(VT, warps) of a step of `step` values asked to run on num_warps warps: VT values a
    thread (quant_kernels' tiling), and no more warps than the step has runs of VT values
    (more would hold copies of the same values)."""
    vt = values_per_thread(group_size, step, num_warps)
    return vt, max(1, min(num_warps, step // (32 * vt)))


@functools.lru_cache(maxsize=1024)
def _static_args(lay: Layout, cfg: EchoConfig, rank: int, dtype: torch.dtype, comp: int,
                 scaled: bool, step_elems: int, half: bool = False,
                 num_warps: int = 4) -> tuple:
    """The launch arguments fixed by (layout, config, rank, dtype): built once, not per call.
    -> (layout scalars, compensator constants, constexprs common to the kernels (num_warps
    among them: step_warps), extra constexprs by kernel name). comp: the kernels' COMP, 0
    without state, 1 one state tensor (m2 is m1), 2 two. half: a reduce-scatter or all-gather
    call (its residual is always the own rounding errors)."""
    spec = cfg.quant_spec()
    k = CompensatorConstants.from_config(cfg)
    scal = (lay.seg, lay.groups, lay.slot, lay.scale_off, lay.zero_off, lay.flags_off, lay.tiles,
            lay.stride)
    consts = (k.eta, k.a, k.one_minus_a, k.beta1, k.one_minus_beta1, k.beta2, k.one_minus_beta2)
    ce = spec_constexprs(spec)
    sg = min(lay.bg, max(1, step_elems // spec.group_size))
    if sg & (sg - 1):
        raise ValueError(f"step_elems {step_elems} / group_size {spec.group_size} must be a "
                         "power of two")
    vt, warps = step_warps(spec.group_size, sg * spec.group_size, num_warps)
    meta = dict(RANK=rank, P=lay.world_size, X_KIND=DTYPE_KIND[dtype], BG=lay.bg, SG=sg,
                GS=ce["GS"], VT=vt, BITS=ce["BITS"], QUANT=ce["QUANT"], OUTLIER=ce["OUTLIER"],
                num_warps=warps)
    local = comp and (half or cfg.residual == "local")
    output = comp and not half and cfg.residual == "output"
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
    either the stage kernels (entry, reduce, tail or reduce_tail: `epoch` bumped by the host)
    or the single fused kernel (`fused`: the epoch bumped by the kernel itself)."""

    rank: int
    lay: Layout
    cfg: EchoConfig
    x: torch.Tensor               # [n] bf16/fp16/fp32, contiguous
    state: CompState | None       # m1, m2 [n] fp32 or bf16 (m2 may be m1), updated in place
    fs: torch.Tensor | None       # [1] fp32 backward scale factor 2^e, or None
    epoch: torch.Tensor           # int64 [2]: the workspace's epoch, already bumped for this
                                  # call (stage kernels; [1] is enough for them), then the
                                  # fused kernel's departure count (it bumps the epoch itself)
    table: torch.Tensor           # [P+1] int64: the P buffers, then the error record
    timeout: int
    use_timer: bool
    num_warps: int                # warps per program
    step_elems: int               # values per step of a tile (what a program holds at once)
    num_stages: int | None = None  # triton's software-pipelining depth (None: its default)
    residual: torch.Tensor | None = None
    """[n] x's dtype, contiguous, or None: the kernels that write y (the reduce's own y, the
    tail) write residual + y there instead (torch's `residual + y`; the state updates still
    read y): the block boundary's residual add, fused where y is decoded."""
    half: str | None = None
    """None: the all-reduce. 'reduce_scatter': x [P*m] -> y [m] by entry() then reduce(y);
    'all_gather': x [m] (the own shard) -> y [P*m] by encode() then tail(y). lay is the layout
    of P*m values (seg = m), the state is x's size (module docstring)."""

    def __post_init__(self):
        if self.half not in HALF_CODES:
            raise ValueError(f"half must be one of {tuple(HALF_CODES)}, got {self.half!r}")
        if self.half is not None and self.residual is not None:
            raise ValueError("the reduce-scatter and all-gather add no residual")

    @functools.cached_property
    def _parts(self):
        st = self.state
        scal, consts, meta, per = _static_args(self.lay, self.cfg, self.rank, self.x.dtype,
                                               _comp(st), self.fs is not None,
                                               self.step_elems, self.half is not None,
                                               self.num_warps)
        x = self.x
        ptrs = (x, st.m1, st.m2) if st is not None else (x, x, x)
        n = self.lay.world_size * self.lay.seg if self.half else x.numel()   # = P*m
        return ptrs, (n, *scal), consts, meta, per

    def _stages(self) -> dict:
        return {} if self.num_stages is None else {"num_stages": self.num_stages}

    def _fs(self):
        return self.fs if self.fs is not None else self.epoch

    def _res(self, y: torch.Tensor) -> tuple:
        """(res_ptr, ADD) of the kernels that write y: the residual, or y (unread) without."""
        if self.residual is None:
            return y, False
        return self.residual, True

    def entry(self) -> None:
        """Quantize and push the segments of the other owners (the all-reduce, the
        reduce-scatter)."""
        if self.lay.world_size == 1:
            self._check_half(None, "reduce_scatter")
            return
        self._launch(*self.stage("entry"))

    def stage(self, name: str, y: torch.Tensor | None = None) -> tuple:
        """One stage kernel's launch: name 'entry', 'reduce' (y: this rank's output), 'encode'
        or 'tail' (y) -> (stage kernel, grid, tensor arguments, the other arguments, meta).
        The tensors are this rank's (x, m1, m2[, y, residual], fs, epoch, table), so the same
        stage of P simulated ranks can run as one launch (`launch_ranks`)."""
        ptrs, scal, consts, meta, per = self._parts
        P, tiles = self.lay.world_size, self.lay.tiles
        if name == "entry":
            self._check_half(None, "reduce_scatter")
            return (entry_kernel, (tiles, P - 1), (*ptrs, self._fs(), self.epoch, self.table),
                    (*scal, *consts), dict(**meta, **per["entry"], **self._stages()))
        if name in ("reduce", "encode"):
            if name == "reduce":
                self._check_half(None, "reduce_scatter")
            else:
                self._check_half("all_gather")
                y = self.x
            res, add = self._res(y)
            return (reduce_kernel, (tiles,),
                    (*ptrs, y, res, self._fs(), self.epoch, self.table),
                    (*scal, self.timeout, *consts),
                    dict(**meta, **per["reduce"], USE_TIMER=self.use_timer, OWN_Y=self.own_y,
                         ADD=add, HALF=HALF_CODES[self.half], **self._stages()))
        if name == "tail":
            self._check_half(None, "all_gather")
            first = int(self.own_y)
            res, add = self._res(y)
            return (tail_kernel, (tiles, P - first),
                    (*ptrs, y, res, self._fs(), self.epoch, self.table),
                    (*scal, self.timeout, *consts),
                    dict(**meta, **per["tail"], USE_TIMER=self.use_timer, FIRST=first, ADD=add,
                         **self._stages()))
        raise ValueError(f"unknown stage {name!r}; one of {STAGES}")

    @staticmethod
    def _launch(kernel, grid: tuple, tensors: tuple, rest: tuple, meta: dict) -> None:
        launch(kernel, grid, (*tensors, *rest), meta)

    @property
    def own_y(self) -> bool:
        """The reduce writes y of the own segment (from the codes in its registers) and the
        tail decodes only the P-1 other owners' packets: a 1/P of the tail's HBM traffic moves
        into the link-bound reduce. Not when the tail updates the output-residual state,
        which needs every element there."""
        return self.half is None and not self._parts[-1]["tail"]["OUTPUT"]

    def reduce(self, y: torch.Tensor) -> None:
        """The owner sum: requantized and pushed (the all-reduce), or stored as this rank's
        chunk y [m] (the reduce-scatter: HALF=1)."""
        self._launch(*self.stage("reduce", y))

    def encode(self) -> None:
        """The all-gather's entry: x' of the own shard encoded once and pushed into every
        rank's gather slot of this rank (the reduce kernel with HALF=2: no waits, no sum)."""
        self._launch(*self.stage("encode"))

    def _check_half(self, *allowed) -> None:
        if self.half not in allowed:
            raise ValueError(f"this stage is not part of a {self.half or 'all_reduce'} call")

    def tail(self, y: torch.Tensor) -> None:
        """After reduce(y): y of the other owners' segments (and of the own one unless the
        reduce wrote it). All-gather, after every rank's encode(): y [P*m], every owner's
        packet decoded, the own one included."""
        self._launch(*self.stage("tail", y))

    def reduce_tail(self, y: torch.Tensor, ticket: torch.Tensor, lag: int) -> None:
        """reduce() then tail(y) as one overlapped launch (`reduce_tail_kernel`; the
        all-reduce): the tails of tile t run beside the reduces of tiles t + lag on. ticket:
        [2] int64, this rank's counters for this layout (only ever advanced by this kernel;
        one per tails-per-tile count, which own_y sets)."""
        self._check_half(None)
        ptrs, scal, consts, meta, per = self._parts
        tiles = self.lay.tiles
        own = self.own_y
        res, add = self._res(y)
        launch(reduce_tail_kernel, ((self.lay.world_size - own + 1) * tiles,),
               (*ptrs, y, res, self._fs(), self.epoch, self.table, ticket, *scal, self.timeout,
                max(0, min(lag, tiles)), *consts),
               dict(**meta, **per["reduce_tail"], USE_TIMER=self.use_timer, OWN_Y=own, ADD=add,
                    **self._stages()))

    def fused(self, y: torch.Tensor, programs: int) -> None:
        """The whole call in one launch of min(programs, tiles) programs (programs: the same
        on every rank; the all-reduce)."""
        self._check_half(None)
        ptrs, scal, consts, meta, per = self._parts
        grid = max(1, min(programs, self.lay.tiles))
        res, add = self._res(y)
        launch(fused_kernel, (grid,),
               (*ptrs, y, res, self._fs(), self.epoch, self.table, *scal, self.timeout, *consts),
               dict(**meta, **per["fused"], USE_TIMER=self.use_timer, ADD=add,
                    **self._stages()))


def launch_ranks(plans: list[CallPlan], name: str, ys: list | None = None) -> bool:
    """Stage `name` of P simulated ranks' plans of one call (plans[r].rank == r, one device)
    as one launch of its ranks kernel (kernels/ranks_kernels.py): bit for bit
    `for r: plans[r].stage(name, ys[r])` launched in turn. Rank r's tensors must lie at one
    stride from rank 0's (rows of [P, ...] tensors, an expanded [P, 1]); returns False, and
    launches nothing, when they do not or the plans are not in rank order (the caller then
    launches rank by rank)."""
    if any(p.rank != r for r, p in enumerate(plans)):
        return False
    calls = [p.stage(name, None if ys is None else ys[r]) for r, p in enumerate(plans)]
    kernel, grid, tensors, rest, meta = calls[0]
    if 0 in grid:                                   # P = 1: no other owner to push to
        return True
    strides = []
    for col in zip(*(c[2] for c in calls)):
        stride = _rank_stride(col)
        if stride is None:
            return False
        strides.append(stride)
    meta = {k: v for k, v in meta.items() if k != "RANK"}
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, len(plans))
    launch(RANKS_KERNELS[kernel], grid3, (*tensors, *strides, *rest), meta)
    return True


def _rank_stride(col: tuple) -> int | None:
    """The element stride s with col[r] at col[0] + r * s for every r (same dtype), or None."""
    t0 = col[0]
    size = t0.element_size()
    if any(t.dtype != t0.dtype or t.device != t0.device for t in col):
        return None
    step = col[1].data_ptr() - t0.data_ptr() if len(col) > 1 else 0
    if step % size or any(t.data_ptr() - t0.data_ptr() != r * step for r, t in enumerate(col)):
        return None
    return step // size


def _comp(state: CompState | None) -> int:
    """The kernels' COMP constexpr of a state: 0 none, 1 one tensor (m2 is m1), 2 two."""
    if state is None:
        return 0
    return 1 if state.m2.data_ptr() == state.m1.data_ptr() else 2


def next_call(epoch: torch.Tensor, tables: torch.Tensor, table: torch.Tensor) -> None:
    """Start a call on a pair of workspaces used in turn: epoch [1] int64 += 1, then table
    [P+1] = tables[epoch % 2] (tables [2, P+1] int64, the two workspaces' pointer tables).
    One launch of flags.next_call_kernel; unfused: `epoch.add_(1); table.copy_(tables[epoch %
    2])` (with a host read). On the device, so graph replays keep alternating."""
    words = table.numel()
    launch(next_call_kernel, (1,), (epoch, tables, table),
           dict(WORDS=words, BLOCK=triton.next_power_of_2(words), num_warps=1))


def local_amax(x: torch.Tensor, state: CompState | None, cfg: EchoConfig,
               block: int = 4096) -> torch.Tensor:
    """Per-block max |x'| of x' = x + c, fp32 [blocks] (feeds qar.grad_scale unchanged)."""
    k = CompensatorConstants.from_config(cfg)
    n = x.numel()
    out = torch.empty(max(1, triton.cdiv(n, block)), dtype=torch.float32, device=x.device)
    m1 = state.m1 if state is not None else x
    m2 = state.m2 if state is not None else x
    amax_kernel[(out.numel(),)](x, m1, m2, out, n, k.eta, k.a, k.one_minus_a,
                                X_KIND=DTYPE_KIND[x.dtype], COMP=_comp(state), BLOCK=block,
                                **LAUNCH_OPTS)
    return out

"""Intra-node fast path: the fused compensated all-reduce over CUDA symmetric memory.

Each rank owns one symmetric byte buffer per workspace (kernels/allreduce_kernels.Layout):
receive slots for the segment packets its peers push, gather slots for the owners' reduced
packets, and int64 readiness flags. Kernels store codes and 16-bit parameters straight into the
peers' buffers (their addresses come from the symmetric-memory handle; NVLink multicast is never
used) and signal per tile with flags whose values only grow (the call's epoch). Per call, on the
current stream and without a host synchronization, either

    one fused kernel (messages up to FUSED_MAX_BYTES): entry, reduce and tail of every tile,
        per-program epochs bumped by the kernel itself; one launch, or
    epoch += 1 (device)  ->  entry (quantize + push)  ->  reduce (owner sum, requantize, push to
        all, y of the own segment)  ->  tail (decode the other owners' packets into y;
        output-residual state update): the stage kernels, which keep more bytes in flight on
        large messages; reduce and tail overlap (one launch, or the tail on a second stream)
        where that measured faster (`overlap_mode`).

Launches after the first of each specialization skip triton's JIT dispatch
(allreduce_kernels.launch). Backward calls with grad_scaling add one kernel for the local max
|x'| and the reference's `grad_scale` (one scalar MAX all-reduce through the process group)
before entry.

Bit-identical to the reference backend (collective/qar.py over DistTransport) for the same
inputs, state and config; calls with record=True run the reference itself. Waits are bounded by
ECHO_FLAG_TIMEOUT_S: a timed-out kernel writes (rank, stage, tile, peer) to pinned host memory
and the next call raises RuntimeError (`check_error()` syncs and raises at once).
Workspaces are cached per (dtype, bits, policy, P, segment length, kernel form, tile).
"""
from __future__ import annotations

import logging
import socket

import torch
import torch.distributed as dist

from .. import envs
from ..compensator import CompState
from ..config import EchoConfig
from .qar import StepRecord, compensated_all_reduce, grad_scale, segment_len
from .reference import DistTransport

log = logging.getLogger(__name__)

CROSSOVER: dict[tuple[int, int], int | None] = {
    # (P, state bytes read + written per value) -> smallest message (bytes per rank) from which
    # an eager p2p call beats NCCL's bf16 all-reduce by >= 5% at every larger measured size;
    # None: never measured faster. State bytes (`state_bytes`): 0 uncompensated; 16 fp32 m1 +
    # m2; 8 bf16 m1 + m2 or one fp32 tensor (beta1 == beta2); 4 one bf16 tensor.
    # 2026-11-30, 2 H200s, NVLink (docs/results/2026-11-30-p2p-x2-r3.md, row 15): 4-bit
    # uncompensated 1.82x at 64 MiB, 2.47-2.60x from 128 MiB (16 MiB: 1.35x, but the one-shot
    # 16-bit kernel is close there and exact); compensated, local residual: one bf16 tensor
    # (4 B) 1.61x at 64 MiB, 1.73-1.82x above; bf16 pair (8 B) 1.31x, 1.37-1.42x; fp32 pair
    # (16 B, HBM-bound) 1.00-1.04x: never 5% faster.
    (2, 0): 64 << 20,
    (2, 16): None,
    (2, 8): 64 << 20,
    (2, 4): 64 << 20,
}
"""Unmeasured P use P=2's entries (NCCL's own cost grows with P, so this errs on NCCL's side).
Inside CUDA graph capture the launch cost is gone: uncompensated calls take p2p at every size
(graph replay 2.4-3.6x NCCL's eager call up to 4 MiB). ECHO_P2P_MIN_BYTES overrides the table."""


def state_bytes(cfg: EchoConfig) -> int:
    """Compensator state bytes a call reads and writes per value: 0 when uncompensated, else
    2 (read + write) x (1 tensor if beta1 == beta2 else 2) x (2 bf16, 4 fp32, 8 fp64)."""
    if not cfg.compensated:
        return 0
    size = {"bfloat16": 2, "float32": 4, "float64": 8}[cfg.state_dtype]
    return 2 * size * (1 if cfg.beta1 == cfg.beta2 else 2)


def crossover_bytes(world_size: int, state: int) -> int | None:
    """The message size from which 'auto' takes the p2p path outside graph capture (None:
    never) for calls with `state` compensator bytes per value (`state_bytes`);
    ECHO_P2P_MIN_BYTES overrides the table."""
    forced = envs.p2p_min_bytes()
    if forced is not None:
        return forced
    key = (world_size, state) if (world_size, state) in CROSSOVER else (2, state)
    return CROSSOVER.get(key)


FUSED_MAX_BYTES: dict[int, int] = {
    # P -> the largest message (bytes per rank) run as one fused kernel; larger ones run as
    # the three stage kernels. 2026-11-29, 2 H200s: the fused kernel saves three launches (host
    # time per eager call 0.025 ms vs 0.11-0.13 ms) but its programs walk their tiles one after
    # another, so from 64 MiB the stage kernels (many more CTAs in flight) move bytes faster
    # (1 GiB: 1.78 ms vs 3.75-3.92 ms fused).
    2: 32 << 20,
}
"""Unmeasured P use P=2's entry."""

STEP_ELEMS = {False: 2048, True: 1024}
"""Values per step (what a program holds in registers at once), uncompensated / compensated.
2026-11-29, 2 H200s: compensated kernels at 2048 values per step need ~110-127 registers at
4 warps (half the resident warps); 1024 brought bf16 one-tensor calls from 0.87-0.94x to
1.00-1.04x NCCL; uncompensated calls keep 2048 (1.81-1.88x vs 1.46-1.55x at 1024)."""

TILE_MAX = 16384
TILES_PER_SEGMENT = {False: 2048, True: 256}
"""Tile size (values per flag and per system-scope release) by segment length: the largest
power of two with at least TILES_PER_SEGMENT[fused] tiles per segment, between the step and
TILE_MAX. Every tile ends in a fence that waits for its remote stores to land, so larger
tiles keep more bytes in flight per fence; too few tiles leave SMs idle. 2026-11-30, 2 H200s
(docs/results/2026-11-30-p2p-x2-r3.md): 4-bit 1 GiB 1.62 ms at 2048-value tiles, 1.32 at
8192, 1.24 at 16384; 64 MiB best at 8192 (2.20x vs 1.51x at 16384); compensated (bf16, one
tensor, 1024-value steps) 1 GiB 2.96 ms at 1024-value tiles, 1.79 at 16384."""


OVERLAP_LAG_PER_SM = 8
"""reduce_tail_kernel: tails trail the reduces by this many tiles per SM (more than the
reduces a GPU has in flight at once), so a tail mostly finds its tile reduced on every rank
instead of spinning in a slot a reduce could use. 2026-11-30, 2 H200s, 8-bit 1 GiB (before
the reduce wrote the own y): lag 264 tiles 1.88x NCCL, 1024 1.92x, 4096 1.84x
(-allreduce-P2-overlap-lag*.json)."""


TAIL_PROGRAMS_PER_SM = 1
"""Overlap 'stream': programs of the persistent tail per SM (4 warps each). The tail's programs
spin on flags the reduce sets, so the reduce must always find an SM slot, whatever order the
GPU starts the two kernels' programs in: a 4-warp program holds at most 128 x 255 registers,
half an SM, so with one tail program per SM either every SM keeps half its registers free or
some SM has no tail program at all, and a reduce program (also 4 warps) always fits. The
reduce is also queued before the tail (streams share the GPU's hardware queues: a reduce
queued behind a spinning tail can wait forever; on one H200, 3 simulated ranks whose tails
were launched first stalled until the flag timeout). 2026-11-30, 2 H200s: exact, but 4-bit
1 GiB 1.83 ms vs 1.18 serial (the tail runs latency-bound in 132 programs); 8 per SM reach
1.19 ms (benchmark variant @o2g8; no such proof for the register-heavy compensated tails), so
'stream' is never picked by overlap_mode (docs/notes/fastpath.md rows 32-34)."""


OVERLAP_LAUNCH_MAX_BYTES: dict[int, int | None] = {4: 128 << 20, 8: None}
"""Uncompensated calls by bits -> the largest message (bytes per rank) run in overlap mode
'launch' (None: every size). 2026-11-30, 2 H200s (docs/results/2026-11-30-p2p-x2-r4.md,
medians of 50 calls): 8-bit 1.97-2.05x NCCL vs 1.78-1.86x 'off' from 128 MiB (1.87x vs 0.69x
at 64 MiB, an outlier of 'off'); 4-bit at 64 MiB ahead in all three runs (1.72 vs 1.62x,
2.18 vs 1.60x, 1.49-1.54 vs 1.38x: one launch fewer), even at 128 MiB (2.46-2.72x vs
2.45-2.63x), behind from 256 MiB (2.67-2.75x vs 2.76-2.81x). Compensated calls: 'off'
(bf16 one state tensor 1.76-1.83x vs 1.82-1.86x from 128 MiB; 64 MiB mixed). Measured at
P=2 only; other P use the same table."""


def overlap_mode(cfg: EchoConfig, nbytes: int) -> str:
    """How the stage kernels run reduce and tail for a call of `nbytes` bytes per rank
    (envs.OVERLAP_MODES): 'off' (reduce, then tail), 'launch' (`CallPlan.reduce_tail`: one
    kernel) or 'stream' (`CallPlan.tail_loop` on a second stream; measured no faster than
    'off', never chosen here: TAIL_PROGRAMS_PER_SM). One kernel runs both stages at the
    larger stage's register count, so the HBM-bound tail loses occupancy; it pays where the
    reduce is long (8-bit) or the launch saved matters (4-bit up to 128 MiB):
    OVERLAP_LAUNCH_MAX_BYTES."""
    if cfg.compensated or cfg.bits not in OVERLAP_LAUNCH_MAX_BYTES:
        return "off"
    cap = OVERLAP_LAUNCH_MAX_BYTES[cfg.bits]
    return "launch" if cap is None or nbytes <= cap else "off"


def tile_shape(seg: int, compensated: bool, fused: bool) -> tuple[int, int]:
    """(values per tile, values per step) for a segment of `seg` values."""
    step = STEP_ELEMS[compensated]
    want = max(1, seg // TILES_PER_SEGMENT[fused])
    tile = 1 << (want.bit_length() - 1)                    # power of two <= want
    return min(max(tile, step), TILE_MAX), step


DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _local_reason() -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e})"
    try:
        from torch.distributed import _symmetric_memory as symm
        symm.empty, symm.rendezvous  # noqa: B018
    except (ImportError, AttributeError) as e:
        return f"torch.distributed._symmetric_memory is unavailable ({e})"
    if not dist.is_available() or not dist.is_initialized():
        return "torch.distributed is not initialized"
    return None


def p2p_unavailable_reason(group: dist.ProcessGroup | None = None) -> str | None:
    """None when the p2p backend can run on `group`, else why not. Cheap, and safe anywhere:
    without CUDA/triton/symmetric memory it answers before any communication; otherwise it is
    a collective (every rank of the group must call it) and all ranks get the same answer."""
    reason = _local_reason()
    if reason is not None:
        return reason
    world = dist.get_world_size(group)
    if world < 2:
        return "a group of one rank needs no all-reduce"
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        return f"process group backend {backend!r} is not NCCL"
    dev = torch.cuda.current_device()
    infos: list = [None] * world
    dist.all_gather_object(infos, (socket.gethostname(), dev), group=group)
    local = None
    if len({h for h, _ in infos}) > 1:
        local = "the group spans several nodes"
    elif len({d for _, d in infos}) < world:
        local = "two ranks share one GPU"
    else:
        for _, d in infos:
            if d != dev and d < torch.cuda.device_count() \
                    and not torch.cuda.can_device_access_peer(dev, d):
                local = f"GPU {dev} has no peer access to GPU {d}"
                break
    reasons: list = [None] * world
    dist.all_gather_object(reasons, local, group=group)
    return next((f"rank {r}: {m}" for r, m in enumerate(reasons) if m is not None), None)


class SymmetricBuffer:
    """One rank's symmetric byte buffer and the device table [P+1] int64 of the P buffers'
    addresses as this rank sees them, then the address of the error record. `flags` (a slice of
    the buffer's words) is zeroed and the ranks barrier once, before any peer can push."""

    def __init__(self, nbytes: int, flags_off: int, group, rank: int, world: int, device,
                 err: torch.Tensor):
        from torch.distributed import _symmetric_memory as symm
        self.buf = symm.empty(nbytes, dtype=torch.uint8, device=device)
        self.buf[flags_off:].view(torch.int64).zero_()
        torch.cuda.synchronize(device)
        self.handle = symm.rendezvous(self.buf, group if group is not None else dist.group.WORLD)
        offset = self.buf.data_ptr() - int(self.handle.buffer_ptrs[rank])
        peers = [self.handle.get_buffer(r, (nbytes,), torch.uint8, storage_offset=offset)
                 for r in range(world)]
        if peers[rank].data_ptr() != self.buf.data_ptr():
            raise RuntimeError("symmetric memory: the local view does not match the buffer")
        self.peers = peers                            # keep the views (and mappings) alive
        self.table = torch.tensor([p.data_ptr() for p in peers] + [err.data_ptr()],
                                  dtype=torch.int64, device=device)
        dist.barrier(group=group)                     # every flag is zero before any push


class _Workspace(SymmetricBuffer):
    """The buffer of one layout, with its epoch counters: one per call (stage kernels, bumped
    by the host) or one per program (fused kernel, bumped by the kernel itself)."""

    def __init__(self, lay, group, rank: int, device, err: torch.Tensor, programs: int):
        super().__init__(lay.nbytes, lay.flags_off, group, rank, lay.world_size, device, err)
        self.lay = lay
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self.programs = programs
        self.epochs = torch.zeros(max(1, programs), dtype=torch.int64, device=device)
        self.ticket = torch.zeros(2, dtype=torch.int64, device=device)   # reduce_tail_kernel


def select_symm_backend(device) -> str | None:
    """Prefer torch's own CUDA symmetric-memory backend (plain cudaMalloc/VMM + IPC, no NVSHMEM
    bootstrap) when nothing chose one yet; leave an earlier choice alone. -> the backend."""
    from torch.distributed import _symmetric_memory as symm
    try:
        if symm.get_backend(device) is None:
            symm.set_backend("CUDA")
    except Exception as e:  # noqa: BLE001 - older torch, or a backend already in use
        log.debug("echo-tp: symmetric memory backend left as is: %s", e)
    try:
        return symm.get_backend(device)
    except Exception:  # noqa: BLE001
        return None


def agreed_sm_count(group, device) -> int:
    """The smallest SM count over the group (one MIN all-reduce, at set-up)."""
    sms = torch.tensor([torch.cuda.get_device_properties(device).multi_processor_count],
                       dtype=torch.int64, device=device)
    dist.all_reduce(sms, op=dist.ReduceOp.MIN, group=group)
    return int(sms.item())


class P2PBackend:
    """The dispatcher interface (`should_use`, `run`, `close`) over the fused kernels."""

    name = "p2p"

    def __init__(self, group: dist.ProcessGroup | None = None, *,
                 min_bytes: int | None = None, tile_elems: int | None = None,
                 num_warps: int | None = None, step_elems: int | None = None,
                 fused: bool | None = None,
                 programs_per_sm: int = 4,
                 fused_max_bytes: int | None = None, defer_output: bool | None = None,
                 overlap: str | None = None, overlap_lag: int | None = None,
                 tail_programs_per_sm: int = TAIL_PROGRAMS_PER_SM):
        from ..kernels import allreduce_kernels as ak
        from ..kernels import flags
        self._ak, self._flags = ak, flags
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.transport = DistTransport(group)        # grad-scale MAX; record=True calls
        self.min_bytes = min_bytes
        """Fixed gate for every call (benchmarks, backend='p2p': 0); None: crossover_bytes."""
        self._gate: dict[int, int | None] = {}      # state bytes -> gate (crossover_bytes)
        self.tile_elems = tile_elems
        """Values per tile (one flag, one release); None: by segment length (`tile_shape`)."""
        self.step_elems = step_elems
        """Values per step within a tile (what a program holds in registers at once); None:
        STEP_ELEMS by compensation; capped at the tile."""
        self.num_warps = num_warps
        """Warps per program; None: 8 for the fused kernel, 4 for the stage kernels (2 H200s,
        1 GiB, 4-bit: stage kernels 1.78 ms at 4 warps vs 2.18 ms at 8)."""
        self.fused = envs.p2p_fused() if fused is None else fused
        """True: one fused kernel per call; False: the three stage kernels; None: by size
        (fused up to `fused_max_bytes`)."""
        self.fused_max_bytes = FUSED_MAX_BYTES.get(self.world_size, FUSED_MAX_BYTES[2]) \
            if fused_max_bytes is None else fused_max_bytes
        self.programs = programs_per_sm * agreed_sm_count(group, self.device) \
            if self.fused is not False else 0
        """Programs of the fused kernel: `programs_per_sm` x the smallest SM count of the
        group, the same on every rank. The sm_90 build takes 48 (uncompensated) to ~114
        (compensated) registers per thread at 8 warps, so 5 to 2 programs are resident per SM;
        the others start as those finish (each program waits only on the same program of the
        peers, which the GPUs start in the same order). 4 per SM measured 1.7x faster than 2 at
        1 GiB, and no slower at 64 KiB."""
        self.use_timer = True                         # %globaltimer; poll count if it fails
        self._err = flags.new_error_buffer(True)
        self._err_np = self._err.numpy()
        self._ws: dict = {}
        self._ws_by_call: dict = {}
        self._timeouts: dict[bool, int] = {}
        self.defer_output = envs.defer_output() if defer_output is None else defer_output
        """Residual 'output': the state update runs after the call on `side_stream` (the paper's
        §5.3: beside the caller's next matmul), and the next call that touches compensator
        state waits for it on the GPU (`wait_pending`). Not inside CUDA graph capture (the
        update then runs in the call's last kernel). Contract: the caller does not write x in
        place before its next call (the update re-reads x; y it decodes again itself)."""
        self.overlap = envs.p2p_overlap() if overlap is None else overlap
        """Stage kernels, how reduce and tail run (the tail is HBM-bound, the reduce
        link-bound): 'launch' = one launch (`CallPlan.reduce_tail`), the tails of tile t beside
        the reduces of tiles t + overlap_lag on; 'stream' = the tail as `tail_programs_per_sm`
        persistent programs per SM on `tail_stream`; 'off' = reduce, then tail; None =
        `overlap_mode`."""
        if self.overlap not in (None, *envs.OVERLAP_MODES):
            raise ValueError(f"overlap must be one of {envs.OVERLAP_MODES} or None, "
                             f"not {self.overlap!r}")
        if self.overlap == "stream" and num_warps not in (None, 4):
            raise ValueError("overlap 'stream' needs 4-warp programs (TAIL_PROGRAMS_PER_SM)")
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.tail_programs = tail_programs_per_sm * sms
        self.tail_stream: torch.cuda.Stream | None = None
        self._tail_events: tuple | None = None
        self.overlap_lag = OVERLAP_LAG_PER_SM * sms if overlap_lag is None else overlap_lag
        """Tiles the tails trail the reduces by (see OVERLAP_LAG_PER_SM)."""
        self.side_stream: torch.cuda.Stream | None = None
        self._pending: torch.cuda.Event | None = None
        self.stage_events: list | None = None
        """Benchmarks only: four torch.cuda.Event recorded around entry, reduce and tail."""
        self.symm_backend = select_symm_backend(self.device)

    # ----- dispatcher interface -----
    def supports(self, x: torch.Tensor, cfg: EchoConfig) -> bool:
        """Whether the kernels can run this call at all (any size)."""
        return (cfg.bits in (4, 8) and x.is_cuda and x.device == self.device
                and x.dtype in DTYPES and cfg.state_dtype in self._ak.STATE_DTYPES
                and x.dim() == 1 and x.is_contiguous())

    def should_use(self, x: torch.Tensor, cfg: EchoConfig) -> bool:
        if not self.supports(x, cfg):
            return False
        sb = state_bytes(cfg)
        gate = self._gate.get(sb, -1)
        if gate == -1:
            gate = self._gate[sb] = self.min_bytes if self.min_bytes is not None else \
                crossover_bytes(self.world_size, sb)
        if gate is None or x.numel() * x.element_size() < gate:
            # inside CUDA graph capture the launch cost is gone: uncompensated p2p wins at any size
            return self.min_bytes is None and not cfg.compensated and \
                torch.cuda.is_current_stream_capturing()
        return True

    def wait_pending(self) -> None:
        """Order the current stream after the last deferred state update (GPU-side: no host
        sync). Every call of this backend does it first; callers that read the compensator
        state themselves call it too (the dispatcher does, before other backends)."""
        if self._pending is not None and not torch.cuda.is_current_stream_capturing():
            # (inside capture there is nothing to wait for: torch.cuda.graph synchronizes the
            # device before capture begins, and captured calls update in their last kernel)
            torch.cuda.current_stream(self.device).wait_event(self._pending)

    def run(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None, backward: bool,
            record: bool, inplace: bool = False) -> tuple[torch.Tensor, StepRecord | None]:
        self._flags.raise_if_set(self._err, self._err_np)
        self.wait_pending()
        if record:   # telemetry needs the unfused intermediates: same numbers, reference path
            return compensated_all_reduce(x, cfg, self.transport, state=state,
                                          backward=backward, record=True)
        why = self._ak.supported(x, cfg, state)
        if why is not None:
            raise ValueError(f"p2p backend cannot run this call: {why}")
        fused = self.fused if self.fused is not None else \
            x.numel() * x.element_size() <= self.fused_max_bytes
        ws, step = self._workspace(x, cfg, fused)
        fs = None
        if backward and cfg.grad_scaling:
            fs = grad_scale(self._ak.local_amax(x, state, cfg), self.transport)   # [1]
        y = torch.empty_like(x)
        if not fused:
            ws.epoch.add_(1)
        defer = self.defer_output and cfg.residual == "output" and state is not None \
            and not torch.cuda.is_current_stream_capturing()
        plan = self._ak.CallPlan(rank=self.rank, lay=ws.lay, cfg=cfg, x=x, state=state, fs=fs,
                                 epoch=ws.epochs if fused else ws.epoch, table=ws.table,
                                 timeout=self._timeout_units(), use_timer=self.use_timer,
                                 num_warps=self.num_warps or (8 if fused else 4),
                                 step_elems=step, defer_output=defer)
        if fused:
            self._with_timer_fallback(plan, lambda: plan.fused(y, ws.programs))
            if defer:
                self._update_on_side_stream(plan, x, state, fs)
            return y, None
        ev = self.stage_events
        if ev:
            ev[0].record()
        plan.entry()
        if ev:
            ev[1].record()
        mode = self.overlap or overlap_mode(cfg, x.numel() * x.element_size())
        if mode == "launch":            # reduce + tail in one launch (events 2, 3: its end)
            self._with_timer_fallback(plan, lambda: plan.reduce_tail(y, ws.ticket,
                                                                     self.overlap_lag))
        elif mode == "stream":
            self._reduce_beside_tail(plan, y)
        else:
            self._with_timer_fallback(plan, lambda: plan.reduce(y))
        if ev:
            ev[2].record()
        if mode == "off":
            self._with_timer_fallback(plan, lambda: plan.tail(y))
        if ev:
            ev[3].record()
        if defer:
            self._update_on_side_stream(plan, x, state, fs)
        return y, None

    def _reduce_beside_tail(self, plan, y: torch.Tensor) -> None:
        """Overlap 'stream': after the entry, the reduce on the current stream and the
        persistent tail on `tail_stream`, which waits for the entry and is waited for before
        the call returns (so everything the tail touches is ordered before the caller's next
        work: no allocator hand-off needed). Inside CUDA graph capture this is a fork/join."""
        main = torch.cuda.current_stream(self.device)
        if self.tail_stream is None:
            self.tail_stream = torch.cuda.Stream(self.device)
            self._tail_events = (torch.cuda.Event(), torch.cuda.Event())
        forked, joined = self._tail_events
        forked.record(main)
        self._with_timer_fallback(plan, lambda: plan.reduce(y))   # queued first
        self.tail_stream.wait_event(forked)
        with torch.cuda.stream(self.tail_stream):
            self._with_timer_fallback(plan, lambda: plan.tail_loop(y, self.tail_programs))
        joined.record(self.tail_stream)
        main.wait_event(joined)

    def _update_on_side_stream(self, plan, x: torch.Tensor, state: CompState,
                               fs: torch.Tensor | None) -> None:
        """plan.output_update() on the side stream after the call's kernels; `_pending` marks
        its end. The tensors it reads are kept from the allocator until it is done."""
        main = torch.cuda.current_stream(self.device)
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(self.device)
            self._pending = torch.cuda.Event()
        side = self.side_stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            plan.output_update()
        self._pending.record(side)
        for t in (x, state.m1, state.m2, *([fs] if fs is not None else [])):
            t.record_stream(side)

    def _timeout_units(self) -> int:
        """ECHO_FLAG_TIMEOUT_S in the kernels' units, read once per timer mode."""
        units = self._timeouts.get(self.use_timer)
        if units is None:
            units = self._timeouts[self.use_timer] = self._flags.timeout_units(
                envs.flag_timeout_s(), self.use_timer)
        return units

    def close(self) -> None:
        if self._pending is not None:          # a deferred update still reads a workspace
            self._pending.synchronize()
        self._ws.clear()
        self._ws_by_call.clear()

    # ----- helpers -----
    def _workspace(self, x: torch.Tensor, cfg: EchoConfig,
                   fused: bool) -> tuple["_Workspace", int]:
        """The workspace of a call's layout and kernel form (the fused kernel's per-program
        epochs and the stage kernels' single epoch never share flags), and the step."""
        spec = cfg.quant_spec()
        comp = cfg.compensated
        call_key = (x.numel(), x.dtype, spec, fused, comp)
        ws = self._ws_by_call.get(call_key)
        if ws is not None:
            return ws                                # (workspace, step)
        tile, step = tile_shape(segment_len(x.numel(), self.world_size, spec.group_size), comp,
                                fused)
        tile = max(self.tile_elems or tile, spec.group_size)
        step = max(min(self.step_elems or step, tile), spec.group_size)
        lay = self._ak.Layout.build(x.numel(), self.world_size, spec, tile)
        key = (x.dtype, spec.bits, spec.quantizer, spec.group_size, self.world_size, lay.seg,
               fused, tile)
        ws = self._ws.get(key)
        if ws is None:
            ws = self._ws[key] = _Workspace(lay, self.group, self.rank, self.device, self._err,
                                            self.programs if fused else 0)
        self._ws_by_call[call_key] = (ws, step)
        return ws, step

    def _with_timer_fallback(self, plan, launch) -> None:
        try:
            launch()
        except Exception as e:  # noqa: BLE001 - a compile failure of the %globaltimer asm
            if not plan.use_timer:
                raise
            log.warning("echo-tp p2p: %%globaltimer wait failed to build (%s); counting polls",
                        e)
            self.use_timer = plan.use_timer = False
            plan.timeout = self._flags.timeout_units(envs.flag_timeout_s(), False)
            launch()

    def check_error(self) -> None:
        """Synchronize the device (deferred state updates included) and raise if any wait of
        this backend timed out."""
        torch.cuda.synchronize(self.device)
        self._flags.raise_if_set(self._err, self._err_np)

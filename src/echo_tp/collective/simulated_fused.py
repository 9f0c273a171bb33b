"""P simulated ranks in one process running the fused all-reduce kernels (the pure-tensor form),
and the simulated communicator's backend over them on a GPU (FusedSimBackend). Needs triton.

`SimulatedFused` mirrors collective/qar.compensated_all_reduce over SimTransport: x [P, N] ->
y [P, N], the state (m1, m2 [P, N]) updated in place, bit for bit; with residual= [P, N] it
returns residual + y instead (the add done by the kernels that write y; same state). Each
virtual rank owns a byte buffer laid out as on a GPU (allreduce_plan.Layout) and a pointer
table to all P buffers; stages run entry(all ranks) -> reduce(all) -> tail(all), so every
flag a kernel waits for is already set. Runs wherever the kernels run: the CPU under
TRITON_INTERPRET=1, or one GPU.

The halves mirror collective/sharded.py over SimTransport the same way (allreduce_plan's
module docstring; chunks of whole quantization groups only: kernels/fits.py):

    reduce_scatter(x [P, P*m]) -> [P, m]      entry(all ranks) -> reduce(all)
    all_gather(x [P, m])       -> [P, P*m]    encode(all) -> tail(all), identical rows
"""
from __future__ import annotations

import torch

from ..compensator import CompState
from ..config import EchoConfig, QuantSpec
from ..kernels.allreduce_plan import CallPlan, Layout, launch_ranks, local_amax
from ..kernels.fits import fits
from ..kernels.flags import new_error_buffer, raise_if_set
from . import routing, tuning
from .backend import Backend
from .qar import grad_scale
from .simulated import SimTransport


class SimulatedFused:
    """P ranks in one process running the fused kernels over per-rank buffers (the pure-tensor
    form). Calls mirror qar.compensated_all_reduce with SimTransport: x [P, N] -> y [P, N];
    the state (CompState with m1, m2 [P, N]) is updated in place. Buffers, flags and epochs
    persist across calls, as on GPUs."""

    def __init__(self, world_size: int, tile_elems: int = 2048, timeout_polls: int = 1000,
                 step_elems: int = 2048, num_warps: int = 4, num_stages: int | None = None,
                 one_launch: bool = True):
        self.world_size = world_size
        self.tile_elems = tile_elems
        """Values per tile (collective/routing.tile_shape picks them on GPUs)."""
        self.step_elems = step_elems
        """Values a program holds at once (capped at the tile)."""
        self.num_warps = num_warps
        self.num_stages = num_stages
        """triton's pipelining depth for the stage kernels (None: its default)."""
        self.timeout = timeout_polls
        self.one_launch = one_launch
        """Each stage of every rank as one launch (kernels/ranks_kernels.py; the same bits as
        rank by rank, and P times the programs per launch); False: one launch per rank."""
        self._ws: dict = {}

    def workspace(self, n: int, spec: QuantSpec, device) -> dict:
        """The buffers of every call on `device` (one room, as the p2p backend's: grown, on
        fresh buffers, when a call does not fit) and this call's layout in them ('lay')."""
        P, key = self.world_size, str(device)
        lay = Layout.build(n, P, spec, self.tile_elems)
        ws = self._ws.get(key)
        if ws is None or not ws["room"].holds(lay.room):
            room = lay.room if ws is None else ws["room"].grown(lay.room)
            nbytes = room.nbytes(P)
            bufs = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
                    for _ in range(P)]                     # poison: unwritten bytes are noise
            for b in bufs:
                b[room.flags_off(P):].view(torch.int64).zero_()
            # error records in host memory the kernels write (pinned on CUDA, as the p2p
            # backend's): the host reads them without a device sync
            errs = [new_error_buffer(torch.device(device).type == "cuda") for _ in range(P)]
            tables = torch.tensor([[b.data_ptr() for b in bufs] + [errs[r].data_ptr()]
                                   for r in range(P)], dtype=torch.int64, device=device)
            #                                               [P, P+1]: rank r's table, row r
            epoch = torch.zeros(P, dtype=torch.int64, device=device)    # every rank's, one
            ws = self._ws[key] = dict(room=room, bufs=bufs, errs=errs, tables=tables,
                                      epoch=epoch, errs_np=[e.numpy() for e in errs])
        ws["lay"] = lay.within(ws["room"])
        return ws

    def __call__(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None,
                 backward: bool = False, stages: tuple = ("entry", "reduce", "tail"),
                 residual: torch.Tensor | None = None):
        """The call's stages in order, each on every rank -> y [P, N]; with residual [P, N]
        (x's dtype): residual + y, bit for bit `residual + <the call without it>`, the state
        updated exactly as without it."""
        self._ranks(x)
        y = torch.empty_like(x)
        plans = self.plans(x, cfg, state, self._grad_scale(x, cfg, state, backward), residual)
        self._run(plans, stages, y)
        return y

    def reduce_scatter(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None,
                       backward: bool = False) -> torch.Tensor:
        """x [P, P*m] -> [P, m], rank r's chunk r of the sum; state (m1, m2 [P, P*m]) updated
        in place: sharded.compensated_reduce_scatter over SimTransport, bit for bit."""
        return self._half("reduce_scatter", x, cfg, state, backward)

    def all_gather(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None,
                   backward: bool = False) -> torch.Tensor:
        """x [P, m] (rank r's shard) -> [P, P*m], every row all shards in rank order (the
        same codes decoded by every rank); state (m1, m2 [P, m]) updated in place:
        sharded.compensated_all_gather over SimTransport, bit for bit."""
        return self._half("all_gather", x, cfg, state, backward)

    def _half(self, kind: str, x: torch.Tensor, cfg: EchoConfig, state: CompState | None,
              backward: bool) -> torch.Tensor:
        P, n = self._ranks(x)
        why = fits(kind, x[0], cfg, world_size=P, state=_rank_state(state, 0))
        if why is not None:
            raise ValueError(f"the kernels cannot run this {kind}: {why}")
        out = n // P if kind == "reduce_scatter" else n * P
        y = torch.empty(P, out, dtype=x.dtype, device=x.device)
        plans = self.plans(x, cfg, state, self._grad_scale(x, cfg, state, backward),
                           half=kind)
        self._run(plans, ("entry", "reduce") if kind == "reduce_scatter" else
                  ("encode", "tail"), y)
        return y

    def _ranks(self, x: torch.Tensor) -> tuple[int, int]:
        P, n = x.shape
        if P != self.world_size:
            raise ValueError(f"x has {P} ranks, the simulation {self.world_size}")
        return P, n

    def _grad_scale(self, x: torch.Tensor, cfg: EchoConfig, state: CompState | None,
                    backward: bool) -> torch.Tensor | None:
        """The backward power of two [P, 1] over the group's x' (None: no scaling): the max
        over every rank's x' is the max of the flat [P*N] (max is exact, NaN counts as +inf
        either way), so one amax launch, not P, then grad_scale of one 'rank'; unfused:
        grad_scale(stack(local_amax(x[r]) for r), SimTransport(P))."""
        if not (backward and cfg.grad_scaling):
            return None
        P = x.shape[0]
        flat = None if state is None else CompState(state.m1.reshape(-1), state.m2.reshape(-1))
        parts = local_amax(x.reshape(-1), flat, cfg)             # [blocks]
        return grad_scale(parts[None], SimTransport(1)).expand(P, 1)

    def _run(self, plans: list[CallPlan], stages: tuple, y: torch.Tensor) -> None:
        """Each stage on every rank (y [P, ...]: rank r's output y[r]): one launch for all
        ranks (one_launch), else rank by rank; then raise on any error record of the
        simulation's ranks. The records are read without a device sync: on the CPU (the
        interpreter runs each launch to its end) this call's own errors; on a GPU those its
        kernels have written so far, so one may surface a call later."""
        ys = None if y is None else list(y)
        for stage in stages:
            if self.one_launch and launch_ranks(plans, stage, ys):
                continue
            for r, plan in enumerate(plans):
                if stage in ("entry", "encode"):
                    getattr(plan, stage)()
                else:
                    getattr(plan, stage)(y[r])
        for ws in self._ws.values():
            for err, err_np in zip(ws["errs"], ws["errs_np"]):
                raise_if_set(err, err_np)

    def plans(self, x: torch.Tensor, cfg: EchoConfig, state: CompState | None,
              fs: torch.Tensor | None = None, residual: torch.Tensor | None = None,
              half: str | None = None) -> list[CallPlan]:
        """One new call: every rank's epoch bumped, its CallPlan (x [P, N]; fs [P, 1] or None;
        residual [P, N] or None; half: CallPlan.half, on the layout of the all-reduce of
        N values (reduce-scatter) or P*N (all-gather))."""
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
            raise ValueError(f"residual must be x's shape and dtype: {tuple(residual.shape)} "
                             f"{residual.dtype} vs {tuple(x.shape)} {x.dtype}")
        n = x.shape[-1] * (self.world_size if half == "all_gather" else 1)
        ws = self.workspace(n, cfg.quant_spec(), x.device)
        ws["epoch"].add_(1)                                   # every rank's epoch, one launch
        plans = []
        for r in range(self.world_size):
            plans.append(CallPlan(rank=r, lay=ws["lay"], cfg=cfg, x=x[r],
                                  state=_rank_state(state, r),
                                  fs=None if fs is None else fs[r].contiguous(),
                                  epoch=ws["epoch"][r:r + 1], table=ws["tables"][r],
                                  timeout=self.timeout, use_timer=False,
                                  num_warps=self.num_warps,
                                  step_elems=min(self.step_elems, self.tile_elems),
                                  num_stages=self.num_stages,
                                  residual=None if residual is None
                                  else residual[r].contiguous(), half=half))
        return plans


def _rank_state(state: CompState | None, r: int) -> CompState | None:
    return None if state is None else CompState(state.m1[r], state.m2[r])


class FusedSimBackend(Backend):
    """Simulated calls on a GPU through the fused p2p kernels (SimulatedFused above: the
    entry, reduce and tail stages of every virtual rank over per-rank buffers, bit-identical to
    the reference: tests/test_p2p_gpu.py), with the tile shape the routing policy picks for a
    real group of this size. The reduce-scatter and all-gather halves likewise (entry, reduce
    without requantization / encode, tail: bit-identical to collective/sharded.py,
    tests/test_sharded_kernels.py), on the layout of the all-reduce of the same P*m values,
    as collective/p2p.P2PBackend runs them on real ranks (there on two workspaces per layout
    and kind, used in turn; here the stages of every virtual rank run one after the other, so
    one is enough).
    Everything else goes to `reference` (a TransportBackend over SimTransport, the same bits):
    CPU tensors, bits=16, telemetry (the kernels leave no StepRecord), and calls the kernels
    do not take (kernels/fits.fits of virtual rank 0's row: for the halves chunks of a whole
    number of quantization groups)."""

    name = "simulated-fused"

    def __init__(self, reference):
        self.reference = reference
        self.world_size = reference.world_size
        self._sims: dict = {}

    def run(self, x: torch.Tensor, cfg, *, state, backward: bool, record: bool,
            inplace: bool = False, route=None):
        if record or not self._fits("all_reduce", x, cfg, state):
            return self.reference.run(x, cfg, state=state, backward=backward, record=record,
                                      inplace=inplace)
        return self._sim(x, cfg)(x, cfg, state=state, backward=backward), None

    def reduce_scatter(self, x, cfg, *, state, backward, route=None):
        """x [P, P*m] -> [P, m] (collective/sharded.py's semantics)."""
        if not self._fits("reduce_scatter", x, cfg, state):
            return self.reference.reduce_scatter(x, cfg, state=state, backward=backward)
        return self._sim(x, cfg).reduce_scatter(x, cfg, state=state, backward=backward)

    def all_gather(self, x, cfg, *, state, backward, route=None):
        """x [P, m] -> [P, P*m] (collective/sharded.py's semantics)."""
        if not self._fits("all_gather", x, cfg, state):
            return self.reference.all_gather(x, cfg, state=state, backward=backward)
        return self._sim(x, cfg, self.world_size * x.shape[1]).all_gather(
            x, cfg, state=state, backward=backward)

    def _fits(self, kind: str, x: torch.Tensor, cfg, state) -> bool:
        """The kernels take this call of x [P, n]: a contiguous CUDA tensor whose rows fit."""
        if not (x.is_cuda and x.dim() == 2 and x.is_contiguous()):
            return False
        row = None if state is None else CompState(state.m1[0], state.m2[0])
        return fits(kind, x[0], cfg, world_size=self.world_size, state=row) is None

    def _sim(self, x: torch.Tensor, cfg, numel: int | None = None):
        """The simulation with the routing's tile shape for a call of numel values per rank
        (default x's row: the all-reduce, the reduce-scatter)."""
        call = routing.Call.of(numel or x.shape[1], x.element_size(), cfg, self.world_size,
                               on_gpu=True)
        plan = routing.p2p_route(call, tuning.DEFAULT, "simulated", form="staged")
        key = (plan.tile, plan.step, plan.num_warps)
        sim = self._sims.get(key)
        if sim is None:
            sim = self._sims[key] = SimulatedFused(self.world_size, tile_elems=plan.tile,
                                                   step_elems=plan.step,
                                                   num_warps=plan.num_warps)
        return sim

    def close(self) -> None:
        self._sims.clear()


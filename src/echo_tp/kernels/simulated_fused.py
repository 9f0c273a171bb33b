"""P simulated ranks in one process running the fused all-reduce kernels (the pure-tensor form).

`SimulatedFused` mirrors collective/qar.compensated_all_reduce over SimTransport: x [P, N] ->
y [P, N], the state (m1, m2 [P, N]) updated in place, bit for bit; with residual= [P, N] it
returns residual + y instead (the add done by the kernels that write y; same state). Each
virtual rank owns a byte buffer laid out as on a GPU (allreduce_plan.Layout) and a pointer
table to all P buffers; stages run entry(all ranks) -> reduce(all) -> tail(all), so every
flag a kernel waits for is already set. Runs wherever the kernels run: the CPU under
TRITON_INTERPRET=1, or one GPU.
"""
from __future__ import annotations

import torch

from ..compensator import CompState
from ..config import EchoConfig, QuantSpec
from .allreduce_plan import CallPlan, Layout, local_amax
from .flags import describe_error, new_error_buffer


class SimulatedFused:
    """P ranks in one process running the fused kernels over per-rank buffers (the pure-tensor
    form). Calls mirror qar.compensated_all_reduce with SimTransport: x [P, N] -> y [P, N];
    the state (CompState with m1, m2 [P, N]) is updated in place. Buffers, flags and epochs
    persist across calls, as on GPUs."""

    def __init__(self, world_size: int, tile_elems: int = 2048, timeout_polls: int = 1000,
                 step_elems: int = 2048, num_warps: int = 4, num_stages: int | None = None):
        self.world_size = world_size
        self.tile_elems = tile_elems
        """Values per tile (collective/routing.tile_shape picks them on GPUs)."""
        self.step_elems = step_elems
        """Values a program holds at once (capped at the tile)."""
        self.num_warps = num_warps
        self.num_stages = num_stages
        """triton's pipelining depth for the stage kernels (None: its default)."""
        self.timeout = timeout_polls
        self._ws: dict = {}

    def workspace(self, n: int, spec: QuantSpec, device) -> dict:
        key = (n, spec, str(device))
        ws = self._ws.get(key)
        if ws is None:
            P = self.world_size
            lay = Layout.build(n, P, spec, self.tile_elems)
            bufs = [torch.randint(0, 256, (lay.nbytes,), dtype=torch.uint8, device=device)
                    for _ in range(P)]                     # poison: unwritten bytes are noise
            for b in bufs:
                lay.flag_words(b).zero_()
            errs = [new_error_buffer(False).to(device) for _ in range(P)]
            tables = [torch.tensor([b.data_ptr() for b in bufs] + [errs[r].data_ptr()],
                                   dtype=torch.int64, device=device) for r in range(P)]
            epochs = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(P)]
            ws = self._ws[key] = dict(lay=lay, bufs=bufs, errs=errs, tables=tables,
                                      epochs=epochs)
        return ws

    def __call__(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None,
                 backward: bool = False, stages: tuple = ("entry", "reduce", "tail"),
                 residual: torch.Tensor | None = None):
        """The call's stages in order, each on every rank -> y [P, N]; with residual [P, N]
        (x's dtype): residual + y, bit for bit `residual + <the call without it>`, the state
        updated exactly as without it."""
        from ..collective.qar import grad_scale
        from ..collective.simulated import SimTransport
        P, n = x.shape
        if P != self.world_size:
            raise ValueError(f"x has {P} ranks, the simulation {self.world_size}")
        ws = self.workspace(n, cfg.quant_spec(), x.device)
        fs = None
        if backward and cfg.grad_scaling:
            parts = torch.stack([local_amax(x[r], _rank_state(state, r), cfg) for r in range(P)])
            fs = grad_scale(parts, SimTransport(P))              # [P, 1]
        y = torch.empty_like(x)
        plans = self.plans(x, cfg, state, fs, residual)
        for stage in stages:
            for r in range(P):
                if stage == "entry":
                    plans[r].entry()
                else:
                    getattr(plans[r], stage)(y[r])
        for r in range(P):
            msg = describe_error(ws["errs"][r].cpu())
            if msg is not None:
                raise RuntimeError(msg)
        return y

    def plans(self, x: torch.Tensor, cfg: EchoConfig, state: CompState | None,
              fs: torch.Tensor | None = None,
              residual: torch.Tensor | None = None) -> list[CallPlan]:
        """One new call: every rank's epoch bumped, its CallPlan (x [P, N]; fs [P, 1] or None;
        residual [P, N] or None)."""
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
            raise ValueError(f"residual must be x's shape and dtype: {tuple(residual.shape)} "
                             f"{residual.dtype} vs {tuple(x.shape)} {x.dtype}")
        ws = self.workspace(x.shape[-1], cfg.quant_spec(), x.device)
        plans = []
        for r in range(self.world_size):
            ws["epochs"][r].add_(1)
            plans.append(CallPlan(rank=r, lay=ws["lay"], cfg=cfg, x=x[r],
                                  state=_rank_state(state, r),
                                  fs=None if fs is None else fs[r].contiguous(),
                                  epoch=ws["epochs"][r], table=ws["tables"][r],
                                  timeout=self.timeout, use_timer=False,
                                  num_warps=self.num_warps,
                                  step_elems=min(self.step_elems, self.tile_elems),
                                  num_stages=self.num_stages,
                                  residual=None if residual is None
                                  else residual[r].contiguous()))
        return plans


def _rank_state(state: CompState | None, r: int) -> CompState | None:
    return None if state is None else CompState(state.m1[r], state.m2[r])

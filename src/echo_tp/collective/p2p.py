"""Intra-node fast path: the fused compensated all-reduce over CUDA symmetric memory.

The dispatcher asks collective/routing.py whether a call comes here and with which kernel plan
(`Route`: form, tile, step, warps, overlap); this backend runs it:

    fused   one launch: entry, reduce and tail of every tile, per-program epochs bumped by
            the kernel itself (no host work per call beyond the launch);
    staged  epoch += 1 (device), entry (quantize + push), then reduce (owner sum, requantize,
            push to all, y of the own segment) and tail (decode the other owners' packets),
            one after the other (overlap 'off') or in one launch (overlap 'launch').

With `residual=` (a block boundary: comm.all_reduce_add_rmsnorm) the kernels that write y (the
reduce's own segment, the tail) write residual + y instead, torch's `residual + y` bit for bit,
so the boundary's add costs no pass of its own (the state updates still read y).

Everything runs on the current stream without a host synchronization, so calls are CUDA-graph
safe (warm each call signature up eagerly before capture). Backward calls with grad_scaling add
one kernel for the local max |x'| and the reference's `grad_scale` (one scalar MAX all-reduce
over the group) before entry. Bit-identical to the reference backend (collective/qar.py over
DistTransport) for the same inputs, state and config; calls with record=True (telemetry) run
the reference itself. Waits are bounded by ECHO_FLAG_TIMEOUT_S: a timed-out kernel writes
(rank, stage, tile, peer) to pinned host memory and the next call raises RuntimeError
(`check_error()` syncs and raises at once). Buffers (kernels/allreduce_plan.Layout) live in
symmetric memory (collective/symm.py), one per (dtype, quantizer, P, segment, form, tile).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .. import envs
from ..compensator import CompState
from ..config import EchoConfig
from . import tuning
from .qar import StepRecord, compensated_all_reduce, grad_scale
from .reference import DistTransport
from .routing import Route
from .symm import SymmetricBuffer, agreed_sm_count, select_symm_backend

log = logging.getLogger(__name__)


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


class P2PBackend:
    """Runs the calls routed to 'p2p' (`run`); `close` drops the buffers."""

    name = "p2p"
    adds_residual = True
    """run(residual=r) returns r + y, the add done by the kernels that write y."""

    def __init__(self, group: dist.ProcessGroup | None = None,
                 shape: tuning.KernelShape = tuning.DEFAULT.shape):
        from ..kernels import allreduce_plan, flags
        self._plan, self._flags = allreduce_plan, flags
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
        self._ws_by_call: dict = {}
        self._timeouts: dict[bool, int] = {}

    def run(self, x: torch.Tensor, cfg: EchoConfig, *, route: Route,
            state: CompState | None, backward: bool, record: bool,
            inplace: bool = False, residual: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, StepRecord | None]:
        """-> (y, None), or (residual + y, None) with residual ([n], x's dtype, contiguous);
        record=True: the reference's (y, StepRecord)."""
        if record:   # telemetry needs the unfused intermediates: same numbers, reference path
            self._flags.raise_if_set(self._err, self._err_np)
            y, rec = compensated_all_reduce(x, cfg, self.transport, state=state,
                                            backward=backward, record=True)
            return (y if residual is None else residual + y), rec
        plan, ws, y = self.prepare(x, cfg, route, state=state, backward=backward,
                                   residual=residual)
        if route.form == "fused":
            self._launch(plan, lambda: plan.fused(y, ws.programs))
            return y, None
        plan.entry()
        if route.overlap == "launch":
            self._launch(plan, lambda: plan.reduce_tail(y, ws.ticket, self.overlap_lag))
        else:
            self._launch(plan, lambda: plan.reduce(y))
            self._launch(plan, lambda: plan.tail(y))
        return y, None

    def prepare(self, x: torch.Tensor, cfg: EchoConfig, route: Route, *,
                state: CompState | None, backward: bool, residual: torch.Tensor | None = None):
        """A call's launch plan, workspace and output, epochs bumped (benchmarks time the
        stages of the plan one by one) -> (CallPlan, workspace, y; residual + y with
        residual)."""
        self._flags.raise_if_set(self._err, self._err_np)
        why = self._plan.supported(x, cfg, state, residual)
        if why is not None:
            raise ValueError(f"p2p backend cannot run this call: {why}")
        fused = route.form == "fused"
        ws = self._workspace(x, cfg, fused, route.tile)
        fs = None
        if backward and cfg.grad_scaling:
            fs = grad_scale(self._plan.local_amax(x, state, cfg), self.transport)   # [1]
        if not fused:
            ws.epoch.add_(1)
        plan = self._plan.CallPlan(rank=self.rank, lay=ws.lay, cfg=cfg, x=x, state=state, fs=fs,
                                   epoch=ws.epochs if fused else ws.epoch, table=ws.table,
                                   timeout=self._timeout_units(), use_timer=self.use_timer,
                                   num_warps=route.num_warps, step_elems=route.step,
                                   residual=residual)
        return plan, ws, torch.empty_like(x)

    def close(self) -> None:
        self._ws.clear()
        self._ws_by_call.clear()

    def check_error(self) -> None:
        """Synchronize the device and raise if any wait of this backend timed out."""
        torch.cuda.synchronize(self.device)
        self._flags.raise_if_set(self._err, self._err_np)

    # ----- helpers -----
    def _workspace(self, x: torch.Tensor, cfg: EchoConfig, fused: bool,
                   tile: int) -> _Workspace:
        spec = cfg.quant_spec()
        call_key = (x.numel(), x.dtype, spec, fused, tile)
        ws = self._ws_by_call.get(call_key)
        if ws is None:
            lay = self._plan.Layout.build(x.numel(), self.world_size, spec, tile)
            key = (x.dtype, spec, lay.seg, fused, tile)      # calls of one layout share it
            ws = self._ws.get(key)
            if ws is None:
                ws = self._ws[key] = _Workspace(lay, self.group, self.rank, self.device,
                                                self._err, self.programs if fused else 0)
            self._ws_by_call[call_key] = ws
        return ws

    def _timeout_units(self) -> int:
        """ECHO_FLAG_TIMEOUT_S in the kernels' units, read once per timer mode."""
        units = self._timeouts.get(self.use_timer)
        if units is None:
            units = self._timeouts[self.use_timer] = self._flags.timeout_units(
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
            plan.timeout = self._flags.timeout_units(envs.flag_timeout_s(), False)
            launch()

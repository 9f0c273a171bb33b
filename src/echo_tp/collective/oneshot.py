"""Small messages on intra-node GPUs: the 16-bit one-shot all-reduce (kernels/oneshot_kernels.py)
over one symmetric buffer, in one kernel launch.

Below the p2p crossover a quantized call saves nothing worth its rounding (the message is
latency-bound), so 'auto' sends it here when it fits: every rank pushes its input to every
peer, then sums the P inputs in rank order in fp32 (the same y on every rank, one rounding).
No error is injected beyond that rounding, so the compensator state is left as it is, exactly
as on the plain NCCL path. Bits=16 sites take it too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import envs
from ..compensator import CompState
from ..config import EchoConfig
from ..kernels import flags
from ..kernels import oneshot_kernels as ok
from . import tuning
from .backend import Backend
from .qar import StepRecord
from .routing import Route
from .symm import SymmetricBuffer, agreed_sm_count, select_symm_backend


class OneShotBackend(Backend):
    """Runs the calls routed to 'oneshot' (messages up to `cap_bytes` per rank, the routing
    table's cap) and, where it takes them, whole decode block boundaries (`run_add_rmsnorm`);
    the buffer is allocated at the first call (a collective moment: every rank makes the same
    call)."""

    name = "oneshot"
    offers = frozenset({"all_reduce", "add_rmsnorm"})

    def __init__(self, group: dist.ProcessGroup | None = None, *, cap_bytes: int,
                 num_warps: int = 4,
                 programs_per_sm: int = tuning.DEFAULT.shape.programs_per_sm.value):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.symm_backend = select_symm_backend(self.device)
        self.cap_bytes = cap_bytes
        self.num_warps = num_warps
        self.programs = programs_per_sm * agreed_sm_count(group, self.device) \
            if self.cap_bytes > 0 else 0
        self._err = flags.new_error_buffer(True)
        self._err_np = self._err.numpy()
        self._buf: SymmetricBuffer | None = None
        self._epochs: torch.Tensor | None = None
        self._lay = ok.OneShotLayout.build(self.world_size, max(self.cap_bytes, 256))
        self._timeout = flags.timeout_units(envs.flag_timeout_s(), True)

    def run(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None, backward: bool,
            record: bool, inplace: bool = False,
            route: Route | None = None) -> tuple[torch.Tensor, StepRecord | None]:
        self._ready(x)
        y = x if inplace else torch.empty_like(x)   # own tile t is read before y's tile t
        ok.oneshot(x, y, rank=self.rank, lay=self._lay, epochs=self._epochs,
                   table=self._buf.table, timeout=self._timeout, use_timer=True,
                   num_warps=self.num_warps)
        return y, None

    def declines(self, op, x, cfg, *, state=None, residual=None, weight=None) -> str | None:
        """The contract's answer; for 'add_rmsnorm' (x, residual [rows, H], weight [H]) also
        the kernel's (oneshot_kernels.add_rmsnorm_unfit: row width, buffer, row flags)."""
        why = super().declines(op, x, cfg, state=state, residual=residual, weight=weight)
        if why is None and op == "add_rmsnorm":
            why = ok.add_rmsnorm_unfit(x, residual, weight, self._lay)
        return why

    def run_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode block boundary in one launch (kernels/oneshot_kernels.
        oneshot_add_rmsnorm_kernel): x, residual [rows, H], weight [H] -> (normed,
        residual_out), bit for bit norm.add_rmsnorm_reference(run(x), residual, ...)."""
        self._ready(x)
        return ok.oneshot_add_rmsnorm(x, residual, weight, eps, rank=self.rank,
                                      lay=self._lay, epochs=self._epochs,
                                      table=self._buf.table, timeout=self._timeout,
                                      use_timer=True, num_warps=self.num_warps)

    def _ready(self, x: torch.Tensor) -> None:
        """Raise a peer's error record; check the size; the buffer at the first call (a
        collective moment: every rank makes the same call)."""
        flags.raise_if_set(self._err, self._err_np)
        if x.numel() * x.element_size() > self.cap_bytes:
            raise ValueError(f"one-shot backend: {x.numel() * x.element_size()} bytes per rank "
                             f"exceed its buffer of {self.cap_bytes}")
        if self._buf is None:
            lay = self._lay
            self._buf = SymmetricBuffer(lay.nbytes, lay.flags_off, self.group, self.rank,
                                        self.world_size, self.device, self._err)
            self._epochs = torch.zeros(self.programs, dtype=torch.int64, device=self.device)

    def check_error(self) -> None:
        torch.cuda.synchronize(self.device)
        flags.raise_if_set(self._err, self._err_np)

    def close(self) -> None:
        self._buf = None

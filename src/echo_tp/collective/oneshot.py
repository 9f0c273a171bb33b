"""Small messages on intra-node GPUs: the 16-bit one-shot all-reduce (kernels/oneshot_kernels.py)
over one symmetric buffer, in one kernel launch.

Below the p2p crossover a quantized call saves nothing worth its rounding (the message is
latency-bound), so 'auto' sends it here when it fits: every rank pushes its input to every
peer, then sums the P inputs in rank order in fp32 (the same y on every rank, one rounding).
No error is injected beyond that rounding, so the compensator state is left as it is, exactly
as on the plain NCCL path. Bits=16 sites take it too.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .. import envs
from ..compensator import CompState
from ..config import EchoConfig
from .p2p import DTYPES, SymmetricBuffer, agreed_sm_count, select_symm_backend
from .qar import StepRecord

log = logging.getLogger(__name__)

MAX_BYTES: dict[int, int] = {
    # P -> the largest message (bytes per rank) 'auto' sends through the one-shot kernel.
    # 2026-11-29, 2 H200s (docs/results/2026-11-29-p2p-x2-r2.md), 4 programs per SM:
    # 1.3-2.2x NCCL at 64 KiB-4 MiB, 1.05-1.07x at 16 MiB, 0.85x at 64 MiB.
    2: 16 << 20,
}
"""Unmeasured P take 1 MiB (each rank pushes P-1 copies of its input, so the one-shot path's
edge over NCCL shrinks as P grows). ECHO_ONESHOT_MAX_BYTES overrides (0 turns it off)."""


def max_bytes(world_size: int) -> int:
    forced = envs.oneshot_max_bytes()
    if forced is not None:
        return forced
    return MAX_BYTES.get(world_size, 1 << 20)


class OneShotBackend:
    """The dispatcher interface over the one-shot kernel; the buffer is allocated at the first
    call (a collective moment: every rank makes the same call)."""

    name = "oneshot"

    def __init__(self, group: dist.ProcessGroup | None = None, *, cap_bytes: int | None = None,
                 num_warps: int = 4, programs_per_sm: int = 4):
        from ..kernels import flags
        from ..kernels import oneshot_kernels as ok
        self._ok, self._flags = ok, flags
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.symm_backend = select_symm_backend(self.device)
        self.cap_bytes = max_bytes(self.world_size) if cap_bytes is None else cap_bytes
        self.num_warps = num_warps
        self.programs = programs_per_sm * agreed_sm_count(group, self.device) \
            if self.cap_bytes > 0 else 0
        self._err = flags.new_error_buffer(True)
        self._err_np = self._err.numpy()
        self._buf: SymmetricBuffer | None = None
        self._epochs: torch.Tensor | None = None
        self._lay = ok.OneShotLayout.build(self.world_size, max(self.cap_bytes, 256))
        self._timeout = flags.timeout_units(envs.flag_timeout_s(), True)

    def should_use(self, x: torch.Tensor, cfg: EchoConfig) -> bool:
        return (x.numel() * x.element_size() <= self.cap_bytes and x.is_cuda
                and x.get_device() == self.device.index and x.dtype in DTYPES and x.dim() == 1
                and x.is_contiguous())

    def run(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None, backward: bool,
            record: bool, inplace: bool = False) -> tuple[torch.Tensor, StepRecord | None]:
        self._flags.raise_if_set(self._err, self._err_np)
        if self._buf is None:
            lay = self._lay
            self._buf = SymmetricBuffer(lay.nbytes, lay.flags_off, self.group, self.rank,
                                        self.world_size, self.device, self._err)
            self._epochs = torch.zeros(self.programs, dtype=torch.int64, device=self.device)
        y = x if inplace else torch.empty_like(x)   # own tile t is read before y's tile t
        self._ok.oneshot(x, y, rank=self.rank, lay=self._lay, epochs=self._epochs,
                         table=self._buf.table, timeout=self._timeout, use_timer=True,
                         num_warps=self.num_warps)
        return y, None

    def check_error(self) -> None:
        torch.cuda.synchronize(self.device)
        self._flags.raise_if_set(self._err, self._err_np)

    def close(self) -> None:
        self._buf = None

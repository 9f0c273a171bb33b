"""Backend dispatch: each backend says whether it takes a call (`should_use`); the first that
does runs it, ending at the torch.distributed reference, which takes everything. Backends that
cannot run at all (no GPU, no peer access, multi-node) disable themselves at construction and
log the reason once.

'auto' on an intra-node GPU group: small messages (up to oneshot.max_bytes) go to the 16-bit
one-shot kernel (one launch, faster than NCCL there); p2p (fused kernels) takes calls where it
was measured faster than NCCL's bf16 all-reduce (p2p.crossover_bytes); the rest goes to the
plain bf16 all-reduce (`PlainBackend`: NCCL itself, exact), else the reference. Elsewhere
(CPU/gloo, multi-node) the quantized reference runs every call.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .. import envs
from ..compensator import CompState
from ..config import EchoConfig
from .chunked import chunked_all_reduce
from .qar import StepRecord
from .reference import DistTransport

log = logging.getLogger(__name__)


class TransportBackend:
    """The unfused algorithm (collective/qar.py) over a transport, large calls in bounded
    memory (collective/chunked.py: same bits); takes every call."""

    def __init__(self, transport):
        self.transport = transport
        self.name = transport.name
        self.world_size = transport.world_size

    def should_use(self, x: torch.Tensor, cfg: EchoConfig) -> bool:
        return True

    def run(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None, backward: bool,
            record: bool, inplace: bool = False) -> tuple[torch.Tensor, StepRecord | None]:
        if not cfg.quantized:
            return self.transport.all_sum(x, inplace=inplace), None
        return chunked_all_reduce(x, cfg, self.transport, state=state, backward=backward,
                                  record=record)

    def close(self) -> None:
        pass


class PlainBackend:
    """The plain all-reduce in the input dtype for GPU calls the fast path declines (a message
    below its measured crossover, or a config it loses on). No rounding beyond the dtype's own,
    so no error is injected: the compensator state is left as it is, and the corrections it
    holds are applied at the next quantized site."""

    name = "plain"

    def __init__(self, group: dist.ProcessGroup | None):
        self.transport = DistTransport(group)
        self.world_size = self.transport.world_size
        self._logged = False

    def should_use(self, x: torch.Tensor, cfg: EchoConfig) -> bool:
        return x.is_cuda

    def run(self, x, cfg, *, state, backward, record, inplace=False):
        if cfg.quantized and not self._logged:
            self._logged = True
            log.info("echo-tp: %d-bit calls below the p2p crossover use the plain bf16 "
                     "all-reduce (faster there); backend='p2p' forces the quantized path",
                     cfg.bits)
        return self.transport.all_sum(x, inplace=inplace), None

    def close(self) -> None:
        pass


class Dispatcher:
    def __init__(self, backends: list, world_size: int):
        if not backends:
            raise ValueError("a dispatcher needs at least one backend")
        self.backends = backends
        self.world_size = world_size
        self._deferring = [b for b in backends if hasattr(b, "wait_pending")]
        self.last_backend: str | None = None

    def run(self, x, cfg, *, state, backward, record, inplace=False):
        for b in self.backends:
            if b.should_use(x, cfg):
                if state is not None:      # another backend's deferred state update lands
                    for d in self._deferring:   # first (a deferring backend waits itself)
                        if d is not b:
                            d.wait_pending()
                self.last_backend = b.name
                return b.run(x, cfg, state=state, backward=backward, record=record,
                             inplace=inplace)
        raise RuntimeError("no backend accepted the call")  # the last backend takes everything

    def close(self) -> None:
        for b in self.backends:
            b.close()


def build_dispatcher(group: dist.ProcessGroup | None, backend: str = "auto") -> Dispatcher:
    """'auto': fastest usable backend first, reference last; 'reference': reference only;
    'p2p': the p2p backend for every call it supports (errors if it cannot run at all)."""
    if backend not in ("auto", "reference", "p2p"):
        raise ValueError(f"backend must be 'auto', 'reference' or 'p2p', got {backend!r}")
    if backend == "auto":
        backend = envs.backend()
    ref = TransportBackend(DistTransport(group))
    backends = []
    if backend != "reference" and not envs.force_reference():
        fast = _try_p2p(group, strict=backend == "p2p")
        if fast is not None:
            if backend == "auto":
                small = _try_oneshot(group)
                backends += [b for b in (small, fast, PlainBackend(group)) if b is not None]
            else:
                backends.append(fast)
    backends.append(ref)
    return Dispatcher(backends, ref.world_size)


def _try_p2p(group, strict: bool):
    try:
        from .p2p import P2PBackend, p2p_unavailable_reason
    except ImportError as e:  # triton missing, or an older torch
        reason = f"p2p backend cannot be imported: {e}"
    else:
        reason = p2p_unavailable_reason(group)
        if reason is None:
            return P2PBackend(group, min_bytes=0 if strict else None)
    if strict:
        raise RuntimeError(f"backend='p2p' requested but unavailable: {reason}")
    log.info("echo-tp: p2p backend disabled: %s", reason)
    return None


def _try_oneshot(group):
    """The one-shot backend, or None when turned off (ECHO_ONESHOT_MAX_BYTES=0) or broken."""
    from .oneshot import OneShotBackend, max_bytes
    if max_bytes(dist.get_world_size(group)) <= 0:
        return None
    try:
        return OneShotBackend(group)
    except Exception as e:  # noqa: BLE001 - the plain path still serves these calls
        log.warning("echo-tp: one-shot backend disabled: %s", e)
        return None

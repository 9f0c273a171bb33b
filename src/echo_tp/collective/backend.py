"""The backend contract: what every collective backend offers, and how it says no.

The shape is vLLM's device-communicator base class: a backend names what it offers, answers
one capability question with a reason, and runs the calls routed to it; the dispatcher
(collective/dispatch.py) reads only this, never a backend's own attributes.

    offers      a subset of OFFERS:
                  all_reduce      run(x, cfg, ...) -> (y, StepRecord or None)
                  reduce_scatter  reduce_scatter(x [P*m], cfg, ...) -> [m]
                  all_gather      all_gather(x [m], cfg, ...) -> [P*m]
                  residual        run(..., residual=r) returns r + y, the add done where y is
                                  decoded (a block boundary's residual: p2p)
                  add_rmsnorm     run_add_rmsnorm(x, residual, weight, eps) -> (normed,
                                  residual_out): the whole block boundary in one launch (the
                                  one-shot backend, decode sizes)
    declines    declines(op, x, cfg, ...) -> None, or why this backend will not run op on this
                call (the default: only whether it offers op; backends with kernels add
                kernels/fits.py's answer or their own buffer limits)
    close       drop buffers

Backends: TransportBackend (the reference: qar over a transport; every call), PlainBackend
(NCCL in the input dtype) in dispatch.py; P2PBackend (p2p.py), OneShotBackend (oneshot.py),
FusedSimBackend (simulated_fused.py). Which one a call gets: collective/routing.py.
"""
from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from ..compensator import CompState
from ..config import EchoConfig
from .qar import StepRecord
from .routing import Route

OFFERS = ("all_reduce", "reduce_scatter", "all_gather", "residual", "add_rmsnorm")
COLLECTIVES = frozenset(OFFERS[:3])
"""What a backend offers unless it says otherwise: the all-reduce and both halves."""


class Backend(Protocol):
    """One collective backend (the module docstring). Subclass it: the defaults below are the
    contract's (offer the three collectives; decline what is not offered)."""

    name: str
    world_size: int
    offers: ClassVar[frozenset[str]] = COLLECTIVES

    def declines(self, op: str, x: torch.Tensor, cfg: EchoConfig, *,
                 state: CompState | None = None, residual: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None) -> str | None:
        """Why this backend will not run `op` (one of OFFERS) on this call; None: it will."""
        if op not in OFFERS:
            raise ValueError(f"op must be one of {OFFERS}, got {op!r}")
        return None if op in self.offers else f"backend {self.name!r} does not offer {op}"

    def run(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None, backward: bool,
            record: bool, inplace: bool = False, route: Route | None = None,
            residual: torch.Tensor | None = None) -> tuple[torch.Tensor, StepRecord | None]:
        """The all-reduce of x [n] (residual: only where 'residual' is offered)."""
        raise NotImplementedError(f"backend {self.name!r} does not offer all_reduce")

    def reduce_scatter(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None,
                       backward: bool, route: Route | None = None) -> torch.Tensor:
        raise NotImplementedError(f"backend {self.name!r} does not offer reduce_scatter")

    def all_gather(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None,
                   backward: bool, route: Route | None = None) -> torch.Tensor:
        raise NotImplementedError(f"backend {self.name!r} does not offer all_gather")

    def run_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"backend {self.name!r} does not offer add_rmsnorm")

    def close(self) -> None:
        """Drop what the backend holds (buffers); the default holds nothing."""

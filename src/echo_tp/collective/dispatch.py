"""Backend dispatch: the routing policy (collective/routing.py) picks the backend of each call;
this module builds the backends a group can have and runs the call on the one picked.

    'auto' on an intra-node GPU group:  oneshot | p2p | plain | reference (routing.route)
    'auto' elsewhere (CPU/gloo, multi-node), or 'reference':  the reference for every call
    'p2p':  p2p for every call its kernels can take (an error at build if it cannot run)
    reduce-scatter / all-gather calls (routing.route of a half's Call): under 'auto' p2p from
        the all-reduce's crossover where the stage kernels take them, else plain; under 'p2p'
        p2p where the kernels take them; the reference for the rest

Every backend keeps one contract (collective/backend.py: what it offers, why it declines). A
block boundary's residual add (comm.all_reduce_add_rmsnorm) goes into the call where the
route's backend offers 'residual' (p2p: added where y is decoded); `adds_residual(x, cfg)` says
so before the call, and the caller adds it itself elsewhere. `run_boundary` runs the whole
boundary where the route's backend offers 'add_rmsnorm' and takes the call (the one-shot
backend at decode sizes), else returns None.

Backends that cannot run (no GPU, no peer access, multi-node) are not built; the reason is
logged once and every route that falls back because of it says so. Each distinct routing
decision is logged once at INFO with its reason (the table entry and record behind it).
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from .. import envs
from ..compensator import CompState
from ..config import EchoConfig
from ..kernels.fits import fits, tensor_unfit
from . import routing, tuning
from .backend import Backend
from .chunked import chunked_all_reduce
from .inband import CallLengths
from .qar import StepRecord
from .reference import DistTransport
from .routing import Route
from .sharded import compensated_all_gather, compensated_reduce_scatter

log = logging.getLogger(__name__)


class TransportBackend(Backend):
    """The unfused algorithm (collective/qar.py) over a transport, large calls in bounded
    memory (collective/chunked.py: same bits); takes every call."""

    def __init__(self, transport):
        self.transport = transport
        self.name = transport.name
        self.world_size = transport.world_size

    def run(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None, backward: bool,
            record: bool, inplace: bool = False,
            route: Route | None = None) -> tuple[torch.Tensor, StepRecord | None]:
        if not cfg.quantized:
            return self.transport.all_sum(x, inplace=inplace), None
        return chunked_all_reduce(x, cfg, self.transport, state=state, backward=backward,
                                  record=record)

    def reduce_scatter(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None,
                       backward: bool, route: Route | None = None) -> torch.Tensor:
        """x [*B, P*m] -> this rank's chunk of the sum [*B, m] (collective/sharded.py)."""
        return compensated_reduce_scatter(x, cfg, self.transport, state=state, backward=backward)

    def all_gather(self, x: torch.Tensor, cfg: EchoConfig, *, state: CompState | None,
                   backward: bool, route: Route | None = None) -> torch.Tensor:
        """x [*B, m] -> every rank's shard in rank order [*B, P*m] (collective/sharded.py)."""
        return compensated_all_gather(x, cfg, self.transport, state=state, backward=backward)


class PlainBackend(Backend):
    """The plain all-reduce (and reduce-scatter, all-gather) in the input dtype for GPU calls
    the fast path declines (a message below its measured crossover, or a config it loses on). No rounding beyond the dtype's own,
    so no error is injected: the compensator state is left as it is, and the corrections it
    holds are applied at the next quantized site."""

    name = "plain"

    def __init__(self, group: dist.ProcessGroup | None):
        self.transport = DistTransport(group)
        self.world_size = self.transport.world_size

    def run(self, x, cfg, *, state, backward, record, inplace=False, route=None):
        return self.transport.all_sum(x, inplace=inplace), None

    def reduce_scatter(self, x, cfg, *, state, backward, route=None):
        """x [P*m] -> this rank's chunk of the sum [m], NCCL's reduce-scatter in x's dtype."""
        return self.transport.sum_scatter(x)

    def all_gather(self, x, cfg, *, state, backward, route=None):
        """x [m] -> every rank's shard [P*m], NCCL's all-gather in x's dtype."""
        return self.transport.gather_cat(x)


class Dispatcher:
    """backends: name (routing.BACKENDS) -> Backend, 'reference' among them. Routes are cached
    per (kind, numel, dtype, device, layout, config, capture state); the halves' also per
    whether the call has compensator state."""

    def __init__(self, backends: dict, world_size: int, *, mode: str = "reference",
                 available: dict[str, str | None] | None = None,
                 tables: tuning.Tables = tuning.DEFAULT, device: torch.device | None = None,
                 lengths: CallLengths | None = None):
        if "reference" not in backends:
            raise ValueError("a dispatcher needs a 'reference' backend (it takes every call)")
        self.backends = backends
        self.world_size = world_size
        self.mode = mode
        self.available = dict(available or {})
        self.tables = tables
        self.device = device
        self.lengths = lengths
        """Shared with the reference transport: quantized CPU calls carry their length in-band
        (collective/inband.py; the communicator sets it); None: they do not."""
        self._only = backends["reference"] if len(backends) == 1 else None
        self._routes: dict = {}
        self._logged: set = set()
        self.last_backend: str | None = None
        self.last_route: Route | None = None

    def route(self, x: torch.Tensor, cfg: EchoConfig, kind: str = "all_reduce",
              state: CompState | None = None) -> Route:
        """The routing decision for a call of `kind` on x under cfg (cached); the halves' also
        by whether the call has compensator state."""
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        layout = x.dim() == 1 and x.is_contiguous()
        key = (kind, x.numel(), x.dtype, x.device, layout, cfg, capturing,
               kind != "all_reduce" and state is None)
        r = self._routes.get(key)
        if r is None:
            call = routing.Call.of(x.numel(), x.element_size(), cfg, self.world_size,
                                   on_gpu=x.is_cuda, capturing=capturing, kind=kind,
                                   tensor_unfit=self._unfit(kind, x, cfg, state))
            if kind != "all_reduce" and state is None:
                call = dataclasses.replace(call, state_bytes=0)     # an uncompensated call
            r = self._routes[key] = routing.route(call, self.mode, self.available, self.tables)
            if r.backend not in self.backends:      # a route to a backend this group lacks
                r = self._routes[key] = Route("reference", f"{r.backend} not built: {r.reason}")
            if (kind, r.backend, r.reason) not in self._logged:
                self._logged.add((kind, r.backend, r.reason))
                what = "calls" if kind == "all_reduce" else f"{kind} calls"
                log.info("echo-tp: %d-bit %s of %d values -> %s: %s", cfg.bits, what,
                         x.numel(), r.backend, r.reason)
        return r

    def _unfit(self, kind: str, x: torch.Tensor, cfg: EchoConfig,
               state: CompState | None) -> str | None:
        """Why no fast kernel takes x (kernels/fits.tensor_unfit); a quantized half also why
        the stage kernels cannot take it (kernels/fits.fits)."""
        if not x.is_cuda or self.device is None:
            return "not on a GPU"
        if kind != "all_reduce" and cfg.quantized:
            return fits(kind, x, cfg, world_size=self.world_size, state=state,
                        device=self.device)
        return tensor_unfit(x, self.device)

    def _backend(self, x, cfg, kind: str = "all_reduce", state=None):
        """(backend, route) of a call (route None without routing)."""
        if self._only is not None:
            return self._only, None
        r = self.route(x, cfg) if kind == "all_reduce" else self.route(x, cfg, kind, state)
        return self.backends[r.backend], r

    def carries_call(self, x, cfg, kind: str = "all_reduce", state=None,
                     record: bool = False) -> bool:
        """Whether this call runs on the p2p or one-shot kernels, whose packets carry the call's
        length and width (the kernels that receive them compare them with their own:
        collective/p2p.py, kernels/oneshot_kernels.py), so the ranks need no host check of its
        length."""
        if record or not x.is_cuda or self._only is not None:
            return False
        return self._backend(x, cfg, kind, state)[0].name in ("p2p", "oneshot")

    def adds_residual(self, x, cfg) -> bool:
        """Whether the call's backend takes `run(residual=...)` (adds it where y is decoded)."""
        return self._backend(x, cfg)[0].declines("residual", x, cfg) is None

    def run_boundary(self, x, cfg, residual, weight, eps):
        """A block boundary (all-reduce + residual add + RMSNorm) in the call's backend, where
        it offers 'add_rmsnorm' and takes this one: x [n], residual [..., H] (n values),
        weight [H] -> (normed, residual_out) [rows, H]; None where it does not (the caller runs
        the parts)."""
        b = self._backend(x, cfg)[0]
        if "add_rmsnorm" not in b.offers:
            return None
        rows = x.view(-1, residual.shape[-1])
        res = residual.reshape(rows.shape).contiguous()
        if b.declines("add_rmsnorm", rows, cfg, residual=res, weight=weight) is not None:
            return None
        return b.run_add_rmsnorm(rows, res, weight, eps)

    def run(self, x, cfg, *, state, backward, record, inplace=False, residual=None):
        """-> (y, StepRecord or None). residual (x's shape and dtype; only where
        `adds_residual(x, cfg)`): the backend returns residual + y instead of y."""
        b, r = self._backend(x, cfg)
        self.last_backend, self.last_route = b.name, r
        kw = {} if r is None else {"route": r}
        if residual is not None:
            why = b.declines("residual", x, cfg, state=state, residual=residual)
            if why is not None:
                raise ValueError(f"backend {b.name!r} does not add a residual (ask "
                                 f"adds_residual(x, cfg) first): {why}")
            kw["residual"] = residual
        return b.run(x, cfg, state=state, backward=backward, record=record, inplace=inplace,
                     **kw)

    def run_half(self, kind: str, x, cfg, *, state, backward):
        """A reduce-scatter or all-gather (kind): the route picks the backend and plan."""
        if kind not in routing.HALVES:
            raise ValueError(f"kind must be one of {routing.HALVES}, got {kind!r}")
        r = self.route(x, cfg, kind, state)
        b = self.backends[r.backend]
        self.last_backend, self.last_route = b.name, r
        half = b.reduce_scatter if kind == "reduce_scatter" else b.all_gather
        return half(x, cfg, state=state, backward=backward, route=r)

    def close(self) -> None:
        for b in self.backends.values():
            b.close()


def build_dispatcher(group: dist.ProcessGroup | None, backend: str = "auto") -> Dispatcher:
    """'auto' (or ECHO_BACKEND): every backend the group can have, routed per call;
    'reference': the reference only; 'p2p': p2p for every call it can take (an error if it
    cannot run at all)."""
    if backend not in routing.MODES:
        raise ValueError(f"backend must be one of {routing.MODES}, got {backend!r}")
    mode = envs.backend() if backend == "auto" else backend
    lengths = CallLengths()
    ref = TransportBackend(DistTransport(group, lengths))
    backends: dict = {"reference": ref}
    available: dict[str, str | None] = {}
    tables = tuning.DEFAULT.with_overrides(p2p_min_bytes=envs.p2p_min_bytes(),
                                           oneshot_max_bytes=envs.oneshot_max_bytes())
    device = None
    if mode != "reference":
        fast, available["p2p"] = _try_p2p(group, strict=mode == "p2p")
        if fast is not None:
            device = fast.device
            backends["p2p"] = fast
            if mode == "auto":
                backends["plain"] = PlainBackend(group)
                cap, _ = tables.oneshot_cap(dist.get_world_size(group))
                one, available["oneshot"] = _try_oneshot(group, cap)
                if one is not None:
                    backends["oneshot"] = one
    return Dispatcher(backends, ref.world_size, mode=mode, available=available, tables=tables,
                      device=device, lengths=lengths)


def _try_p2p(group, strict: bool):
    """-> (P2PBackend or None, None or why not)."""
    try:
        from .p2p import P2PBackend
        from .symm import fast_path_unavailable_reason
    except ImportError as e:  # triton missing, or an older torch
        reason = f"p2p backend cannot be imported: {e}"
    else:
        reason = fast_path_unavailable_reason(group)
        if reason is None:
            return P2PBackend(group), None
    if strict:
        raise RuntimeError(f"backend='p2p' requested but unavailable: {reason}")
    log.info("echo-tp: p2p backend disabled: %s", reason)
    return None, reason


def _try_oneshot(group, cap: int):
    """-> (OneShotBackend or None, None or why not): off at cap 0 (ECHO_ONESHOT_MAX_BYTES=0)."""
    if cap <= 0:
        return None, "one-shot cap 0 (ECHO_ONESHOT_MAX_BYTES=0)"
    from .oneshot import OneShotBackend
    try:
        return OneShotBackend(group, cap_bytes=cap), None
    except Exception as e:  # noqa: BLE001 - the plain path still serves these calls
        log.warning("echo-tp: one-shot backend disabled: %s", e)
        return None, f"one-shot backend failed to build: {e}"

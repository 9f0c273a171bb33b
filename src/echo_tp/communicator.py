"""EchoCommunicator: the stateful Echo all-reduce a user keeps per TP group.

    comm = EchoCommunicator.from_group(group, EchoConfig(bits=4))
    with comm.pass_scope("forward"):          # resets the forward compensator state
        for block in blocks:
            y = comm.all_reduce(partial)       # every rank gets the same y, in partial's dtype

Sites are numbered in call order within a pass. One compensator state pair per direction
('forward', 'backward'), reset by `new_pass`, shaped lazily by the first site of each tensor
size (compensator.PassState). bits=16 runs the plain all-reduce through the same API. The
backend is picked per call by a dispatcher (collective/dispatch.py) that falls back, ending at
the torch.distributed reference.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

from . import envs
from .collective.dispatch import Dispatcher, build_dispatcher
from .collective.simulated import SimTransport
from .compensator import PassState
from .config import DIRECTIONS, EchoConfig
from .telemetry import Telemetry

log = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class EchoCommunicator:
    """Compensated quantized all-reduce over one group (real ranks, or P virtual ones)."""

    simulated = False

    def __init__(self, dispatcher: Dispatcher, config: EchoConfig | None = None, *,
                 telemetry: bool = False, group: dist.ProcessGroup | None = None):
        self.config = config if config is not None else EchoConfig()
        self.dispatcher = dispatcher
        self.world_size = dispatcher.world_size
        self.group = group
        self.passes = {d: PassState() for d in DIRECTIONS}
        self.telemetry = Telemetry() if telemetry else None
        self._configs: dict[int, EchoConfig] = {}
        self._debug_checks = envs.debug_checks()

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None, config: EchoConfig | None = None,
                   *, backend: str = "auto", telemetry: bool = False,
                   check_config: bool = True) -> "EchoCommunicator":
        """A communicator over a torch.distributed group (None = the default group)."""
        config = config if config is not None else EchoConfig()
        if check_config:
            check_same_config(config, group)
        return cls(build_dispatcher(group, backend), config, telemetry=telemetry, group=group)

    # ----- passes -----
    def new_pass(self, direction: str = "forward") -> None:
        """Start a pass: zero the compensator state of `direction` and restart site numbering."""
        _check_direction(direction)
        self.passes[direction].reset()
        if self.telemetry is not None:
            self.telemetry.new_pass(direction)

    @contextlib.contextmanager
    def pass_scope(self, direction: str = "forward"):
        """`with comm.pass_scope('forward'):` runs one pass with fresh compensator state."""
        self.new_pass(direction)
        yield self

    def state(self, direction: str = "forward", numel: int | None = None):
        """The compensator state (CompState) of a direction's stream of `numel`-sized sites."""
        streams = self.passes[direction].streams
        if numel is None:
            if len(streams) != 1:
                raise ValueError(f"{len(streams)} state streams exist; name numel")
            return next(iter(streams.values()))
        return streams.get(numel)

    # ----- the collective -----
    def config_for(self, bits: int | None) -> EchoConfig:
        if bits is None or bits == self.config.bits:
            return self.config
        cfg = self._configs.get(bits)
        if cfg is None:
            cfg = self._configs[bits] = self.config.replace(bits=bits)
        return cfg

    def all_reduce(self, x: torch.Tensor, *, direction: str = "forward",
                   bits: int | None = None, inplace: bool = False) -> torch.Tensor:
        """Sum of x over the group (x's shape and dtype), with Echo compensation.

        `bits` overrides the config's width for this site (per-site policies). `inplace=True`
        lets a plain (16-bit) all-reduce reuse x's storage (saves a copy; the caller must not
        need x afterwards); quantized calls always return a new tensor."""
        _check_direction(direction)
        self._check_input(x)
        cfg = self.config_for(bits)
        ps = self.passes[direction]
        site = ps.sites
        ps.sites += 1
        flat = self._flatten(x)
        if flat.shape[-1] == 0:
            return x.clone()
        if self._debug_checks and not self.simulated:
            check_same_shape(flat, self.group)
        state = None
        if cfg.compensated:
            sdtype = getattr(torch, cfg.state_dtype)
            state = ps.get(flat.shape[-1], tuple(flat.shape[:-1]), flat.device, sdtype,
                           compact=cfg.beta1 == cfg.beta2)   # one tensor when m1 == m2
        record = self.telemetry is not None and cfg.quantized
        inplace = inplace and x.is_contiguous() and (flat is x or flat.data_ptr() == x.data_ptr())
        y, rec = self.dispatcher.run(flat, cfg, state=state, backward=direction == "backward",
                                     record=record, inplace=inplace)
        if self.telemetry is not None:
            self.telemetry.record(direction=direction, site=site, bits=cfg.bits, x=flat, y=y,
                                  rec=rec, simulated=self.simulated)
        return y if flat is x else y.reshape(x.shape)

    def _flatten(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.dim() == 1 else x.reshape(-1)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"all_reduce expects a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in DTYPES:
            raise ValueError(f"all_reduce supports {DTYPES}, got {x.dtype}")

    def telemetry_summary(self, reduce: bool = True) -> list[dict]:
        if self.telemetry is None:
            raise RuntimeError("telemetry is off: build the communicator with telemetry=True")
        return self.telemetry.summary(self.group, reduce=reduce and not self.simulated)

    def close(self) -> None:
        self.dispatcher.close()
        for ps in self.passes.values():
            ps.reset()


class SimulatedCommunicator(EchoCommunicator):
    """P virtual ranks in one process: all_reduce takes [P, ...] (rank i's partial at index i)
    and returns [P, ...] (identical rows), bit-identical to the P-process run."""

    simulated = True

    def __init__(self, world_size: int, config: EchoConfig | None = None, *,
                 telemetry: bool = False):
        from .collective.dispatch import TransportBackend
        super().__init__(Dispatcher([TransportBackend(SimTransport(world_size))], world_size),
                         config, telemetry=telemetry)

    def all_reduce_list(self, xs: list[torch.Tensor], **kw) -> torch.Tensor:
        """The P partial tensors as a list -> their (same-for-all) sum, shaped like xs[0]."""
        if len(xs) != self.world_size:
            raise ValueError(f"expected {self.world_size} partials, got {len(xs)}")
        return self.all_reduce(torch.stack(xs), **kw)[0]

    def _flatten(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[0] != self.world_size:
            raise ValueError(f"simulated all_reduce needs a leading dim of size "
                             f"{self.world_size} (one slice per virtual rank), "
                             f"got {tuple(x.shape)}")
        return x.reshape(self.world_size, -1)


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")


def check_same_config(config: EchoConfig, group=None) -> None:
    """One small all-gather at setup: every rank must hold the same EchoConfig."""
    world = dist.get_world_size(group)
    sigs: list = [None] * world
    dist.all_gather_object(sigs, config.signature(), group=group)
    bad = [r for r, s in enumerate(sigs) if s != sigs[0]]
    if bad:
        raise ValueError(f"EchoConfig differs across ranks: rank 0 has {sigs[0]}, "
                         + ", ".join(f"rank {r} has {sigs[r]}" for r in bad))


def check_same_shape(flat: torch.Tensor, group=None) -> None:
    """Debug check (ECHO_DEBUG_CHECKS=1): all ranks pass the same numel and dtype."""
    world = dist.get_world_size(group)
    got: list = [None] * world
    dist.all_gather_object(got, (flat.numel(), str(flat.dtype)), group=group)
    if any(g != got[0] for g in got):
        raise ValueError(f"all_reduce inputs differ across ranks (numel, dtype): {got}")

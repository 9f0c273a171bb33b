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

Sequence parallelism: `reduce_scatter(x, dim=0)` (each rank gets its chunk of the sum) and
`all_gather(shard, dim=0)` (every rank gets all shards, bit-identical everywhere), the two
halves of the quantized all-reduce (collective/sharded.py), with their own compensator states
per direction and kind (reset by new_pass with the all-reduce's) and the same checks below.
They leave no telemetry rows (telemetry covers the all-reduce).

Defined answers:
* Ranks must make the same calls: every call's signature (kind, numel, dtype, bits, direction,
  device) is agreed across ranks before a packet moves, the numel of quantized CPU calls
  in-band (echo_tp/agreement.py says how and what it costs); ranks that disagree get a
  ValueError on every rank.
* Zero-size inputs return zero-size outputs of their shape, and take part in the checks (a
  quantized CPU call runs its collectives with empty packets, so its length is compared too).
* A group of one returns its input exactly (a copy, or x itself with inplace=True).
* One communicator serves one thread (echo_tp/guard.py): a second thread entering a collective
  while another is inside raises RuntimeError, and the communicator refuses every later call.
* Inputs that require grad (with grad mode on) are refused: the collectives are no autograd
  ops; the TP layers (tp/sites.py) give them their backward.
* Calls outside any pass keep one state stream per tensor size; past MAX_STREAMS sizes the
  oldest stream is dropped (its compensation restarts from zero, as at a new pass).

Where the rest lives: the passes in echo_tp/passes.py, the block boundary's forms in echo_tp/boundary.py, the argument checks in
echo_tp/checks.py, the state streams in echo_tp/streams.py, the halves' shapes (dim, the
simulated rank dim) in echo_tp/halves.py, the backends and which one a call gets in
collective/ (dispatch.py, routing.py).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from . import envs
from .agreement import Agreement, check_same_config
from .boundary import Boundary, Reduced, finish, over_ranks, promoted
from .checks import check_direction, check_input
from .collective.dispatch import Dispatcher, TransportBackend, build_dispatcher
from .collective.reference import warn_if_long_wait
from .collective.simulated import SimTransport
from .compensator import NormOutput
from .config import EchoConfig, check_bits
from .guard import OneThread
from .halves import half_view
from .mapped import run_mapped
from .norm import check_add_rmsnorm
from .passes import Passes
from .streams import MAX_STREAMS, state_of
from .telemetry import Telemetry

__all__ = ["EchoCommunicator", "SimulatedCommunicator", "Boundary", "Reduced", "MAX_STREAMS"]


class EchoCommunicator(Passes):
    """Compensated quantized all-reduce over one group (real ranks, or P virtual ones); its
    passes (new_pass, pass_scope, state): echo_tp/passes.py."""

    simulated = False

    def __init__(self, dispatcher: Dispatcher, config: EchoConfig | None = None, *,
                 telemetry: bool = False, group: dist.ProcessGroup | None = None):
        self.config = config if config is not None else EchoConfig()
        self.dispatcher = dispatcher
        self.world_size = dispatcher.world_size
        self.group = group
        super().__init__(Telemetry() if telemetry else None)
        self.agreement = Agreement(group, dispatcher.lengths)
        """The cross-rank call check (echo_tp/agreement.py; quantized CPU calls: in-band)."""
        self.guard = OneThread()
        self._configs: dict[int, EchoConfig] = {}

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None, config: EchoConfig | None = None,
                   *, backend: str = "auto", telemetry: bool = False,
                   check_config: bool = True) -> "EchoCommunicator":
        """A communicator over a torch.distributed group (None = the default group). Logs one
        warning when the group waits longer on a peer than ECHO_COLLECTIVE_TIMEOUT_S (torch's
        default is 30 minutes: build it with timeout=echo_tp.launch.group_timeout())."""
        config = config if config is not None else EchoConfig()
        warn_if_long_wait(group)
        if check_config:
            check_same_config(config, group)
        return cls(build_dispatcher(group, backend), config, telemetry=telemetry, group=group)

    # ----- the collective -----
    def config_for(self, bits: int | None, kind: str = "all_reduce") -> EchoConfig:
        if bits is None:
            return self.config
        check_bits(bits, f"{kind}(bits=...)")
        if bits == self.config.bits:
            return self.config
        cfg = self._configs.get(bits)
        if cfg is None:
            cfg = self._configs[bits] = self.config.replace(bits=bits)
        return cfg

    def all_reduce(self, x: torch.Tensor, *, direction: str = "forward",
                   bits: int | None = None, inplace: bool = False,
                   output_map: NormOutput | None = None) -> torch.Tensor:
        """Sum of x over the group (x's shape and dtype), with Echo compensation.

        `bits` overrides the config's width for this site (per-site policies). `inplace=True`
        lets a plain (16-bit) all-reduce reuse x's storage (saves a copy; the caller must not
        need x afterwards); quantized calls always return a new tensor. `output_map`: the
        norm the sum passes before it reaches the residual stream (compensator.NormOutput; a
        forward site of a post-norm model), so error feedback works in the stream's units."""
        with self.guard.entered("all_reduce"):
            return self._all_reduce(x, direction, bits, inplace, output_map=output_map).out

    def reduce_scatter(self, x: torch.Tensor, *, dim: int = 0, direction: str = "forward",
                       bits: int | None = None, compensate: bool = True) -> torch.Tensor:
        """This rank's chunk of the sum over the group, with Echo compensation: x [..., P*k
        at dim, ...] -> [..., k, ...] in x's dtype, chunk j along dim (x.chunk(P, dim)[j]) summed
        on rank j, as torch's reduce_scatter_tensor (dim 0) does. Each rank's contribution to
        another's chunk is quantized once, its own never (collective/sharded.py). Simulated:
        x [P, ...] (rank i's tensor at index i; dim counts in rank i's tensor) -> [P, ...].
        compensate=False: this call neither applies nor updates the error feedback (for an
        output that is not summed downstream, where a fed-back error is added, not cancelled)."""
        with self.guard.entered("reduce_scatter"):
            return self._half("reduce_scatter", x, dim, direction, bits, compensate)

    def all_gather(self, x: torch.Tensor, *, dim: int = 0, direction: str = "forward",
                   bits: int | None = None, compensate: bool = True) -> torch.Tensor:
        """Every rank's x concatenated along dim in rank order (as torch's all_gather_into_
        tensor at dim 0), with Echo compensation: x [..., k at dim, ...] -> [..., P*k, ...] in
        x's dtype. Each shard is quantized once, by its rank; every rank (the owner too) decodes
        the same codes, so the output is bit-identical on every rank (collective/sharded.py).
        Simulated: x [P, ...] -> [P, ...] (identical rows). compensate: as reduce_scatter's."""
        with self.guard.entered("all_gather"):
            return self._half("all_gather", x, dim, direction, bits, compensate)

    def all_reduce_add_rmsnorm(self, partial: torch.Tensor, residual: torch.Tensor,
                               weight: torch.Tensor, eps: float, *, direction: str = "forward",
                               bits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A block boundary in one call: residual_out = residual + all_reduce(partial) and
        normed = RMSNorm(residual_out) * weight -> (normed, residual_out); bit for bit the
        all-reduce then norm.add_rmsnorm_reference, whichever backend adds what
        (echo_tp/boundary.py). partial, residual [..., H] (simulated: [P, ..., H], residual
        [..., H] or [P, ..., H]); weight [H]. Of two dtypes both are taken in the promoted
        one, as `residual + y` would, and residual_out has it."""
        check_input(partial, "all_reduce")
        if self.simulated and residual.shape == partial.shape[1:] and (
                residual.dtype != partial.dtype or not self.dispatcher.adds_residual(
                    self._flatten(partial), self.config_for(bits))):
            if residual.dtype == partial.dtype:                  # the calls of the paths below
                check_add_rmsnorm(partial[0], residual, weight)       # refused before the call
                with self.guard.entered("all_reduce"):
                    y = self._all_reduce(partial, direction, bits, False).out[0]
            else:
                y = self.all_reduce(partial, direction=direction, bits=bits)[0]
            return over_ranks(promoted(y, residual, weight, eps), partial.shape[0])
        if residual.shape != partial.shape:
            residual = residual.expand(partial.shape)
        if residual.dtype != partial.dtype:     # autocast: a bf16 block output, fp32 stream
            y = self.all_reduce(partial, direction=direction, bits=bits)
            return promoted(y, residual, weight, eps)
        check_add_rmsnorm(partial, residual, weight)
        with self.guard.entered("all_reduce"):
            r = self._all_reduce(partial, direction, bits, False, Boundary(residual, weight, eps))
        return finish(r, residual, weight, eps)

    def _all_reduce(self, x, direction, bits, inplace, boundary: Boundary | None = None,
                    output_map: NormOutput | None = None) -> Reduced:
        """The all-reduce of x; with a boundary, what of it the call's backend runs too
        (Reduced.form; Dispatcher.adds_residual, Dispatcher.run_boundary)."""
        check_direction(direction)
        check_input(x, "all_reduce")
        cfg = self.config_for(bits)
        ps = self.passes[direction]
        site = ps.sites
        flat = self._flatten(x)
        record = self.telemetry is not None and cfg.quantized
        inband = not self.simulated and self.agreement.check(
            flat, cfg, direction, "all_reduce",
            carried=self.dispatcher.carries_call(flat, cfg, record=record))
        ps.sites += 1
        if self.world_size == 1:       # the sum over a group of one is the input, exactly
            return Reduced(x if inplace else x.clone())
        if flat.shape[-1] == 0 and not inband:
            return Reduced(x.clone())
        state = state_of(ps, flat, cfg)
        inplace = inplace and x.is_contiguous() and (flat is x or flat.data_ptr() == x.data_ptr())
        if boundary is not None and not record and not self.simulated:
            done = self.dispatcher.run_boundary(flat, cfg, boundary.residual, boundary.weight,
                                                boundary.eps)
            if done is not None:
                return Reduced(tuple(t.reshape(x.shape) for t in done), "normed")
        added = boundary is not None and not record and self.dispatcher.adds_residual(flat, cfg)
        residual = boundary.residual.reshape(flat.shape).contiguous() if added else None
        run = self.dispatcher.run
        if output_map is not None and state is not None and direction == "forward":
            run = functools.partial(run_mapped, run, omap=output_map,
                                    world_size=self.world_size)
        with self.agreement.in_band(inband, flat, cfg, direction, "all_reduce"):
            y, rec = run(flat, cfg, state=state, backward=direction == "backward",
                         record=record, inplace=inplace, residual=residual)
        if self.telemetry is not None:
            self.telemetry.record(direction=direction, site=site, bits=cfg.bits, x=flat, y=y,
                                  rec=rec, simulated=self.simulated)
        return Reduced(y if flat is x else y.reshape(x.shape),
                       "residual_out" if added else "y")

    def _half(self, kind, x, dim, direction, bits, compensate):
        """A reduce-scatter or all-gather: the checks of all_reduce, dim moved to the front."""
        check_direction(direction)
        check_input(x, kind)
        cfg = self.config_for(bits, kind)
        ps = self.half_passes[kind][direction]
        if self.simulated:
            self._flatten(x)                               # the leading-dim check
        flat, restore = half_view(x, dim, kind, self.world_size, self.simulated)
        live = compensate and self.world_size > 1 and flat.shape[-1] > 0
        state = state_of(ps, flat, cfg) if live else None
        inband = not self.simulated and self.agreement.check(
            flat, cfg, direction, kind,
            carried=self.dispatcher.carries_call(flat, cfg, kind, state))
        ps.sites += 1
        if self.world_size == 1:       # a group of one: its chunk / its gather is the input
            return x.clone()
        if flat.shape[-1] == 0 and not inband:
            return restore(flat.clone())
        with self.agreement.in_band(inband, flat, cfg, direction, kind):
            y = self.dispatcher.run_half(kind, flat, cfg, state=state,
                                         backward=direction == "backward")
        return restore(y)

    def _flatten(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.dim() == 1 else x.reshape(-1)

    def telemetry_summary(self, reduce: bool = True) -> list[dict]:
        if self.telemetry is None:
            raise RuntimeError("telemetry is off: build the communicator with telemetry=True")
        return self.telemetry.summary(self.group, reduce=reduce and not self.simulated)

    def close(self) -> None:
        self.dispatcher.close()
        self.reset_passes()


class SimulatedCommunicator(EchoCommunicator):
    """P virtual ranks in one process: all_reduce takes [P, ...] (rank i's partial at index i)
    and returns [P, ...] (identical rows), bit-identical to the P-process run; reduce_scatter
    and all_gather likewise ([P, ...] in, rank i's output at index i out). On a GPU the
    quantized all-reduces run the fused p2p kernels of every virtual rank (fused=False or
    ECHO_BACKEND=reference: the unfused reference; the same bits either way)."""

    simulated = True

    def __init__(self, world_size: int, config: EchoConfig | None = None, *,
                 telemetry: bool = False, fused: bool = True):
        ref = TransportBackend(SimTransport(world_size))
        if fused and torch.cuda.is_available() and envs.backend() != "reference":
            from .collective.simulated_fused import FusedSimBackend   # optional: needs triton
            ref = FusedSimBackend(ref)   # CUDA calls through the p2p kernels (same bits)
        super().__init__(Dispatcher({"reference": ref}, world_size), config,
                         telemetry=telemetry)

    def all_reduce_list(self, xs: list[torch.Tensor], **kw) -> torch.Tensor:
        """The P partial tensors as a list -> their (same-for-all) sum, shaped like xs[0]."""
        if len(xs) != self.world_size:
            raise ValueError(f"expected {self.world_size} partials, got {len(xs)}")
        return self.all_reduce(torch.stack(xs), **kw)[0]

    def _flatten(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[0] != self.world_size:
            raise ValueError(f"simulated collectives need a leading dim of size "
                             f"{self.world_size} (one slice per virtual rank), "
                             f"got {tuple(x.shape)}")
        return x.reshape(self.world_size, -1)

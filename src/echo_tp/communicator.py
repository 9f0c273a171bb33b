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

Defined answers (issues 15, 28):
* Ranks must make the same calls. A call's fixed part (kind, dtype, bits, direction, device)
  is checked once per communicator with one small all-gather of 6 integers (the numel of that
  first call among them), then remembered: ranks that disagree get a ValueError on every rank
  before any packet moves. The numel, which a server changes with every prefill length and
  batch size, is checked without a collective of its own on quantized CPU calls: the reference
  transport carries it in-band (collective/inband.py), so ranks whose numels differ get the same
  ValueError on every rank after the first collective of the call, before anything is
  returned; a call whose rows are wider than any before pays one 3-integer agreement. CUDA
  calls and 16-bit calls check each new (fixed part, numel) once (on CUDA reading an in-band
  header would be a host sync per call; the 16-bit calls are torch's own collectives, bit for
  bit), remembering at most MAX_CHECKED of them. ECHO_DEBUG_CHECKS=1 checks the whole
  signature on every call (the default cannot tell when a rank repeats a remembered signature
  while a peer makes a new one, or when two ranks' numels fall in different width classes,
  unless both rows are wider than any sent before: gloo then aborts or times out).
* Zero-size inputs return zero-size outputs of their shape, and take part in the checks (a
  quantized CPU call runs its collectives with empty packets, so its length is compared too).
* A group of one returns its input exactly (a copy, or x itself with inplace=True).
* One communicator serves one thread: a second thread entering a collective while another is
  inside raises RuntimeError, and the communicator refuses every later call (the two calls'
  packets may have met their peers' in either order); build one communicator per thread.
* Inputs that require grad (with grad mode on) are refused: the collectives are no autograd
  ops; the TP layers (tp/sites.py) give them their backward.
* Calls outside any pass keep one state stream per tensor size; past MAX_STREAMS sizes the
  oldest stream is dropped (its compensation restarts from zero, as at a new pass).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import OrderedDict

import torch
import torch.distributed as dist

from . import envs
from .collective.dispatch import Dispatcher, build_dispatcher
from .collective.inband import CallLengthMismatch
from .collective.reference import DistTransport, group_wait_s
from .collective.simulated import SimTransport
from .compensator import PassState
from .config import DIRECTIONS, DTYPES, KINDS, EchoConfig, check_bits
from .telemetry import Telemetry

log = logging.getLogger(__name__)

MAX_STREAMS = 16
"""Compensator state streams (distinct tensor sizes) one direction keeps; the oldest beyond."""
MAX_CHECKED = 4096
"""Exact call signatures (CUDA and 16-bit calls) one communicator remembers; the least recently
used beyond (it is checked again when it comes back: every rank forgets the same one)."""


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
        """The all-reduce's compensator state streams and site counters, per direction."""
        self.half_passes = {k: {d: PassState() for d in DIRECTIONS} for k in KINDS[1:]}
        """The same for the reduce-scatter and all-gather: [kind][direction]."""
        self.telemetry = Telemetry() if telemetry else None
        self._configs: dict[int, EchoConfig] = {}
        self._debug_checks = envs.debug_checks()
        self._lengths = dispatcher.lengths         # quantized CPU calls: the numel in-band
        self._agreed: set[tuple] = set()           # fixed parts every rank agreed on
        self._checked: OrderedDict[tuple, None] = OrderedDict()   # exact ones (CUDA, 16-bit)
        self._check_transport = None
        self._entry = threading.Lock()
        self._broken: str | None = None
        self._open_scopes: set[str] = set()

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None, config: EchoConfig | None = None,
                   *, backend: str = "auto", telemetry: bool = False,
                   check_config: bool = True) -> "EchoCommunicator":
        """A communicator over a torch.distributed group (None = the default group). Logs one
        warning when the group waits longer on a peer than ECHO_COLLECTIVE_TIMEOUT_S (torch's
        default is 30 minutes: build it with timeout=echo_tp.launch.group_timeout())."""
        config = config if config is not None else EchoConfig()
        wait = group_wait_s(group)
        if wait is not None and wait > envs.collective_timeout_s():
            _warn_long_wait(id(group if group is not None else dist.group.WORLD), wait,
                            envs.collective_timeout_s())
        if check_config:
            check_same_config(config, group)
        return cls(build_dispatcher(group, backend), config, telemetry=telemetry, group=group)

    # ----- passes -----
    def new_pass(self, direction: str = "forward") -> None:
        """Start a pass: zero the compensator state of `direction` and restart site numbering."""
        _check_direction(direction)
        self.passes[direction].reset()
        for kind in self.half_passes.values():
            kind[direction].reset()
        if self.telemetry is not None:
            self.telemetry.new_pass(direction)

    @contextlib.contextmanager
    def pass_scope(self, direction: str = "forward"):
        """`with comm.pass_scope('forward'):` runs one pass with fresh compensator state.
        Scopes of one direction do not nest (the inner one would reset the outer pass)."""
        _check_direction(direction)
        if direction in self._open_scopes:
            raise RuntimeError(f"a {direction!r} pass_scope is already open on this "
                               "communicator; a nested one would reset the outer pass's "
                               "compensator state. Close the outer scope first, or use a second "
                               "communicator for an independent pass")
        self.new_pass(direction)
        self._open_scopes.add(direction)
        try:
            yield self
        finally:
            self._open_scopes.discard(direction)

    def state(self, direction: str = "forward", numel: int | None = None,
              kind: str = "all_reduce"):
        """The compensator state (CompState) of a direction's stream of `numel`-sized calls of
        `kind` (numel: the input's per-rank size)."""
        streams = self._pass(kind, direction).streams
        if numel is None:
            if len(streams) != 1:
                raise ValueError(f"{len(streams)} state streams exist; name numel")
            return next(iter(streams.values()))
        return streams.get(numel)

    def _pass(self, kind: str, direction: str) -> PassState:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return self.passes[direction] if kind == "all_reduce" else \
            self.half_passes[kind][direction]

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
                   bits: int | None = None, inplace: bool = False) -> torch.Tensor:
        """Sum of x over the group (x's shape and dtype), with Echo compensation.

        `bits` overrides the config's width for this site (per-site policies). `inplace=True`
        lets a plain (16-bit) all-reduce reuse x's storage (saves a copy; the caller must not
        need x afterwards); quantized calls always return a new tensor."""
        return self._guarded("all_reduce",
                             lambda: self._all_reduce(x, direction, bits, inplace)[0])

    def reduce_scatter(self, x: torch.Tensor, *, dim: int = 0, direction: str = "forward",
                       bits: int | None = None, compensate: bool = True) -> torch.Tensor:
        """This rank's chunk of the sum over the group, with Echo compensation: x [..., P*k
        at dim, ...] -> [..., k, ...] in x's dtype, chunk j along dim (x.chunk(P, dim)[j]) summed
        on rank j, as torch's reduce_scatter_tensor (dim 0) does. Each rank's contribution to
        another's chunk is quantized once, its own never (collective/sharded.py). Simulated:
        x [P, ...] (rank i's tensor at index i; dim counts in rank i's tensor) -> [P, ...].
        compensate=False: this call neither applies nor updates the error feedback (for an
        output that is not summed downstream, where a fed-back error is added, not cancelled)."""
        return self._guarded("reduce_scatter", lambda: self._half(
            "reduce_scatter", x, dim, direction, bits, compensate))

    def all_gather(self, x: torch.Tensor, *, dim: int = 0, direction: str = "forward",
                   bits: int | None = None, compensate: bool = True) -> torch.Tensor:
        """Every rank's x concatenated along dim in rank order (as torch's all_gather_into_
        tensor at dim 0), with Echo compensation: x [..., k at dim, ...] -> [..., P*k, ...] in
        x's dtype. Each shard is quantized once, by its rank; every rank (the owner too) decodes
        the same codes, so the output is bit-identical on every rank (collective/sharded.py).
        Simulated: x [P, ...] -> [P, ...] (identical rows). compensate: as reduce_scatter's."""
        return self._guarded("all_gather", lambda: self._half(
            "all_gather", x, dim, direction, bits, compensate))

    def _guarded(self, name: str, call):
        """call() as the one thread inside this communicator (see the module docstring)."""
        if not self._entry.acquire(blocking=False):
            self._broken = (f"{name} was entered from two threads at once on one "
                            "communicator; the calls' results are undefined (their packets may "
                            "have met the peers' in either order), so this communicator refuses "
                            "every call now. Use one communicator per thread, or serialize the "
                            "calls")
            raise RuntimeError(self._broken)
        try:
            self._refuse_if_broken()
            out = call()
            self._refuse_if_broken()
            return out
        finally:
            self._entry.release()

    def all_reduce_add_rmsnorm(self, partial: torch.Tensor, residual: torch.Tensor,
                               weight: torch.Tensor, eps: float, *, direction: str = "forward",
                               bits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A block boundary in one call: residual_out = residual + all_reduce(partial) and
        normed = RMSNorm(residual_out) * weight (echo_tp.norm: the models' RMSNorm, the sum of
        squares in a fixed order) -> (normed, residual_out). partial, residual [..., H]
        (simulated: [P, ..., H], residual [..., H] or [P, ..., H]); weight [H]. Of two dtypes
        (autocast: a bf16 partial, an fp32 residual) both are taken in the promoted one, as
        `residual + y` would, and residual_out has it.

        Where the call's backend adds the residual where y is decoded (p2p: the reduce's own
        segment and the tail write residual + y instead of y), the all-reduce returns
        residual_out and one norm-only pass follows (norm.rmsnorm); elsewhere the all-reduce
        returns y and the add and the norm run as one pass after it (norm.add_rmsnorm; one
        kernel on CUDA). Both give add_rmsnorm_reference(all_reduce(partial), residual, ...)
        bit for bit, with the same compensator state.

        Simulated, with one residual [..., H] for every virtual rank (and a backend that does
        not add it): the ranks' y rows are identical, so the add and the norm run once, on
        row 0 (each row's bits), and both outputs are that row expanded over the ranks."""
        from .norm import add_rmsnorm, check_add_rmsnorm, rmsnorm
        self._check_input(partial, "all_reduce")
        if self.simulated and residual.shape == partial.shape[1:] and (
                residual.dtype != partial.dtype or not self.dispatcher.adds_residual(
                    self._flatten(partial), self.config_for(bits))):
            if residual.dtype == partial.dtype:                  # the calls of the paths below
                check_add_rmsnorm(partial[0], residual, weight)       # refused before the call
                y = self._guarded("all_reduce", lambda: self._all_reduce(
                    partial, direction, bits, False))[0][0]
            else:
                y = self.all_reduce(partial, direction=direction, bits=bits)[0]
            dtype = torch.promote_types(y.dtype, residual.dtype)
            normed, rout = add_rmsnorm(y.to(dtype), residual.to(dtype).contiguous(), weight, eps)
            return normed.expand(partial.shape[0], *normed.shape), \
                rout.expand(partial.shape[0], *rout.shape)
        if residual.shape != partial.shape:
            residual = residual.expand(partial.shape)
        if isinstance(residual, torch.Tensor) and residual.dtype != partial.dtype:
            # autocast: a bf16 block output onto an fp32 residual stream. As the plain model's
            # `residual + y` does, both in the promoted dtype (y widened exactly), then the norm
            dtype = torch.promote_types(partial.dtype, residual.dtype)
            y = self.all_reduce(partial, direction=direction, bits=bits)
            return add_rmsnorm(y.to(dtype), residual.to(dtype).contiguous(), weight, eps)
        check_add_rmsnorm(partial, residual, weight)
        out, added = self._guarded("all_reduce", lambda: self._all_reduce(
            partial, direction, bits, False, residual=residual, norm=(weight, eps)))
        if added == "normed":                  # the whole boundary in the backend's kernel
            return out
        if added:
            return rmsnorm(out, weight, eps), out
        return add_rmsnorm(out, residual.contiguous(), weight, eps)

    def _refuse_if_broken(self) -> None:
        if self._broken is not None:
            raise RuntimeError(self._broken)

    def _all_reduce(self, x, direction, bits, inplace, residual=None, norm=None):
        """-> (y, added): added=True when residual was given and the backend returned
        residual + y instead of y; with norm=(weight, eps) too, where the call's backend runs
        the whole boundary (Dispatcher.run_boundary): ((normed, residual_out), "normed")."""
        _check_direction(direction)
        self._check_input(x, "all_reduce")
        cfg = self.config_for(bits)
        ps = self.passes[direction]
        site = ps.sites
        flat = self._flatten(x)
        inband = not self.simulated and self._check_call(flat, cfg, direction, "all_reduce")
        ps.sites += 1
        if self.world_size == 1:       # the sum over a group of one is the input, exactly
            return (x if inplace else x.clone()), False
        if flat.shape[-1] == 0 and not inband:
            return x.clone(), False
        state = self._state_of(ps, flat, cfg)
        record = self.telemetry is not None and cfg.quantized
        inplace = inplace and x.is_contiguous() and (flat is x or flat.data_ptr() == x.data_ptr())
        if norm is not None and residual is not None and not record and not self.simulated:
            done = self.dispatcher.run_boundary(flat, cfg, residual, norm[0], norm[1])
            if done is not None:
                return tuple(t.reshape(x.shape) for t in done), "normed"
        added = residual is not None and not record and self.dispatcher.adds_residual(flat, cfg)
        with self._in_band(inband, flat, cfg, direction, "all_reduce"):
            y, rec = self.dispatcher.run(flat, cfg, state=state,
                                         backward=direction == "backward", record=record,
                                         inplace=inplace,
                                         residual=residual.reshape(flat.shape).contiguous()
                                         if added else None)
        if self.telemetry is not None:
            self.telemetry.record(direction=direction, site=site, bits=cfg.bits, x=flat, y=y,
                                  rec=rec, simulated=self.simulated)
        return (y if flat is x else y.reshape(x.shape)), added

    def _half(self, kind, x, dim, direction, bits, compensate):
        """A reduce-scatter or all-gather: the checks of all_reduce, dim moved to the front."""
        _check_direction(direction)
        self._check_input(x, kind)
        cfg = self.config_for(bits, kind)
        ps = self.half_passes[kind][direction]
        flat, restore = self._half_view(x, dim, kind)
        inband = not self.simulated and self._check_call(flat, cfg, direction, kind)
        ps.sites += 1
        if self.world_size == 1:       # a group of one: its chunk / its gather is the input
            return x.clone()
        if flat.shape[-1] == 0 and not inband:
            return restore(flat.clone())
        state = self._state_of(ps, flat, cfg) if compensate else None
        with self._in_band(inband, flat, cfg, direction, kind):
            y = self.dispatcher.run_half(kind, flat, cfg, state=state,
                                         backward=direction == "backward")
        return restore(y)

    def _half_view(self, x: torch.Tensor, dim: int, kind: str):
        """x -> (flat [*B, n] with `dim` moved to the front of each rank's tensor and made
        contiguous, restore: the flat output [*B, n'] -> its shape, dim put back)."""
        b = 1 if self.simulated else 0
        if self.simulated:
            self._flatten(x)                               # the leading-dim check
        shape = tuple(x.shape[b:])
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ValueError(f"{kind}(dim=...) takes an int, got {dim!r}")
        if not shape:
            raise ValueError(f"{kind} needs a tensor of at least one dim per rank, got shape "
                             f"{tuple(x.shape)}")
        if not -len(shape) <= dim < len(shape):
            raise ValueError(f"{kind}: dim {dim} is out of range for a rank's tensor of shape "
                             f"{shape}")
        d = dim % len(shape)
        P = self.world_size
        if kind == "reduce_scatter" and shape[d] % P:
            raise ValueError(f"reduce_scatter splits dim {dim} of a rank's tensor {shape} into "
                             f"{P} equal chunks, one per rank: its size {shape[d]} must be "
                             f"divisible by the group size {P}")
        xm = (x.movedim(b + d, b) if d else x).contiguous()
        flat = xm.reshape(*x.shape[:b], -1)
        size = shape[d] // P if kind == "reduce_scatter" else shape[d] * P
        out_shape = (*x.shape[:b], size, *xm.shape[b + 1:])

        def restore(y: torch.Tensor) -> torch.Tensor:
            y = y.reshape(out_shape)
            return y.movedim(b, b + d).contiguous() if d else y
        return flat, restore

    def _state_of(self, ps: PassState, flat: torch.Tensor, cfg: EchoConfig):
        """The compensator state stream of flat's size in ps (None when uncompensated)."""
        if not cfg.compensated:
            return None
        sdtype = getattr(torch, cfg.state_dtype)
        state = ps.get(flat.shape[-1], tuple(flat.shape[:-1]), flat.device, sdtype,
                       compact=cfg.beta1 == cfg.beta2)   # one tensor when m1 == m2
        _bound_streams(ps, flat.shape[-1])
        return state

    def _check_call(self, flat: torch.Tensor, cfg: EchoConfig, direction: str,
                    kind: str) -> bool:
        """Every rank makes this call with the same signature (module docstring): a ValueError
        on every rank otherwise. Returns whether the call's numel is checked in-band (a
        quantized CPU call with a transport that carries it: the rest of its signature is
        checked here once); otherwise the whole signature is checked here once, or on every
        call under ECHO_DEBUG_CHECKS=1."""
        sig = (KINDS.index(kind), flat.shape[-1], DTYPES.index(flat.dtype), cfg.bits,
               DIRECTIONS.index(direction), int(flat.is_cuda))
        inband = (self._lengths is not None and cfg.quantized and not flat.is_cuda
                  and not self._debug_checks)
        if inband:
            key = sig[:1] + sig[2:]                       # without the numel
            if key in self._agreed:
                return True
        elif sig in self._checked:
            self._checked.move_to_end(sig)
            return False
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"echo-tp: the first call of signature {_describe(sig)} "
                "is inside CUDA graph capture; its once-per-signature check across ranks needs "
                "a collective and a host read. Make one eager call of each signature before "
                "capturing (the usual warm-up).")
        if self._check_transport is None:
            self._check_transport = DistTransport(self.group)
        check_same_call(sig, self._check_transport, flat.device)
        if inband:
            self._agreed.add(key)
        elif not self._debug_checks:
            self._checked[sig] = None
            if len(self._checked) > MAX_CHECKED:
                self._checked.popitem(last=False)
        return inband

    @contextlib.contextmanager
    def _in_band(self, inband: bool, flat: torch.Tensor, cfg: EchoConfig, direction: str,
                 kind: str):
        """The call's numel handed to the transport (when inband), and a length mismatch the
        transport found turned into the ValueError naming every rank's call."""
        if not inband:
            yield
            return
        self._lengths.numel = flat.shape[-1]
        try:
            yield
        except CallLengthMismatch as e:
            sigs = [(KINDS.index(kind), n, DTYPES.index(flat.dtype), cfg.bits,
                     DIRECTIONS.index(direction), 0) for n in e.numels]
            raise ValueError(_mismatch(sigs, "the call returned nothing on any rank")) from None
        finally:
            self._lengths.numel = None

    def _flatten(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.dim() == 1 else x.reshape(-1)

    def _check_input(self, x: torch.Tensor, kind: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{kind} expects a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in DTYPES:
            raise ValueError(f"{kind} supports {DTYPES}, got {x.dtype}")
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{kind} got a tensor that requires_grad with grad mode on, "
                               "but it is no autograd op (its result would be detached). Call "
                               "it under torch.no_grad() or on x.detach(), or use the TP layers "
                               "of echo_tp.tp, whose sites give the collectives their backward")

    def telemetry_summary(self, reduce: bool = True) -> list[dict]:
        if self.telemetry is None:
            raise RuntimeError("telemetry is off: build the communicator with telemetry=True")
        return self.telemetry.summary(self.group, reduce=reduce and not self.simulated)

    def close(self) -> None:
        self.dispatcher.close()
        for ps in self.passes.values():
            ps.reset()
        for kind in self.half_passes.values():
            for ps in kind.values():
                ps.reset()


class SimulatedCommunicator(EchoCommunicator):
    """P virtual ranks in one process: all_reduce takes [P, ...] (rank i's partial at index i)
    and returns [P, ...] (identical rows), bit-identical to the P-process run; reduce_scatter
    and all_gather likewise ([P, ...] in, rank i's output at index i out). On a GPU the
    quantized all-reduces run the fused p2p kernels of every virtual rank (fused=False or
    ECHO_BACKEND=reference: the unfused reference; the same bits either way)."""

    simulated = True

    def __init__(self, world_size: int, config: EchoConfig | None = None, *,
                 telemetry: bool = False, fused: bool = True):
        from .collective.dispatch import TransportBackend
        from .collective.simulated import FusedSimBackend
        ref = TransportBackend(SimTransport(world_size))
        if fused and torch.cuda.is_available() and envs.backend() != "reference":
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


def _bound_streams(ps, keep: int) -> None:
    """At most MAX_STREAMS state streams per direction: drop the oldest (not `keep`)."""
    while len(ps.streams) > MAX_STREAMS:
        oldest = next(n for n in ps.streams if n != keep)
        del ps.streams[oldest]
        log.warning("echo-tp: more than %d tensor sizes in one pass; dropped the compensator "
                    "state of size %d (start passes with new_pass/pass_scope)", MAX_STREAMS,
                    oldest)


def _describe(sig) -> str:
    kind, n, dt, bits, d, cuda = (int(v) for v in sig)
    name = KINDS[kind] if 0 <= kind < len(KINDS) else f"collective#{kind}"
    dtype = DTYPES[dt] if 0 <= dt < len(DTYPES) else f"dtype#{dt}"
    direction = DIRECTIONS[d] if 0 <= d < len(DIRECTIONS) else f"direction#{d}"
    return (f"{name}(numel={n}, dtype={dtype}, bits={bits}, direction={direction!r}"
            + (", on CUDA)" if cuda else ")"))


def _mismatch(sigs: list[tuple], what: str) -> str:
    bad = [r for r, g in enumerate(sigs) if g != sigs[0]]
    return ("collective calls differ across ranks: rank 0 calls " + _describe(sigs[0]) + ", "
            + ", ".join(f"rank {r} calls {_describe(sigs[r])}" for r in bad)
            + ". Every rank must make the same calls in the same order (same collective, numel, "
            f"dtype, bits and direction); {what}")


def check_same_call(sig: tuple, transport, device) -> None:
    """One small all-gather (6 integers a rank): every rank makes the same call (kind, numel,
    dtype, bits, direction, device); ValueError on every rank, naming each rank's call,
    otherwise."""
    got = transport.all_gather_ints(list(sig), device=device, stage="call-signature check")
    if any(g != got[0] for g in got):
        raise ValueError(_mismatch(got, "nothing was sent"))


@functools.lru_cache(maxsize=None)
def _warn_long_wait(group_id: int, wait: float, limit: float) -> None:
    """One warning per group (and timeout) per process."""
    log.warning("echo-tp: this process group waits %g s on a peer, longer than "
                "ECHO_COLLECTIVE_TIMEOUT_S=%g s: a rank that dies leaves the others waiting "
                "that long. Build it with timeout=echo_tp.launch.group_timeout() "
                "(torch's default is 30 minutes)", wait, limit)

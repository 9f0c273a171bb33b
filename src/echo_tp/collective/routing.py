"""Which backend and which kernel run one call, and why: one pure function.

    route(call, mode, available, tables) -> Route     the all-reduce, reduce-scatter, all-gather

`call` says what matters of the call (its kind, bytes per rank, bits, compensator state bytes,
P, whether the kernels can take the tensor at all: kernels/fits.py, CUDA graph capture),
`available` which fast
backends this group has (or why not), `tables` the measurements (collective/tuning.py). Under
mode 'auto' on an intra-node GPU group, in this order:

    oneshot    messages up to the one-shot cap (16-bit, exact; any bits)
    p2p        quantized calls from the measured crossover (never where NCCL measured faster);
               inside graph capture uncompensated calls at every size (no launch cost there)
    plain      every other GPU call: NCCL's all-reduce in the input dtype (exact)
    reference  everything else (CPU tensors, groups without the fast path): the quantized
               algorithm over torch.distributed

Reduce-scatter and all-gather calls (Call.kind; sequence parallelism) follow the same rules
for the P*m values they move: under 'auto' p2p from the all-reduce's crossover where the stage
kernels take them (quantized GPU calls whose chunks are whole quantization groups:
kernels/fits.fits), staged; 'plain' (NCCL's reduce-scatter / all-gather in
the input dtype) below it and where the kernels cannot; under 'p2p' p2p wherever the kernels
take them; everything else to the reference (at bits=16 the transport's plain reduce-scatter /
all-gather, NCCL's on GPUs).
Mode 'p2p' sends every call the kernels can take to p2p (the rest to the reference); mode
'reference' sends all to the reference. A p2p route also fixes the kernel form ('fused': one
kernel; 'staged': entry, reduce, tail), the tile shape and the reduce/tail overlap.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import EchoConfig
from ..kernels.fits import HALVES, KINDS, config_unfit
from . import tuning

__all__ = ["Call", "Route", "route", "p2p_route", "tile_shape", "state_bytes", "BACKENDS", "MODES",
           "KINDS", "HALVES"]

BACKENDS = ("oneshot", "p2p", "plain", "reference")
MODES = ("auto", "p2p", "reference")


@dataclass(frozen=True)
class Call:
    """What routing reads of one call."""

    nbytes: int               # per rank
    numel: int
    bits: int                 # 4, 8 or 16
    state_bytes: int          # compensator bytes read + written per value (`state_bytes`)
    group_size: int
    world_size: int
    on_gpu: bool              # x is a CUDA tensor
    tensor_unfit: str | None  # why no fast kernel can take x (device, dtype, layout); None: fits
    config_unfit: str | None  # why the p2p kernels cannot run cfg (bits, state dtype)
    capturing: bool = False   # inside CUDA graph capture
    kind: str = "all_reduce"  # one of KINDS; the halves' x: [P*m] (reduce-scatter), [m]

    @classmethod
    def of(cls, numel: int, itemsize: int, cfg: EchoConfig, world_size: int, *,
           on_gpu: bool, tensor_unfit: str | None = None, capturing: bool = False,
           kind: str = "all_reduce") -> "Call":
        return cls(nbytes=numel * itemsize, numel=numel, bits=cfg.bits,
                   state_bytes=state_bytes(cfg), group_size=cfg.group_size,
                   world_size=world_size, on_gpu=on_gpu, tensor_unfit=tensor_unfit,
                   config_unfit=config_unfit(cfg), capturing=capturing, kind=kind)

    @property
    def compensated(self) -> bool:
        return self.state_bytes > 0


@dataclass(frozen=True)
class Route:
    backend: str                  # one of BACKENDS
    reason: str                   # why, with the table entry's record where one decided
    form: str | None = None       # p2p: 'fused' | 'staged'
    overlap: str = "off"          # staged: 'off' (reduce, then tail) | 'launch' (one kernel)
    tile: int = 0                 # p2p: values per tile (one flag, one release)
    step: int = 0                 # p2p: values a program holds at once
    num_warps: int = 0


def state_bytes(cfg: EchoConfig) -> int:
    """Compensator state bytes a call reads and writes per value: 0 when uncompensated, else
    2 (read + write) x (1 tensor if beta1 == beta2 else 2) x (2 bf16, 4 fp32, 8 fp64)."""
    if not cfg.compensated:
        return 0
    size = {"bfloat16": 2, "float32": 4, "float64": 8}[cfg.state_dtype]
    return 2 * size * (1 if cfg.beta1 == cfg.beta2 else 2)


def route(call: Call, mode: str = "auto", available: dict[str, str | None] | None = None,
          tables: tuning.Tables = tuning.DEFAULT) -> Route:
    """The backend and kernel plan of `call` (an all-reduce, or a half: `_route_half`).
    available: 'oneshot' / 'p2p' -> None when this group has it, else why not (missing: not
    built)."""
    if call.kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {call.kind!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if call.kind != "all_reduce":
        return _route_half(call, mode, available, tables)
    available = available or {}
    p2p_why = available.get("p2p", "not built")
    if mode == "reference":
        return Route("reference", "backend 'reference' was asked for")
    if p2p_why is not None:
        return Route("reference", f"no fast path: {p2p_why}")
    if not call.on_gpu:
        return Route("reference", "the tensor is not on this rank's GPU")
    unfit = call.tensor_unfit or call.config_unfit
    if mode == "p2p":
        if unfit is not None:
            return Route("reference", f"the p2p kernels cannot take it: {unfit}")
        return p2p_route(call, tables, "backend 'p2p' was asked for")
    if available.get("oneshot", "not built") is None and call.tensor_unfit is None:
        cap, src = tables.oneshot_cap(call.world_size)
        if call.nbytes <= cap:
            return Route("oneshot", f"<= the one-shot cap {_mib(cap)} ({src})")
    if unfit is not None:
        return Route("plain", f"the p2p kernels cannot take it: {unfit}")
    gate, src = tables.p2p_gate(call.world_size, call.state_bytes)
    if call.capturing and not call.compensated:
        return p2p_route(call, tables, "inside CUDA graph capture (no launch cost): p2p at "
                                       "every size uncompensated")
    if gate is None:
        return Route("plain", f"p2p never measured faster with {call.state_bytes} state "
                              f"bytes per value ({src})")
    if call.nbytes < gate:
        return Route("plain", f"below the p2p crossover {_mib(gate)} ({src})")
    return p2p_route(call, tables, f">= the p2p crossover {_mib(gate)} ({src})")


def _route_half(call: Call, mode: str, available: dict[str, str | None] | None,
                tables: tuning.Tables) -> Route:
    """The backend and kernel plan of a reduce-scatter or all-gather call (sequence
    parallelism). call: the Call of the input x (P*m values for the reduce-scatter, the own
    m-value shard for the all-gather), its tensor_unfit also saying why the kernels cannot
    take this half (kernels/fits.fits: a chunk that is not a whole number of quantization
    groups, ...). available, tables: as route's.

    Mode 'p2p': p2p (P2PBackend.reduce_scatter / all_gather) for every quantized GPU call the
    kernels take. Mode 'auto', as the all-reduce's route on a group with the p2p backend: p2p
    from the all-reduce's measured crossover for the P*m values a half moves (no crossover is
    measured for the halves themselves; a reduce-scatter + all-gather of a tensor is its
    all-reduce), inside graph capture uncompensated at every size; below it, and for calls
    the kernels cannot take, 'plain': NCCL's reduce-scatter / all-gather in the input dtype
    (exact, no error injected, the state kept for the next quantized call), never slower
    than 16 bits. A p2p route is staged (entry + reduce, encode + tail), overlap 'off', with
    the tile shape of the all-reduce of P*m values (whose segments are the m-value chunks).
    Everything else (mode 'reference', no fast path, CPU tensors, bits=16; in mode 'p2p' the
    calls the kernels cannot take) the reference algorithm (collective/sharded.py) over the
    group's transport, with the reason; at bits=16 that is the transport's plain
    reduce-scatter / all-gather (NCCL's on GPUs)."""
    kind = call.kind
    name = kind.replace("_", "-")
    p2p_why = (available or {}).get("p2p", "not built")
    if mode == "reference":
        return Route("reference", f"{name}: backend 'reference' was asked for")
    if p2p_why is not None:
        return Route("reference", f"{name}: no fast path: {p2p_why}")
    if not call.on_gpu:
        return Route("reference", f"{name}: the tensor is not on this rank's GPU")
    if call.bits == 16:
        return Route("reference", f"{name}: bits=16 is the transport's plain {name}")
    unfit = call.tensor_unfit or call.config_unfit
    if unfit is not None:
        if mode == "auto":
            return Route("plain", f"{name}: the p2p kernels cannot take it: {unfit}")
        return Route("reference", f"{name}: the p2p kernels cannot take it: {unfit}")
    numel = call.numel * (call.world_size if kind == "all_gather" else 1)      # P*m
    layout = replace(call, numel=numel, nbytes=call.nbytes // max(1, call.numel) * numel)
    if mode == "p2p":
        why = "backend 'p2p' was asked for"
    elif call.capturing and not call.compensated:
        why = "inside CUDA graph capture (no launch cost): p2p at every size uncompensated"
    else:
        gate, src = tables.p2p_gate(call.world_size, call.state_bytes)
        if gate is None:
            return Route("plain", f"{name}: p2p never measured faster with {call.state_bytes} "
                                  f"state bytes per value ({src})")
        if layout.nbytes < gate:
            return Route("plain", f"{name}: below the all-reduce's p2p crossover "
                                  f"{_mib(gate)} for its P*m values ({src})")
        why = f">= the all-reduce's p2p crossover {_mib(gate)} for its P*m values ({src})"
    return p2p_route(layout, tables, f"{name}: {why}", form="staged", overlap="off")


def p2p_route(call: Call, tables: tuning.Tables, reason: str, *, form: str | None = None,
              overlap: str | None = None) -> Route:
    """The kernel plan of a p2p call: form by size, tile shape by segment length, overlap as
    measured. form ('fused' / 'staged') and overlap ('off' / 'launch'): forced instead (tests,
    benchmarks); a fused call has no overlap."""
    if form is None:
        fused_max, _ = tables.fused_max_bytes.lookup(call.world_size)
        form = "fused" if call.nbytes <= (fused_max or 0) else "staged"
    if form not in ("fused", "staged"):
        raise ValueError(f"form must be 'fused' or 'staged', got {form!r}")
    fused = form == "fused"
    seg = -(-call.numel // (call.world_size * call.group_size)) * call.group_size
    tile, step = tile_shape(seg, call.compensated, fused, tables.shape)
    tile = max(tile, call.group_size)
    step = max(min(step, tile), call.group_size)
    if overlap is None:
        overlap = "off"
        if not call.compensated:
            cap, _ = tables.overlap_launch_max_bytes.lookup(call.bits)
            if cap is None or call.nbytes <= cap:
                overlap = "launch"
    if overlap not in ("off", "launch"):
        raise ValueError(f"overlap must be 'off' or 'launch', got {overlap!r}")
    return Route("p2p", reason, form=form, overlap="off" if fused else overlap,
                 tile=tile, step=step, num_warps=tables.shape.num_warps[fused].value)


def tile_shape(seg: int, compensated: bool, fused: bool,
               shape: tuning.KernelShape | None = None) -> tuple[int, int]:
    """(values per tile, values per step) for a segment of `seg` values: the largest power of
    two with at least tiles_per_segment tiles, between the step and tile_max."""
    shape = shape or tuning.DEFAULT.shape
    step = shape.step_elems[compensated].value
    want = max(1, seg // shape.tiles_per_segment[fused].value)
    tile = 1 << (want.bit_length() - 1)                    # power of two <= want
    return min(max(tile, step), shape.tile_max.value), step


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"

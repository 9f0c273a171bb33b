"""The unfused algorithm (collective/qar.py) in bounded memory: a large call runs as column chunks
of the P segments, each chunk one smaller call of the same algorithm.

    x [*B, N] -> P segments of seg (SPEC §2) -> columns [c0, c1) of every segment = one chunk
    chunk [*B, P*w] (w = c1 - c0, a multiple of g; padding zeros included) -> qar.py -> y, state

Every operation of the algorithm is per element or per quantization group, groups never straddle
a chunk (c0, c1 and seg are multiples of g), owner sums stay in rank order and the backward
scale is the group-wide max over the whole call (one scalar, taken before the chunks), so the
chunked call returns bit for bit what one call over [*B, N] returns, and leaves the same state
(tests/test_defined_answers.py). A chunked call makes two collectives per chunk (one call: two).
Peak memory: the output plus ~14 fp32 temporaries of a chunk's size instead of the call's size:
under 3x the input's bytes (docs/results/2026-12-01-defined-answers.md has the figures).
"""
from __future__ import annotations

import torch

from ..compensator import CompState, apply_correction, correction
from ..config import CompensatorConstants, EchoConfig
from .qar import compensated_all_reduce, grad_scale, segment_len

MAX_CHUNKS = 64
"""A large call runs as at most this many chunks: their fp32 temporaries (~14 arrays of a
chunk's size) then come to under one fp32 copy of the call (0.9 bytes per element)."""
CHUNK_ELEMS = 1 << 18
"""The smallest chunk (values of one virtual rank, all P segments): a call up to this size
runs as one chunk with no extra collectives (its temporaries: ~14 MB at most); a call between
this and MAX_CHUNKS times it runs as chunks of this size."""


def chunk_width(n: int, world_size: int, group_size: int) -> int | None:
    """Columns per chunk (a multiple of g), or None when the whole call is one chunk."""
    seg = segment_len(n, world_size, group_size)
    g = group_size
    by_count = -(-seg // (MAX_CHUNKS * g)) * g                 # at most MAX_CHUNKS chunks
    floor = max(g, CHUNK_ELEMS // world_size // g * g)         # and none below CHUNK_ELEMS
    cols = max(by_count, floor)
    return cols if cols < seg else None


def chunked_all_reduce(x: torch.Tensor, cfg: EchoConfig, t, *, state: CompState | None,
                       backward: bool, record: bool):
    """compensated_all_reduce(x, ...) computed chunk by chunk (same y, same state, bit for bit).
    Telemetry calls (record=True) run as one call: they keep whole-call tensors anyway."""
    P, n = t.world_size, x.shape[-1]
    cols = chunk_width(n, P, cfg.group_size) if cfg.quantized and not record else None
    if cols is None:
        return compensated_all_reduce(x, cfg, t, state=state, backward=backward, record=record)
    seg = segment_len(n, P, cfg.group_size)
    spans = [(c0, min(c0 + cols, seg)) for c0 in range(0, seg, cols)]
    scale = None
    if backward and cfg.grad_scaling:
        scale = _call_scale(x, cfg, t, state, seg, spans)
    y = torch.empty_like(x)
    for c0, c1 in spans:
        xc = _gather(x, seg, c0, c1, P)
        sc = None if state is None else _gather_state(state, seg, c0, c1, P)
        yc, _ = compensated_all_reduce(xc, cfg, t, state=sc, backward=backward, scale=scale)
        _scatter(y, yc, seg, c0, c1, P)
        if sc is not None:
            _scatter(state.m1, sc.m1, seg, c0, c1, P)
            if not state.compact:
                _scatter(state.m2, sc.m2, seg, c0, c1, P)
    return y, None


def _call_scale(x, cfg, t, state, seg, spans) -> torch.Tensor:
    """The backward power of two of the whole call: grad_scale of the per-chunk max |x'| (a
    max of maxima is the max, and the padding zeros never raise it)."""
    k = CompensatorConstants.from_config(cfg)
    P = t.world_size
    peaks = []
    for c0, c1 in spans:
        xp = _gather(x, seg, c0, c1, P).to(torch.float32)
        if state is not None:
            xp = apply_correction(xp, correction(_gather_state(state, seg, c0, c1, P), k)
                                  .to(torch.float32))
        peaks.append(xp.abs().amax(dim=-1))
    return grad_scale(torch.stack(peaks, dim=-1), t)


def _pieces(n: int, seg: int, c0: int, c1: int, P: int):
    """(owner j, first, stop) of the real elements of columns [c0, c1) of each segment."""
    for j in range(P):
        a, b = j * seg + c0, min(j * seg + c1, n)
        if b > a:
            yield j, a, b


def _gather(x: torch.Tensor, seg: int, c0: int, c1: int, P: int) -> torch.Tensor:
    """x [*B, N] -> the chunk [*B, P*w]: columns [c0, c1) of every segment, zeros past N."""
    w = c1 - c0
    out = x.new_zeros(*x.shape[:-1], P, w)
    for j, a, b in _pieces(x.shape[-1], seg, c0, c1, P):
        out[..., j, :b - a] = x[..., a:b]
    return out.reshape(*x.shape[:-1], P * w)


def _gather_state(state: CompState, seg: int, c0: int, c1: int, P: int) -> CompState:
    m1 = _gather(state.m1, seg, c0, c1, P)
    return CompState(m1, m1 if state.compact else _gather(state.m2, seg, c0, c1, P))


def _scatter(dst: torch.Tensor, chunk: torch.Tensor, seg: int, c0: int, c1: int, P: int) -> None:
    """The inverse of _gather for the real elements: dst [*B, N] <- chunk [*B, P*w]."""
    w = c1 - c0
    chunk = chunk.reshape(*chunk.shape[:-1], P, w)
    for j, a, b in _pieces(dst.shape[-1], seg, c0, c1, P):
        dst[..., a:b] = chunk[..., j, :b - a]

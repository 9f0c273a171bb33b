"""The compensator state stream a call gets: one per tensor size within a pass and direction
(compensator.PassState), at most MAX_STREAMS of them (the oldest is dropped beyond)."""
from __future__ import annotations

import logging

import torch

from .compensator import PassState
from .config import EchoConfig

log = logging.getLogger(__name__)

MAX_STREAMS = 16
"""Compensator state streams (distinct tensor sizes) one direction keeps; the oldest beyond."""


def state_of(ps: PassState, flat: torch.Tensor, cfg: EchoConfig):
    """The compensator state stream of flat's size in ps (None when uncompensated). flat:
    [numel] or [P, numel] (simulated ranks)."""
    if not cfg.compensated:
        return None
    sdtype = getattr(torch, cfg.state_dtype)
    state = ps.get(flat.shape[-1], tuple(flat.shape[:-1]), flat.device, sdtype,
                   compact=cfg.beta1 == cfg.beta2)   # one tensor when m1 == m2
    bound_streams(ps, flat.shape[-1])
    return state


def bound_streams(ps: PassState, keep: int) -> None:
    """At most MAX_STREAMS state streams per direction: drop the oldest (not `keep`)."""
    while len(ps.streams) > MAX_STREAMS:
        oldest = next(n for n in ps.streams if n != keep)
        del ps.streams[oldest]
        log.warning("echo-tp: more than %d tensor sizes in one pass; dropped the compensator "
                    "state of size %d (start passes with new_pass/pass_scope)", MAX_STREAMS,
                    oldest)

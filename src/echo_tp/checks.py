"""The checks every collective call of a communicator makes on its arguments before anything
moves: the direction, the input's type and dtype, and no autograd through a collective."""
from __future__ import annotations

import torch

from .config import DIRECTIONS, DTYPES


def check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")


def check_input(x: torch.Tensor, kind: str) -> None:
    """TypeError / ValueError / RuntimeError that says how to fix a bad input of `kind`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{kind} expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise ValueError(f"{kind} supports {DTYPES}, got {x.dtype}")
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{kind} got a tensor that requires_grad with grad mode on, "
                           "but it is no autograd op (its result would be detached). Call "
                           "it under torch.no_grad() or on x.detach(), or use the TP layers "
                           "of echo_tp.tp, whose sites give the collectives their backward")

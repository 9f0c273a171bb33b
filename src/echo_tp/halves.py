"""The shapes of the two halves (reduce-scatter, all-gather): a rank's tensor and `dim` in, the
flat rows the collective runs on and the way back out.

    flat, restore = half_view(x, dim, kind, world_size, simulated)
    y = restore(collective(flat))

Real: x [..., k at dim, ...] -> flat [n] with `dim` moved to the front (contiguous); restore
puts `dim` back with its new size (k/P for the reduce-scatter, k*P for the all-gather).
Simulated: x [P, ...] (virtual rank i's tensor at index i; dim counts in rank i's tensor) ->
flat [P, n], the same per row. The checks raise ValueError saying what to change.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def half_view(x: torch.Tensor, dim: int, kind: str, world_size: int, simulated: bool
              ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """x -> (flat [*B, n] with `dim` moved to the front of each rank's tensor and made
    contiguous, restore: the flat output [*B, n'] -> its shape, dim put back)."""
    b = 1 if simulated else 0
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
    P = world_size
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

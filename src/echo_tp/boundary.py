"""A block boundary riding on an all-reduce: residual_out = residual + all_reduce(partial) and
normed = RMSNorm(residual_out) * weight (echo_tp.norm: the models' RMSNorm, the sum of squares
in a fixed order), EchoCommunicator.all_reduce_add_rmsnorm.

Where the call's backend adds the residual where y is decoded (p2p: the reduce's own segment
and the tail write residual + y instead of y), the all-reduce returns residual_out and one
norm-only pass follows (norm.rmsnorm); where the backend runs the whole boundary, it returns
both; elsewhere the all-reduce returns y and the add and the norm run as one pass after it
(norm.add_rmsnorm; one kernel on CUDA). Every form gives add_rmsnorm_reference(all_reduce(
partial), residual, ...) bit for bit, with the same compensator state.

Of two dtypes (autocast: a bf16 partial, an fp32 residual) both are taken in the promoted one,
as the plain model's `residual + y` would (y widened exactly), and residual_out has it.
Simulated ranks with one residual [..., H] for every rank (and a backend that does not add it):
the ranks' y rows are identical, so the add and the norm run once, on row 0 (each row's bits),
and both outputs are that row expanded over the ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .norm import add_rmsnorm, rmsnorm


@dataclass(frozen=True)
class Boundary:
    """A block boundary riding on an all-reduce of y: residual_out = residual + y, normed =
    RMSNorm(residual_out) * weight (residual: the call's shape and dtype)."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class Reduced:
    """An all-reduce's result: `out` is y ('y'), residual + y ('residual_out': the backend
    added it where y is decoded) or (normed, residual_out) ('normed': the backend ran the
    whole boundary)."""

    out: object
    form: str = "y"


def finish(r: Reduced, residual: torch.Tensor, weight: torch.Tensor, eps: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual_out) from what the all-reduce's backend already ran (r.form)."""
    if r.form == "normed":                 # the whole boundary in the backend's kernel
        return r.out
    if r.form == "residual_out":
        return rmsnorm(r.out, weight, eps), r.out
    return add_rmsnorm(r.out, residual.contiguous(), weight, eps)


def promoted(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The add and the norm after the all-reduce, both in the promoted dtype of y and residual
    (y widened exactly) -> (normed, residual_out)."""
    dtype = torch.promote_types(y.dtype, residual.dtype)
    return add_rmsnorm(y.to(dtype), residual.to(dtype).contiguous(), weight, eps)


def over_ranks(out: tuple[torch.Tensor, torch.Tensor], P: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's (normed, residual_out) [..., H] as every simulated rank's: [P, ..., H]."""
    return tuple(t.expand(P, *t.shape) for t in out)

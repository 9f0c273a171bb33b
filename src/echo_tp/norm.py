"""The residual add + RMSNorm that follows every block's all-reduce, with a fixed summation order.

    residual_out = residual + y                                  (in y's dtype, one rounding)
    normed       = weight * cast(v * 1 / sqrt(mean(v^2) + eps))   v = residual_out in fp32

as the models' RMSNorm computes it (fp32 inside, cast back, times the weight), except that the
sum of squares is taken in one fixed order, so the Triton kernel (kernels/norm_kernels.py) and
this reference agree bit for bit on every device: per row, LANES partial sums, acc[l] += v[c *
LANES + l]^2 for chunks c = 0, 1, ... in order, then the lanes halved pairwise (acc[i] + acc[i +
n/2]) down to one. Divisions and the square root are IEEE, correctly rounded (0-dim tensors;
the square root through fp64, as torch's fp32 CPU sqrt can be 1 ulp off; div_rn / sqrt_rn in
the kernel). `add_rmsnorm` runs the kernel on CUDA tensors it fits and this reference elsewhere.

`rmsnorm(r, weight, eps)` is the second half alone (normed of an r whose add is already done:
the p2p all-reduce adds the residual where it decodes y), so

    add_rmsnorm_reference(y, residual, w, eps) == (rmsnorm_reference(residual + y, w, eps),
                                                   residual + y)

by construction (the same function computes both), and the norm-only kernel equals
rmsnorm_reference bit for bit (tests/test_kernels.py).
"""
from __future__ import annotations

import torch

from .norm_reference import (LANES, MAX_HIDDEN, add_rmsnorm_reference, check_add_rmsnorm,
                             rmsnorm_reference, sum_of_squares)

__all__ = ["add_rmsnorm", "rmsnorm", "add_rmsnorm_reference", "rmsnorm_reference",
           "check_add_rmsnorm", "sum_of_squares", "LANES", "MAX_HIDDEN"]


def add_rmsnorm(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual_out) of `add_rmsnorm_reference`, in one kernel pass on CUDA."""
    check_add_rmsnorm(y, residual, weight)
    nk = _kernels(y)
    if nk is not None:
        return nk.add_rmsnorm(y, residual, weight, eps)
    return add_rmsnorm_reference(y, residual, weight, eps)


def rmsnorm(r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """normed of `rmsnorm_reference`, in one kernel pass on CUDA."""
    check_add_rmsnorm(r, r, weight)
    nk = _kernels(r)
    if nk is not None:
        return nk.rmsnorm(r, weight, eps)
    return rmsnorm_reference(r, weight, eps)


def _kernels(y: torch.Tensor):
    """kernels.norm_kernels where its kernel takes y (CUDA, rows up to MAX_HIDDEN), else None."""
    if y.is_cuda and y.shape[-1] <= MAX_HIDDEN and y.numel() > 0:
        try:
            from .kernels import norm_kernels     # optional: needs triton
        except ImportError:   # no triton: the reference
            return None
        return norm_kernels
    return None

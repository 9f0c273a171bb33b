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

LANES = 256
"""Partial sums per row (a power of two); the kernel's vector width."""
MAX_HIDDEN = 1 << 16
"""Largest row the kernel takes (larger rows use the reference)."""


def sum_of_squares(v: torch.Tensor) -> torch.Tensor:
    """v fp32 [..., H] -> [..., 1]: the sum of v^2 in the fixed order above."""
    h = v.shape[-1]
    if h == 0:                                    # an empty row: its sum is 0
        return v.new_zeros(*v.shape[:-1], 1)
    pad = (-h) % LANES
    sq = torch.nn.functional.pad(v * v, (0, pad)).reshape(*v.shape[:-1], (h + pad) // LANES,
                                                          LANES)
    acc = sq[..., 0, :]
    for c in range(1, sq.shape[-2]):
        acc = acc + sq[..., c, :]
    n = LANES
    while n > 1:
        n //= 2
        acc = acc[..., :n] + acc[..., n:2 * n]
    return acc


def rmsnorm_reference(r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """r [..., H], weight [H] -> normed, of the dtype of weight * r (torch's promotion)."""
    v = r.float()
    h = v.new_tensor(float(v.shape[-1]))
    ms = sum_of_squares(v) / h + v.new_tensor(eps)
    inv = v.new_tensor(1.0) / torch.sqrt(ms.double()).float()   # correctly rounded sqrt
    return weight * (v * inv).to(r.dtype)


def add_rmsnorm_reference(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y, residual [..., H] (one dtype), weight [H] -> (normed, residual_out); normed has the
    dtype of weight * residual_out (torch's promotion), residual_out y's dtype."""
    r = residual + y
    return rmsnorm_reference(r, weight, eps), r


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
            from .kernels import norm_kernels
        except ImportError:   # no triton: the reference
            return None
        return norm_kernels
    return None


def check_add_rmsnorm(y, residual, weight) -> None:
    """ValueError unless y, residual [..., H] share shape and dtype (fp32/fp16/bf16) and
    weight is [H]."""
    if residual.shape != y.shape or residual.dtype != y.dtype:
        raise ValueError(f"residual must match the reduced tensor: {tuple(residual.shape)} "
                         f"{residual.dtype} vs {tuple(y.shape)} {y.dtype}")
    if weight.dim() != 1 or weight.shape[0] != y.shape[-1]:
        raise ValueError(f"weight must be [{y.shape[-1]}], got {tuple(weight.shape)}")
    for name, t in (("y", y), ("residual", residual), ("weight", weight)):
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{name} must be fp32, fp16 or bf16, got {t.dtype}")

"""The pure-torch reference of the block boundary's add + RMSNorm, with its fixed summation
order (norm.py's docstring gives the formula and the order): what the Triton kernels
(kernels/norm_kernels.py, kernels/oneshot_kernels.py) are tested against bit for bit. Torch
only: the kernels import it, nothing here imports them.
"""
from __future__ import annotations

import torch

LANES = 256
"""Partial sums per row (a power of two); the kernel's vector width."""
MAX_HIDDEN = 1 << 16
"""Largest row the kernel takes (larger rows use the reference)."""


def sum_of_squares(v: torch.Tensor) -> torch.Tensor:
    """v fp32 [..., H] -> [..., 1]: the sum of v^2 in the fixed order above."""
    return row_sum(v * v)


def row_sum(v: torch.Tensor) -> torch.Tensor:
    """v fp32 [..., H] -> [..., 1]: the sum of each row in the fixed order above (the same bits
    whatever the leading dims: simulated ranks [P, ...] and a real rank's [...] agree)."""
    h = v.shape[-1]
    if h == 0:                                    # an empty row: its sum is 0
        return v.new_zeros(*v.shape[:-1], 1)
    pad = (-h) % LANES
    sq = torch.nn.functional.pad(v, (0, pad)).reshape(*v.shape[:-1], (h + pad) // LANES,
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

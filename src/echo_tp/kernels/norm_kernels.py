"""Residual add + RMSNorm in one pass per row (Triton); the reference is echo_tp/norm_reference.py.

    rmsnorm_kernel (grid rows), ADD: r = cast(y + residual) -> residual_out; else r = y (the
    add already done: the p2p all-reduce wrote residual + y); acc[l] += v^2 over chunks of
    LANES values (v = r in fp32), lanes halved pairwise to one sum; inv = 1 / sqrt(ss / H +
    eps) (IEEE); normed = cast_w(w * cast(v * inv)), a second pass over the row (L2-hot).

Unfused equivalent: `residual + y`, then the models' RMSNorm (fp32 inside), i.e. 1 read of y
and residual, 1 write of residual_out, 1 read of it, 1 write of normed, with the sum of squares
in norm.sum_of_squares' order (bit for bit: tests/test_kernels.py, tests/test_kernels_gpu.py).
`add_rmsnorm` (ADD) reads y and residual and writes residual_out and normed; `rmsnorm` reads r
and writes normed (norm.add_rmsnorm_reference / norm.rmsnorm_reference).
The row loops are while loops: triton 3.6's interpreter runs no other (CI runs it too).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..norm_reference import LANES
from .flags import gated
from .launcher import launch
from .quant_kernels import DTYPE_KIND, _cast_out, _load_f32


@triton.jit
def _halve(acc, N: tl.constexpr):
    """[N] -> [N/2]: out[i] = acc[i] + acc[i + N/2] (one addition per value: exact order)."""
    return tl.sum(tl.reshape(acc, [2, N // 2]), axis=0)


@triton.jit
def _as_f32(v, KIND: tl.constexpr):
    """A value of dtype KIND (0 fp32, 1 fp16, 2 bf16) as fp32, exactly."""
    if KIND == 2:
        out = (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        out = v.to(tl.float32)
    return out


@triton.jit
def _inv_rms(acc, H, eps, L: tl.constexpr):
    """Lane partial sums of squares [L] (L = 256) -> 1 / sqrt(sum / H + eps) [1]: the lanes
    halved pairwise down to one sum (norm.sum_of_squares' order), IEEE division and root."""
    acc = _halve(acc, L)
    acc = _halve(acc, L // 2)
    acc = _halve(acc, L // 4)
    acc = _halve(acc, L // 8)
    acc = _halve(acc, L // 16)
    acc = _halve(acc, L // 32)
    acc = _halve(acc, L // 64)
    acc = _halve(acc, L // 128)                             # [1] for L = 256
    ss = tl.math.div_rn(acc, tl.full([1], 1.0, tl.float32) * H) + eps
    return tl.math.div_rn(tl.full([1], 1.0, tl.float32), tl.math.sqrt_rn(ss))


@triton.jit
def _normalize_row(r_ptr, w_ptr, out_ptr, row, H, chunks, inv, ok, X_KIND: tl.constexpr,
                   W_KIND: tl.constexpr, O_KIND: tl.constexpr, L: tl.constexpr):
    """normed = cast_o(w * cast(v * inv)) over the row of r (v = r in fp32) in chunks of L,
    stored where ok (a scalar)."""
    lanes = tl.arange(0, L)
    c = 0
    while c < chunks:
        offs = c * L + lanes
        m = offs < H
        v = _load_f32(r_ptr + row + offs, m, X_KIND)
        xn = _as_f32(_cast_out(v * inv, X_KIND), X_KIND)
        w = _load_f32(w_ptr + offs, m, W_KIND)
        tl.store(out_ptr + row + offs, _cast_out(w * xn, O_KIND), mask=gated(m, ok))
        c += 1


@triton.jit
def rmsnorm_kernel(y_ptr, res_ptr, w_ptr, out_ptr, rout_ptr, H, chunks, eps,
                   X_KIND: tl.constexpr, W_KIND: tl.constexpr, O_KIND: tl.constexpr,
                   L: tl.constexpr, ADD: tl.constexpr):
    """grid (rows,): one row [H] of y (and residual, ADD) -> normed (and residual_out, ADD).
    Without ADD, res_ptr is unread and rout_ptr is y_ptr (r = y)."""
    row = tl.program_id(0).to(tl.int64) * H
    lanes = tl.arange(0, L)
    acc = tl.zeros([L], tl.float32)
    c = 0
    while c < chunks:                                       # pass 1: [add, store], sum of squares
        offs = c * L + lanes
        m = offs < H
        if ADD:
            s = _load_f32(y_ptr + row + offs, m, X_KIND) \
                + _load_f32(res_ptr + row + offs, m, X_KIND)
            r = _cast_out(s, X_KIND)
            tl.store(rout_ptr + row + offs, r, mask=m)
            v = _as_f32(r, X_KIND)
        else:
            v = _load_f32(y_ptr + row + offs, m, X_KIND)
        acc = acc + tl.where(m, v * v, 0.0)
        c += 1
    _normalize_row(rout_ptr, w_ptr, out_ptr, row, H, chunks, _inv_rms(acc, H, eps, L), True,
                   X_KIND, W_KIND, O_KIND, L)                # pass 2: normalize, scale


def add_rmsnorm(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y, residual [..., H], weight [H] -> (normed, residual_out)."""
    y, residual = y.contiguous(), residual.contiguous()
    rout = torch.empty_like(y)
    return _launch(y, residual, rout, weight, eps, True), rout


def rmsnorm(r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """r [..., H] (residual_out, the add done), weight [H] -> normed."""
    r = r.contiguous()
    return _launch(r, r, r, weight, eps, False)


def _launch(y, residual, rout, weight, eps: float, add: bool) -> torch.Tensor:
    """One rmsnorm_kernel launch over the rows of y [..., H] -> normed."""
    if LANES != 256:
        raise AssertionError("rmsnorm_kernel halves exactly 8 times (LANES = 256)")
    h = y.shape[-1]
    weight = weight.contiguous()
    out_dtype = torch.promote_types(weight.dtype, y.dtype)
    normed = torch.empty(y.shape, dtype=out_dtype, device=y.device)
    rows = y.numel() // h
    chunks = -(-h // LANES)
    launch(rmsnorm_kernel, (rows,), (y, residual, weight, normed, rout, h, chunks, float(eps)),
           dict(X_KIND=DTYPE_KIND[y.dtype], W_KIND=DTYPE_KIND[weight.dtype],
                O_KIND=DTYPE_KIND[out_dtype], L=LANES, ADD=add, num_warps=4))
    return normed

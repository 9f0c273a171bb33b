"""Shared test helpers. One multi-process test harness (gloo on CPU): echo_tp.launch.run_ranks.
Start-up (~seconds per spawn) dominates, so tests put many checks into one spawned function and
cache it per module. `bits_differ`: the bit-for-bit comparison every exactness test uses
(`assert_bits_equal`: the same as an assertion naming the first difference);
`interpret_kernels`: the Triton kernels on the CPU (TRITON_INTERPRET=1, modules reloaded).
`two_timescale`: the config the compensator tests run on. `extreme_groups`, `edge_input`: the
issue-15 inputs (groups at every scale; call sequences with huge groups, sums near the dtype's
max and NaN/Inf), and `outlier_groups` (the outlier word's cases), shared by the interpreted
and the GPU kernel tests."""
import importlib
import os
import sys

import pytest
import torch

from echo_tp.config import PAPER_STATE, EchoConfig
from echo_tp.launch import run_ranks
from echo_tp.models import ModelConfig, build_meta_model, init_weights

__all__ = ["run_ranks", "bits_differ", "assert_bits_equal", "interpret_kernels", "two_timescale",
           "extreme_groups", "edge_input", "outlier_groups"]

KERNEL_MODULES = ("echo_tp.kernels.quant_kernels", "echo_tp.kernels.flags",
                  "echo_tp.kernels.allreduce_kernels", "echo_tp.kernels.launcher",
                  "echo_tp.kernels.norm_kernels", "echo_tp.kernels.allreduce_plan",
                  "echo_tp.collective.simulated_fused")
"""The kernel modules in import order (each only imports those before it)."""


def interpret_kernels() -> None:
    """Run the Triton kernels on the CPU: TRITON_INTERPRET=1 (read when triton.jit decorates),
    and every kernel module imported earlier without it rebuilt. Call before importing them."""
    os.environ["TRITON_INTERPRET"] = "1"
    for name in KERNEL_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])


def two_timescale(**kw) -> EchoConfig:
    """EchoConfig with the paper's two-timescale fp32 state (beta1 0.7, beta2 0.3) unless kw
    sets it: the default (beta1 = beta2 = 0, one bf16 tensor) multiplies both decays by zero,
    so tests of the compensator's arithmetic run on the pair; the default has its own cases."""
    return EchoConfig(**{**PAPER_STATE, **kw})


def bits_differ(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise: the bit patterns differ (any NaN matches any NaN; integer tensors compare
    by value)."""
    if not got.is_floating_point():
        return got != want
    gn, wn = got.isnan(), want.isnan()
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    return (gn != wn) | (~gn & ~wn & (got.view(ints) != want.view(ints)))


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal dtypes, shapes and bit patterns, except that any NaN matches any NaN (their
    payloads depend on the device and the input NaN)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype,
                                                                 got.shape, want.shape)
    bad = bits_differ(got, want)
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        pytest.fail(f"{what}: {int(bad.sum())} of {bad.numel()} differ, first at {idx}: "
                    f"got {got[tuple(idx)].item()!r}, want {want[tuple(idx)].item()!r}")


def extreme_groups(rows: int, groups: int, g: int, dtype, seed: int):
    """[rows, groups*g] groups at every scale (issue 15), one random kind each: +-3e6 ramps,
    randn at 10^k for k in [-38, 38], near the dtype's largest value, fp32 subnormals, one-sided
    and far-from-zero wide groups, huge and tiny constants, fp16 sums near 65504."""
    gen = torch.Generator().manual_seed(seed)
    big = float(torch.finfo(dtype).max) * (0.99 if dtype != torch.float16 else 0.999)
    x = torch.randn(rows, groups, g, generator=gen)
    kinds = torch.randint(0, 8, (rows, groups), generator=gen)
    expo = torch.randint(-38, 39, (rows, groups), generator=gen).double()
    for r in range(rows):
        for j in range(groups):
            k, v, m = int(kinds[r, j]), x[r, j], float(10.0 ** expo[r, j])
            if k == 0:
                v.copy_(torch.linspace(-3e6, 3e6, g) * (1 + 0.1 * v[0]))        # issue 15 ramp
            elif k == 1:
                v.mul_(m)
            elif k == 2:
                v.copy_((v.abs() * 0.2 + 0.5) * big * (1 if j % 2 else -1))    # near the max
            elif k == 3:
                v.mul_(1e-40)                                                 # fp32 subnormal
            elif k == 4:
                v.copy_(v.abs() * m + m)                                      # one-sided
            elif k == 5:
                v.mul_(m * 1e-3).add_(m * (1 if j % 2 else -1))               # far from zero
            elif k == 6:
                v.fill_(float(v[0]) * m if j % 2 else big * (1 if r % 2 else -1))   # constant
            else:
                v.copy_(torch.linspace(-1000.0, 64992.0, g))                 # fp16 near max
    x = x.clamp(-big, big)
    return x.reshape(rows, groups * g).to(dtype)


def edge_input(P, n, dtype, call, seed):
    """Call `call` of an issue-15 sequence, [P, n] in dtype: 0 huge groups (randn * 1e6, or
    fp16 partials summing to 64992 - the 4-bit grid reaches past 65504); 1 mixed scales with a
    NaN and an Inf; 2 clean; 3 values near the dtype's largest (sums past it); 4 clean."""
    gen = torch.Generator().manual_seed(seed + call)
    x = torch.randn(P, n, generator=gen)
    big = float(torch.finfo(dtype).max)
    ramp = (torch.linspace(-1000.0, 64992.0, 128) / P).repeat(-(-n // 128))[:n]
    if call == 0:
        x = ramp.expand(P, n).clone() if dtype == torch.float16 else x * 1e6
    elif call == 1:
        wide = 1e30 if dtype != torch.float16 else 3e4
        x[:, :128] = torch.linspace(-3e6, 3e6, 128) if dtype != torch.float16 else ramp[:128]
        x[:, 128:256] *= wide
        x[:, 256:384] *= 1e-35 if dtype != torch.float16 else 1e-6
        x[1, 400] = float("nan")
        x[P - 1, 900] = float("inf")
    elif call == 3:
        x = (x.abs() * 0.05 + 0.8).clamp(max=0.99) * big
        x[:, 1::2] *= -1
        x[:, 512:] = ramp[512:] if dtype == torch.float16 else x[:, 512:]
    return x.to(dtype)


def outlier_groups(rows: int, groups: int, g: int, dtype, seed: int, nonfinite: bool = True):
    """[rows, groups*g] groups for the outlier word (quant.py: each group's largest |value|,
    +|v| before -|v| then the first index, as fp16 where it is an fp16 normal), one random kind each: a massive value (30 to
    3000) at a random place; tied largest |values| (same sign, or +v and -v); the largest
    |value| at fp16's edges (65504, 2^-14, just past them: 65505, 65519, 2^-14 - ulp, 1e5, 1e-6
    groups; fp16 inputs stop at 65504); a largest value halfway between two fp16 values
    (1024.5 + k: round to even); a massive value over a constant or all-zero rest; constant
    groups, all-zero and -0.0 groups, every |value| equal with random signs, wide groups (1e30,
    fp16: 1e3), a far-from-zero group; NaN or Inf beside a massive value (nonfinite)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups, g, generator=gen)
    kinds = torch.randint(0, 16 if nonfinite else 14, (rows, groups), generator=gen)
    pos = torch.randint(0, g, (rows, groups, 2), generator=gen)
    edge = (65504.0, 65505.0, 65519.0, 1e5, 2.0 ** -14, 2.0 ** -14 * (1 - 2.0 ** -24))
    fp16 = dtype == torch.float16                         # no value past 65504 (no Inf)
    for r in range(rows):
        for j in range(groups):
            k, v, (p, q) = int(kinds[r, j]), x[r, j], pos[r, j].tolist()
            big = float(torch.rand(1, generator=gen)) * 3000 + 30
            if k == 0:
                v[p] = big * (1 if j % 2 else -1)                           # massive
            elif k == 1:
                v[p] = v[q] = -big                                          # tie, same sign
            elif k == 2:
                v[p], v[q] = big, -big                                      # tie, +v and -v
            elif k == 3:
                e = edge[(r + j) % len(edge)]
                e = min(e, 65504.0) if fp16 else e
                v.mul_(e * 1e-3 if e > 1 else e * 0.25)
                v[p] = e if j % 2 else -e                                   # fp16's edges
            elif k == 4:
                v.mul_(1e-6)                                                # all below 2^-14
            elif k == 5:
                v.copy_(1 + torch.randint(-40, 40, (g,), generator=gen) * 2.0 ** -11)
                v[p] = 1024.5 + int(torch.randint(0, 4, (), generator=gen))  # fp16: a tie
            elif k == 6:
                v.fill_(float(v[0]))
                v[p] = big                                                  # massive, constant
            elif k == 7:
                v.zero_()
                v[p] = -big                                                 # massive, zeros
            elif k == 8:
                v.fill_(float(v[0]) * 3)                                    # constant
            elif k == 9:
                v.zero_()
                if (r + j) % 2:
                    v.neg_()                                                # -0.0
            elif k == 10:
                v.copy_(torch.where(torch.rand(g, generator=gen) < 0.5, 1.5, -1.5))
            elif k == 11:
                v.mul_(1e3 if fp16 else 1e30)                               # wide
            elif k == 12:
                v.mul_(1e-2).add_(500.0)
                v[p] = 700.0                                                # far from zero
            elif k == 14:
                v[p] = big
                v[q] = float("nan")
            elif k == 15:
                v[p] = big
                v[q] = float("inf") if j % 2 else -float("inf")
            # k == 13: randn as it is
    return x.reshape(rows, groups * g).to(dtype)


def perturbed_model(preset: str, over: dict, seed: int) -> torch.nn.Module:
    """A model of `preset` (fields `over` replaced) with seeded weights (seed) and its norms and
    biases moved away from 1 / 0 (seed + 1), so a dropped one shows in a comparison."""
    cfg = ModelConfig.from_name(preset).replace(**over)
    model = init_weights(build_meta_model(cfg).to_empty(device="cpu"), seed=seed, std=0.1)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def token_batch(seed: int, shape=(2, 9)) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of random token ids < 256, seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g)

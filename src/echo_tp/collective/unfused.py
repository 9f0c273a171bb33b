"""Echo with the compensator as separate torch ops around any uncompensated quantized
all-reduce: the unfused baseline of the paper's fused design (and of benchmarks/allreduce.py's
`p2p4c-out-unfused` row). Residual 'output' only: the 'local' residual needs the rounding errors
inside the collective.

    c  = eta * (a*m1 + (1-a)*m2)           # torch ops, fp32
    x' = x + c                              # fp32 input to the collective
    y  = QAR(x')  in x's dtype              # any uncompensated backend
    m1, m2 <- update with u = x' - y/P      # torch ops

Bit-identical to collective/qar.compensated_all_reduce with residual='output' (forward sites;
tested in tests/test_unfused.py), which fuses the same steps.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..compensator import CompState, apply_correction, correction, output_residual, update_
from ..config import CompensatorConstants, EchoConfig
from ..quant import saturate


def unfused_output_compensated(all_reduce: Callable[[torch.Tensor], torch.Tensor],
                               x: torch.Tensor, cfg: EchoConfig, state: CompState,
                               world_size: int) -> torch.Tensor:
    """x [*B, n] -> y [*B, n] in x's dtype; `all_reduce(x')` is the uncompensated quantized
    all-reduce of the fp32 x' (returning fp32); updates state in place."""
    if cfg.residual != "output":
        raise ValueError("the unfused compensator implements residual='output' only")
    k = CompensatorConstants.from_config(cfg)
    xp = apply_correction(x.to(torch.float32), correction(state, k).to(torch.float32))
    y = saturate(all_reduce(xp), x.dtype)
    update_(state, output_residual(xp, y, world_size), k)
    return y

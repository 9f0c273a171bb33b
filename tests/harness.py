"""Shared test helpers. One multi-process test harness (gloo on CPU): echo_tp.launch.run_ranks.
Start-up (~seconds per spawn) dominates, so tests put many checks into one spawned function and
cache it per module. `bits_differ`: the bit-for-bit comparison every exactness test uses.
`two_timescale`: the config the compensator tests run on."""
import torch

from echo_tp.config import PAPER_STATE, EchoConfig
from echo_tp.launch import run_ranks

__all__ = ["run_ranks", "bits_differ", "two_timescale"]


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

"""Shared test helpers. One multi-process test harness (gloo on CPU): echo_tp.launch.run_ranks.
Start-up (~seconds per spawn) dominates, so tests put many checks into one spawned function and
cache it per module. `bits_differ`: the bit-for-bit comparison every exactness test uses."""
import torch

from echo_tp.launch import run_ranks

__all__ = ["run_ranks", "bits_differ"]


def bits_differ(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise: the bit patterns differ (any NaN matches any NaN; integer tensors compare
    by value)."""
    if not got.is_floating_point():
        return got != want
    gn, wn = got.isnan(), want.isnan()
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    return (gn != wn) | (~gn & ~wn & (got.view(ints) != want.view(ints)))

"""One multi-process test harness (gloo on CPU): echo_tp.launch.run_ranks. Start-up (~seconds per
spawn) dominates, so tests put many checks into one spawned function and cache it per module."""
from echo_tp.launch import run_ranks

__all__ = ["run_ranks"]

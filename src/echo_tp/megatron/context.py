"""What every Echo site of one Megatron-core model shares: the TP engine's context, plus whether
the model's forward is running (the guard against activation recomputation).

A site is `echo_tp.tp.sites.Site(ctx, index, dim=0)`: Megatron's activations are [s, b, h], so
the sequence dim the SP halves split is 0. Its width is `ctx.bits(index)`, the TP engine's own
rule (tp.policy.site_width of ctx.widths).
"""
from __future__ import annotations

from dataclasses import dataclass

from echo_tp.tp.sites import TPContext

SAFE_RECOMPUTE = ("core_attn", "layernorm", "moe_act")
"""Megatron's recompute_modules that hold no TP collective (selective recomputation of these
reruns no Echo site)."""


@dataclass(eq=False, kw_only=True)
class MegatronContext(TPContext):
    """TPContext of an Echo-enabled Megatron-core model (echo_tp.megatron.enable_echo)."""

    depth: int = 0
    """How many calls of the model's forward are running (0: none)."""
    model_name: str = "GPTModel"

    def check_forward(self, module) -> None:
        """RuntimeError unless the model's forward is running: a site that runs outside it
        (activation recomputation in the backward pass, or a layer called on its own) would
        advance the compensator a second time and give other values than the forward's."""
        if self.depth > 0:
            return
        raise RuntimeError(
            f"echo-tp: {type(module).__name__} ran an Echo site outside {self.model_name}."
            "forward. Each forward pass starts fresh compensator state and every site advances "
            "it once; activation recomputation reruns a layer's forward in the backward pass "
            "(recompute_granularity='full', or 'selective' with recompute_modules other than "
            f"{list(SAFE_RECOMPUTE)}), which would advance it again and recompute other "
            "activations than the forward's. Echo refuses that: turn recomputation off for "
            "those modules, and call the model, not its layers, while Echo is enabled "
            "(echo_tp.megatron.disable_echo restores Megatron's own collectives).")

"""Error feedback at a site whose output reaches the residual stream through a norm
(compensator.NormOutput): the state in residual-stream units around any backend's call.

    c      = eta (a m1 + (1-a) m2)                residual units (the pass's state)
    c_site = omap.to_site(c, x)                   site units, this rank's estimate
    y      = backend(x, carrier)                  carrier: m1 = c_site, eta = a = 1, beta = 0,
                                                  fp32: the backend applies exactly c_site and
                                                  leaves this rank's residual u in m1
    m      <- beta m + (1-beta) J(y) u            (compensator.update_)

Every step is elementwise or a fixed-order row sum, so real ranks and simulated ranks agree bit
for bit, as for unmapped sites; the backend (reference, p2p kernels) runs unchanged.
"""
from __future__ import annotations

import functools

import torch

from .compensator import CompState, NormOutput, correction, update_
from .config import CompensatorConstants, EchoConfig


@functools.lru_cache(maxsize=64)
def carrier_config(cfg: EchoConfig) -> EchoConfig:
    """cfg whose compensator applies its state as it is and stores the residual u: eta = a = 1,
    beta1 = beta2 = 0, fp32 state (its other fields, the packet's, unchanged)."""
    return cfg.replace(eta=1.0, a=1.0, beta1=0.0, beta2=0.0, state_dtype="float32")


def run_mapped(run, flat: torch.Tensor, cfg: EchoConfig, state: CompState, omap: NormOutput,
               world_size: int, **kw):
    """run(flat, cfg, state=..., **kw) -> (y, rec) with the state in residual units (the
    module docstring); flat [*B, n] (n a multiple of omap's hidden size)."""
    k = CompensatorConstants.from_config(cfg)
    c = correction(state, k).to(torch.float32)
    carrier = CompState.zeros(flat.shape, flat.device, torch.float32, compact=True)
    carrier.m1.copy_(omap.to_site(c, flat, world_size))
    y, rec = run(flat, carrier_config(cfg), state=carrier, **kw)
    update_(state, omap.tangent(y.to(torch.float32), carrier.m1), k)
    return y, rec

"""The two-timescale error-feedback compensator (SPEC.md §4, paper Algorithm 1).

State per rank and pass direction: m1, m2 (one entry per element of the site's tensor; fp32 by
default, bf16 or fp64 by EchoConfig.state_dtype), reset to zero at the start of every pass.
At every site:

    c  = eta * (a*m1 + (1-a)*m2)          # correction, applied to x before quantization
    x' = x + c
    y  = QAR(x')                           # the collective
    u  = x' - y/P       (residual 'output', the paper)
       | own rounding errors (residual 'local', see collective/qar.py)
    m1 = beta1*m1 + (1-beta1)*u
    m2 = beta2*m2 + (1-beta2)*u

Every product and sum is a separate fp32 rounding with the fp32-rounded constants of
`CompensatorConstants`; fused kernels must reproduce exactly this order. A bf16 state is read
as fp32 (exact), computed on in fp32, and rounded once to bf16 (RNE, saturating) when stored.

Non-finite values never enter the state: where an updated m1 or m2 is not finite (a NaN/Inf
input, or its group's NaN output, made u non-finite) the element's state is stored as 0, so
a bad input affects the call it entered and no later one. x' of a finite x saturates at
+-fp32 max instead of overflowing.

Sites of different sizes in one pass: the state is kept per element count, so each distinct
tensor size forms its own error stream (all TP sites of one model share the size of the hidden
state, so a model pass uses one pair, as the paper does).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import CompensatorConstants, EchoConfig
from .norm_reference import row_sum
from .quant import clamp_finite, saturate


@dataclass
class CompState:
    """m1, m2: [*batch, n] (fp32 by default); batch is () on a real rank and (P,) in
    simulation. Compact: m2 IS m1 (one tensor), valid when beta1 == beta2, where the two
    averages receive identical updates from identical (zero) starts and so never differ; it
    halves the state's memory and the fused kernels' state traffic, with the same bits."""

    m1: torch.Tensor
    m2: torch.Tensor

    @classmethod
    def zeros(cls, shape, device, dtype=torch.float32, compact: bool = False) -> "CompState":
        m1 = torch.zeros(shape, device=device, dtype=dtype)
        return cls(m1, m1 if compact else torch.zeros(shape, device=device, dtype=dtype))

    @property
    def compact(self) -> bool:
        return self.m2 is self.m1


def _compute(t: torch.Tensor) -> torch.Tensor:
    """The state as the arithmetic sees it: fp32 for a bf16 state (exact), else itself."""
    return t.float() if t.dtype == torch.bfloat16 else t


def correction(state: CompState, k: CompensatorConstants) -> torch.Tensor:
    """c = eta * (a*m1 + (1-a)*m2), each operation rounded on its own."""
    return (_compute(state.m1) * k.a + _compute(state.m2) * k.one_minus_a) * k.eta


def apply_correction(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """x' = x + c, fp32 [..]: saturated at +-fp32 max where x is finite (Inf/NaN x pass)."""
    xp = x + c
    return torch.where(torch.isfinite(x), clamp_finite(xp), xp)


def _store(dst: torch.Tensor, v: torch.Tensor) -> None:
    """dst <- v (the state's arithmetic dtype), 0 where v is not finite; a bf16 state is
    rounded once (RNE), saturating."""
    v = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    dst.copy_(saturate(v, dst.dtype) if dst.dtype == torch.bfloat16 else v)


def update_(state: CompState, u: torch.Tensor, k: CompensatorConstants) -> None:
    """m1 = beta1*m1 + (1-beta1)*u; m2 = beta2*m2 + (1-beta2)*u, in place (computed in the
    state's arithmetic dtype, then stored: one rounding to bf16 for a bf16 state; 0 where the
    new value is not finite)."""
    m1, m2 = _compute(state.m1), _compute(state.m2)
    u = u.to(m1.dtype)
    if state.compact and k.beta1 != k.beta2:
        raise ValueError("a compact compensator state needs beta1 == beta2")
    _store(state.m1, m1 * k.beta1 + u * k.one_minus_beta1)
    if not state.compact:                   # one tensor: the m2 update is the m1 update
        _store(state.m2, m2 * k.beta2 + u * k.one_minus_beta2)


def output_residual(x_prime: torch.Tensor, y: torch.Tensor, world_size: int) -> torch.Tensor:
    """u = x' - y/P (fp32); summed over the group this is -delta."""
    yf = y.to(torch.float32)
    return x_prime - yf / yf.new_full((), float(world_size))  # IEEE division on every device


@dataclass
class PassState:
    """All compensator state of one pass direction, keyed by the sites' element count."""

    streams: dict[int, CompState] = field(default_factory=dict)
    sites: int = 0

    def get(self, n: int, batch: tuple, device, dtype, compact: bool = False) -> CompState:
        st = self.streams.get(n)
        if st is None or st.m1.device != device or tuple(st.m1.shape) != (*batch, n) \
                or st.m1.dtype != dtype or st.compact != compact:
            st = CompState.zeros((*batch, n), device=device, dtype=dtype, compact=compact)
            self.streams[n] = st
        return st

    def reset(self) -> None:
        self.streams.clear()
        self.sites = 0


def correction_weights(cfg: EchoConfig, n: int) -> torch.Tensor:
    """w_r = a(1-beta1)beta1^r + (1-a)(1-beta2)beta2^r for r = 0..n-1 (float64) (Eqn 12)."""
    r = torch.arange(n, dtype=torch.float64)
    return cfg.a * (1 - cfg.beta1) * cfg.beta1 ** r + (1 - cfg.a) * (1 - cfg.beta2) * cfg.beta2 ** r


def closed_form_corrections(deltas: torch.Tensor, cfg: EchoConfig) -> torch.Tensor:
    """deltas [N, ...] (injected errors of sites 0..N-1) -> C [N, ...], the group's summed
    correction at each site: C_k = -eta * sum_{s<k} w_{k-1-s} delta_s (float64)."""
    n = deltas.shape[0]
    w = correction_weights(cfg, n)
    d = deltas.to(torch.float64)
    out = torch.zeros_like(d)
    for k in range(1, n):
        out[k] = -cfg.eta * torch.tensordot(w[:k].flip(0), d[:k], dims=1)
    return out


def mean_age(cfg: EchoConfig, terms: int = 4096) -> float:
    """mu_w = sum_r r * w_r: the source bound at eta = 1 is (1 + mu_w) * q (Theorem 1)."""
    w = correction_weights(cfg, terms)
    return float((torch.arange(terms, dtype=torch.float64) * w).sum())


# ----- sites whose output reaches the residual stream through a norm -----

class NormOutput:
    """A forward site whose reduced output y [rows, H] reaches the residual stream as an RMS
    norm of it, gain * y / rms(y) (the 'post-norms' of Gemma 2/3 and OLMo 2), instead of y itself.

    Error feedback carries each site's error into the next site's all-reduce. In pre-norm
    models both land on the residual stream as they are, so the next site cancels the error
    with its own value. Behind a norm they do not: an error d in y moves the stream by
    J(y) d = gain / r * (d - y^ mean(y^ d)) (r = rms(y), y^ = y / r, per row), and the sites'
    gains and rms differ by orders of magnitude (Gemma-3-270M: gains -0.1..740, attention
    outputs 5-27x the MLP's), so a correction fed back in site units lands with the wrong scale
    and feedback diverges. With a NormOutput the state holds residual-stream units instead:

        c_site = to_site(c)            # c = eta (a m1 + (1-a) m2), residual units
        y      = QAR(x + c_site)       # u: this rank's own rounding errors, site units
        m      <- beta m + (1-beta) J(y) u

    to_site(c) = c * r^ * gain / (gain^2 + (FLOOR * rms(gain))^2): r^ = sqrt(P) * rms(x_i) per
    row estimates the rms of the sum before it exists (each rank from its own partial; the
    state update uses the true y), and the floor keeps channels whose gain is ~0 from taking an
    unbounded share. Pre-norm sites (no map) keep the plain update, bit for bit.

    gain [H] fp32: the norm's output for a row of ones times sqrt(1 + eps) (any RMS-type norm:
    `from_module`, which reads it on first use, so a call that applies no feedback, at 16 bits
    or uncompensated, never runs the norm)."""

    FLOOR = 0.1
    """Gains below this fraction of their rms take a damped share of a correction."""

    def __init__(self, gain: torch.Tensor | None = None, eps: float = 1e-6, *,
                 norm: torch.nn.Module | None = None, hidden: int | None = None):
        if (gain is None) == (norm is None):
            raise ValueError("NormOutput takes a gain [H] or a norm module (from_module)")
        self._gain, self._norm, self._hidden = gain, norm, hidden
        self.eps = float(eps)

    @classmethod
    def from_module(cls, norm: torch.nn.Module, hidden: int) -> "NormOutput":
        """The map of an RMS-type norm module (its gain read on first use)."""
        p = next(norm.parameters(), None)
        eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
        if eps is None:                # torch.nn.RMSNorm's default: its dtype's epsilon
            eps = torch.finfo(p.dtype if p is not None else torch.float32).eps
        return cls(eps=eps, norm=norm, hidden=hidden)

    @property
    @torch.no_grad()
    def gain(self) -> torch.Tensor:
        """[H] fp32 (the class docstring)."""
        if self._gain is None:
            p = next(self._norm.parameters(), None)
            ones = torch.ones(1, self._hidden, device=p.device if p is not None else "cpu",
                              dtype=p.dtype if p is not None else torch.float32)
            out = self._norm(ones).float().reshape(self._hidden)
            self._gain = (out * float((1.0 + self.eps) ** 0.5)).contiguous()
        return self._gain

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*t.shape[:-1], -1, self.gain.shape[0])

    def tangent(self, y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """y, d fp32 [..., rows*H] -> J(y) d [..., rows*H] fp32 (the module docstring)."""
        yr, dr = self._rows(y), self._rows(d)
        h = yr.new_tensor(float(yr.shape[-1]))
        r = torch.sqrt(row_sum(yr * yr) / h + yr.new_tensor(self.eps))
        yh = yr / r
        out = (self.gain / r) * (dr - yh * (row_sum(yh * dr) / h))
        return out.reshape(d.shape)

    def to_site(self, c: torch.Tensor, x: torch.Tensor, world_size: int) -> torch.Tensor:
        """c fp32 residual units, x this rank's partial, [..., rows*H] -> c in site units."""
        cr, xr = self._rows(c), self._rows(x.to(torch.float32))
        h = xr.new_tensor(float(xr.shape[-1]))
        rhat = torch.sqrt(row_sum(xr * xr) / h * xr.new_tensor(float(world_size)))
        g = self.gain
        floor = (self.FLOOR ** 2) * (g * g).mean()
        out = cr * rhat * (g / (g * g + floor))
        return torch.where(torch.isfinite(out), out, torch.zeros_like(out)).reshape(c.shape)

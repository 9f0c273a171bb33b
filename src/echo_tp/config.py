"""Typed settings for the Echo communicator (SPEC.md §3, §4, §7).

`EchoConfig` is what every rank of a TP group must agree on: bit width, group size, quantizer
policy, compensator gains and the residual mode. `QuantSpec` is the part the quantizer needs.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import struct
from dataclasses import dataclass
from types import SimpleNamespace

import torch

QUANTIZERS = ("zero_aware", "naive", "symmetric")
STATE_DTYPES = ("float32", "bfloat16", "float64")
"""Compensator state storage. float32: the paper's. bfloat16: half the state bytes (the fused
path's HBM traffic is dominated by reading and writing m1, m2); arithmetic stays fp32, each
stored value is rounded once to bf16 (round to nearest even). float64: for analysis."""
RESIDUAL_MODES = ("output", "local")
BITS = (4, 8, 16)
DIRECTIONS = ("forward", "backward")
KINDS = ("all_reduce", "reduce_scatter", "all_gather")
"""The collectives a communicator runs (part of each call's signature)."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""The input dtypes every collective takes (the fast kernels' too: kernels/fits.py)."""


class ConfigTypeError(TypeError, ValueError):
    """A setting of the wrong type (a TypeError; also a ValueError, so callers that catch bad
    settings as ValueError, like the CLI, report it in one line)."""


def check_int(name: str, v) -> None:
    """v must be an int (not a bool, not a float such as 4.0)."""
    if isinstance(v, bool) or not isinstance(v, int):
        hint = f"; write {name}={int(v)}" if isinstance(v, float) and v.is_integer() else ""
        raise ConfigTypeError(f"{name} must be an int, got {v!r} ({type(v).__name__}){hint}")


def check_bits(bits, name: str = "bits") -> None:
    """bits must be the int 4, 8 or 16."""
    check_int(name, bits)
    if bits not in BITS:
        raise ValueError(f"{name} must be one of {BITS}, got {bits!r}")


def check_group_size(g) -> None:
    check_int("group_size", g)
    if g < 8 or g & (g - 1):
        raise ValueError(f"group_size must be a power of two >= 8 (e.g. 128), got {g!r}")


@dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """What one group quantizer needs: bit width, group size and policy."""

    bits: int = 4
    """Code width, 4 or 8 (16 is the plain all-reduce and never reaches the quantizer)."""
    group_size: int = 128
    """Consecutive values sharing one scale word (and zero-point): a power of two >= 8."""
    quantizer: str = "zero_aware"
    """'zero_aware' (default asymmetric with the blended zero-point), 'naive' (grid anchored at
    the group minimum) or 'symmetric' (no zero-point, code -2^(b-1) unused)."""
    outlier: bool = False
    """Each group's largest |value| travels as a 16-bit word beside the codes, its code slot
    holding the marker code; the grid covers the other g-1 values (quant.py)."""

    def __post_init__(self) -> None:
        check_int("QuantSpec.bits", self.bits)
        if not isinstance(self.outlier, bool):
            raise ConfigTypeError(f"outlier must be True or False, got {self.outlier!r}")
        if self.bits not in (4, 8):
            raise ValueError(f"QuantSpec.bits must be 4 or 8, got {self.bits!r}")
        check_group_size(self.group_size)
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {self.quantizer!r}")

    @property
    def levels(self) -> int:
        """L, the top code of the asymmetric grid: 2^b - 1, or 2^b - 2 with an outlier word
        (the code 2^b - 1 then marks the outlier's slot)."""
        return (1 << self.bits) - (2 if self.outlier and self.has_zero else 1)

    @property
    def marker(self) -> int:
        """The code of an outlier's slot: 2^b - 1 (asymmetric), 0 (symmetric: the offset code
        of -2^(b-1), which the symmetric grid never uses)."""
        return (1 << self.bits) - 1 if self.has_zero else 0

    @property
    def qmax(self) -> int:
        """2^(b-1) - 1, the largest magnitude of a symmetric code."""
        return (1 << (self.bits - 1)) - 1

    @property
    def has_zero(self) -> bool:
        return self.quantizer != "symmetric"

    def packet_bytes(self, n: int) -> int:
        """Wire bytes of n values (n a multiple of group_size): codes + 16-bit scale word
        (+ fp16 zero) (+ fp16 outlier word)."""
        groups = n // self.group_size
        return n * self.bits // 8 + groups * 2 * (1 + self.has_zero + self.outlier)


PAPER_STATE = dict(a=0.35, beta1=0.7, beta2=0.3, state_dtype="float32")
"""The paper's compensator state (SPEC §4 defaults): two timescales, fp32."""


@dataclass(frozen=True, kw_only=True)
class EchoConfig:
    """Settings of one Echo communicator; every rank of the group must hold equal values."""

    bits: int = 4
    """Wire width: 4 or 8 for the quantized all-reduce, 16 for the plain all-reduce."""
    group_size: int = 128
    """Values per quantization group (power of two >= 8)."""
    quantizer: str = "zero_aware"
    """Group quantizer policy: 'zero_aware', 'naive' or 'symmetric' (SPEC §3)."""
    outlier: bool = True
    """Send each group's largest |value| as a 16-bit word beside the codes (QuantSpec.outlier;
    +2 bytes per group: 4.375 bits per value at 4 bits). On by default: real LLMs' massive
    activations put one value 100-1000x the rest into many groups, and on SmolLM2-135M at TP=3
    the word takes the default from +5.2% to +2.4% perplexity, on Gemma-3-270M from +60% to
    +11% (docs/results/2026-12-04-real-llm.md). False: the paper's packet."""
    eta: float = 1.0
    """Compensator gain; 0 disables compensation (SPEC §4). The paper uses 0.75; 1.0 (the gain at
    which Theorem 1's bound holds) was chosen by measurement: docs/results/2026-11-29-studies.md."""
    a: float = 0.35
    """Blend between the fast (m1) and slow (m2) averages (no effect when beta1 == beta2)."""
    beta1: float = 0.0
    """Decay of the fast average m1 (the paper: 0.7)."""
    beta2: float = 0.0
    """Decay of the slow average m2 (the paper: 0.3). Default beta1 = beta2 = 0: m1 = m2 = the
    last residual u (single-step error feedback, Theorem 1's smallest bound, mu_w = 0), one
    state tensor instead of two; chosen by measurement: docs/results/2026-11-30-compact-state.md.
    The paper's pair: preset 'echo4-2ts'."""
    residual: str = "local"
    """'local' (default): u from this rank's own rounding errors, the state stays at rounding
    scale; 'output': the paper's u = x' - y/P (docs/results/2026-11-29-studies.md compares)."""
    grad_scaling: bool = True
    """Backward pass: scale x' by a group-shared power of two before quantizing (SPEC §5)."""
    state_dtype: str = "bfloat16"
    """dtype of the compensator state m1, m2 (SPEC §4: float32). bf16 by default: fp32
    arithmetic, one rounding per store, a quarter of the fp32 pair's state traffic, which decides
    the fused kernels' speed (docs/results/2026-11-30-compact-state.md, -p2p-x2-r4.md)."""
    preset: str | None = dataclasses.field(default=None, compare=False, repr=False)
    """The preset name this config was built from (`from_name`), kept through `replace`. The
    collective never reads it (not in `signature`, equality or repr); the TP engine takes the
    preset's width rules from it when parallelize gets no WidthPlan (tp.policy.WidthPlan.of),
    so a preset name means the same widths everywhere."""

    def __post_init__(self) -> None:
        check_bits(self.bits)
        # checked at 16 bits too: a per-site policy switches single sites to 4 or 8 bits
        check_group_size(self.group_size)
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {self.quantizer!r}")
        for name in ("eta", "a", "beta1", "beta2"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigTypeError(f"{name} must be a number (int or float), got {v!r} "
                                      f"({type(v).__name__})")
            if not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.eta < 0:
            raise ValueError(f"eta must be >= 0, got {self.eta}")
        for name in ("a", "beta1", "beta2"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        if not isinstance(self.outlier, bool):
            raise ConfigTypeError(f"outlier must be True or False, got {self.outlier!r} "
                                  f"({type(self.outlier).__name__})")
        if not isinstance(self.grad_scaling, bool):
            raise ConfigTypeError(f"grad_scaling must be True or False, got "
                                  f"{self.grad_scaling!r} ({type(self.grad_scaling).__name__})")
        if self.residual not in RESIDUAL_MODES:
            raise ValueError(f"residual must be one of {RESIDUAL_MODES}, got {self.residual!r}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got "
                             f"{self.state_dtype!r}")

    @property
    def quantized(self) -> bool:
        return self.bits != 16

    @property
    def compensated(self) -> bool:
        return self.quantized and self.eta != 0.0

    def quant_spec(self) -> QuantSpec:
        if not self.quantized:
            raise ValueError("bits=16 has no quantizer")
        return _quant_spec(self.bits, self.group_size, self.quantizer, self.outlier)

    def replace(self, **changes) -> "EchoConfig":
        return dataclasses.replace(self, **changes)

    def signature(self) -> tuple:
        """A tuple every rank must agree on (checked once at communicator setup): every field
        the collective reads (not `preset`)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.compare)

    # Named configurations used by the demo, eval and benchmarks (a TP model's width rules of
    # each: echo_tp.tp.policy.WidthPlan.from_name).
    @classmethod
    def from_name(cls, name: str) -> "EchoConfig":
        presets = {
            "16": dict(bits=16),
            # naive: the paper's packet, no feedback
            "8": dict(bits=8, eta=0.0, outlier=False),
            "4": dict(bits=4, eta=0.0, outlier=False),
            "echo8": dict(bits=8),
            "echo4": dict(bits=4),
            # the paper's setting: output residual, eta 0.75, two timescales, fp32 state, its
            # packet
            "echo4-output": dict(bits=4, residual="output", eta=0.75, outlier=False,
                                 **PAPER_STATE),
            "echo4-local": dict(bits=4, residual="local"),
            # the paper's two-timescale pair with the local residual (the default before
            # 2026-11-30), in fp32 and in bf16 (echo4bf: half the state traffic)
            "echo4-2ts": dict(bits=4, outlier=False, **PAPER_STATE),
            "echo4bf": dict(bits=4, outlier=False, **dict(PAPER_STATE, state_dtype="bfloat16")),
        }
        if name not in presets:
            raise ValueError(f"unknown comm config {name!r}; known: {sorted(presets)}")
        return cls(**presets[name], preset=name)


@dataclass(frozen=True, kw_only=True)
class CompensatorConstants:
    """The compensator's coefficients rounded once to fp32, shared by every implementation so the
    torch reference and fused kernels multiply by bit-identical constants."""

    eta: float
    a: float
    one_minus_a: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float

    @classmethod
    def from_config(cls, cfg: EchoConfig) -> "CompensatorConstants":
        return _constants(cfg.eta, cfg.a, cfg.beta1, cfg.beta2)

    @classmethod
    def _build(cls, cfg) -> "CompensatorConstants":
        def f32(v: float) -> float:
            return struct.unpack("f", struct.pack("f", v))[0]

        return cls(eta=f32(cfg.eta), a=f32(cfg.a), one_minus_a=f32(1.0 - cfg.a),
                   beta1=f32(cfg.beta1), one_minus_beta1=f32(1.0 - cfg.beta1),
                   beta2=f32(cfg.beta2), one_minus_beta2=f32(1.0 - cfg.beta2))


@functools.lru_cache(maxsize=256)
def _quant_spec(bits: int, group_size: int, quantizer: str, outlier: bool) -> QuantSpec:
    return QuantSpec(bits=bits, group_size=group_size, quantizer=quantizer, outlier=outlier)


@functools.lru_cache(maxsize=256)
def _constants(eta: float, a: float, beta1: float, beta2: float) -> CompensatorConstants:
    """Built once per coefficient set: every call of the collective needs them."""
    return CompensatorConstants._build(SimpleNamespace(eta=eta, a=a, beta1=beta1, beta2=beta2))


__all__ = ["EchoConfig", "QuantSpec", "ConfigTypeError", "check_bits", "CompensatorConstants",
           "QUANTIZERS", "RESIDUAL_MODES", "DIRECTIONS", "KINDS", "DTYPES"]

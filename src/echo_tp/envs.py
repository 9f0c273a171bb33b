"""Every environment flag of echo-tp, in one place, prefixed ECHO_, typed, read on demand.

A bad value raises ValueError naming the flag and what it accepts.
"""
from __future__ import annotations

import os


def _bool(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={v!r}: expected one of 1/0/true/false/yes/no/on/off")


def _float(name: str, default: float) -> float:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        out = float(v)
    except ValueError:
        raise ValueError(f"{name}={v!r}: expected a number") from None
    if not out > 0:
        raise ValueError(f"{name}={v!r}: expected a positive number")
    return out


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    v = os.environ.get(name) or default
    if v not in choices:
        raise ValueError(f"{name}={v!r}: expected one of {choices}")
    return v


def force_reference() -> bool:
    """ECHO_FORCE_REFERENCE: dispatch always picks the torch.distributed reference backend."""
    return _bool("ECHO_FORCE_REFERENCE", False)


def torch_quant() -> bool:
    """ECHO_TORCH_QUANT: the reference QAR quantizes with quant.py even on CUDA (default: the
    bit-identical Triton kernels there)."""
    return _bool("ECHO_TORCH_QUANT", False)


def debug_checks() -> bool:
    """ECHO_DEBUG_CHECKS: every call all-gathers (numel, dtype) to catch ranks that disagree."""
    return _bool("ECHO_DEBUG_CHECKS", False)


def flag_timeout_s() -> float:
    """ECHO_FLAG_TIMEOUT_S: seconds a p2p kernel waits on a peer's flag before failing."""
    return _float("ECHO_FLAG_TIMEOUT_S", 5.0)


def collective_timeout_s() -> float:
    """ECHO_COLLECTIVE_TIMEOUT_S: seconds a gloo rank started by echo_tp.launch waits on a peer
    in any collective before failing (instead of hanging)."""
    return _float("ECHO_COLLECTIVE_TIMEOUT_S", 300.0)


def backend() -> str:
    """ECHO_BACKEND: 'auto' (default), 'reference' or 'p2p' for communicators built with 'auto'."""
    return _choice("ECHO_BACKEND", "auto", ("auto", "reference", "p2p"))


def p2p_min_bytes() -> int | None:
    """ECHO_P2P_MIN_BYTES: messages of at least this many bytes per rank take the p2p path under
    'auto', whatever the measured crossover table says (unset: the table)."""
    v = os.environ.get("ECHO_P2P_MIN_BYTES")
    if v is None or v == "":
        return None
    try:
        out = int(v)
    except ValueError:
        raise ValueError(f"ECHO_P2P_MIN_BYTES={v!r}: expected a whole number of bytes") from None
    if out < 0:
        raise ValueError(f"ECHO_P2P_MIN_BYTES={v!r}: expected >= 0")
    return out

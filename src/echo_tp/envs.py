"""Every environment flag of echo-tp, in one place, prefixed ECHO_, typed, read on demand.

    ECHO_BACKEND              auto | reference | p2p       (communicators built with 'auto')
    ECHO_P2P_MIN_BYTES        bytes                        (overrides the p2p crossover table)
    ECHO_ONESHOT_MAX_BYTES    bytes, 0 = off               (overrides the one-shot cap table)
    ECHO_FLAG_TIMEOUT_S       seconds, default 5           (p2p / one-shot flag waits)
    ECHO_COLLECTIVE_TIMEOUT_S seconds, default 300         (collectives of echo-tp's groups)
    ECHO_DEBUG_CHECKS         0 | 1                        (check every call's signature)
    ECHO_CLI_TRACEBACK        0 | 1                        (the CLI prints tracebacks)
    ECHO_RANK_THREADS         threads, default 1           (spawned ranks, simulated models)
    ECHO_VLLM                 a comm spec, unset = off     (Echo inside vLLM: echo_tp.vllm)

All are for users (the table in docs/usage/collectives.md); test-only switches are fixtures or
arguments. A bad value raises ValueError naming the flag and what it accepts.
"""
from __future__ import annotations

import math
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


def _number(name: str, default, cast, ok, expected: str):
    """The flag parsed by cast and checked by ok; ValueError naming `expected` otherwise."""
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        out = cast(v)
    except ValueError:
        raise ValueError(f"{name}={v!r}: expected {expected}") from None
    if not ok(out):
        raise ValueError(f"{name}={v!r}: expected {expected}")
    return out


def _float(name: str, default: float) -> float:
    return _number(name, default, float, lambda v: math.isfinite(v) and v > 0,
                   "a finite positive number of seconds")


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    v = os.environ.get(name) or default
    if v not in choices:
        raise ValueError(f"{name}={v!r}: expected one of {choices}")
    return v


def debug_checks() -> bool:
    """ECHO_DEBUG_CHECKS: every call checks its (numel, dtype, bits, direction) across ranks
    (default: each new signature once per communicator, then cached)."""
    return _bool("ECHO_DEBUG_CHECKS", False)


def cli_traceback() -> bool:
    """ECHO_CLI_TRACEBACK: the CLI prints a failed rank's full traceback above its one-line
    error (default: the line only)."""
    return _bool("ECHO_CLI_TRACEBACK", False)


def flag_timeout_s() -> float:
    """ECHO_FLAG_TIMEOUT_S: seconds a p2p kernel waits on a peer's flag before failing."""
    return _float("ECHO_FLAG_TIMEOUT_S", 5.0)


def collective_timeout_s() -> float:
    """ECHO_COLLECTIVE_TIMEOUT_S: seconds a rank waits on a peer in any collective of a group
    echo-tp builds (echo_tp.launch, tp/runtime.py under torchrun, the benchmarks) before it fails
    with an error naming its rank and the stage; groups a user builds get it by passing
    `timeout=echo_tp.launch.group_timeout()` (docs/usage/defined-answers.md)."""
    return _float("ECHO_COLLECTIVE_TIMEOUT_S", 300.0)


def rank_threads() -> int:
    """ECHO_RANK_THREADS: the intra-op threads of each rank echo_tp.launch.run_ranks spawns, and
    of a simulated model's forward and backward on the CPU (threads.py: simulated TP equals the
    real ranks bit for bit at equal counts)."""
    return _number("ECHO_RANK_THREADS", 1, int, lambda v: v >= 1, "a whole number >= 1")


def backend() -> str:
    """ECHO_BACKEND: 'auto' (default), 'reference' or 'p2p' for communicators built with 'auto'."""
    return _choice("ECHO_BACKEND", "auto", ("auto", "reference", "p2p"))


def p2p_min_bytes() -> int | None:
    """ECHO_P2P_MIN_BYTES: messages of at least this many bytes per rank take the p2p path under
    'auto', whatever the measured crossover table says (unset: the table)."""
    return _number("ECHO_P2P_MIN_BYTES", None, int, lambda v: v >= 0,
                   "a whole number of bytes >= 0")


def oneshot_max_bytes() -> int | None:
    """ECHO_ONESHOT_MAX_BYTES: the largest message (bytes per rank) 'auto' sends through the
    16-bit one-shot kernel on intra-node GPUs (0: never; unset: the measured table)."""
    return _number("ECHO_ONESHOT_MAX_BYTES", None, int, lambda v: v >= 0,
                   "a whole number of bytes >= 0")


def vllm_comm() -> str | None:
    """ECHO_VLLM: the comm spec (tp/policy.py's syntax: 'echo4', '4', '16', 'echo4:eta=0', ...)
    every TP all-reduce of a vLLM engine runs at, through echo_tp.vllm (the vllm extra's
    plugin); unset or empty: off, vLLM runs as it would without echo-tp. The spec is parsed at
    engine start (echo_tp.vllm.comm_spec), a bad one a ValueError naming this flag."""
    v = os.environ.get("ECHO_VLLM", "").strip()
    return v or None

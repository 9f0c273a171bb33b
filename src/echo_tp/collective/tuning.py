"""The measured tables the routing policy reads (collective/routing.py): data, not prose.

Every entry is a `Measured`: the value, the record in docs/results it was read from, and what
that record measured. Keys a table lacks (an unmeasured P, an unmeasured state size) fall back
as each table's `fallback` says; `Tables.with_overrides` applies the two user overrides
(ECHO_P2P_MIN_BYTES, ECHO_ONESHOT_MAX_BYTES). Sizes are bytes per rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

MiB = 1 << 20


@dataclass(frozen=True)
class Measured:
    value: int | None
    source: str              # a record under docs/results/
    measured: str            # what the record shows, in one line


@dataclass(frozen=True)
class Table:
    """key -> Measured; a missing key reads `fallback_key`'s entry, else `fallback`."""

    entries: dict
    fallback: int | None = None
    fallback_key: object = None
    rule: str = ""           # why the fallback is what it is

    def lookup(self, key) -> tuple[int | None, str]:
        """-> (value, where it came from)."""
        if key in self.entries:
            m = self.entries[key]
            return m.value, m.source
        if self.fallback_key is not None and self.fallback_key in self.entries:
            m = self.entries[self.fallback_key]
            return m.value, f"{m.source} (measured at {self.fallback_key}, used for {key})"
        return self.fallback, f"unmeasured {key}: {self.rule}"


R2 = "2026-11-29-p2p-x2-r2.md"
R3 = "2026-11-30-p2p-x2-r3.md"
R4 = "2026-11-30-p2p-x2-r4.md"
R5 = "2026-12-02-kernel-roofline.md"

ONESHOT_MAX_BYTES = Table(
    # P -> the largest message 'auto' sends through the 16-bit one-shot kernel
    {2: Measured(16 * MiB, R2, "1.3-2.2x NCCL at 64 KiB-4 MiB, 1.05-1.07x at 16 MiB, "
                               "0.85x at 64 MiB")},
    fallback=1 * MiB,
    rule="each rank pushes P-1 copies of its input, so the edge over NCCL shrinks with P")

P2P_MIN_BYTES = Table(
    # (P, compensator state bytes per value) -> the smallest message from which an eager p2p
    # call beat NCCL's bf16 all-reduce by >= 5% at every larger measured size; None: never
    {(2, 0): Measured(64 * MiB, R3, "4-bit uncompensated 1.82x at 64 MiB, 2.47-2.60x above "
                                    "(16 MiB 1.35x: the exact one-shot kernel is close)"),
     (2, 4): Measured(64 * MiB, R3, "one bf16 state tensor 1.61x at 64 MiB, 1.73-1.82x above"),
     (2, 8): Measured(64 * MiB, R3, "bf16 pair / one fp32 tensor 1.31x at 64 MiB, "
                                    "1.37-1.42x above"),
     (2, 16): Measured(None, R3, "fp32 pair, HBM-bound: 1.00-1.04x, never 5% faster")},
    fallback=None,
    rule="an unmeasured state size stays on NCCL")
P2P_MIN_BYTES_UNMEASURED_P = 2
"""Unmeasured P read P=2's entry (NCCL's own cost grows with P, so this errs on NCCL's side)."""

FUSED_MAX_BYTES = Table(
    # P -> the largest message run as one fused kernel (larger: the three stage kernels)
    {2: Measured(32 * MiB, R2, "host time per eager call 0.025 ms fused vs 0.11-0.13 ms "
                               "staged; from 64 MiB the stage kernels move bytes faster "
                               "(1 GiB 1.78 ms vs 3.75-3.92 ms fused)")},
    fallback_key=2)

OVERLAP_LAUNCH_MAX_BYTES = Table(
    # uncompensated calls by bits -> the largest staged message run with reduce and tail in
    # one launch (overlap 'launch'); None: every size. Compensated calls: never (measured
    # 1.76-1.83x vs 1.82-1.86x NCCL serial from 128 MiB, bf16 one state tensor)
    {4: Measured(128 * MiB, R4, "64 MiB 1.49-2.18x vs 1.38-1.62x serial (one launch fewer), "
                                "128 MiB 2.46-2.72x vs 2.45-2.63x; behind from 256 MiB"),
     8: Measured(None, R4, "1.97-2.05x NCCL vs 1.78-1.86x serial from 128 MiB")},
    fallback=0,
    rule="unmeasured bits run serially")


@dataclass(frozen=True)
class KernelShape:
    """How the p2p kernels cut a call, by kernel form; measured at P=2 on 2 H200s."""

    step_elems: dict = field(default_factory=lambda: {
        # compensated -> values a program holds in registers at once (32 a thread at 4 warps:
        # quant_kernels' tiling)
        False: Measured(4096, R5, "one-GPU stage floors, P=4 1 GiB: 1.23 ms at 4096 vs 1.42 at "
                                  "2048 and 1.87 at 1024"),
        True: Measured(4096, R5, "bf16 one tensor, P=4 1 GiB: 2.00 ms at 4096 vs 2.17 at 2048 "
                                 "and 2.45 at 1024 (127 registers)")})
    tiles_per_segment: dict = field(default_factory=lambda: {
        # fused -> at least this many tiles (one flag, one release each) per segment
        False: Measured(2048, R3, "4-bit 1 GiB 1.62 ms at 2048-value tiles, 1.32 at 8192, "
                                  "1.24 at 16384; 64 MiB best at 8192"),
        True: Measured(256, R3, "fused kernel, tiles of the same bounds")})
    tile_max: Measured = Measured(16384, R3, "compensated 1 GiB 2.96 ms at 1024-value tiles, "
                                             "1.79 at 16384")
    num_warps: dict = field(default_factory=lambda: {
        # fused -> warps per program
        False: Measured(4, R2, "stage kernels 4-bit 1 GiB 1.78 ms at 4 warps vs 2.18 at 8"),
        True: Measured(8, R2, "fused kernel: 48-114 registers per thread at 8 warps")})
    programs_per_sm: Measured = Measured(4, R2, "fused 1 GiB 6.60 / 3.92 / 3.88 / 3.75 ms at "
                                                "2 / 4 / 8 / 16 programs per SM")
    overlap_lag_per_sm: Measured = Measured(8, R4, "8-bit 1 GiB: lag 264 tiles 1.88x NCCL, "
                                                   "1024 1.92x, 4096 1.84x")


@dataclass(frozen=True)
class Tables:
    """Everything routing reads; `DEFAULT` is the measured set."""

    oneshot_max_bytes: Table = ONESHOT_MAX_BYTES
    p2p_min_bytes: Table = P2P_MIN_BYTES
    fused_max_bytes: Table = FUSED_MAX_BYTES
    overlap_launch_max_bytes: Table = OVERLAP_LAUNCH_MAX_BYTES
    shape: KernelShape = field(default_factory=KernelShape)
    p2p_min_bytes_forced: int | None = None        # ECHO_P2P_MIN_BYTES
    oneshot_max_bytes_forced: int | None = None    # ECHO_ONESHOT_MAX_BYTES

    def oneshot_cap(self, world_size: int) -> tuple[int, str]:
        if self.oneshot_max_bytes_forced is not None:
            return self.oneshot_max_bytes_forced, "ECHO_ONESHOT_MAX_BYTES"
        return self.oneshot_max_bytes.lookup(world_size)

    def p2p_gate(self, world_size: int, state_bytes: int) -> tuple[int | None, str]:
        if self.p2p_min_bytes_forced is not None:
            return self.p2p_min_bytes_forced, "ECHO_P2P_MIN_BYTES"
        t = self.p2p_min_bytes
        key = (world_size, state_bytes)
        if key not in t.entries and (P2P_MIN_BYTES_UNMEASURED_P, state_bytes) in t.entries:
            m = t.entries[(P2P_MIN_BYTES_UNMEASURED_P, state_bytes)]
            return m.value, f"{m.source} (measured at P={P2P_MIN_BYTES_UNMEASURED_P})"
        return t.lookup(key)

    def with_overrides(self, *, p2p_min_bytes: int | None,
                       oneshot_max_bytes: int | None) -> "Tables":
        return replace(self, p2p_min_bytes_forced=p2p_min_bytes,
                       oneshot_max_bytes_forced=oneshot_max_bytes)


DEFAULT = Tables()


def entries() -> list[tuple[str, Measured]]:
    """(name, entry) for every measured entry (the test that each names an existing record)."""
    out = []
    for name in ("oneshot_max_bytes", "p2p_min_bytes", "fused_max_bytes",
                 "overlap_launch_max_bytes"):
        for k, m in getattr(DEFAULT, name).entries.items():
            out.append((f"{name}[{k}]", m))
    s = DEFAULT.shape
    for name in ("step_elems", "tiles_per_segment", "num_warps"):
        for k, m in getattr(s, name).items():
            out.append((f"shape.{name}[{k}]", m))
    for name in ("tile_max", "programs_per_sm", "overlap_lag_per_sm"):
        out.append((f"shape.{name}", getattr(s, name)))
    return out

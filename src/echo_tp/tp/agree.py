"""Real ranks run one width plan: the resolved per-site widths agreed once, when a model is
parallelized (or pointed at another communicator, tp.set_comm), not per call.

The communicator checks each call's fixed signature (kind, dtype, bits, direction) once
(echo_tp/agreement.py). A rank whose plan differs from its peer's can pass that check: a site
whose width was agreed at an earlier site skips it while the peer, at a new width, runs it, and
the ranks then send packets of different sizes (gloo aborts the one, the other waits out its
timeout). So the TP engine compares the whole plan up front: every static site's reduce width
and, under sequence parallelism, its all-gather width (tp.policy.site_width, with the
communicator config's own width), in one small all-gather over the group; ranks that differ
get one ValueError on every rank, naming each rank's widths.
"""
from __future__ import annotations

from echo_tp.collective.reference import DistTransport

from .plan import SITES_PER_LAYER

STAGE = "width-plan agreement (parallelize)"
"""The stage a peer wait names (collective/reference.py: PeerWaitError)."""


def plan_widths(tp) -> list[int]:
    """[sequence_parallel, n_sites, the sites' reduce widths..., (SP) their gather widths...]:
    what every real rank of tp's group must hold equal (None widths made the config's)."""
    n_sites = SITES_PER_LAYER * tp.n_layers
    bits = tp.comm.config.bits
    reduce = [bits if (b := tp.bits(s)) is None else b for s in range(n_sites)]
    gather = [tp.bits(s, "gather") for s in range(n_sites)] if tp.sequence_parallel else []
    return [int(tp.sequence_parallel), n_sites, *reduce, *gather]


def check_same_widths(tp) -> None:
    """Every real rank of tp.comm's group resolves the same per-site widths: a ValueError on
    every rank naming each rank's widths otherwise. Simulated models and groups of one: no-op.
    Two all-gathers of integers (the plan's length, then the plan), each waiting at most the
    group's timeout on a peer (PeerWaitError naming this rank and the stage)."""
    if tp.simulated or tp.world_size == 1:
        return
    mine = plan_widths(tp)
    transport = DistTransport(tp.comm.group)
    lengths = transport.all_gather_ints([len(mine)], device="cpu", stage=STAGE)
    width = max(n for (n,) in lengths)
    padded = mine + [-1] * (width - len(mine))
    got = transport.all_gather_ints(padded, device="cpu", stage=STAGE)
    plans = [list(g[:n]) for g, (n,) in zip(got, lengths)]
    if any(p != plans[0] for p in plans):
        raise ValueError("the TP ranks' width plans differ: "
                         + "; ".join(f"rank {r} {_describe(p)}" for r, p in enumerate(plans))
                         + ". Every rank must parallelize with the same WidthPlan (policy, "
                         "edge_bits, gather_bits), config bits, layer count and "
                         "sequence_parallel; nothing was sent")


def _describe(plan: list[int]) -> str:
    sp, n = plan[0], plan[1]
    text = f"runs {n} sites{' sequence-parallel' if sp else ''}: reduce widths {plan[2:2 + n]}"
    return text + (f", gather widths {plan[2 + n:]}" if sp else "")

"""Every p2p call carries its length and width: the call word beside each flag, checked by the
kernels that wait for it (kernels/allreduce_kernels.py, flags.same_call), on the CPU under
TRITON_INTERPRET=1 with P simulated ranks in one process (stages run entry(all ranks) ->
reduce(all) -> tail(all), as collective/simulated_fused.py runs them). The cases live in
tests/header_cases.py; tests/test_kernels_gpu.py runs them compiled on one GPU (-k header).

  * calls of different lengths and widths on one room (kernels/allreduce_plan.Room) agree with
    the reference bit for bit, call after call (the counters, flags and headers of a shared
    workspace);
  * ranks whose calls differ (length, bits, quantizer, input dtype, one rank of three) get an
    error record on every rank naming both calls, the host raises a ValueError, and the
    failed call's output is NaN everywhere, never stale memory; the halves too;
  * the call word written by the kernels is flags.host_call_word's.
The real-rank form (two GPUs, symmetric memory): tests/test_p2p_gpu.py -k header.
"""
from __future__ import annotations

import os

import pytest
import torch
from harness import interpret_kernels

interpret_kernels()                   # before triton.jit decorates anything
pytest.importorskip("triton")

import header_cases as hc  # noqa: E402

SEED = int(os.environ.setdefault("ECHO_TEST_SEED", str(int.from_bytes(os.urandom(4), "little"))))


def test_calls_of_any_length_share_one_room_bit_exact():
    hc.shared_room(SEED, "cpu")


@pytest.mark.parametrize("what", list(hc.MISMATCHES))
def test_ranks_whose_calls_differ_fail_on_every_rank(what):
    hc.mismatch(what, SEED, "cpu")


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
def test_halves_whose_calls_differ_fail_on_every_rank(kind):
    hc.half_mismatch(kind, SEED, "cpu")


def test_describe_call_reads_the_word_back():
    hc.describe_call_cases()


def _carried_agreement(rank: int, world: int) -> dict:
    """Agreement.check on a gloo group: calls whose packets carry their length (carried=True,
    what the communicator passes for a p2p route) agree on their fixed part once, whatever
    their lengths; other calls on each new length; a fixed part that differs still raises."""
    from echo_tp.agreement import Agreement
    from echo_tp.collective.reference import DistTransport
    from echo_tp.config import EchoConfig
    ag = Agreement(None, None)
    ag._transport = DistTransport(None)
    calls = []
    inner = ag._transport.all_gather_ints
    ag._transport.all_gather_ints = lambda *a, **k: (calls.append(1), inner(*a, **k))[1]
    cfg = EchoConfig(bits=4)
    for n in (10, 20 + rank, 30, 40 * (rank + 1)):     # lengths differ across ranks: unchecked
        ag.check(torch.zeros(n), cfg, "forward", "all_reduce", carried=True)
    out = {"carried": len(calls)}
    for n in (10, 20, 30):
        ag.check(torch.zeros(n), cfg, "forward", "all_reduce")
    out["exact"] = len(calls) - out["carried"]
    try:
        ag.check(torch.zeros(8), EchoConfig(bits=4 if rank == 0 else 8), "backward",
                 "all_reduce", carried=True)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_carried_calls_agree_on_their_fixed_part_once():
    from harness import run_ranks
    for rank, r in enumerate(run_ranks(2, _carried_agreement)):
        assert r["carried"] == 1 and r["exact"] == 3, (rank, r)
        assert r["error"] and "bits=4" in r["error"] and "bits=8" in r["error"], (rank, r)


def test_room_holds_grows_and_refuses():
    """allreduce_plan.Room: a call's layout inside a room keeps the room's slot, flag stride and
    bytes (so calls of any length address the same words), a call the room cannot hold is
    refused, growth at least doubles what grows and keeps what does not."""
    from echo_tp.config import EchoConfig
    from echo_tp.kernels import allreduce_plan as ap
    spec4, spec8 = EchoConfig(bits=4).quant_spec(), EchoConfig(bits=8).quant_spec()
    big = ap.Layout.needs(100_000, 4, spec8, 1024)
    for n, spec in ((1, spec4), (777, spec8), (100_000, spec4), (100_000, spec8)):
        lay = ap.Layout.build(n, 4, spec, 1024, room=big)
        assert (lay.slot, lay.stride, lay.nbytes) == (big.slot, big.tiles, big.nbytes(4))
        assert lay.tiles <= lay.stride and lay.scale_off < lay.slot
        words = (lay.nbytes - lay.flags_off) // 8          # flags, abort, headers: in the buffer
        assert 4 * 4 * lay.stride + 1 <= words
    with pytest.raises(ValueError, match="needs Room"):
        ap.Layout.build(200_000, 4, spec8, 1024, room=big)
    small = ap.Room(256, 2)
    assert small.grown(ap.Room(300, 1)) == ap.Room(512, 2)             # doubles the slot
    assert small.grown(ap.Room(2000, 9)) == ap.Room(2000, 9)           # or takes the need
    assert big.grown(big) == big and big.holds(small) and not small.holds(big)
    assert small.union(ap.Room(100, 5)) == ap.Room(256, 5)

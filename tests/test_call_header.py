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


class _FakeTransport:
    """The p2p backend's transport, its peers' needs given: all_gather_ints returns this rank's
    values and each peer's (kind, slot, tiles)."""

    def __init__(self, peers):
        self.peers, self.calls = peers, []

    def all_gather_ints(self, values, *, device, stage):
        self.calls.append((tuple(values), stage))
        return [tuple(values), *self.peers(values)]


def test_p2p_workspace_grows_only_when_a_call_needs_it(monkeypatch):
    """P2PBackend's host side without a GPU (its buffers faked): one workspace per kind; a call
    the room holds runs on it with no agreement, whatever its length; a larger one grows it
    once, to hold every rank's need, at least doubling; the old one is kept (graphs); a peer
    growing another kind is refused on this rank; growth inside graph capture is refused."""
    from echo_tp.collective import p2p
    from echo_tp.config import EchoConfig
    from echo_tp.kernels import allreduce_plan as ap

    class FakeWorkspace:
        def __init__(self, room, group, rank, world, device, err):
            self.room = room

    monkeypatch.setattr(p2p, "_Workspace", FakeWorkspace)
    monkeypatch.setattr(p2p, "_HalfWorkspaces", FakeWorkspace)
    b = object.__new__(p2p.P2PBackend)
    b.world_size, b.rank, b.group, b.device, b._err = 2, 0, None, torch.device("cpu"), None
    b._ws, b._retired = {}, []
    peer_need = {"slot": 0, "tiles": 0}
    b.transport = _FakeTransport(lambda v: [(v[0], max(v[1], peer_need["slot"]),
                                             max(v[2], peer_need["tiles"]))])
    cfg, tile = EchoConfig(bits=4), 1024
    x = lambda n: torch.empty(n, dtype=torch.bfloat16)             # noqa: E731
    spec = cfg.quant_spec()
    ws, lay = b._workspace(x(100_000), cfg, tile)
    assert len(b.transport.calls) == 1 and ws.room == ap.Layout.needs(100_000, 2, spec, tile)
    for n in (1, 5_000, 99_999, 100_000):                           # held: no agreement
        ws2, lay = b._workspace(x(n), cfg, tile)
        assert ws2 is ws and lay.room == ws.room and len(b.transport.calls) == 1
    peer_need["slot"] = 10 * ws.room.slot                           # a peer needs more
    ws3, _ = b._workspace(x(120_000), cfg, tile)                    # larger: one agreement
    assert len(b.transport.calls) == 2 and b._retired == [ws]
    assert ws3.room.slot == 10 * ws.room.slot and ws3.room.tiles >= ws.room.tiles
    ws4, _ = b._workspace(x(150_000), cfg, tile)                    # within the peer's need
    assert ws4 is ws3 and len(b.transport.calls) == 2
    hw, _ = b._workspace(x(4096), cfg, tile, "all_gather")          # another kind: its own
    assert hw is not ws3 and b._ws["all_gather"] is hw and len(b.transport.calls) == 3
    b.transport = _FakeTransport(lambda v: [(ap.HALF_CODES["reduce_scatter"], *v[1:])])
    with pytest.raises(ValueError, match="collective calls differ across ranks: rank 0 grows "
                                         "the workspace of all_reduce, rank 1 grows the "
                                         "workspace of reduce_scatter"):
        b._workspace(x(10_000_000), cfg, tile)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside CUDA graph capture"):
        b._workspace(x(20_000_000), cfg, tile)

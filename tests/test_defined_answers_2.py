"""Issue 28, items 3-6: the dead rank named first, zero-size inputs, bounded group timeouts, and
the call agreement that serving with varying lengths pays no collective for.

Compared:
  * run_ranks with a rank that dies mid-collective (os._exit(3), SIGKILL): the report opens with
    that rank and its exit code or signal, then the peer's failure;
  * zero-size inputs (0 tokens, a 0-wide hidden) to every collective and boundary: all_reduce
    (both directions), reduce_scatter, all_gather, all_reduce_add_rmsnorm (one dtype and two),
    at 4, 8 and 16 bits, simulated (P = 1, 2, 3) and on 2 gloo ranks: the output's shape and dtype
    are torch's (an empty tensor; torch's rms_norm for the boundary), and a zero-size call on
    one rank against a non-empty one on the other is a ValueError on both, first call or not;
  * serving on 2 gloo ranks: 120 distinct lengths in a random order, each in its own forward
    pass, then the same again: how many agreement collectives (int64 all-gathers) each pass
    runs (main: one per new length; now a handful for the first pass, none for the second),
    what the communicator keeps, and y bit for bit against SimulatedCommunicator on the same
    inputs (the in-band padding changes no value), a chunked call and the halves included;
  * ranks whose numels differ after both used that width (one numel new to its rank, or both
    made by both before: a silent wrong sum on main): the in-band header makes it a ValueError
    on both ranks naming both calls, with no collective of its own (4 and 8 bits, both
    directions, both halves), and the communicator is usable after; the 16-bit calls' exact
    cache is bounded (LRU);
  * from_group on a group that waits torch's default 30 minutes logs one warning (and none for
    a bounded group), and every README / docs/usage example builds its group with a timeout.
Where to look first: launch.py (_failure, _dead) for the dead rank; agreement.py
(Agreement.check, in_band) and collective/inband.py + reference.py (the header, the widths) for
the agreement; norm.py (sum_of_squares) and quant.py (_words) for zero-size.
"""
import logging
import os
import random
import re
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from echo_tp import EchoCommunicator, EchoConfig, SimulatedCommunicator, agreement
from echo_tp.collective import chunked
from echo_tp.collective.inband import FLOOR, Widths, byte_numels, byte_row, wire_len
from echo_tp.launch import group_timeout
from harness import bits_differ, run_ranks

README = Path(__file__).resolve().parents[1] / "README.md"
HIDDEN = 32
LENGTHS = 120
BITS = (4, 8, 16)


# ----- 3. a rank that dies mid-collective is named first --------------------------------------
def _die_mid_call(rank, world_size, how):
    comm = EchoCommunicator.from_group(None, EchoConfig(bits=4))
    comm.all_reduce(torch.ones(1024))
    if rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(torch.ones(1024))
    return rank


@pytest.mark.parametrize("how,reason", [("exit", "exit code 3"), ("kill", "signal SIGKILL")])
def test_the_dead_rank_is_named_first(how, reason):
    with pytest.raises(RuntimeError) as e:
        run_ranks(2, _die_mid_call, how, timeout=120.0)
    summary = e.value.summary
    assert summary.startswith(f"rank 1 died ({reason})"), summary
    assert e.value.rank == 1


# ----- 4. zero-size inputs, simulated ----------------------------------------------------------
ZERO_SHAPES = [(0,), (0, HIDDEN), (3, 0), (2, 0, HIDDEN)]


def _zero_calls(comm, b: int, bits: int):
    """(name, output, expected shape) of every collective on zero-size inputs; b = 1 with a
    leading virtual-rank dim (simulated), else 0."""
    P = comm.world_size
    lead = (P,) if b else ()
    out = []
    for shape in ZERO_SHAPES:
        x = torch.zeros(*lead, *shape)
        for direction in ("forward", "backward"):
            out.append((f"all_reduce {shape} {direction}",
                        comm.all_reduce(x, bits=bits, direction=direction), x.shape))
        out.append((f"all_gather {shape}", comm.all_gather(x, bits=bits),
                    (*lead, shape[0] * P, *shape[1:])))
        if shape[0] % P == 0:
            out.append((f"reduce_scatter {shape}", comm.reduce_scatter(x, bits=bits),
                        (*lead, shape[0] // P, *shape[1:])))
    for h, dtypes in ((HIDDEN, (torch.float32, torch.float32)), (HIDDEN, (torch.bfloat16,
                                                                          torch.float32)),
                      (0, (torch.float32, torch.float32))):
        partial = torch.zeros(*lead, 0 if h else 3, h, dtype=dtypes[0])
        residual = torch.zeros(0 if h else 3, h, dtype=dtypes[1])
        normed, res = comm.all_reduce_add_rmsnorm(partial, residual, torch.ones(h), 1e-6,
                                                  bits=bits)
        want = torch.nn.functional.rms_norm(residual, (h,), torch.ones(h), 1e-6)
        out.append((f"add_rmsnorm H={h} {dtypes}", normed, (*lead, *want.shape)))
        out.append((f"add_rmsnorm residual H={h} {dtypes}", res, (*lead, *want.shape)))
    return out


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("bits", BITS)
def test_zero_size_simulated(P, bits):
    comm = SimulatedCommunicator(P, EchoConfig(bits=4))
    with comm.pass_scope("forward"), comm.pass_scope("backward"):
        for name, y, shape in _zero_calls(comm, 1, bits):
            assert tuple(y.shape) == tuple(shape) and y.numel() == 0, (name, y.shape, shape)
            assert y.dtype in (torch.float32, torch.bfloat16), name


def test_zero_rows_in_the_norm_reference():
    from echo_tp.norm import add_rmsnorm_reference, rmsnorm_reference
    for shape in ((0, 8), (3, 0), (0, 0)):
        y = torch.zeros(shape)
        normed, r = add_rmsnorm_reference(y, y, torch.ones(shape[-1]), 1e-6)
        assert normed.shape == r.shape == y.shape
        assert rmsnorm_reference(y, torch.ones(shape[-1]), 1e-6).shape == y.shape


# ----- 4, 5, 6 on 2 gloo ranks: one spawned run -----------------------------------------------
def serving_inputs(rank: int):
    """(order of token counts, per-call partials [t, HIDDEN]) of one rank."""
    order = list(range(1, LENGTHS + 1))
    random.Random(0).shuffle(order)
    return order, [torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(1000 * t + rank))
                   for t in order]


def _expect_error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "returned"


def _gloo_worker(rank, world_size):
    out = {}
    counted = {"n": 0}
    real_gather = dist.all_gather

    def counting(tensors, tensor, *a, **kw):
        counted["n"] += tensor.dtype == torch.int64
        return real_gather(tensors, tensor, *a, **kw)
    dist.all_gather = counting

    # 4. zero-size, and zero-size against non-empty (first call of a signature, then after)
    comm = EchoCommunicator.from_group(None, EchoConfig(bits=4))
    out["zero"] = [(n, tuple(y.shape), tuple(s)) for bits in BITS
                   for n, y, s in _zero_calls(comm, 0, bits)]
    mixed = []
    for bits in (4, 16):
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            fresh = EchoCommunicator.from_group(None, EchoConfig(bits=bits))
            # 16 bits: only a new signature is checked (an exact check, as on CUDA)
            for when in ("first", "after") if bits == 4 else ("first",):
                x = torch.ones(0 if rank == 0 else 8, 4)
                mixed.append(((bits, kind, when), _expect_error(
                    lambda: getattr(fresh, kind)(x))))
                getattr(fresh, kind)(torch.ones(8, 4))          # both ranks: the same call
    out["zero_mismatch"] = mixed

    # 6. serving: distinct lengths, each in its own pass; then the same lengths again
    order, xs = serving_inputs(rank)
    comm = EchoCommunicator.from_group(None, EchoConfig.from_name("echo4"))
    passes = []
    for _ in range(2):
        counted["n"] = 0
        ys = []
        for x in xs:
            comm.new_pass("forward")
            ys.append(comm.all_reduce(x))
        passes.append({"checks": counted["n"], "ys": ys, "agreed": len(comm.agreement._agreed),
                       "checked": len(comm.agreement._checked),
                       "widths": len(comm.dispatcher.backends["reference"].transport.widths)})
    out["serving"] = passes
    chunked.CHUNK_ELEMS = 1 << 12      # a chunked call (8 column chunks) and the halves
    g = torch.Generator().manual_seed(7 + rank)
    big, shard = torch.randn(32768, generator=g), torch.randn(8, HIDDEN, generator=g)
    comm.new_pass("backward")
    out["chunked"] = comm.all_reduce(big, direction="backward")
    out["halves"] = (comm.reduce_scatter(shard), comm.all_gather(shard))

    # 6. numels that differ after both ranks used that width: caught in-band
    cases = []
    for bits in (4, 8):
        comm = EchoCommunicator.from_group(None, EchoConfig(bits=bits))
        for direction in ("forward", "backward"):
            comm.all_reduce(torch.ones(1024), direction=direction)      # the width is agreed
            before = counted["n"]
            cases.append(((bits, "all_reduce", direction), _expect_error(lambda: comm.all_reduce(
                torch.ones(1024 if rank == 0 else 1000), direction=direction)),
                counted["n"] - before))
        for kind, rows in (("reduce_scatter", (8, 6)), ("all_gather", (4, 3))):
            getattr(comm, kind)(torch.ones(rows[0], 64))
            before = counted["n"]
            cases.append(((bits, kind, "forward"), _expect_error(lambda: getattr(comm, kind)(
                torch.ones(rows[rank], 64))), counted["n"] - before))
        comm.all_reduce(torch.ones(1000))                  # now both ranks have made both calls
        before = counted["n"]
        cases.append(((bits, "all_reduce", "both seen"), _expect_error(lambda: comm.all_reduce(
            torch.ones(1024 if rank == 0 else 1000))), counted["n"] - before))
        cases.append(((bits, "all_reduce", "both new"), _expect_error(
            lambda: comm.all_reduce(torch.ones(4096 if rank == 0 else 8192))), None))
        cases.append(((bits, "usable after"), comm.all_reduce(torch.ones(1024)), None))
    out["mismatch"] = cases

    # 6. the exact checks of 16-bit (and CUDA) calls are bounded
    agreement.MAX_CHECKED = 8
    comm = EchoCommunicator.from_group(None, EchoConfig(bits=16))
    sums = [bool(torch.equal(comm.all_reduce(torch.ones(n)), torch.full((n,), 2.0)))
            for n in list(range(1, 21)) + [1, 2]]
    out["bounded"] = (sums, len(comm.agreement._checked))

    # 5. one warning for a group that waits torch's default 30 minutes
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("echo_tp").addHandler(handler)
    long_group = dist.new_group([0, 1])
    for group in (long_group, long_group, dist.new_group([0, 1], timeout=group_timeout()), None):
        EchoCommunicator.from_group(group, EchoConfig(bits=4))
    out["warnings"] = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    return out


@pytest.fixture(scope="module")
def gloo():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ECHO_COLLECTIVE_TIMEOUT_S", "60")   # a case that hangs fails in a minute
        return run_ranks(2, _gloo_worker, timeout=300.0)


def test_zero_size_on_gloo_ranks(gloo):
    for r in range(2):
        for name, got, want in gloo[r]["zero"]:
            assert got == want, (r, name, got, want)


def test_zero_size_against_non_empty_is_an_error_on_both_ranks(gloo):
    for r in range(2):
        for case, msg in gloo[r]["zero_mismatch"]:
            assert "differ across ranks" in msg and "numel=0" in msg, (r, case, msg)


def test_serving_pays_no_agreement_per_new_length(gloo):
    for r in range(2):
        first, again = gloo[r]["serving"]
        # main ran one agreement per new length (LENGTHS); a new widest row still pays one
        assert 1 <= first["checks"] <= 20, first["checks"]
        assert again["checks"] == 0
        assert again["agreed"] == 1 and again["checked"] == 0 and again["widths"] <= 2, again


def test_serving_results_are_the_simulated_ones_bit_for_bit(gloo):
    _, xs0 = serving_inputs(0)
    _, xs1 = serving_inputs(1)
    sim = SimulatedCommunicator(2, EchoConfig.from_name("echo4"))
    for i, (a, b) in enumerate(zip(xs0, xs1)):
        sim.new_pass("forward")
        want = sim.all_reduce(torch.stack([a, b]))
        for r in range(2):
            for p in range(2):
                assert not bits_differ(gloo[r]["serving"][p]["ys"][i], want[r]).any(), (i, r, p)
    g0, g1 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)
    big = torch.stack([torch.randn(32768, generator=g0), torch.randn(32768, generator=g1)])
    shard = torch.stack([torch.randn(8, HIDDEN, generator=g0), torch.randn(8, HIDDEN,
                                                                           generator=g1)])
    sim = SimulatedCommunicator(2, EchoConfig.from_name("echo4"))
    sim.new_pass("backward")
    want = sim.all_reduce(big, direction="backward")
    halves = (sim.reduce_scatter(shard), sim.all_gather(shard))
    for r in range(2):
        assert not bits_differ(gloo[r]["chunked"], want[r]).any(), r
        for got, w in zip(gloo[r]["halves"], halves):
            assert not bits_differ(got, w[r]).any(), r


def test_numels_that_differ_in_a_known_width_are_caught_in_band(gloo):
    for r in range(2):
        for case, msg, agreements in gloo[r]["mismatch"]:
            if case[-1] == "usable after":
                assert torch.equal(msg, gloo[1 - r]["mismatch"][-1][1])
                continue
            assert "differ across ranks" in msg and "rank 1 calls" in msg, (r, case, msg)
            if agreements is not None:
                assert agreements == 0, (case, agreements)   # no collective of its own


def test_exact_checks_are_bounded(gloo):
    for r in range(2):
        sums, kept = gloo[r]["bounded"]
        assert all(sums) and kept == 8, (sums, kept)


def test_a_long_group_timeout_warns_once(gloo):
    for r in range(2):
        warnings = gloo[r]["warnings"]
        assert len(warnings) == 1, warnings
        assert "1800 s" in warnings[0] and "ECHO_COLLECTIVE_TIMEOUT_S" in warnings[0]


def test_readme_examples_build_groups_with_a_timeout():
    pages = [README, *sorted((README.parent / "docs" / "usage").glob("*.md"))]
    blocks = [b for page in pages
              for b in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]
    code = [line.split("#")[0] for b in blocks for line in b.splitlines()]
    calls = [c for line in code for c in re.findall(r"(?:init_process_group|new_group)\((.*)",
                                                    line)]
    assert calls and all("timeout=" in c for c in calls), calls


# ----- the wire format, alone ------------------------------------------------------------------
def test_width_classes_bound_the_padding():
    prev = 0
    for w in list(range(0, 5000)) + [10 ** 6 + 1, 2 ** 31 - 1]:
        c = wire_len(w)
        assert c >= max(w, FLOOR) and c >= prev
        assert w <= FLOOR or c - w <= w / 8, (w, c)
        prev = c
    assert len({wire_len(w) for w in range(FLOOR + 1, 2 * FLOOR + 1)}) == 8   # 8 an octave


def test_headers_round_trip_and_widths_remember_the_widest():
    rows = torch.randint(0, 256, (3, 100), dtype=torch.uint8)
    for n in (0, 1, 12345, 2 ** 40 + 7):
        wire = byte_row(rows, 128, n)
        assert torch.equal(wire[:, :100], rows) and not wire[:, 100:128].any()
        assert byte_numels(wire, 128) == [n] * 3
    widths = Widths()
    assert not widths.knows("all_to_all", 256)
    widths.add("all_to_all", 512)
    assert widths.knows("all_to_all", 256) and widths.knows("all_to_all", 512)
    assert not widths.knows("all_to_all", 640) and not widths.knows("all_gather", 256)

"""The reduce-scatter and all-gather halves on the stage kernels against their pure-torch
reference, on the CPU under TRITON_INTERPRET=1 (issue 20 item 4). Compared bit for bit:

  * collective.simulated_fused.SimulatedFused.reduce_scatter (entry -> reduce with HALF=1 over P
    per-rank buffers: the owner sum stored as y, no requantization)  vs
    collective.sharded.compensated_reduce_scatter over SimTransport;
  * SimulatedFused.all_gather (encode = the reduce kernel with HALF=2, then the tail over all
    P owners)  vs  collective.sharded.compensated_all_gather; every rank's row identical;
    y and the compensator state (m1, m2) after each of 3 consecutive calls (2 at P=4) on
    fresh random inputs (ECHO_TEST_SEED), P = 2 and 4, bits 4 and 8, bf16 and fp32 inputs,
    no state / the paper's fp32 pair / the default single bf16 tensor, forward and backward
    (the power of two over the group); chunks of 3 groups in tiles of 2 (a partial tile per
    segment); with the outlier word (QuantSpec.outlier) too: P = 2/3/4, bits 4/8, the three
    policies, bf16/fp16/fp32, massive values, ties, a NaN now and then;
  * kernels.fits.fits: which halves the kernels refuse, and why;
  * kernels.allreduce_plan.next_call (the p2p halves' pair of workspaces used in turn): each
    call bumps the pair's epoch once and points the table at workspace epoch % 2.
The GPU forms (compiled, larger sizes, P up to 8): tests/test_kernels_gpu.py -k halves.
One tolerance: any NaN matches any NaN (payloads). When y differs, look first at
allreduce_kernels._reduce_tile's HALF branches (the y store at e - RANK*seg; the division by
2^e); when only the state of the own chunk differs, at the u = 0 update there (the reference
adds +0.0); when the all-gather's state differs, at the HALF=2 update (x' - decode(encode(x'))
before the division by 2^e, as sharded.compensated_all_gather).
"""
from __future__ import annotations

import os

import pytest
import torch
from harness import assert_bits_equal, interpret_kernels, two_timescale

interpret_kernels()                   # before triton.jit decorates anything
pytest.importorskip("triton")

from echo_tp.collective.sharded import (compensated_all_gather,  # noqa: E402
                                        compensated_reduce_scatter)
from echo_tp.collective.simulated import SimTransport  # noqa: E402
from echo_tp.compensator import CompState  # noqa: E402
from echo_tp.config import EchoConfig  # noqa: E402
from echo_tp.kernels.allreduce_plan import next_call  # noqa: E402
from echo_tp.kernels.fits import fits  # noqa: E402
from echo_tp.collective.simulated_fused import SimulatedFused  # noqa: E402

SEED = int(os.environ.setdefault("ECHO_TEST_SEED", str(int.from_bytes(os.urandom(4), "little"))))
G = 128
M = 3 * G                               # values per chunk: 3 groups, tiles of 2 groups

# (P, bits, quantizer, input dtype, state: None | 'pair' (paper, fp32) | 'default', backward,
# outlier: QuantSpec.outlier)
CASES = [
    (2, 4, "zero_aware", "bfloat16", "pair", False, False),
    (2, 8, "symmetric", "float32", None, True, False),
    (2, 4, "zero_aware", "bfloat16", "default", True, False),
    (4, 4, "zero_aware", "float32", "pair", True, False),
    (4, 8, "naive", "bfloat16", "default", False, False),
    (4, 4, "zero_aware", "bfloat16", None, False, False),
    (2, 4, "symmetric", "float16", "pair", False, True),
    (3, 8, "zero_aware", "bfloat16", "default", True, True),
    (4, 4, "naive", "float32", None, False, True),
    (2, 8, "naive", "float16", "default", False, True),
    (3, 4, "zero_aware", "float32", "pair", False, True),
]


def _config(bits: int, quantizer: str, state: str | None, outlier: bool = False) -> EchoConfig:
    if state is None:
        return EchoConfig(bits=bits, quantizer=quantizer, eta=0.0, outlier=outlier)
    if state == "pair":
        return two_timescale(bits=bits, quantizer=quantizer, outlier=outlier)
    return EchoConfig(bits=bits, quantizer=quantizer, outlier=outlier)   # one bf16 tensor


def _input(P: int, n: int, dtype, backward: bool, gen, outlier: bool = False) -> torch.Tensor:
    """[P, n]: groups of widely different magnitudes, an outlier channel, a zero group;
    gradients tiny (the backward scaling brings them up). outlier: also a group of ties of
    the largest |value| (+-v), massive values x300-x3000 here and there, a NaN in a call in
    three (the outlier word's cases)."""
    x = torch.randn(P, n, generator=gen)
    x *= torch.exp(torch.randn(P, n // G, generator=gen) * 2).repeat_interleave(G, dim=1)
    x[:, 5::97] *= 30.0
    x[:, G:2 * G] = 0.0
    if outlier:
        x[:, 2 * G + 3], x[:, 2 * G + 9] = 5000.0, -5000.0            # tied largest |values|
        pick = torch.rand(P, n, generator=gen) < 0.01
        x[pick] *= 300.0 * (1 + 9 * torch.rand(int(pick.sum()), generator=gen))
        if float(torch.rand(1, generator=gen)) < 0.34:
            x[P - 1, n // 2 + 1] = float("nan")
    return (x * (1e-6 if backward else 1.0)).to(dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
def test_halves_match_sharded_reference(kind, case):
    """y and (m1, m2) after each of 3 calls (2 at P=4: the interpreter's time), bit for bit;
    all-gather rows identical."""
    P, bits, qz, dtype, state, backward, outlier = case
    cfg = _config(bits, qz, state, outlier)
    n = P * M if kind == "reduce_scatter" else M              # a rank's input
    sdt = torch.bfloat16 if state == "default" else torch.float32
    st = CompState.zeros((P, n), "cpu", sdt, compact=state == "default") if state else None
    st_r = CompState.zeros((P, n), "cpu", sdt, compact=state == "default") if state else None
    sim = SimulatedFused(P, tile_elems=2 * G, step_elems=G)
    ref = compensated_reduce_scatter if kind == "reduce_scatter" else compensated_all_gather
    gen = torch.Generator().manual_seed(SEED + 100 * P + 10 * bits + len(kind))
    for call in range(3 if P == 2 else 2):
        x = _input(P, n, getattr(torch, dtype), backward, gen, outlier)
        y = getattr(sim, kind)(x, cfg, state=st, backward=backward)
        y_r = ref(x, cfg, SimTransport(P), state=st_r, backward=backward)
        assert_bits_equal(y, y_r, f"call {call} y")
        if state:
            assert_bits_equal(st.m1, st_r.m1, f"call {call} m1")
            assert_bits_equal(st.m2, st_r.m2, f"call {call} m2")
            assert st.compact == (state == "default")
        if kind == "all_gather":
            assert all(torch.equal(y[0].view(torch.uint8), y[r].view(torch.uint8))
                       for r in range(P)), call
    if state:
        assert st.m1.abs().amax() > 0                          # the state was written


def test_fits_says_why_for_the_halves():
    """The kernels take chunks of whole groups of a 1-D contiguous bf16/fp16/fp32 tensor at 4
    or 8 bits; the other calls get a reason (and SimulatedFused a ValueError)."""
    cfg = EchoConfig()
    P = 4
    assert fits("reduce_scatter", torch.zeros(P * M), cfg, world_size=P) is None
    assert fits("all_gather", torch.zeros(M), cfg, world_size=P) is None
    for qz in ("zero_aware", "naive", "symmetric"):                  # the outlier word too
        ocfg = EchoConfig(bits=8, quantizer=qz, outlier=True)
        assert fits("reduce_scatter", torch.zeros(P * M), ocfg, world_size=P) is None
        assert fits("all_reduce", torch.zeros(1000), ocfg, world_size=P) is None
    assert "equal chunks" in fits("reduce_scatter", torch.zeros(P * M + 1), cfg, world_size=P)
    assert "whole number" in fits("reduce_scatter", torch.zeros(P * 200), cfg, world_size=P)
    assert "whole number" in fits("all_gather", torch.zeros(200), cfg, world_size=P)
    assert "empty" in fits("all_gather", torch.zeros(0), cfg, world_size=P)
    assert "bits=16" in fits("all_gather", torch.zeros(M), EchoConfig(bits=16), world_size=P)
    assert "1-D" in fits("all_gather", torch.zeros(3, G), cfg, world_size=P)
    wrong = CompState.zeros((M,), "cpu", torch.float32)             # config says bf16
    assert "state" in fits("all_gather", torch.zeros(M), cfg, world_size=P, state=wrong)
    with pytest.raises(ValueError, match="kind"):
        fits("broadcast", torch.zeros(M), cfg, world_size=P)
    with pytest.raises(ValueError, match="whole number"):
        SimulatedFused(2).all_gather(torch.zeros(2, 200), cfg, state=None)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_next_call_alternates_the_half_workspaces(P):
    """epoch += 1 and table = tables[epoch % 2] on every call, P + 1 words (the P buffers and
    the error record), nothing else written."""
    tables = torch.randint(1, 1 << 40, (2, P + 1), dtype=torch.int64)
    table = torch.full((P + 2,), -1, dtype=torch.int64)       # one guard word after the table
    epoch = torch.zeros(1, dtype=torch.int64)
    for call in range(5):
        next_call(epoch, tables, table[:P + 1])
        assert int(epoch) == call + 1
        assert torch.equal(table[:P + 1], tables[(call + 1) % 2]), call
        assert int(table[P + 1]) == -1


def _concurrent_half_rank(rank, P, kind, bufs, errs, xs, ys, m1s, m2s, cfg):
    """One rank in its own process, as P2PBackend runs a half: a pair of workspaces (bufs[w]
    [P] shared byte buffers) used in turn through next_call, calls of one kind back to back
    with no barrier; one rank per call is slow to read (it sleeps between its writing stage
    and its reading one), so a fast peer's next call would overwrite what it still reads if
    both calls shared one workspace."""
    import time

    from echo_tp.kernels import allreduce_plan as ap
    torch.set_num_threads(1)
    n_lay = xs.shape[-1] * (P if kind == "all_gather" else 1)
    lay = ap.Layout.build(n_lay, P, cfg.quant_spec(), tile_elems=2 * G)
    tables = torch.stack([torch.tensor([b.data_ptr() for b in bufs[w]] + [errs[rank].data_ptr()])
                          for w in range(2)])                          # [2, P+1]
    table = tables[0].clone()
    epoch = torch.zeros(1, dtype=torch.int64)
    state = CompState(m1s[rank], m2s[rank])
    first, second = ("entry", "reduce") if kind == "reduce_scatter" else ("encode", "tail")
    for call in range(xs.shape[0]):
        next_call(epoch, tables, table)
        plan = ap.CallPlan(rank=rank, lay=lay, cfg=cfg, x=xs[call, rank], state=state, fs=None,
                           epoch=epoch, table=table, timeout=300_000, use_timer=False,
                           num_warps=4, step_elems=G, half=kind)
        getattr(plan, first)()
        time.sleep(2.0 if rank == call % P else 0.0)           # this rank reads late
        getattr(plan, second)(ys[call, rank])


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
def test_half_calls_back_to_back_in_concurrent_processes(kind):
    """The double-buffered halves with real concurrency: P=3 processes share their buffers (as
    symmetric memory would), 4 calls of one kind back to back, one slow reader per call; every
    rank's y and state equal the reference's, call after call (collective/p2p._HalfWorkspaces
    gives the argument). With both tables pointing at one workspace it fails for both kinds
    (checked when it was written: a fast rank's next call overwrites the slow reader's slots)."""
    import torch.multiprocessing as mp

    from echo_tp.kernels import allreduce_plan as ap
    from echo_tp.kernels.flags import describe_error
    P, calls = 3, 4
    cfg = EchoConfig()                                  # the default: one bf16 state tensor
    n = P * M if kind == "reduce_scatter" else M
    lay = ap.Layout.build(n * (P if kind == "all_gather" else 1), P, cfg.quant_spec(),
                          tile_elems=2 * G)
    bufs = [[torch.randint(0, 256, (lay.nbytes,), dtype=torch.uint8).share_memory_()
             for _ in range(P)] for _ in range(2)]
    for pair in bufs:
        for b in pair:
            lay.flag_words(b).zero_()
    errs = [torch.zeros(8, dtype=torch.int64).share_memory_() for _ in range(P)]
    gen = torch.Generator().manual_seed(SEED + 7)
    xs = torch.stack([_input(P, n, torch.bfloat16, False, gen) for _ in range(calls)])
    xs = xs.share_memory_()
    out = n // P if kind == "reduce_scatter" else n * P
    ys = torch.empty(calls, P, out, dtype=torch.bfloat16).share_memory_()
    m1s = torch.zeros(P, n, dtype=torch.bfloat16).share_memory_()
    mp.start_processes(_concurrent_half_rank, args=(P, kind, bufs, errs, xs, ys, m1s, m1s, cfg),
                       nprocs=P, start_method="spawn")
    for r in range(P):
        assert describe_error(errs[r]) is None, describe_error(errs[r])
    ref = CompState.zeros((P, n), "cpu", torch.bfloat16, compact=True)
    fn = compensated_reduce_scatter if kind == "reduce_scatter" else compensated_all_gather
    for call in range(calls):
        want = fn(xs[call], cfg, SimTransport(P), state=ref)
        assert_bits_equal(ys[call], want, f"y call={call}")
    assert_bits_equal(m1s, ref.m1, "state")

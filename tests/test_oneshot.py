"""The 16-bit one-shot kernels (kernels/oneshot_kernels.py) on the CPU under TRITON_INTERPRET=1:
P processes share their buffers (as symmetric memory would) and run several calls back to back
with varying sizes and dtypes, one rank late each time; every y must equal the pure-torch
reference bit for bit on every rank. The decode block boundary (one-shot sum + residual add +
RMSNorm in one kernel) must give norm.add_rmsnorm_reference of that sum bit for bit, both in
concurrent processes and as P ranks in one process (push phase of every rank, then the sum
phase). A rank whose peer never pushes times out with a record naming rank, stage and tile.
First look: oneshot_reference / oneshot_add_rmsnorm_reference, then the kernel's rank order."""
from __future__ import annotations

import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from harness import bits_differ  # noqa: E402

from echo_tp.kernels import oneshot_kernels as ok  # noqa: E402
from echo_tp.kernels.flags import describe_error  # noqa: E402

CAP = 24_000          # bytes per rank: up to 12k bf16 values = 6 tiles
CALLS = [(5000, torch.bfloat16), (1, torch.float16), (12_000, torch.bfloat16),
         (3000, torch.float32), (2048, torch.float16)]


def _inputs(P: int) -> list[torch.Tensor]:
    """Per call [P, n] of the call's dtype: mixed magnitudes, signed zeros, a NaN."""
    out = []
    for c, (n, dtype) in enumerate(CALLS):
        g = torch.Generator().manual_seed(100 + c)
        x = torch.randn(P, n, generator=g) * torch.exp(torch.randn(P, 1, generator=g) * 3)
        x[:, :4] = torch.tensor([0.0, -0.0, 65000.0, -1e-30])[: min(4, n)]
        if n > 100:
            x[P - 1, 77] = float("nan")
        out.append(x.to(dtype).share_memory_())
    return out


def _rank(rank, P, bufs, errs, xs, ys, lay, programs):
    torch.set_num_threads(1)
    table = torch.tensor([b.data_ptr() for b in bufs] + [errs[rank].data_ptr()])
    epochs = torch.zeros(programs, dtype=torch.int64)
    for call, x in enumerate(xs):
        time.sleep(0.4 if rank == call % P else 0.0)
        ok.oneshot(x[rank], ys[call][rank], rank=rank, lay=lay, epochs=epochs, table=table,
                   timeout=400_000, use_timer=False)


@pytest.mark.parametrize("P,programs", [(2, 2), (3, 4), (8, 3)])
def test_oneshot_concurrent_ranks_match_reference(P, programs):
    import torch.multiprocessing as mp
    lay = ok.OneShotLayout.build(P, CAP)
    bufs = [torch.randint(0, 256, (lay.nbytes,), dtype=torch.uint8).share_memory_()
            for _ in range(P)]
    for b in bufs:
        lay.flag_words(b).zero_()
    errs = [torch.zeros(8, dtype=torch.int64).share_memory_() for _ in range(P)]
    xs = _inputs(P)
    ys = [torch.full_like(x, 7.0).share_memory_() for x in xs]
    mp.start_processes(_rank, args=(P, bufs, errs, xs, ys, lay, programs), nprocs=P,
                       start_method="spawn")
    for r in range(P):
        assert describe_error(errs[r]) is None, describe_error(errs[r])
    for call, (x, y) in enumerate(zip(xs, ys)):
        want = ok.oneshot_reference(list(x.unbind(0)))
        for r in range(P):
            bad = bits_differ(y[r], want)
            assert not bool(bad.any()), f"call {call} rank {r}: {int(bad.sum())} differ"
        if x.dtype != torch.float32:           # fp32 accumulation, one rounding
            exact = x.double().sum(0)
            err = (y[0].double() - exact).abs()
            fin = exact.isfinite() & (exact.abs() < 6e4)
            assert bool((err[fin] <= exact[fin].abs() * 2.0 ** -7 + 1e-30).all())


def test_peer_a_call_ahead_leaves_the_slower_ranks_call_word():
    """Rank 1 sums call 0 and pushes call 1 (another length and dtype) before rank 0 sums
    call 0: rank 0 still finds rank 1's call-0 word (the headers have the slots' parity), so
    no false mismatch is recorded, and both calls equal the reference on both ranks."""
    P = 2
    lay, bufs, errs, tables, epochs = _ranks_in_one_process(P, CAP, 2)
    xs = _inputs(P)[:2]                           # 5000 bf16 values, then 1 fp16 value
    ys = [torch.full_like(x, 7.0) for x in xs]

    def run(r, c, phases):
        ok.oneshot(xs[c][r], ys[c][r], rank=r, lay=lay, epochs=epochs[r], table=tables[r],
                   timeout=50, use_timer=False, phases=phases)
    for r, c, phases in ((0, 0, 1), (1, 0, 1), (1, 0, 2), (1, 1, 1), (0, 0, 2), (0, 1, 1),
                         (0, 1, 2), (1, 1, 2)):
        run(r, c, phases)
    for r in range(P):
        assert describe_error(errs[r]) is None, describe_error(errs[r])
    for c, (x, y) in enumerate(zip(xs, ys)):
        want = ok.oneshot_reference(list(x.unbind(0)))
        for r in range(P):
            assert not bool(bits_differ(y[r], want).any()), (c, r)


def test_oneshot_times_out_naming_rank_stage_tile():
    lay = ok.OneShotLayout.build(2, CAP)
    bufs = [torch.zeros(lay.nbytes, dtype=torch.uint8) for _ in range(2)]
    err = torch.zeros(8, dtype=torch.int64)
    table = torch.tensor([b.data_ptr() for b in bufs] + [err.data_ptr()])
    x = torch.randn(3000).to(torch.bfloat16)
    ok.oneshot(x, torch.empty_like(x), rank=0, lay=lay, epochs=torch.zeros(2, dtype=torch.int64),
               table=table, timeout=50, use_timer=False)
    msg = describe_error(err)
    assert msg is not None and "rank 0 timed out in stage 3" in msg and "peer 1" in msg, msg


def test_layout_caps_and_rejects_large():
    lay = ok.OneShotLayout.build(4, 1 << 20)
    assert lay.slot % 256 == 0 and lay.flags_off == 8 * lay.slot
    assert lay.max_tiles * ok.TILE * 2 >= 1 << 20
    assert lay.fits(torch.empty(1 << 19, dtype=torch.bfloat16))
    assert not lay.fits(torch.empty((1 << 19) + 1, dtype=torch.bfloat16))


BOUNDARY_CALLS = [(3, 300, torch.bfloat16, torch.bfloat16), (2, 512, torch.float16, torch.float32),
                  (1, 64, torch.float32, torch.float32), (5, 1000, torch.bfloat16, torch.float32)]


def _boundary_inputs(P: int, seed: int):
    """Per call: xs [P, rows, H], residual [rows, H], weight [H] (fresh random, mixed scales)."""
    out = []
    for c, (rows, h, dt, wdt) in enumerate(BOUNDARY_CALLS):
        g = torch.Generator().manual_seed(seed + c)
        xs = (torch.randn(P, rows, h, generator=g)
              * torch.exp(torch.randn(P, 1, 1, generator=g) * 2)).to(dt)
        res = (torch.randn(rows, h, generator=g) * 3).to(dt)
        w = torch.randn(h, generator=g).to(wdt)
        out.append((xs.share_memory_(), res.share_memory_(), w.share_memory_()))
    return out


def _check_boundary(outs, calls, P):
    for c, (xs, res, w) in enumerate(calls):
        want = ok.oneshot_add_rmsnorm_reference(list(xs.unbind(0)), res, w, 1e-5)
        for r in range(P):
            for got, exp, what in zip(outs[c][r], want, ("normed", "residual_out")):
                bad = bits_differ(got, exp)
                assert not bool(bad.any()), f"call {c} rank {r} {what}: {int(bad.sum())} differ"


def _ranks_in_one_process(P: int, cap: int, programs: int):
    """P ranks' buffers (poisoned, flags zeroed), error records, pointer tables and epochs in
    this process -> (layout, bufs, errs, tables, epochs); the tables point into bufs."""
    lay = ok.OneShotLayout.build(P, cap)
    bufs = [torch.randint(0, 256, (lay.nbytes,), dtype=torch.uint8) for _ in range(P)]
    for b in bufs:
        lay.flag_words(b).zero_()
    errs = [torch.zeros(8, dtype=torch.int64) for _ in range(P)]
    tables = [torch.tensor([b.data_ptr() for b in bufs] + [errs[r].data_ptr()])
              for r in range(P)]
    return lay, bufs, errs, tables, [torch.zeros(programs, dtype=torch.int64) for _ in range(P)]


@pytest.mark.parametrize("P", [2, 3])
def test_decode_boundary_ranks_in_one_process_match_reference(P):
    lay, bufs, errs, tables, epochs = _ranks_in_one_process(P, 16_000, 2)
    calls = _boundary_inputs(P, 7)
    outs = []
    for xs, res, w in calls:
        assert ok.add_rmsnorm_unfit(xs[0], res, w, lay) is None
        got = [None] * P
        for phase in (1, 2):                # every rank's push, then every rank's sum
            for r in range(P):
                o = ok.oneshot_add_rmsnorm(xs[r], res, w, 1e-5, rank=r, lay=lay,
                                           epochs=epochs[r], table=tables[r], timeout=1000,
                                           use_timer=False, phases=phase)
                got[r] = o
        outs.append(got)
    for r in range(P):
        assert describe_error(errs[r]) is None, describe_error(errs[r])
    _check_boundary(outs, calls, P)


def _boundary_rank(rank, P, bufs, errs, calls, outs, lay):
    torch.set_num_threads(1)
    table = torch.tensor([b.data_ptr() for b in bufs] + [errs[rank].data_ptr()])
    epochs = torch.zeros(2, dtype=torch.int64)
    for c, (xs, res, w) in enumerate(calls):
        time.sleep(0.3 if rank == c % P else 0.0)
        ok.oneshot_add_rmsnorm(xs[rank], res, w, 1e-5, rank=rank, lay=lay, epochs=epochs,
                               table=table, timeout=400_000, use_timer=False,
                               out=outs[c][rank])


def test_decode_boundary_concurrent_ranks_match_reference():
    import torch.multiprocessing as mp
    P = 2
    lay = ok.OneShotLayout.build(P, 16_000)
    bufs = [torch.randint(0, 256, (lay.nbytes,), dtype=torch.uint8).share_memory_()
            for _ in range(P)]
    for b in bufs:
        lay.flag_words(b).zero_()
    errs = [torch.zeros(8, dtype=torch.int64).share_memory_() for _ in range(P)]
    calls = _boundary_inputs(P, 11)
    outs = [[(torch.full(res.shape, 7.0, dtype=torch.promote_types(w.dtype, res.dtype))
              .share_memory_(), torch.full_like(res, 7.0).share_memory_()) for _ in range(P)]
            for xs, res, w in calls]
    mp.start_processes(_boundary_rank, args=(P, bufs, errs, calls, outs, lay), nprocs=P,
                       start_method="spawn")
    for r in range(P):
        assert describe_error(errs[r]) is None, describe_error(errs[r])
    _check_boundary(outs, calls, P)


def test_decode_boundary_unfit_reasons():
    lay = ok.OneShotLayout.build(2, 4096)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    w = torch.ones(256, dtype=torch.bfloat16)
    assert ok.add_rmsnorm_unfit(x, x, w, lay) is None
    assert "exceed" in ok.add_rmsnorm_unfit(torch.zeros(16, 256, dtype=torch.bfloat16),
                                             torch.zeros(16, 256, dtype=torch.bfloat16), w, lay)
    assert "residual" in ok.add_rmsnorm_unfit(x, x.float(), w, lay)
    assert "rows of 0" in ok.add_rmsnorm_unfit(torch.zeros(4, 0), torch.zeros(4, 0), w, lay)


# (what differs, per rank: (n, dtype)); 'form': rank 1 runs the decode boundary (rows x H = n)
ONESHOT_MISMATCHES = {"length": [(5000, torch.bfloat16), (3000, torch.bfloat16)],
                      "dtype": [(3000, torch.bfloat16), (3000, torch.float16)],
                      "one of three": [(2048, torch.float16)] * 2 + [(2049, torch.float16)],
                      "form": [(4 * 512, torch.bfloat16), (4 * 512, torch.bfloat16)]}


@pytest.mark.parametrize("what", list(ONESHOT_MISMATCHES))
def test_oneshot_ranks_whose_calls_differ_fail_on_every_rank(what):
    """P ranks in one process (push of every rank, then the sums) whose calls differ: every
    rank records the mismatch (stage 6) naming both call words, raise_if_set raises
    ValueError, and the outputs are NaN (y; residual_out and normed of the boundary)."""
    from echo_tp.kernels.flags import describe_call, raise_if_set
    calls = ONESHOT_MISMATCHES[what]
    P, programs = len(calls), 2
    lay, bufs, errs, tables, epochs = _ranks_in_one_process(P, CAP, programs)
    xs = [torch.randn(n).to(dt) for n, dt in calls]
    outs = [torch.zeros_like(x) for x in xs]
    res, w = torch.randn(4, 512).to(torch.bfloat16), torch.randn(512).to(torch.bfloat16)
    boundary = [what == "form" and r == 1 for r in range(P)]
    normed = {}
    for phases in (1, 2):
        for r in range(P):
            kw = dict(rank=r, lay=lay, epochs=epochs[r], table=tables[r], timeout=50,
                      use_timer=False, phases=phases)
            if boundary[r]:
                normed[r], outs[r] = ok.oneshot_add_rmsnorm(xs[r].view(4, 512), res, w, 1e-5,
                                                            **kw)
            else:
                ok.oneshot(xs[r], outs[r], **kw)
    for r in range(P):
        rank, stage, tile, peer, seen, wanted = errs[r][1:7].tolist()
        assert errs[r][0] == 1 and rank == r and stage == 6 and seen != wanted, errs[r]
        msg = describe_error(errs[r])
        assert f"rank {r} called {describe_call(wanted)}" in msg, msg
        assert f"rank {peer} called {describe_call(seen)}" in msg, msg
        assert ("decode boundary" in msg) == (what == "form"), msg
        with pytest.raises(ValueError, match="collective calls differ"):
            raise_if_set(errs[r], errs[r].numpy())
        assert outs[r].isnan().all() and (r not in normed or normed[r].isnan().all()), r

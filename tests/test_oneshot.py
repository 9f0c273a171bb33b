"""The 16-bit one-shot kernel (kernels/oneshot_kernels.py) on the CPU under TRITON_INTERPRET=1:
P processes share their buffers (as symmetric memory would) and run several calls back to back
with varying sizes and dtypes, one rank late each time; every y must equal the pure-torch
reference bit for bit on every rank. A rank whose peer never pushes times out with a record
naming rank, stage and tile."""
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

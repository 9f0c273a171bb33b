"""The packet-header cases shared by tests/test_call_header.py (the Triton interpreter, CPU)
and tests/test_kernels_gpu.py (compiled, one GPU): P simulated ranks in one process over one
room (collective/simulated_fused.SimulatedFused), stages run entry(all ranks) -> reduce(all) ->
tail(all). Imports are inside the functions: the interpreted file sets TRITON_INTERPRET before
any kernel module is imported."""
from __future__ import annotations

import torch
from harness import assert_bits_equal, two_timescale

TILE = 256


def _x(P: int, n: int, dtype, seed: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(P, n, generator=gen) * 2).to(dtype).to(device)


def shared_room(seed: int, device) -> None:
    """Lengths up and down (tile counts 1 to 6) and both widths on the buffers of one
    SimulatedFused: y and the state equal the reference after every call."""
    from echo_tp.collective.qar import compensated_all_reduce
    from echo_tp.collective.simulated import SimTransport
    from echo_tp.collective.simulated_fused import SimulatedFused
    from echo_tp.compensator import CompState
    P = 3
    sim = SimulatedFused(P, tile_elems=TILE, step_elems=TILE)
    calls = [(2000, 4), (300, 4), (2000, 8), (777, 4), (1, 8), (1500, 4)]
    state = {bits: CompState.zeros((P, 2000), device) for bits in (4, 8)}
    ref = {bits: CompState.zeros((P, 2000), device) for bits in (4, 8)}
    rooms = set()
    for k, (n, bits) in enumerate(calls):
        cfg = two_timescale(bits=bits)
        x = _x(P, n, torch.bfloat16, seed + k, device)
        st, rs = state[bits], ref[bits]
        y = sim(x, cfg, state=CompState(st.m1[:, :n], st.m2[:, :n]))
        want, _ = compensated_all_reduce(x, cfg, SimTransport(P),
                                         state=CompState(rs.m1[:, :n], rs.m2[:, :n]))
        assert_bits_equal(y, want, f"y call {k} (n={n}, bits={bits}), seed {seed}")
        assert_bits_equal(st.m1, rs.m1, f"m1 after call {k}")
        rooms.add(id(sim._ws[str(x.device)]["bufs"][0]))
    assert len(rooms) <= 2            # the first call's room, grown at most once (8 bits)


# what differs -> each rank's call (n, bits, quantizer, dtype)
MISMATCHES = {
    "length": [(2000, 4, "zero_aware", torch.bfloat16), (1500, 4, "zero_aware", torch.bfloat16)],
    "longer": [(300, 4, "zero_aware", torch.bfloat16), (2000, 4, "zero_aware", torch.bfloat16)],
    "bits": [(1000, 4, "zero_aware", torch.bfloat16), (1000, 8, "zero_aware", torch.bfloat16)],
    "quantizer": [(1000, 4, "zero_aware", torch.float32), (1000, 4, "symmetric", torch.float32)],
    "dtype": [(1000, 4, "zero_aware", torch.bfloat16), (1000, 4, "zero_aware", torch.float32)],
    "one of three": [(1000, 4, "zero_aware", torch.bfloat16)] * 2
                    + [(1001, 4, "zero_aware", torch.bfloat16)],
}


def word(n, bits, quantizer, dtype, g=128, outlier=None) -> int:
    """The call word of a call (n, bits, quantizer, dtype) under EchoConfig's defaults."""
    from echo_tp.config import EchoConfig
    from echo_tp.kernels import flags
    from echo_tp.kernels.quant_kernels import DTYPE_KIND, QUANT_CODE
    spec = EchoConfig(bits=bits, quantizer=quantizer, group_size=g).quant_spec()
    return flags.host_call_word(n, g, bits, QUANT_CODE[quantizer],
                                spec.outlier if outlier is None else outlier, DTYPE_KIND[dtype])


def _room_after_a_good_call(sim, calls, cfgs, seed, device, halves: bool = False) -> dict:
    """One room that holds every rank's call, its flags and epochs live after one good call."""
    from echo_tp.config import EchoConfig
    P = len(calls)
    for (n, *_), cfg in zip(calls, cfgs):
        sim.workspace(n * (P if halves else 1), cfg.quant_spec(), device)
    sim(_x(P, 640, torch.bfloat16, seed, device), EchoConfig(bits=4), state=None)
    return sim._ws[str(device)]


def _check_records(ws, calls, ys, what, stage: int, refused=None) -> None:
    """Every rank recorded the mismatch with a peer whose call differs, names both calls and
    raises ValueError; its output is NaN where it used a refused packet (refused(y, rank,
    peer): that part; default all of y, as every value of an all-reduce sums every rank's)."""
    import pytest

    from echo_tp.kernels import flags
    for r, (err, err_np) in enumerate(zip(ws["errs"], ws["errs_np"])):
        rank, st, tile, peer, seen, wanted = err[1:7].tolist()
        assert err_np[0] == 1 and rank == r and st == stage, (what, r, err.tolist())
        assert wanted == word(*calls[r]) and seen == word(*calls[peer]), (what, r)
        assert calls[peer] != calls[r]
        msg = flags.describe_error(err)
        assert f"rank {r} called {flags.describe_call(wanted)}" in msg, msg
        assert f"rank {peer} called {flags.describe_call(seen)}" in msg, msg
        with pytest.raises(ValueError, match="collective calls differ across ranks"):
            flags.raise_if_set(err, err_np)
        part = ys[r] if refused is None else refused(ys[r], r, peer)
        assert part.isnan().all(), (what, r, part)


def mismatch(what: str, seed: int, device) -> None:
    """An all-reduce whose calls differ across ranks (MISMATCHES[what])."""
    from echo_tp.collective.simulated_fused import SimulatedFused
    from echo_tp.config import EchoConfig
    from echo_tp.kernels import allreduce_plan as ap
    calls = MISMATCHES[what]
    P = len(calls)
    sim = SimulatedFused(P, tile_elems=TILE, step_elems=TILE, timeout_polls=50)
    cfgs = [EchoConfig(bits=b, quantizer=q) for _, b, q, _ in calls]
    ws = _room_after_a_good_call(sim, calls, cfgs, seed, device)
    plans, ys = [], []
    ws["epoch"].add_(1)                                    # a new call on every rank
    for r, ((n, bits, q, dtype), cfg) in enumerate(zip(calls, cfgs)):
        lay = ap.Layout.build(n, P, cfg.quant_spec(), TILE, room=ws["room"])
        x = _x(1, n, dtype, seed + 1 + r, device)[0]
        ys.append(torch.zeros_like(x))                     # zeros: the kernels must overwrite
        plans.append(ap.CallPlan(rank=r, lay=lay, cfg=cfg, x=x, state=None, fs=None,
                                 epoch=ws["epoch"][r:r + 1], table=ws["tables"][r], timeout=50,
                                 use_timer=False, num_warps=4, step_elems=TILE))
    for stage in ("entry", "reduce", "tail"):
        for r, plan in enumerate(plans):
            plan.entry() if stage == "entry" else getattr(plan, stage)(ys[r])
    if device != "cpu":
        torch.cuda.synchronize()
    _check_records(ws, calls, ys, what, 4)


def half_mismatch(kind: str, seed: int, device) -> None:
    """A reduce-scatter (stage 4, the reduce) or all-gather (stage 5, the tail) whose shard
    lengths differ across 2 ranks (chunks of whole groups)."""
    from echo_tp.collective.simulated_fused import SimulatedFused
    from echo_tp.config import EchoConfig
    from echo_tp.kernels import allreduce_plan as ap
    P, m = 2, [3 * 128, 5 * 128]
    calls = [(mr * P, 4, "zero_aware", torch.bfloat16) for mr in m]   # the layout's P*m
    sim = SimulatedFused(P, tile_elems=TILE, step_elems=TILE, timeout_polls=50)
    cfg = EchoConfig(bits=4)
    ws = _room_after_a_good_call(sim, [(mr, *c[1:]) for mr, c in zip(m, calls)], [cfg] * P,
                                 seed, device, halves=True)
    plans, ys = [], []
    ws["epoch"].add_(1)                                    # a new call on every rank
    for r in range(P):
        lay = ap.Layout.build(m[r] * P, P, cfg.quant_spec(), TILE, room=ws["room"])
        n_in = m[r] * P if kind == "reduce_scatter" else m[r]
        x = _x(1, n_in, torch.bfloat16, seed + 1 + r, device)[0]
        ys.append(torch.zeros(m[r] if kind == "reduce_scatter" else m[r] * P,
                              dtype=torch.bfloat16, device=device))
        plans.append(ap.CallPlan(rank=r, lay=lay, cfg=cfg, x=x, state=None, fs=None,
                                 epoch=ws["epoch"][r:r + 1], table=ws["tables"][r], timeout=50,
                                 use_timer=False, num_warps=4, step_elems=TILE, half=kind))
    stages = ("entry", "reduce") if kind == "reduce_scatter" else ("encode", "tail")
    for stage in stages:
        for r, plan in enumerate(plans):
            getattr(plan, stage)() if stage in ("entry", "encode") else \
                getattr(plan, stage)(ys[r])
    if device != "cpu":
        torch.cuda.synchronize()
    def peers_shard(y, r, peer):          # the all-gather's own shard decodes its own packet
        return y.view(P, m[r])[peer]
    _check_records(ws, calls, ys, kind, 4 if kind == "reduce_scatter" else 5,
                   None if kind == "reduce_scatter" else peers_shard)


def describe_call_cases() -> None:
    from echo_tp.kernels import flags
    from echo_tp.kernels.quant_kernels import DTYPE_KIND, QUANT_CODE
    w = word(123_456_789, 8, "symmetric", torch.float16, g=64, outlier=False)
    assert flags.describe_call(w) == ("123456789 values, 8-bit packets (group 64, symmetric), "
                                      "float16")
    o = flags.host_call_word(5, 128, 4, QUANT_CODE["zero_aware"], True, DTYPE_KIND[torch.float32])
    assert flags.describe_call(o) == ("5 values, 4-bit packets (group 128, zero_aware, outlier "
                                      "word), float32")

"""The p2p backend against the reference backend over NCCL, on 2 and 4 real GPUs.

Each spawned rank (tests/harness.py, gloo default group plus an NCCL group for the GPUs) runs
the same fresh random inputs through P2PBackend and through the reference TransportBackend
(collective/qar.py over DistTransport, quantizing with quant.py: torch, not the Triton
kernels) with separate compensator states, three calls in a row,
and compares bit for bit: y, m1, m2 (NaN matches NaN; no other tolerance). Cases cover bf16 and
fp16, bits 4/8, the three policies, both residual modes, no compensation, odd sizes and
backward power-of-two scaling; one case replays a captured CUDA graph. A second test runs two
process groups side by side on the same GPUs (interleaved calls) and a soak of 10^5 small calls
(ECHO_SOAK_CALLS): bit-stable outputs, one epoch per call, no memory growth. Each form also
runs the block boundary (the residual added where y is decoded, then the norm-only kernel; and
comm.all_reduce_add_rmsnorm on backend='p2p') against the reference all-reduce then
norm.add_rmsnorm_reference. The halves (`-k halves`): EchoCommunicator(backend='p2p')'s
reduce_scatter / all_gather (dim 0) against a backend='reference' communicator's
(collective/sharded.py over DistTransport, quant.py), 4 and 8 bits, bf16, compensated,
forward and backward, 4 reduce-scatters in a row, 4 all-gathers in a row, then alternating,
the p2p calls all enqueued before any reference call (no collective between them: the race the
two workspaces per kind prevent; ranks skewed by device sleeps), bit for bit y and state after
every call, every rank's all-gather output identical; chunks of no whole groups and bits=16 go
to the reference; 3 reduce-scatters and an all-gather captured in one CUDA graph, replayed.
Skipped without 2 GPUs; the availability check itself also runs on the CPU.

When it fails, look first at: the case and tensor named in the message; a mismatch only in
cases of one policy -> quant_kernels._group_params against quant.group_params (divisions must
be div_rn, the reference divides by 0-dim tensors); a RuntimeError naming rank/stage/tile ->
a flag never arrived (kernels/flags.py, the epoch bump in P2PBackend.run); wrong values in the
first tiles of a segment only -> Layout offsets; values that change between runs -> a race
(signal/wait ordering; for the halves, only in calls after the first two of a kind: the
workspace pair's alternation, P2PBackend._HalfWorkspaces and flags.next_call_kernel).
"""
from __future__ import annotations

import os

import pytest
import torch

from harness import bits_differ, run_ranks, two_timescale

NEEDS = "needs >= {} CUDA GPUs with peer access"

# (bits, quantizer, residual, eta, dtype, backward, numel[, state dtype[-compact]]);
# '-compact': beta1 = beta2 = 0 and one state tensor (m2 is m1)
CASES = [
    (4, "zero_aware", "output", 0.75, "bfloat16", False, 1 << 20),
    (4, "zero_aware", "local", 0.75, "bfloat16", False, 3_000_017),
    (8, "zero_aware", "output", 0.75, "float16", False, 1_000_003),
    (4, "symmetric", "local", 0.75, "float16", False, 777_777),
    (8, "naive", "output", 0.75, "bfloat16", False, 524_288),
    (4, "naive", "local", 0.75, "bfloat16", True, 1_048_573),
    (4, "zero_aware", "output", 0.75, "bfloat16", True, 2_000_000),
    (8, "symmetric", "output", 0.0, "bfloat16", False, 999_999),
    (4, "zero_aware", "output", 0.0, "float16", False, 4096 * 5 + 3),
    (4, "zero_aware", "local", 1.0, "bfloat16", False, 2_000_003, "bfloat16"),   # bf16 state
    (4, "naive", "output", 0.75, "bfloat16", True, 1_000_000, "bfloat16"),
    (4, "zero_aware", "local", 1.0, "bfloat16", False, 1_500_001, "bfloat16-compact"),
    (4, "zero_aware", "output", 0.75, "float16", True, 700_001, "float32-compact"),
    # large enough for multi-step tiles (routing.tile_shape): staged 8192-16384-value tiles in
    # 2048 (uncompensated) / 1024 (compensated) steps; fused (<= 32 MiB) 16384-value tiles
    (4, "zero_aware", "output", 0.0, "bfloat16", False, 50_000_001),
    (4, "zero_aware", "local", 1.0, "bfloat16", False, 40_000_003, "bfloat16-compact"),
    (4, "naive", "local", 0.75, "bfloat16", True, 12_000_001),
]


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> int:
    return int(bits_differ(got, want).sum())


def _first(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where the first mismatch is (element, its group and tile), for the failure message."""
    idx = int(bits_differ(got, want).nonzero()[0])
    return (f"elem {idx} (group {idx // 128}, tile {idx // 2048}): got {got[idx].item()!r} "
            f"want {want[idx].item()!r}")


def _input(n, dtype, rank, seed, backward):
    gen = torch.Generator(device="cuda").manual_seed(seed * 131 + rank)
    x = torch.randn(n, generator=gen, device="cuda")
    x *= torch.exp(torch.randn(n // 128 + 1, generator=gen, device="cuda") * 2) \
        .repeat_interleave(128)[:n]                          # group magnitudes
    x[7::501] *= 30.0                                        # outliers
    x[1024:1152] = 0.0                                       # an all-zero group
    x[2048:2176] = 1.5                                       # a constant group
    if backward:
        x *= 1e-7                                            # gradients: tiny values
    return x.to(getattr(torch, dtype))


def p2p_route(x: torch.Tensor, cfg, world: int, form: str | None = None,
              overlap: str | None = None):
    """The route 'p2p' mode gives x (form / overlap forced where given)."""
    from echo_tp.collective import routing, tuning
    call = routing.Call.of(x.numel(), x.element_size(), cfg, world, on_gpu=True)
    return routing.p2p_route(call, tuning.DEFAULT, "test", form=form, overlap=overlap)


def exactness_worker(rank: int, world: int, cases=CASES, calls: int = 3, group=None,
                     graph: bool = True, form: str | None = None,
                     overlap: str | None = None) -> list[dict]:
    """On one rank: every case through p2p and the reference; mismatch counts per tensor.
    form 'fused' / 'staged': that kernel form for every call; None: by size. overlap: the
    stage kernels' reduce and tail, 'off' or 'launch' (None: as measured)."""
    import importlib

    from echo_tp import quant
    from echo_tp.collective.dispatch import TransportBackend
    from echo_tp.collective.p2p import P2PBackend
    from echo_tp.collective.reference import DistTransport
    from echo_tp.collective.symm import fast_path_unavailable_reason
    from echo_tp.compensator import CompState
    reason = fast_path_unavailable_reason(group)
    if reason is not None:
        return [{"error": reason}]
    qar = importlib.import_module("echo_tp.collective.qar")   # the module, not the function
    qar.codec_for = lambda x: quant        # the reference quantizes with quant.py (torch)
    p2p = P2PBackend(group)
    calls = int(os.environ.get("ECHO_TEST_CALLS", calls))
    ref = TransportBackend(DistTransport(group))
    out = []
    for ci, case in enumerate(cases):
        bits, quantizer, residual, eta, dtype, backward, n = case[:7]
        sdt, _, compact = (case[7] if len(case) > 7 else "float32").partition("-")
        betas = dict(beta1=0.0, beta2=0.0) if compact else {}
        cfg = two_timescale(bits=bits, quantizer=quantizer, residual=residual, eta=eta,
                         state_dtype=sdt, **betas)
        comp = cfg.compensated
        st_p = CompState.zeros(n, "cuda", getattr(torch, sdt), compact=bool(compact)) \
            if comp else None
        st_r = CompState.zeros(n, "cuda", getattr(torch, sdt), compact=bool(compact)) \
            if comp else None
        row = {"case": case, "y": 0, "m1": 0, "m2": 0}
        for call in range(calls):
            x = _input(n, dtype, rank, seed=1000 * ci + call, backward=backward)
            y_r, _ = ref.run(x, cfg, state=st_r, backward=backward, record=False)
            y_p, _ = p2p.run(x, cfg, route=p2p_route(x, cfg, world, form, overlap),
                             state=st_p, backward=backward, record=False)
            row["y"] += _mismatch(y_p, y_r)
            if comp:
                row["m1"] += _mismatch(st_p.m1, st_r.m1)
                row["m2"] += _mismatch(st_p.m2, st_r.m2)
            if "first" not in row and (row["y"] or row["m1"]):
                row["first"] = f"call {call}: " + (_first(y_p, y_r) if row["y"]
                                                   else "m1 " + _first(st_p.m1, st_r.m1))
        out.append(row)
        print(f"[exact P{world} rank{rank}] {row}", flush=True)   # survives a later hang
    if graph:
        out.append(_graph_case(p2p, ref, rank, world))
        print(f"[exact P{world} rank{rank}] {out[-1]}", flush=True)
    out.append(_add_norm_case(p2p, ref, group, rank, world, form, overlap))
    print(f"[exact P{world} rank{rank}] {out[-1]}", flush=True)
    out.append(_oneshot_case(group, rank, world))
    print(f"[exact P{world} rank{rank}] {out[-1]}", flush=True)
    out.append({"case": "info", "symm_backend": str(p2p.symm_backend), "use_timer": p2p.use_timer,
                "form": form, "overlap": overlap, "y": 0, "m1": 0, "m2": 0})
    p2p.check_error()
    p2p.close()
    return out


# (bits, residual mode or None: uncompensated, dtype, rows, hidden): the block boundary
ADD_NORM_CASES = [(4, "local", "bfloat16", 1021, 4096), (4, "output", "bfloat16", 64, 4096),
                  (8, None, "float16", 8, 5120), (4, None, "bfloat16", 2049, 4096)]


def _add_norm_case(p2p, ref, group, rank: int, world: int, form, overlap) -> dict:
    """The block boundary with the residual added where y is decoded (issue 18 item 2):
    P2PBackend.run(residual=r) then the norm-only kernel against the reference's y, then
    add_rmsnorm_reference (residual_out, normed, state: 3 calls); then
    comm.all_reduce_add_rmsnorm on a backend='p2p' communicator against a reference
    communicator's all_reduce then add_rmsnorm_reference (outputs and state, 2 calls). The
    default config (one bf16 state tensor) for the local mode, the two-timescale fp32 pair for
    the output mode."""
    from echo_tp import norm
    from echo_tp.communicator import EchoCommunicator
    from echo_tp.compensator import CompState
    from echo_tp.config import EchoConfig
    row = {"case": f"add+rmsnorm {form}/{overlap}", "y": 0, "m1": 0, "m2": 0, "normed": 0}
    for ci, (bits, mode, dtype, rows, h) in enumerate(ADD_NORM_CASES):
        cfg = (EchoConfig(bits=bits) if mode == "local" else
               two_timescale(bits=bits, residual=mode) if mode else
               two_timescale(bits=bits, eta=0.0))
        n, dt = rows * h, getattr(torch, dtype)
        sdt = getattr(torch, cfg.state_dtype)
        compact = cfg.beta1 == cfg.beta2
        st_p = CompState.zeros(n, "cuda", sdt, compact=compact) if mode else None
        st_r = CompState.zeros(n, "cuda", sdt, compact=compact) if mode else None
        gen = torch.Generator(device="cuda").manual_seed(4000 + ci)      # same on every rank
        w = (1 + 0.1 * torch.randn(h, device="cuda", generator=gen)).to(torch.float32)
        for call in range(3):
            x = _input(n, dtype, rank, seed=3000 + 10 * ci + call, backward=False)
            res = (torch.randn(rows, h, device="cuda", generator=gen) * 4).to(dt)
            y_r, _ = ref.run(x, cfg, state=st_r, backward=False, record=False)
            want_n, want_r = norm.add_rmsnorm_reference(y_r.view(rows, h), res, w, 1e-6)
            rout, _ = p2p.run(x, cfg, route=p2p_route(x, cfg, world, form, overlap), state=st_p,
                              backward=False, record=False, residual=res.view(-1))
            normed = norm.rmsnorm(rout.view(rows, h), w, 1e-6)
            row["y"] += _mismatch(rout.view(rows, h), want_r)
            row["normed"] += _mismatch(normed, want_n)
            if mode:
                row["m1"] += _mismatch(st_p.m1, st_r.m1)
                row["m2"] += _mismatch(st_p.m2, st_r.m2)
    cfg = EchoConfig(bits=4)
    comms = [EchoCommunicator.from_group(group, cfg, backend=b) for b in ("p2p", "reference")]
    rows, h = 513, 4096
    gen = torch.Generator(device="cuda").manual_seed(4100)
    w = (1 + 0.1 * torch.randn(h, device="cuda", generator=gen)).to(torch.bfloat16)
    for c in comms:
        c.new_pass()
    for call in range(2):
        partial = _input(rows * h, "bfloat16", rank, seed=3100 + call, backward=False) \
            .view(rows, h)
        res = (torch.randn(rows, h, device="cuda", generator=gen) * 4).to(torch.bfloat16)
        normed, rout = comms[0].all_reduce_add_rmsnorm(partial, res, w, 1e-6)
        y = comms[1].all_reduce(partial)
        want_n, want_r = norm.add_rmsnorm_reference(y, res, w, 1e-6)
        row["y"] += _mismatch(rout, want_r)
        row["normed"] += _mismatch(normed, want_n)
        st_p, st_r = comms[0].state(numel=rows * h), comms[1].state(numel=rows * h)
        row["m1"] += _mismatch(st_p.m1, st_r.m1)
    row["comm_backend"] = comms[0].dispatcher.last_backend
    row["comm_adds"] = comms[0].dispatcher.adds_residual(partial.view(-1), cfg)
    if row["comm_backend"] != "p2p" or not row["comm_adds"]:
        row["y"] += 1                                      # the fused route was not taken
    for c in comms:
        c.close()
    return row


def _oneshot_case(group, rank: int, world: int) -> dict:
    """The 16-bit one-shot kernel against its reference (all-gather, sum in rank order in fp32,
    one rounding) on fresh inputs of several sizes and dtypes, in place and not."""
    import torch.distributed as dist

    from echo_tp.collective.oneshot import OneShotBackend
    from echo_tp.kernels.oneshot_kernels import oneshot_reference
    one = OneShotBackend(group, cap_bytes=4 << 20)
    row = {"case": "oneshot16", "y": 0, "m1": 0, "m2": 0}
    for k, (n, dtype) in enumerate([(1, "bfloat16"), (4097, "float16"), (1 << 20, "bfloat16"),
                                    (300_001, "float32"), (2 << 20, "bfloat16")]):
        x = _input(n, dtype, rank, seed=900 + k, backward=False) if n > 2200 else \
            torch.randn(n, device="cuda").to(getattr(torch, dtype))
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        want = oneshot_reference(parts)
        y, _ = one.run(x, None, state=None, backward=False, record=False, inplace=k % 2 == 1)
        row["y"] += _mismatch(y, want)
    one.check_error()
    one.close()
    return row


def _graph_case(p2p, ref, rank: int, world: int) -> dict:
    """Capture one compensated p2p call in a CUDA graph; replay it on new inputs; both
    residuals."""
    from echo_tp.compensator import CompState
    row = {"case": "cuda-graph replay x3, local + output", "y": 0, "m1": 0, "m2": 0}
    for residual in ("local", "output"):
        n, cfg = 1 << 20, two_timescale(bits=4, residual=residual)
        st_p, st_r = CompState.zeros(n, "cuda"), CompState.zeros(n, "cuda")
        x_static = _input(n, "bfloat16", rank, seed=77, backward=False)
        y_r, _ = ref.run(x_static, cfg, state=st_r, backward=False, record=False)
        route = p2p_route(x_static, cfg, world)
        y_p, _ = p2p.run(x_static, cfg, route=route, state=st_p, backward=False,
                         record=False)                                  # warm-up
        row["y"] += _mismatch(y_p, y_r)
        row["m1"] += _mismatch(st_p.m1, st_r.m1)
        row["m2"] += _mismatch(st_p.m2, st_r.m2)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y_static, _ = p2p.run(x_static, cfg, route=route, state=st_p, backward=False,
                                  record=False)
        for call in range(3):
            x_static.copy_(_input(n, "bfloat16", rank, seed=78 + call, backward=False))
            y_r, _ = ref.run(x_static, cfg, state=st_r, backward=False, record=False)
            g.replay()
            row["y"] += _mismatch(y_static, y_r)
            row["m1"] += _mismatch(st_p.m1, st_r.m1)
            row["m2"] += _mismatch(st_p.m2, st_r.m2)
    return row


def _ranks_fn(rank: int, world: int, cases, form: str = "fused"):
    """form: 'fused' (the fused kernel for every call), or an overlap mode for every call of
    the stage kernels ('off', 'launch')."""
    import torch.distributed as dist
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    torch.cuda.set_device(rank)
    group = dist.new_group(backend="nccl")
    if form == "fused":
        return exactness_worker(rank, world, cases, group=group, form="fused")
    return exactness_worker(rank, world, cases, group=group, form="staged", overlap=form)


def test_unavailable_reason_is_cheap_without_a_group():
    """Answered locally, before any communication: no CUDA, or (with CUDA, triton and
    symmetric memory) no process group in this pytest process."""
    import torch.distributed as dist

    from echo_tp.collective.symm import fast_path_unavailable_reason
    assert not dist.is_initialized()
    reason = fast_path_unavailable_reason(None)
    if not torch.cuda.is_available():
        assert reason == "CUDA is not available"
    else:
        assert reason == "torch.distributed is not initialized", reason


@pytest.mark.parametrize("world,form", [(2, "fused"), (2, "off"), (2, "launch"),
                                        (4, "fused"), (4, "off"), (4, "launch")])
def test_p2p_bit_identical_to_nccl_reference(world, form):
    if torch.cuda.device_count() < world:
        pytest.skip(NEEDS.format(world))
    results = run_ranks(world, _ranks_fn, CASES, form, timeout=600)
    for rank, rows in enumerate(results):
        assert "error" not in rows[0], f"rank {rank}: p2p unavailable: {rows[0]}"
        bad = [r for r in rows if r["y"] or r["m1"] or r["m2"] or r.get("normed")]
        assert not bad, f"rank {rank}: mismatching elements {bad}"


def _soak_fn(rank: int, world: int, calls: int):
    """Two NCCL groups over the same GPUs, each with its own P2PBackend (own workspaces, flags,
    signal pads), calls interleaved; then `calls` small calls on one backend. Returns mismatch
    counts against the reference, the epoch counter (flags grow by one per call, never wrap at
    int64) and the allocated-memory growth over the soak."""
    import torch.distributed as dist

    from echo_tp.collective.dispatch import TransportBackend
    from echo_tp.collective.p2p import P2PBackend
    from echo_tp.collective.reference import DistTransport
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    torch.cuda.set_device(rank)
    groups = [dist.new_group(backend="nccl") for _ in range(2)]
    p2ps = [P2PBackend(g) for g in groups]
    ref = TransportBackend(DistTransport(groups[0]))
    cfg = two_timescale(bits=4, eta=0.0)
    out = {"two_groups": 0, "soak": 0}
    for call in range(20):                        # interleaved: A, B, A, B, ...
        x = _input(300_007, "bfloat16", rank, seed=500 + call, backward=False)
        want, _ = ref.run(x, cfg, state=None, backward=False, record=False)
        for p in p2ps:
            y, _ = p.run(x, cfg, route=p2p_route(x, cfg, world), state=None, backward=False,
                         record=False)
            out["two_groups"] += _mismatch(y, want)
    x = _input(32_768, "bfloat16", rank, seed=9, backward=False)   # 64 KiB
    want, _ = ref.run(x, cfg, state=None, backward=False, record=False)
    p, route = p2ps[0], p2p_route(x, cfg, world)
    y, _ = p.run(x, cfg, route=route, state=None, backward=False, record=False)
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_allocated()
    for call in range(calls):
        y, _ = p.run(x, cfg, route=route, state=None, backward=False, record=False)
        if call % 10_000 == 0:
            out["soak"] += _mismatch(y, want)
    torch.cuda.synchronize()
    out["soak"] += _mismatch(y, want)
    out["mem_growth"] = torch.cuda.memory_allocated() - mem0
    out["epochs"] = [_calls_seen(p, ws) for ws in p._ws.values()]
    for q in p2ps:
        q.check_error()
        q.close()
    return out


def _calls_seen(p2p, ws) -> list[int]:
    """A workspace's counters: [epoch (the calls it ran, stage or fused), fused departures
    (0 between calls)]."""
    return ws.epoch.tolist()


def test_two_groups_and_soak():
    if torch.cuda.device_count() < 2:
        pytest.skip(NEEDS.format(2))
    calls = int(os.environ.get("ECHO_SOAK_CALLS", 100_000))
    for rank, r in enumerate(run_ranks(2, _soak_fn, calls, timeout=900)):
        assert r["two_groups"] == 0 and r["soak"] == 0, (rank, r)
        assert r["mem_growth"] == 0, (rank, r)
        # one workspace for every size: 20 interleaved calls, 1 warm-up and the soak
        assert r["epochs"] == [[20 + calls + 1, 0]], (rank, r)


# ----- the halves: reduce-scatter and all-gather ---------------------------------------------

# (bits, config, rows, hidden, the backend the p2p communicator must take): a rank's chunk is
# rows x hidden values (m = rows * hidden); 'default': one bf16 state tensor; 'pair': the
# paper's fp32 two-timescale pair
HALF_CASES = [(4, "default", 257, 4096, "p2p"), (8, "pair", 64, 4096, "p2p"),
              (4, "pair", 3, 128, "p2p"), (8, "default", 1031, 1024, "p2p"),
              (4, "default", 3, 100, "reference"),                    # 300: no whole groups
              (16, "default", 64, 4096, "reference")]                  # NCCL's plain halves
HALF_SEQUENCE = ["reduce_scatter"] * 4 + ["all_gather"] * 4 + ["reduce_scatter", "all_gather"] * 3


def _state_copy(comm, kind: str, direction: str, numel: int):
    st = comm.state(direction, numel=numel, kind=kind)
    return st.m1.clone(), st.m2.clone()


def _halves_fn(rank: int, world: int) -> list[dict]:
    """On one rank: every HALF_CASE forward and backward through a backend='p2p' and a
    backend='reference' communicator, HALF_SEQUENCE of calls on fresh inputs; mismatch counts
    of y, of the state after each call, and of the all-gather outputs across ranks; then
    _halves_graph_case."""
    import importlib

    import torch.distributed as dist

    from echo_tp import quant
    from echo_tp.collective.symm import fast_path_unavailable_reason
    from echo_tp.communicator import EchoCommunicator
    from echo_tp.config import EchoConfig
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    torch.cuda.set_device(rank)
    group = dist.new_group(backend="nccl")
    reason = fast_path_unavailable_reason(group)
    if reason is not None:
        return [{"error": reason}]
    for mod in ("echo_tp.collective.qar", "echo_tp.collective.sharded"):
        importlib.import_module(mod).codec_for = lambda x: quant   # the torch quantizer
    configs = {"default": EchoConfig(bits=4), "pair": two_timescale(bits=4)}
    comms = {name: {b: EchoCommunicator.from_group(group, cfg, backend=b)
                    for b in ("p2p", "reference")} for name, cfg in configs.items()}
    sleep = getattr(torch.cuda, "_sleep", None)
    out = []
    for ci, (bits, cname, rows, h, want) in enumerate(HALF_CASES):
        p2p, ref = comms[cname]["p2p"], comms[cname]["reference"]
        for direction in ("forward", "backward"):
            backward = direction == "backward"
            row = {"case": (bits, cname, rows, h, direction), "want": want, "backends": [],
                   "y": 0, "m1": 0, "m2": 0, "ag_ranks": 0}
            p2p.new_pass(direction)
            ref.new_pass(direction)
            xs = [_input((world if kind == "reduce_scatter" else 1) * rows * h, "bfloat16",
                         rank, seed=5000 + 100 * ci + 10 * backward + i, backward=backward)
                  .view(-1, h) for i, kind in enumerate(HALF_SEQUENCE)]
            got = []
            for i, (kind, x) in enumerate(zip(HALF_SEQUENCE, xs)):   # p2p: back to back
                if sleep is not None and (i + rank) % 3 == 0:
                    sleep(200_000)                                     # skew the ranks
                y = getattr(p2p, kind)(x, dim=0, direction=direction, bits=bits)
                st = _state_copy(p2p, kind, direction, x.numel()) if bits != 16 else None
                got.append((y, st))
                if p2p.dispatcher.last_backend not in row["backends"]:
                    row["backends"].append(p2p.dispatcher.last_backend)
            for i, (kind, x) in enumerate(zip(HALF_SEQUENCE, xs)):   # then the reference
                y_p, st_p = got[i]
                y_r = getattr(ref, kind)(x, dim=0, direction=direction, bits=bits)
                row["y"] += _mismatch(y_p, y_r)
                if st_p is not None:
                    m1, m2 = _state_copy(ref, kind, direction, x.numel())
                    row["m1"] += _mismatch(st_p[0], m1)
                    row["m2"] += _mismatch(st_p[1], m2)
                if kind == "all_gather":
                    parts = [torch.empty_like(y_p) for _ in range(world)]
                    dist.all_gather(parts, y_p.contiguous(), group=group)
                    row["ag_ranks"] += sum(_mismatch(q, parts[0]) for q in parts[1:])
                if "first" not in row and (row["y"] or row["m1"]):
                    row["first"] = f"call {i} ({kind}): " + (
                        _first(y_p.view(-1), y_r.view(-1)) if row["y"]
                        else "m1 " + _first(st_p[0].view(-1), m1.view(-1)))
            out.append(row)
            print(f"[halves P{world} rank{rank}] {row}", flush=True)   # survives a later hang
    for by_backend in comms.values():
        by_backend["p2p"].dispatcher.backends["p2p"].check_error()   # raises on a timed-out wait
        for c in by_backend.values():
            c.close()
    out.append(_halves_graph_case(group, rank, world))
    print(f"[halves P{world} rank{rank}] {out[-1]}", flush=True)
    return out


def _halves_graph_case(group, rank: int, world: int) -> dict:
    """Three reduce-scatters and one all-gather (odd counts on each workspace pair) captured
    in one CUDA graph after an eager warm-up, replayed 3 times on new inputs, then one eager
    call of each kind: P2PBackend against the reference backend in the same order, y and
    state. The pair's workspace is picked on the device, so replays keep alternating."""
    from echo_tp.collective import routing
    from echo_tp.collective.dispatch import TransportBackend
    from echo_tp.collective.p2p import P2PBackend
    from echo_tp.collective.reference import DistTransport
    from echo_tp.compensator import CompState
    p2p, ref = P2PBackend(group), TransportBackend(DistTransport(group))
    cfg = two_timescale(bits=4)
    m = 64 * 4096
    sizes = {"reduce_scatter": world * m, "all_gather": m}
    routes = {k: routing.route(routing.Call.of(n, 2, cfg, world, on_gpu=True, kind=k), "p2p",
                               {"p2p": None}) for k, n in sizes.items()}
    st_p = {k: CompState.zeros(n, "cuda") for k, n in sizes.items()}
    st_r = {k: CompState.zeros(n, "cuda") for k, n in sizes.items()}
    row = {"case": "halves cuda-graph replay x3", "y": 0, "m1": 0, "m2": 0,
           "routes": sorted({r.backend for r in routes.values()})}

    def run(kind, x, seed=None):
        if seed is not None:
            x.copy_(_input(x.numel(), "bfloat16", rank, seed=seed, backward=False))
        return getattr(p2p, kind)(x, cfg, state=st_p[kind], backward=False, route=routes[kind])

    def check(kind, x, y_p):
        y_r = getattr(ref, kind)(x, cfg, state=st_r[kind], backward=False)
        row["y"] += _mismatch(y_p, y_r)

    def check_states():
        for k in sizes:
            row["m1"] += _mismatch(st_p[k].m1, st_r[k].m1)
            row["m2"] += _mismatch(st_p[k].m2, st_r[k].m2)

    kinds = ["reduce_scatter"] * 3 + ["all_gather"]
    xs = [torch.empty(sizes[k], dtype=torch.bfloat16, device="cuda") for k in kinds]
    for i in (0, 3):                                       # eager warm-up: one of each kind
        check(kinds[i], xs[i], run(kinds[i], xs[i], seed=800 + i))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = [run(k, x) for k, x in zip(kinds, xs)]
    for rep in range(3):
        for i, x in enumerate(xs):
            x.copy_(_input(x.numel(), "bfloat16", rank, seed=810 + 10 * rep + i, backward=False))
        g.replay()
        for k, x, y in zip(kinds, xs, ys):
            check(k, x, y)
        check_states()
    for i in (0, 3):                                       # eager again, after the replays
        check(kinds[i], xs[i], run(kinds[i], xs[i], seed=850 + i))
    check_states()
    p2p.check_error()
    p2p.close()
    if row["routes"] != ["p2p"]:
        row["y"] += 1                                      # the route did not pick p2p
    return row


@pytest.mark.parametrize("world", [2, 4], ids=["x2", "x4"])
def test_p2p_halves_bit_identical_to_reference(world):
    if torch.cuda.device_count() < world:
        pytest.skip(NEEDS.format(world))
    results = run_ranks(world, _halves_fn, timeout=600)
    for rank, rows in enumerate(results):
        assert "error" not in rows[0], f"rank {rank}: p2p unavailable: {rows[0]}"
        bad = [r for r in rows if r["y"] or r["m1"] or r["m2"] or r.get("ag_ranks")
               or ("want" in r and r["backends"] != [r["want"]])]
        assert not bad, f"rank {rank}: mismatching elements or routes {bad}"


# ----- the packet header on real ranks: any length without a host check, mismatches refused ----

def _nccl_group(rank: int):
    """This rank's GPU and a new NCCL group over the world, multicast off."""
    import torch.distributed as dist
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    torch.cuda.set_device(rank)
    return dist.new_group(backend="nccl")


def _header_fn(rank: int, world: int, lengths: int):
    """`lengths` distinct lengths (fused and staged forms, 4 and 8 bits) on one P2PBackend, then
    one call whose length differs on the last rank. Returns: mismatches against the reference
    (every 50th call), the workspaces grown, the host collectives the backend ran (its
    transport's all-gathers: the growth agreements only), whether the bad call's y is all NaN,
    and the error check_error() raised."""
    from echo_tp.collective.dispatch import TransportBackend
    from echo_tp.collective.p2p import P2PBackend
    from echo_tp.collective.reference import DistTransport
    group = _nccl_group(rank)
    p = P2PBackend(group)
    ref = TransportBackend(DistTransport(group))
    agreements = []
    grow = p._grow
    p._grow = lambda *a: (agreements.append(a[1]), grow(*a))[1]
    gen = torch.Generator().manual_seed(11)
    ns = torch.randint(1 << 12, 1 << 23, (lengths,), generator=gen).tolist()
    out = {"mismatch": 0}
    for k, n in enumerate(ns):
        cfg = two_timescale(bits=4 if k % 3 else 8, eta=0.0)
        x = _input(n, "bfloat16", rank, seed=k, backward=False)
        y, _ = p.run(x, cfg, route=p2p_route(x, cfg, world), state=None, backward=False,
                     record=False)
        if k % 50 == 0:
            want, _ = ref.run(x, cfg, state=None, backward=False, record=False)
            out["mismatch"] += _mismatch(y, want)
    p.check_error()
    out["grown"], out["workspaces"] = len(agreements), len(p._retired) + len(p._ws)
    cfg = two_timescale(bits=4, eta=0.0)
    n = 1 << 20
    x = _input(n + (4096 if rank == world - 1 else 0), "bfloat16", rank, seed=3, backward=False)
    y, _ = p.run(x, cfg, route=p2p_route(x, cfg, world), state=None, backward=False,
                 record=False)
    try:
        p.check_error()
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    out["nan"] = bool(y.isnan().all())
    return out


def test_header_any_length_and_mismatch_on_real_ranks():
    if torch.cuda.device_count() < 2:
        pytest.skip(NEEDS.format(2))
    lengths = 1000
    for rank, r in enumerate(run_ranks(2, _header_fn, lengths, timeout=900)):
        assert r["mismatch"] == 0, (rank, r)
        assert r["grown"] <= 12 and r["workspaces"] == r["grown"], (rank, r)
        assert r["error"] and "collective calls differ across ranks" in r["error"], (rank, r)
        assert r["nan"], (rank, r)

"""The quantized all-reduce on real gloo ranks (P = 2, 4 and 8) against SPEC.md §2, and the simulated
backend against those real runs, bit for bit; likewise its two halves, the reduce-scatter and the
all-gather (collective/sharded.py; their simulated-only tests: test_sharded.py).

Each world size is spawned once (module fixture) and runs every case; the tests then compare:
  * every rank's y, bit for bit;
  * y with an independent re-implementation of §2 written here (loops over ranks and segments,
    quant.quant_dequant per segment, fp32 sum in rank order), bit for bit, and with the exact sum
    within the bound of the two quantizations;
  * compensated passes (both residual modes, bits 4 and 8, forward and backward with gradient
    scaling): y and compensator states against SimulatedCommunicator on the same inputs.
Halves: every rank's reduce-scatter and all-gather against an independent re-implementation
(chunk j of rank r quant_dequant'ed unless r == j, fp32 owner sum in rank order; each shard
quant_dequant'ed once), bit for bit (bits 4/8, three quantizers and dtypes, padded chunks, dim
0 / 1 / -2); compensated passes (forward, backward with scaling) against simulated, outputs and
states bit for bit; bits=16 against torch's reduce_scatter_tensor / all_gather_into_tensor;
calls that differ in kind or size refused on every rank.
Inputs come from a fresh seed per test session (printed on failure).
If the independent reference disagrees, look first at collective/qar.py (padding, owner order),
for the halves at collective/sharded.py and echo_tp/halves.py (dims).
"""
import os

import pytest
import torch
import torch.nn.functional as F

from echo_tp import EchoConfig, SimulatedCommunicator, quant
from harness import bits_differ, run_ranks, two_timescale

# fresh per session; spawned ranks inherit it through the environment
SEED = int(os.environ.setdefault("ECHO_TEST_SEED", str(int.from_bytes(os.urandom(4), "little"))))

QAR_CASES = [  # (shape, dtype, bits, policy)
    ((3, 333), torch.bfloat16, 4, "zero_aware"),
    ((4096,), torch.bfloat16, 8, "zero_aware"),
    ((2, 1000), torch.float16, 4, "naive"),
    ((777,), torch.float32, 4, "symmetric"),
    ((5, 130), torch.float16, 8, "symmetric"),
    ((1,), torch.bfloat16, 4, "zero_aware"),
    ((0,), torch.bfloat16, 4, "zero_aware"),
    ("transposed", torch.bfloat16, 4, "zero_aware"),
]
COMP_CONFIGS = [
    dict(bits=4, residual="output"),
    dict(bits=4, residual="local"),
    dict(bits=8, residual="local"),
    dict(bits=8, residual="output", quantizer="symmetric", group_size=256),
    dict(bits=4, beta1=0.0, beta2=0.0, state_dtype="bfloat16"),    # = EchoConfig() (default)
]
FWD_SITES, BWD_SITES, HIDDEN = 5, 3, (6, 200)


def case_input(case: int, rank: int, shape, dtype):
    g = torch.Generator().manual_seed(SEED + 7919 * case + rank)
    if shape == "transposed":
        return (torch.randn(64, 48, generator=g) * (1 + rank)).to(dtype).t()  # non-contiguous
    x = torch.randn(shape, generator=g) * (1 + rank)
    if x.numel() > 50:
        x.view(-1)[::37] *= 20.0  # outliers
    return x.to(dtype)


def site_input(cfg_i: int, site: int, rank: int, backward: bool):
    g = torch.Generator().manual_seed(SEED + 104729 * cfg_i + 31 * site + rank + 999 * backward)
    x = torch.randn(HIDDEN, generator=g) + 0.5 * rank
    return (x * 1e-7 if backward else x).to(torch.bfloat16)  # tiny gradients exercise scaling


def _worker(rank, world_size):
    import torch.distributed as dist

    from echo_tp import EchoCommunicator
    out = {"qar": [], "comp": []}
    for case, (shape, dtype, bits, policy) in enumerate(QAR_CASES):
        comm = EchoCommunicator.from_group(None, two_timescale(bits=bits, quantizer=policy, eta=0.0))
        out["qar"].append(comm.all_reduce(case_input(case, rank, shape, dtype)))
    x16 = case_input(0, rank, (3, 333), torch.bfloat16)
    out["plain16"] = EchoCommunicator.from_group(None, two_timescale(bits=16)).all_reduce(x16)
    ref = x16.clone()
    dist.all_reduce(ref)
    out["dist16"] = ref
    for i, kw in enumerate(COMP_CONFIGS):
        comm = EchoCommunicator.from_group(None, two_timescale(**kw), telemetry=True)
        res = {"fwd": [], "bwd": []}
        for direction, n, key in (("forward", FWD_SITES, "fwd"), ("backward", BWD_SITES, "bwd")):
            comm.new_pass(direction)
            for s in range(n):
                res[key].append(comm.all_reduce(site_input(i, s, rank, key == "bwd"),
                                                direction=direction))
            st = comm.state(direction)
            res[key + "_state"] = (st.m1.clone(), st.m2.clone())
        res["telemetry"] = comm.telemetry_summary()
        out["comp"].append(res)
    # configs that differ across ranks are refused, on every rank, with a clear error
    try:
        EchoCommunicator.from_group(None, two_timescale(eta=0.5 if rank == 1 else 0.75))
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    out["halves"] = _halves_worker(rank, world_size)
    return out


@pytest.fixture(scope="module", params=[2, 4, 8], ids=["P2", "P4", "P8"])
def world(request):
    return request.param, run_ranks(request.param, _worker)


def bits_of(t):
    t = t.contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def independent_qar(xs, spec, out_dtype):
    """SPEC §2 written plainly: segment j of rank r is quantized unless r == j; owner sums in fp32
    in rank order; the owner's sum is quantized once and everyone decodes it."""
    P, n, g = len(xs), xs[0].numel(), spec.group_size
    seg = -(-n // (P * g)) * g
    X = [F.pad(x.reshape(-1).float(), (0, P * seg - n)).view(P, seg) for x in xs]
    ys, bound = [], []
    for j in range(P):
        acc = None
        b = torch.zeros(seg // g)
        for r in range(P):
            if r == j:
                c = X[r][j]
            else:
                c = quant.quant_dequant(X[r][j], spec)
                b += quant.group_params(X[r][j].view(-1, g), spec)[0].float()
            acc = c if acc is None else acc + c
        ys.append(quant.quant_dequant(acc, spec))
        b += quant.group_params(acc.view(-1, g), spec)[0].float()
        bound.append(b.repeat_interleave(g) * (0.5 + 2.0 ** -4))
    y = torch.cat(ys)[:n].to(out_dtype).reshape(xs[0].shape)
    return y, torch.cat(bound)[:n].reshape(xs[0].shape)


def test_all_ranks_bit_identical(world):
    P, res = world
    for c in range(len(QAR_CASES)):
        for r in range(1, P):
            assert torch.equal(bits_of(res[r]["qar"][c]), bits_of(res[0]["qar"][c])), (c, SEED)


def test_matches_independent_spec_implementation_and_bound(world):
    P, res = world
    for c, (shape, dtype, bits, policy) in enumerate(QAR_CASES):
        spec = two_timescale(bits=bits, quantizer=policy).quant_spec()
        xs = [case_input(c, r, shape, dtype) for r in range(P)]
        y = res[0]["qar"][c]
        assert y.shape == xs[0].shape and y.dtype == dtype
        if y.numel() == 0:
            continue
        want, bound = independent_qar(xs, spec, dtype)
        assert torch.equal(bits_of(y), bits_of(want)), (c, SEED)
        exact = sum(x.double() for x in xs)
        out_round = y.double().abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11)
        assert torch.all((y.double() - exact).abs() <= bound.double() + out_round + 1e-6), (c, SEED)


def test_eight_bits_error_far_below_four(world):
    P, _ = world
    xs = [case_input(1, r, (4096,), torch.float32) for r in range(P)]
    exact = sum(x.double() for x in xs)
    errs = {}
    for bits in (4, 8):
        y, _ = independent_qar(xs, two_timescale(bits=bits).quant_spec(), torch.float32)
        errs[bits] = float((y.double() - exact).abs().mean())
    assert errs[8] < errs[4] / 8, errs


def test_bits16_is_the_plain_all_reduce(world):
    P, res = world
    for r in range(P):
        assert torch.equal(res[r]["plain16"], res[r]["dist16"])


def test_simulated_is_bit_identical_to_gloo(world):
    P, res = world
    for i, kw in enumerate(COMP_CONFIGS):
        sim = SimulatedCommunicator(P, two_timescale(**kw))
        for direction, n, key in (("forward", FWD_SITES, "fwd"), ("backward", BWD_SITES, "bwd")):
            sim.new_pass(direction)
            for s in range(n):
                xs = torch.stack([site_input(i, s, r, key == "bwd") for r in range(P)])
                y = sim.all_reduce(xs, direction=direction)
                for r in range(P):
                    assert torch.equal(bits_of(y[r]), bits_of(res[r]["comp"][i][key][s])), \
                        (kw, key, s, r, SEED)
            st = sim.state(direction)
            for r in range(P):
                m1, m2 = res[r]["comp"][i][key + "_state"]
                assert torch.equal(st.m1[r], m1) and torch.equal(st.m2[r], m2), (kw, key, r, SEED)


def test_backward_scaling_keeps_tiny_gradients(world):
    P, res = world
    for i, kw in enumerate(COMP_CONFIGS):
        xs = [site_input(i, 0, r, True) for r in range(P)]
        exact = sum(x.double() for x in xs)
        y = res[0]["comp"][i]["bwd"][0].double()
        rel = float((y - exact).norm() / exact.norm())
        assert rel < (0.2 if kw["bits"] == 4 else 0.02), (kw, rel)


def test_telemetry_rows_summed_over_group(world):
    P, res = world
    for i in range(len(COMP_CONFIGS)):
        rows = res[0]["comp"][i]["telemetry"]
        assert len(rows) == FWD_SITES + BWD_SITES
        assert [r["site"] for r in rows] == list(range(FWD_SITES)) + list(range(BWD_SITES))
        for r in range(1, P):  # the summary is a group-wide sum: equal everywhere
            assert res[r]["comp"][i]["telemetry"] == rows
        assert all(r["delta_norm_est"] > 0 for r in rows)


def test_config_mismatch_is_refused_on_every_rank(world):
    P, res = world
    for r in range(P):
        assert res[r]["mismatch"] is not None and "differs across ranks" in res[r]["mismatch"]


def test_all_reduce_add_rmsnorm_is_the_composition():
    """comm.all_reduce_add_rmsnorm = all_reduce, then norm.add_rmsnorm_reference, bit for bit
    (simulated P=4, the default compensated config, two calls: the state feeds back); bad
    shapes are refused."""
    from echo_tp import norm
    from echo_tp.communicator import SimulatedCommunicator
    gen = torch.Generator().manual_seed(SEED + 77)
    a, b = SimulatedCommunicator(4), SimulatedCommunicator(4)
    a.new_pass()
    b.new_pass()
    w = torch.randn(256, generator=gen)
    for _ in range(2):
        partial = torch.randn(4, 3, 5, 256, generator=gen).to(torch.bfloat16)
        res = torch.randn(3, 5, 256, generator=gen).to(torch.bfloat16)
        normed, rout = a.all_reduce_add_rmsnorm(partial, res, w, 1e-5)
        y = b.all_reduce(partial)
        want_n, want_r = norm.add_rmsnorm_reference(y, res.expand(y.shape).contiguous(), w, 1e-5)
        assert torch.equal(rout, want_r) and torch.equal(normed, want_n)
        assert normed.shape == (4, 3, 5, 256) and normed.dtype == torch.float32
        assert torch.equal(rout[0], rout[3])                 # every rank the same
    with pytest.raises(ValueError, match="weight"):
        a.all_reduce_add_rmsnorm(partial, res, w[:10], 1e-5)


# ----- the halves: reduce-scatter and all-gather ---------------------------------------------
HALF_CASES = [  # (per-rank shape, dim, dtype, bits, quantizer): the RS input; the AG input is
    ((8 * 150,), 0, torch.bfloat16, 4, "zero_aware"),          # its output. Chunks padded
    ((8, 3, 50), 0, torch.float16, 8, "naive"),                 # to whole groups
    ((2, 16, 64), 1, torch.float32, 4, "symmetric"),           # the sequence dim of SP
    ((5, 8, 96), -2, torch.bfloat16, 4, "zero_aware"),
    ((8,), 0, torch.float32, 4, "zero_aware"),                  # one value per chunk at P=8
]
HALF_COMP = [EchoConfig(), two_timescale(bits=4), two_timescale(bits=8, quantizer="symmetric")]
HALF_SHAPE, HALF_FWD, HALF_BWD = (2, 8, 96), 4, 3                # [B, T, H]


def half_input(case: int, rank: int, shape, dtype):
    g = torch.Generator().manual_seed(SEED + 7919 * case + rank + 555)
    x = torch.randn(shape, generator=g) * (1 + rank)
    if x.numel() > 40:
        x.view(-1)[::37] *= 20.0                                 # outliers
    return x.to(dtype)


def half_comp_input(cfg_i: int, call: int, rank: int, backward: bool):
    g = torch.Generator().manual_seed(SEED + 104729 * cfg_i + 31 * call + rank + 777 * backward)
    x = torch.randn(HALF_SHAPE, generator=g) + 0.5 * rank
    return (x * 1e-7 if backward else x).to(torch.bfloat16)      # tiny gradients: scaling


def _halves_worker(rank, world_size):
    import torch.distributed as dist

    from echo_tp import EchoCommunicator
    P = world_size
    out = {"rs": [], "ag": [], "comp": []}
    for c, (shape, dim, dtype, bits, qz) in enumerate(HALF_CASES):
        comm = EchoCommunicator.from_group(None, EchoConfig(bits=bits, quantizer=qz, eta=0.0))
        y = comm.reduce_scatter(half_input(c, rank, shape, dtype), dim=dim)
        out["rs"].append(y)
        out["ag"].append(comm.all_gather(y, dim=dim))
    plain = EchoCommunicator.from_group(None, EchoConfig(bits=16))
    x = half_input(0, rank, (8 * 150,), torch.bfloat16)
    want = torch.empty(8 * 150 // P, dtype=x.dtype)
    dist.reduce_scatter_tensor(want, x)
    gathered = torch.empty(P * 150, dtype=x.dtype)
    dist.all_gather_into_tensor(gathered, x[:150].contiguous())
    ints = torch.randint(-32, 32, (2, 8, 6), generator=torch.Generator().manual_seed(SEED + rank))
    out["plain"] = dict(rs=plain.reduce_scatter(x), want_rs=want,
                        ag=plain.all_gather(x[:150]), want_ag=gathered,
                        ints=plain.reduce_scatter(ints.bfloat16(), dim=1))
    for i, cfg in enumerate(HALF_COMP):
        comm = EchoCommunicator.from_group(None, cfg)
        res = {}
        for direction, n, bwd in (("forward", HALF_FWD, False), ("backward", HALF_BWD, True)):
            comm.new_pass(direction)
            ys = []
            for call in range(n):
                y = comm.reduce_scatter(half_comp_input(i, call, rank, bwd), dim=1,
                                        direction=direction)
                ys.append((y, comm.all_gather(y, dim=1, direction=direction)))
            res[direction] = ys
            res[direction + "_state"] = {
                k: (s.m1.clone(), s.m2.clone()) for k in ("reduce_scatter", "all_gather")
                if (s := comm.state(direction, kind=k)) is not None}
        out["comp"].append(res)
    # calls that differ across ranks: a ValueError on every rank, the communicator usable after
    out["mismatch"] = []
    for a, b in ((("reduce_scatter", 1024), ("all_gather", 1024)),
                 (("reduce_scatter", 1024), ("reduce_scatter", 2048))):
        comm = EchoCommunicator.from_group(None, EchoConfig(bits=4))
        kind, n = a if rank == 0 else b
        try:
            getattr(comm, kind)(torch.ones(n))
            res = "returned"
        except ValueError as e:
            res = str(e)
        y = comm.all_gather(torch.full((8,), float(rank)), bits=16)
        out["mismatch"].append((res, torch.equal(y, torch.arange(float(P)).repeat_interleave(8))))
    try:
        comm.reduce_scatter(torch.ones(6, 7), dim=1)
    except ValueError as e:
        out["bad_dim"] = str(e)
    return out


def _front(x, dim):
    """A rank's tensor with dim moved first, flat, fp32 (the order its groups are taken in)."""
    return x.movedim(dim, 0).contiguous().reshape(-1).float()


def independent_reduce_scatter(xs, dim, spec, dtype):
    """Owner j: the sum over ranks r, in rank order, of chunk j, quant_dequant'ed (padded to
    whole groups) unless r == j, in fp32; each rank's output in its chunk's shape."""
    P, m = len(xs), xs[0].numel() // len(xs)
    seg = -(-m // spec.group_size) * spec.group_size
    flat = [_front(x, dim).view(P, m) for x in xs]
    shape = list(xs[0].movedim(dim, 0).shape)
    shape[0] //= P
    outs = []
    for j in range(P):
        acc = None
        for r in range(P):
            c = flat[r][j] if r == j else quant.quant_dequant(F.pad(flat[r][j], (0, seg - m)),
                                                               spec)[:m]
            acc = c if acc is None else acc + c
        outs.append(acc.to(dtype).reshape(shape).movedim(0, dim))
    return outs


def independent_all_gather(shards, dim, spec, dtype):
    """Each shard quant_dequant'ed once (padded to whole groups), concatenated in rank order."""
    m = shards[0].numel()
    seg = -(-m // spec.group_size) * spec.group_size
    dec = [quant.quant_dequant(F.pad(_front(s, dim), (0, seg - m)), spec)[:m] for s in shards]
    shape = list(shards[0].movedim(dim, 0).shape)
    shape[0] *= len(shards)
    return torch.cat(dec).to(dtype).reshape(shape).movedim(0, dim)


def test_halves_match_independent_implementation(world):
    P, res = world
    for c, (shape, dim, dtype, bits, qz) in enumerate(HALF_CASES):
        spec = EchoConfig(bits=bits, quantizer=qz).quant_spec()
        xs = [half_input(c, r, shape, dtype) for r in range(P)]
        want = independent_reduce_scatter(xs, dim, spec, dtype)
        got = [res[r]["halves"]["rs"][c] for r in range(P)]
        for r in range(P):
            assert got[r].dtype == dtype and got[r].shape == want[r].shape, (c, got[r].shape)
            assert not bits_differ(got[r], want[r]).any(), (c, r, SEED)
        gathered = independent_all_gather(got, dim, spec, dtype)
        assert gathered.shape == xs[0].shape
        for r in range(P):                           # every rank the same codes, decoded
            assert not bits_differ(res[r]["halves"]["ag"][c], gathered).any(), (c, r, SEED)
        exact = torch.stack([x.double() for x in xs]).sum(0).chunk(P, dim)
        err = max(float((got[r].double() - exact[r]).abs().max()) for r in range(P))
        assert err < 0.3 * float(max(x.double().abs().max() for x in xs)), (c, err)


def test_halves_simulated_is_bit_identical_to_gloo(world):
    P, res = world
    for c, (shape, dim, dtype, bits, qz) in enumerate(HALF_CASES):
        sim = SimulatedCommunicator(P, EchoConfig(bits=bits, quantizer=qz, eta=0.0))
        y = sim.reduce_scatter(torch.stack([half_input(c, r, shape, dtype) for r in range(P)]),
                               dim=dim)
        g = sim.all_gather(y, dim=dim)
        for r in range(P):
            assert not bits_differ(y[r], res[r]["halves"]["rs"][c]).any(), (c, r)
            assert not bits_differ(g[r], res[r]["halves"]["ag"][c]).any(), (c, r)
    for i, cfg in enumerate(HALF_COMP):
        sim = SimulatedCommunicator(P, cfg)
        for direction, n, bwd in (("forward", HALF_FWD, False), ("backward", HALF_BWD, True)):
            sim.new_pass(direction)
            for call in range(n):
                xs = torch.stack([half_comp_input(i, call, r, bwd) for r in range(P)])
                y = sim.reduce_scatter(xs, dim=1, direction=direction)
                ag = sim.all_gather(y, dim=1, direction=direction)
                for r in range(P):
                    got_y, got_ag = res[r]["halves"]["comp"][i][direction][call]
                    assert torch.equal(y[r], got_y) and torch.equal(ag[r], got_ag), \
                        (i, direction, call, r, SEED)
            states = res[0]["halves"]["comp"][i][direction + "_state"]
            assert set(states) == {"reduce_scatter", "all_gather"}
            for kind in states:
                st = sim.state(direction, kind=kind)
                for r in range(P):
                    m1, m2 = res[r]["halves"]["comp"][i][direction + "_state"][kind]
                    assert torch.equal(st.m1[r], m1) and torch.equal(st.m2[r], m2), (i, kind, r)


def test_halves_backward_scaling_keeps_tiny_gradients(world):
    P, res = world
    for i, cfg in enumerate(HALF_COMP):
        xs = torch.stack([half_comp_input(i, 0, r, True) for r in range(P)]).double()
        exact = xs.sum(0).chunk(P, dim=1)
        y, ag = res[0]["halves"]["comp"][i]["backward"][0]
        tol = 0.2 if cfg.bits == 4 else 0.02
        assert float((y.double() - exact[0]).norm() / exact[0].norm()) < tol, i
        full = torch.cat(exact, dim=1)               # the chunks summed, then gathered
        assert float((ag.double() - full).norm() / full.norm()) < 1.5 * tol, i


def test_halves_at_16_bits_are_torch_reduce_scatter_and_all_gather(world):
    P, res = world
    for r in range(P):
        p = res[r]["halves"]["plain"]
        assert torch.equal(p["rs"], p["want_rs"]) and torch.equal(p["ag"], p["want_ag"])
    # |ints| <= 32 at P <= 8: every partial sum, in any order, is an integer of at most 256,
    # exact in bf16 too (gloo sums bf16 in bf16; with +-50 a partial past 256 was rounded)
    ints = torch.stack([torch.randint(-32, 32, (2, 8, 6),
                                      generator=torch.Generator().manual_seed(SEED + r))
                        for r in range(P)]).bfloat16()
    sim = SimulatedCommunicator(P, EchoConfig(bits=16)).reduce_scatter(ints, dim=1)
    want = ints.double().sum(0).chunk(P, dim=1)
    for r in range(P):    # integers: every summation order is exact
        assert torch.equal(sim[r], res[r]["halves"]["plain"]["ints"])
        assert torch.equal(sim[r], want[r].to(torch.bfloat16))


def test_halves_disagreeing_calls_are_refused_on_every_rank(world):
    P, res = world
    for c in range(2):
        for r in range(P):
            msg, usable = res[r]["halves"]["mismatch"][c]
            assert "differ across ranks" in msg and "rank 1 calls" in msg, (c, r, msg)
            assert usable, (c, r)
    msg = res[0]["halves"]["mismatch"][0][0]
    assert "rank 0 calls reduce_scatter(numel=1024" in msg and "all_gather(numel=1024" in msg
    assert f"divisible by the group size {P}" in res[0]["halves"]["bad_dim"]

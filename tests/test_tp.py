"""Tensor-parallel models (echo_tp.tp) on real gloo ranks (P = 2, 4) and simulated in-process.

What is compared with what:
- gloo TP at bits=16 vs the single-device model: logits and every parameter gradient (each rank's
  slice of the whole gradient, after tp.sync_partial_grads), the gathered weights, the global
  grad norm. Tolerance: logits atol 1e-5 (values O(1)), grads atol 2e-6 + rtol 1e-4; TP sums the
  same fp32 products in another grouping (per-shard dot products, then the all-reduce), which
  moves results by a few ulp and never by a wrong slice, head or missing all-reduce.
- simulated TP vs gloo TP at bits 4 (output residual) and 8 (local residual): logits, and every shard's
  gradients after one training step, bit for bit; greedy generation with a KV cache, token for
  token. Cases cover Llama (with and without attention bias), Qwen3 (q/k norm: partial grads)
  and, at P=4, 2 kv heads replicated over 4 ranks.
- simulated only: pass resets and direction separation (site counters, telemetry, determinism of
  repeated passes), bit policies in both directions, replicated kv heads at P=8, and Echo 4-bit
  against uncompensated 4-bit on a model with planted outlier channels.
- sequence parallelism (parallelize(..., sequence_parallel=True), tp/sequence.py), on the same
  gloo ranks (P = 2, 4) and simulated: at 16 bits logits and every gradient against the
  single-device model (same tolerances; the norms' and row-parallel biases' gradients are
  partial over the sequence shards until sync_partial_grads); at 4 and 8 bits (and 16 at
  P = 2) simulated == gloo, logits and every gradient, bit for bit. Simulated only: the
  reduce-scatter / all-gather calls per pass (none of the all-reduce), bits per site, and the
  clear errors (a sequence length P does not divide, one-token decoding).
Where to look first: a 16-bit mismatch -> tp/plan.py (head/kv index maths) or tp/parallelize.py
(_shard); a simulated != gloo mismatch -> SimTPBlock / SimCopy / SimReduce (the shard loop must
run the very ops of a real rank) or grads.sync_partial_grads (sum order); under sequence
parallelism tp/sequence.py (sim_shardwise: the simulated norms must run shard by shard).
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from echo_tp import EchoConfig, SimulatedCommunicator
from echo_tp.models import ModelConfig, build_meta_model, init_weights
from echo_tp.tp import (WidthPlan, full_state_dict, grad_norm, make_policy, parallelize,
                        parse_comm_spec, rank_parameters, sync_partial_grads)
from harness import perturbed_model, run_ranks, token_batch, two_timescale

CASES = {  # name -> (preset, ModelConfig overrides, world sizes it runs at)
    "llama": ("tiny-llama", {}, (2,)),
    "llama-bias": ("tiny-llama", {"attention_bias": True}, (2,)),
    "qwen3": ("tiny-qwen3", {}, (2, 4, 8)),  # at 8: kv heads replicated over 2 ranks
    "qwen3-kv2": ("tiny-qwen3", {"n_kv_heads": 2}, (4,)),  # kv heads replicated over 2 ranks
}
QUANT_CONFIGS = [dict(bits=4),                       # the paper's fp32 pair (two_timescale)
                 dict(bits=8, beta1=0.0, beta2=0.0, state_dtype="bfloat16")]   # default state
LOGIT_ATOL, GRAD_ATOL, GRAD_RTOL = 1e-5, 2e-6, 1e-4
SP_CASES = {"llama-bias": (2,), "qwen3": (2, 4)}   # sequence parallel: case -> world sizes


def build(case: str) -> torch.nn.Module:
    preset, over, _ = CASES[case]
    return perturbed_model(preset, over, 11)


def batch():
    return token_batch(13)


def sp_batch():
    """T = 8: divisible by every P the sequence-parallel cases run at."""
    g = torch.Generator().manual_seed(14)
    return torch.randint(0, 256, (2, 8), generator=g), torch.randint(0, 256, (2, 8), generator=g)


def step(model, data=batch):
    """Forward + cross-entropy backward + partial-grad sync: (logits, {real name: grad})."""
    x, y = data()
    logits = model(x)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    if getattr(model, "echo_tp", None) is not None:
        sync_partial_grads(model)
    return logits.detach()


def grads_of(params):
    return {n: p.grad.clone() for n, p in params.items()}


def _worker(rank, world_size):
    from echo_tp import EchoCommunicator
    out = {}
    for case, (_, _, sizes) in CASES.items():
        if world_size not in sizes:
            continue
        for cfg in [dict(bits=16)] + QUANT_CONFIGS:
            model = build(case)
            parallelize(model, EchoCommunicator.from_group(None, two_timescale(**cfg)), rank)
            logits = step(model)
            res = {"logits": logits, "grads": grads_of(rank_parameters(model))}
            if cfg["bits"] == 16:
                res["state"] = full_state_dict(model)
                res["norm"] = grad_norm(model)
                res["shards"] = {k: (d, idx) for k, (d, idx, _) in model.echo_tp.shards.items()}
            if cfg == QUANT_CONFIGS[0]:
                model.eval()
                res["generated"] = model.generate(batch()[0][:, :4], 5)
            out[(case, str(cfg))] = res
    for case, sizes in SP_CASES.items():
        if world_size not in sizes:
            continue
        for cfg in [dict(bits=16)] + QUANT_CONFIGS:
            model = build(case)
            parallelize(model, EchoCommunicator.from_group(None, two_timescale(**cfg)), rank,
                        sequence_parallel=True)
            logits = step(model, sp_batch)
            out[("sp", case, str(cfg))] = dict(
                logits=logits, grads=grads_of(rank_parameters(model)),
                shards={k: (d, idx) for k, (d, idx, _) in model.echo_tp.shards.items()})
    return out


@pytest.fixture(scope="module", params=[2, 4, 8], ids=["P2", "P4", "P8"])
def world(request):
    return request.param, run_ranks(request.param, _worker)


def _slice(full, shards, name, rank):
    if name not in shards:
        return full
    dim, idx = shards[name]
    return full.index_select(dim, idx[rank])


def test_tp_matches_single_device_at_16_bits(world):
    P, res = world
    for case, (_, _, sizes) in CASES.items():
        if P not in sizes:
            continue
        ref = build(case)
        ref_logits = step(ref)
        ref_grads = grads_of(dict(ref.named_parameters(remove_duplicate=False)))
        ref_norm = torch.stack([p.grad.square().sum() for p in ref.parameters()]).sum().sqrt()
        for r in range(P):
            got = res[r][(case, str(dict(bits=16)))]
            torch.testing.assert_close(got["logits"], ref_logits, atol=LOGIT_ATOL, rtol=0)
            assert set(got["grads"]) == set(ref_grads), case
            for name, g in got["grads"].items():
                want = _slice(ref_grads[name], got["shards"], name, r)
                torch.testing.assert_close(g, want, atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                           msg=lambda m: f"{case} rank {r} {name}: {m}")
            for name, w in ref.state_dict().items():
                assert torch.equal(got["state"][name], w), (case, name)
            torch.testing.assert_close(got["norm"], ref_norm, atol=0, rtol=1e-5)


def test_simulated_is_bit_identical_to_gloo(world):
    P, res = world
    _compare_simulated(P, res)


def _compare_simulated(P, res):
    for case, (_, _, sizes) in CASES.items():
        if P not in sizes:
            continue
        for cfg in QUANT_CONFIGS:
            sim = build(case)
            parallelize(sim, SimulatedCommunicator(P, two_timescale(**cfg)))
            logits = step(sim)
            for r in range(P):
                got = res[r][(case, str(cfg))]
                assert torch.equal(logits, got["logits"]), (case, cfg, r)
                params = rank_parameters(sim, r)
                assert set(params) == set(got["grads"]), (case, cfg)
                for name, p in params.items():
                    assert torch.equal(p.grad, got["grads"][name]), (case, cfg, r, name)
            if cfg == QUANT_CONFIGS[0]:
                sim.eval()
                gen = sim.generate(batch()[0][:, :4], 5)
                for r in range(P):
                    assert torch.equal(gen, res[r][(case, str(cfg))]["generated"]), (case, r)


def test_kv_heads_replicated_beyond_their_count_simulated():
    """P=8 > 4 kv heads (tiny presets): each rank keeps the kv head of its query heads."""
    for case in ("llama", "qwen3"):
        ref = build(case)
        ref_logits = step(ref)
        ref_grads = grads_of(dict(ref.named_parameters(remove_duplicate=False)))
        sim = build(case)
        parallelize(sim, SimulatedCommunicator(8, two_timescale(bits=16)))
        torch.testing.assert_close(step(sim), ref_logits, atol=LOGIT_ATOL, rtol=0)
        shards = {k: (d, idx) for k, (d, idx, _) in sim.echo_tp.shards.items()}
        for r in range(8):
            k = rank_parameters(sim, r)["model.layers.0.self_attn.k_proj.weight"]
            assert k.shape[0] == 16  # one kv head of head_dim 16
            for name, p in rank_parameters(sim, r).items():
                torch.testing.assert_close(p.grad, _slice(ref_grads[name], shards, name, r),
                                           atol=GRAD_ATOL, rtol=GRAD_RTOL)
        assert sim.echo_tp.replicas["model.layers.0.self_attn.k_proj.weight"] == \
            [(0, 1), (2, 3), (4, 5), (6, 7)]
        torch.testing.assert_close(grad_norm(sim), torch.stack(
            [p.grad.square().sum() for p in ref.parameters()]).sum().sqrt(), atol=0, rtol=1e-5)


def test_passes_reset_and_directions_are_separate():
    model = build("qwen3")
    L = model.cfg.n_layers
    comm = SimulatedCommunicator(2, two_timescale(bits=4), telemetry=True)
    parallelize(model, comm, policy="early8")
    x, y = batch()
    first = []
    for rep in range(2):
        logits = model(x)
        assert comm.passes["forward"].sites == 2 * L
        fwd_state = comm.state("forward")
        m1 = fwd_state.m1.clone()
        assert comm.passes["backward"].sites == (0 if rep == 0 else 2 * L)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        assert comm.passes["backward"].sites == 2 * L  # reset at the start of each backward
        assert comm.state("forward") is fwd_state and torch.equal(fwd_state.m1, m1)
        assert comm.state("backward") is not fwd_state
        grads = [p.grad.clone() for p in model.parameters()]
        if rep == 0:
            first = [logits.detach(), grads]
        else:  # fresh state every pass: the repeat is bit-identical
            assert torch.equal(logits, first[0])
            assert all(torch.equal(a, b) for a, b in zip(grads, first[1]))
    rows = comm.telemetry_summary()
    fwd = [(r["pass"], r["site"], r["bits"]) for r in rows if r["direction"] == "forward"]
    bwd = [(r["pass"], r["site"], r["bits"]) for r in rows if r["direction"] == "backward"]
    # early8 at L=2: layer 0 (static sites 0, 1) at 8 bits; backward visits static 3, 2, 1, 0
    assert fwd == [(p, s, b) for p in range(2) for s, b in enumerate([8, 8, 4, 4])]
    assert bwd == [(p, s, b) for p in range(2) for s, b in enumerate([4, 4, 8, 8])]
    with torch.no_grad():
        model(x)  # no graph: the backward counter stays where it was
    assert comm.passes["backward"].sites == 2 * L


def planted_outlier_model(seed: int, n_layers: int = 8, channels: int = 4, gain: float = 10.0):
    """tiny-llama with 8 layers whose o_proj/down_proj rows of a few hidden channels are scaled
    up: those channels of every block output (and so of every all-reduce) are outliers."""
    cfg = ModelConfig.from_name("tiny-llama").replace(n_layers=n_layers)
    model = init_weights(build_meta_model(cfg).to_empty(device="cpu"), seed=seed).eval()
    chans = torch.randperm(cfg.dim, generator=torch.Generator().manual_seed(1000 + seed))[:channels]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[chans] *= gain
            layer.mlp.down_proj.weight[chans] *= gain
    return model


OUTLIER_SEEDS = range(6)


def test_echo_beats_uncompensated_4bit_with_outlier_channels():
    """Relative logit deviation ||y - y16|| / ||y16|| at P=4 (simulated), 8 layers, 4 outlier
    channels at 10x, 64 tokens. Measured, seeds 0-5: uncompensated 4-bit 0.23-0.69, Echo 4-bit
    output residual 0.10-0.22, local residual 0.09-0.23; ratio Echo / uncompensated 0.32-0.61
    (mean 0.45). Over seeds 6-25 the ratio averages 0.47-0.49 and peaks at 0.75 (output) and
    0.92 (local), so the per-seed claim asserted is only "smaller", the margin is on the mean."""
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    table = {}
    for seed in OUTLIER_SEEDS:
        base = planted_outlier_model(seed)
        outs = {}
        for name in ("16", "4", "echo4-output", "echo4-local"):
            model = copy.deepcopy(base)
            parallelize(model, SimulatedCommunicator(4, EchoConfig.from_name(name)))
            with torch.no_grad():
                outs[name] = model(x)
        dev = {n: float((outs[n] - outs["16"]).norm() / outs["16"].norm())
               for n in ("4", "echo4-output", "echo4-local")}
        table[seed] = dev
    for seed, dev in table.items():
        for mode in ("echo4-output", "echo4-local"):
            assert dev[mode] < dev["4"], (seed, table)
    mean = {n: sum(d[n] for d in table.values()) / len(table) for n in table[0]}
    assert mean["echo4-output"] < 0.6 * mean["4"] and mean["echo4-local"] < 0.6 * mean["4"], mean


def test_policies_and_comm_specs():
    early = make_policy("early8", 5)  # first 5 // 2 = 2 layers = sites 0..3 at 8 bits
    assert [early(s) for s in range(10)] == [8, 8, 8, 8, 4, 4, 4, 4, 4, 4]
    for name, wide in (("first8", {0}), ("last8", {5}), ("ends8", {0, 5})):
        fn = make_policy(name, 3)                     # 3 layers: sites 0..5
        assert [fn(s) for s in range(6)] == [8 if s in wide else None for s in range(6)], name
    assert make_policy("uniform8", 2)(3) == 8 and make_policy(None, 2)(0) is None
    assert make_policy({0: 16}, 2)(0) == 16 and make_policy({0: 16}, 2)(1) is None
    assert make_policy([4, 8, 4, 8], 2)(3) == 8
    with pytest.raises(ValueError, match="entries"):
        make_policy([4, 8], 2)
    with pytest.raises(ValueError, match="expected 4, 8, 16"):
        make_policy(lambda s: 5, 2)
    spec = parse_comm_spec("echo4:eta=0.9,quantizer=naive,g=256,residual=local")
    assert spec.config == EchoConfig(bits=4, eta=0.9, quantizer="naive", group_size=256,
                                     residual="local")
    assert parse_comm_spec("early8").widths.policy == "early8"
    assert parse_comm_spec("4").config.eta == 0.0
    assert parse_comm_spec("echo4bf").config.state_dtype == "bfloat16"
    assert parse_comm_spec("16:policy=early8").widths.policy == "early8"
    for bad, msg in (("echo5", "unknown comm config"), ("echo4:eta", "KEY=VALUE"),
                     ("echo4:bogus=1", "unknown key"), ("echo4:eta=x", "not a valid"),
                     ("echo4:policy=late", "unknown policy"), ("echo4:g=100", "power of two")):
        with pytest.raises(ValueError, match=msg):
            parse_comm_spec(bad)


def test_bad_tp_sizes_are_refused():
    with pytest.raises(ValueError, match="n_heads=8 does not split over TP=3"):
        parallelize(build("llama"), SimulatedCommunicator(3, two_timescale(bits=16)))
    model = build("llama")
    parallelize(model, SimulatedCommunicator(2, two_timescale(bits=16)))
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize(model, SimulatedCommunicator(2, two_timescale(bits=16)))


def test_block_boundaries_are_fused_all_reduce_add_rmsnorm(monkeypatch):
    """Under TP (P > 1) each layer's two block boundaries are one comm.all_reduce_add_rmsnorm
    call each (2 per layer per forward pass: the all-reduce, the residual add and the next
    RMSNorm, the model's last norm included), training included (gradients within the 16-bit
    tolerances of the single-device model: test_tp_matches_single_device_at_16_bits covers
    every case); a row-parallel bias keeps the plain path; a group of one stays plain."""
    from echo_tp.communicator import EchoCommunicator
    calls = []
    real = EchoCommunicator.all_reduce_add_rmsnorm

    def counting(self, *a, **kw):
        calls.append(kw.get("bits"))
        return real(self, *a, **kw)
    monkeypatch.setattr(EchoCommunicator, "all_reduce_add_rmsnorm", counting)
    ref = build("qwen3")
    model = parallelize(copy.deepcopy(ref), SimulatedCommunicator(2, EchoConfig(bits=16)))
    n = len(model.model.layers)
    assert all(layer.boundaries is not None for layer in model.model.layers)
    want, got = step(ref), step(model)
    assert len(calls) == 2 * n
    torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)
    calls.clear()
    biased = parallelize(build("llama-bias"), SimulatedCommunicator(2, EchoConfig(bits=16)))
    assert all(layer.boundaries is None for layer in biased.model.layers)
    step(biased)
    assert not calls
    one = parallelize(build("qwen3"), SimulatedCommunicator(1))
    assert all(layer.boundaries is None for layer in one.model.layers)
    torch.testing.assert_close(step(one), want, atol=0, rtol=0)   # a group of one: exact


def test_sequence_parallel_matches_single_device_at_16_bits(world):
    P, res = world
    for case, sizes in SP_CASES.items():
        if P not in sizes:
            continue
        ref = build(case)
        ref_logits = step(ref, sp_batch)
        ref_grads = grads_of(dict(ref.named_parameters(remove_duplicate=False)))
        for r in range(P):
            got = res[r][("sp", case, str(dict(bits=16)))]
            shards = got["shards"]
            torch.testing.assert_close(got["logits"], ref_logits, atol=LOGIT_ATOL, rtol=0)
            assert set(got["grads"]) == set(ref_grads), case
            for name, g in got["grads"].items():
                want = _slice(ref_grads[name], shards, name, r)
                torch.testing.assert_close(g, want, atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                           msg=lambda m: f"SP {case} rank {r} {name}: {m}")


def test_sequence_parallel_simulated_is_bit_identical_to_gloo(world):
    P, res = world
    for case, sizes in SP_CASES.items():
        if P not in sizes:
            continue
        # at P = 2 also 16 bits (a sum of two is one rounding in any order): no ulp of
        # difference hides behind the quantizer's grid
        for cfg in QUANT_CONFIGS + ([dict(bits=16)] if P == 2 else []):
            sim = build(case)
            parallelize(sim, SimulatedCommunicator(P, two_timescale(**cfg)),
                        sequence_parallel=True)
            logits = step(sim, sp_batch)
            for r in range(P):
                got = res[r][("sp", case, str(cfg))]
                assert torch.equal(logits, got["logits"]), (case, cfg, r)
                params = rank_parameters(sim, r)
                assert set(params) == set(got["grads"]), (case, cfg)
                for name, p in params.items():
                    assert torch.equal(p.grad, got["grads"][name]), (case, cfg, r, name)


def test_sequence_parallel_sites_and_errors():
    """Per pass of an L-layer model: forward 2L reduce-scatters (compensated) and 2L + 1
    all-gathers (the blocks' inputs and the head's), backward the mirror (2L all-gathers of the
    blocks' output gradients + 1 of the embedding's, 2L reduce-scatters), no all-reduce; the
    policy's bits reach them; 4 bits really quantize yet stay near 16 bits; a sequence length
    P does not divide and one-token decoding get a ValueError."""
    model = build("qwen3")
    L = model.cfg.n_layers
    comm = SimulatedCommunicator(2, EchoConfig(bits=4))
    bits = []
    real = SimulatedCommunicator._half

    def recording(self, kind, x, dim, direction, b, compensate):
        bits.append((kind, direction, b, compensate))
        return real(self, kind, x, dim, direction, b, compensate)
    ref = step(build("qwen3"), sp_batch)
    parallelize(model, comm, policy="early8", sequence_parallel=True)
    SimulatedCommunicator._half = recording
    try:
        logits = step(model, sp_batch)
    finally:
        SimulatedCommunicator._half = real
    half = comm.half_passes
    assert [half[k][d].sites for k in ("reduce_scatter", "all_gather")
            for d in ("forward", "backward")] == [2 * L, 2 * L, 2 * L + 1, 2 * L + 1]
    assert comm.passes["forward"].sites == comm.passes["backward"].sites == 0
    assert {(k, c) for k, _, _, c in bits} == {("reduce_scatter", True), ("all_gather", False)}
    fwd_rs = [b for k, d, b, _ in bits if (k, d) == ("reduce_scatter", "forward")]
    assert fwd_rs == [8, 8, 4, 4]                        # early8: layer 0 at 8 bits
    assert comm.state(kind="reduce_scatter") is not None
    rel = float((logits - ref).norm() / ref.norm())
    assert 1e-4 < rel < 0.5, rel
    with pytest.raises(ValueError, match="length 9 is not divisible by P=2"):
        model(batch()[0])
    model.eval()
    with pytest.raises(ValueError, match="decoding one token"):
        model.generate(sp_batch()[0][:, :4], 2)
    one = parallelize(build("qwen3"), SimulatedCommunicator(1), sequence_parallel=True)
    torch.testing.assert_close(step(one, sp_batch), ref, atol=0, rtol=0)   # plain at P = 1


def test_edge_sites_at_edge_bits_in_both_directions():
    """WidthPlan.edge_bits (8 by default): the first and last site run at 8 bits forward and
    backward where the policy leaves the width to the config; an explicit width wins; 0, the
    naive presets and a uniform policy keep every site at the config's width."""
    L = build("qwen3").cfg.n_layers
    last = 2 * L - 1

    def site_bits(cfg, policy=None):
        model = build("qwen3")
        comm = SimulatedCommunicator(2, cfg)
        parallelize(model, comm, policy=policy)
        return {(d, s): model.echo_tp.bits(s) for d in ("f",) for s in range(2 * L)}, \
            model, comm

    widths, model, comm = site_bits(EchoConfig())
    assert {s: b for (_, s), b in widths.items()} == {s: 8 if s in (0, last) else None
                                                     for s in range(2 * L)}
    calls = []
    real = comm.all_reduce
    comm.all_reduce = lambda x, **k: (calls.append((k["direction"], k.get("bits"))),
                                      real(x, **k))[1]
    real_norm = comm.all_reduce_add_rmsnorm
    comm.all_reduce_add_rmsnorm = lambda *a, **k: (calls.append((k["direction"], k.get("bits"))),
                                                   real_norm(*a, **k))[1]
    step(model)
    for d in ("forward", "backward"):
        seq = [b for dd, b in calls if dd == d]
        assert len(seq) == 2 * L and seq.count(8) == 2 and seq.count(None) == 2 * L - 2, (d, seq)
        order = seq if d == "forward" else seq[::-1]       # backward visits the sites reversed
        assert order[0] == 8 and order[-1] == 8, (d, seq)
    assert site_bits(EchoConfig(), policy={0: 16})[0][("f", 0)] == 16
    assert site_bits(EchoConfig(), policy={0: 16})[0][("f", last)] == 8
    naive4, paper = parse_comm_spec("4"), parse_comm_spec("echo4-output")
    for cfg, policy in ((EchoConfig(), WidthPlan(edge_bits=0)), (naive4.config, naive4.widths),
                        (paper.config, paper.widths), (EchoConfig(), "uniform4")):
        assert 8 not in site_bits(cfg, policy)[0].values(), (cfg, policy)
    assert set(site_bits(EchoConfig(bits=16))[0].values()) == {None}     # never narrowed
    with pytest.raises(ValueError, match="edge_bits must be one of"):
        WidthPlan(edge_bits=6)


def test_sequence_parallel_gather_bits():
    """WidthPlan(gather_bits=8): every all-gather of an SP pass (forward and backward) runs at
    8 bits, the reduce-scatters at the sites' own 4; a site set wider (16) keeps its width;
    the 8-bit gathers bring the logits closer to 16 bits than 4-bit gathers do."""
    L = build("qwen3").cfg.n_layers
    ref = step(build("qwen3"), sp_batch)
    real = SimulatedCommunicator._half
    runs = {}
    for gather in (0, 8):
        model = build("qwen3")
        comm = SimulatedCommunicator(2, EchoConfig(bits=4))
        parallelize(model, comm, policy=WidthPlan(policy={0: 16}, gather_bits=gather,
                                                  edge_bits=0), sequence_parallel=True)
        bits = []

        def recording(self, kind, x, dim, direction, b, compensate):
            bits.append((kind, direction, b))
            return real(self, kind, x, dim, direction, b, compensate)
        SimulatedCommunicator._half = recording
        try:
            logits = step(model, sp_batch)
        finally:
            SimulatedCommunicator._half = real
        runs[gather] = (bits, float((logits - ref).norm() / ref.norm()))
    bits8 = runs[8][0]
    gathers = [b for k, _, b in bits8 if k == "all_gather"]
    assert len(gathers) == 2 * (2 * L + 1) and set(gathers) == {8, 16}
    assert [b for k, d, b in bits8 if (k, d) == ("all_gather", "forward")][0] == 16  # site 0
    assert {b for k, _, b in bits8 if k == "reduce_scatter"} == {None, 16}   # None: 4
    assert {b for k, _, b in runs[0][0] if k == "all_gather"} == {4, 16}
    assert 0 < runs[8][1] < runs[0][1], (runs[8][1], runs[0][1])
    with pytest.raises(ValueError, match="gather_bits must be one of"):
        WidthPlan(gather_bits=6)

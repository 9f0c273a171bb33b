"""The two-timescale compensator (SPEC.md §4, paper Eqn 12 and Theorem 1), run through the
simulated backend (which test_collective.py proves bit-identical to real gloo ranks).

Compared: the group sum of residuals with -delta; the summed corrections with the closed form
C_k = -eta sum_{s<k} w_{k-1-s} delta_s on the recorded delta sequence; partial sums of the net
error at eta = 1 with the (1 + mu_w) max|delta| bound (constant inputs, the adversarial case), and
their linear growth without compensation; pass resets and the forward/backward separation.
If the closed form disagrees, look first at compensator.correction/update_ (constants, order).
"""
import os

import pytest
import torch

from echo_tp import EchoConfig, SimulatedCommunicator
from echo_tp.config import CompensatorConstants
from echo_tp.collective.qar import compensated_all_reduce
from echo_tp.collective.simulated import SimTransport
from echo_tp.compensator import CompState, closed_form_corrections, mean_age
from harness import two_timescale

SEED = int(os.environ.setdefault("ECHO_TEST_SEED", str(int.from_bytes(os.urandom(4), "little"))))
MODES = ("output", "local")


def partials(P, n, seed, spread=1.0):
    g = torch.Generator().manual_seed(SEED + seed)
    base = torch.randn(n, generator=g)
    return (base + spread * torch.randn(P, n, generator=g)).to(torch.bfloat16)


def run_sites(cfg, xs_per_site, P):
    """Runs one pass; returns per site (x [P,n], x' [P,n], c [P,n] or None, y [n])."""
    t = SimTransport(P)
    state = CompState.zeros((P, xs_per_site[0].shape[-1]), "cpu") if cfg.compensated else None
    out = []
    for x in xs_per_site:
        y, rec = compensated_all_reduce(x, cfg, t, state=state, record=True)
        assert all(torch.equal(y[0], y[r]) for r in range(P))
        out.append((x, rec.x_prime, rec.correction, y[0]))
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("P", (2, 4))
def test_residuals_sum_to_minus_delta(mode, P):
    # with beta1 = 0 the first update leaves m1 == u exactly (in an fp32 state)
    cfg = two_timescale(bits=4, residual=mode, beta1=0.0, state_dtype="float32")
    sim = SimulatedCommunicator(P, cfg)
    x = partials(P, 1000, 1)
    y = sim.all_reduce(x)[0].double()
    u = sim.state().m1.double()
    delta = y - x.double().sum(0)
    assert torch.allclose(u.sum(0), -delta, atol=1e-5 * float(x.double().abs().max()), rtol=0)
    if mode == "local":  # the state stays at rounding scale; 'output' carries x_i - mean
        assert u.abs().max() < 0.5 * x.double().abs().max()


@pytest.mark.parametrize("mode", MODES)
def test_corrections_match_closed_form(mode):
    P, n, N = 4, 512, 12
    cfg = two_timescale(bits=4, residual=mode)
    sites = run_sites(cfg, [partials(P, n, 100 + k) for k in range(N)], P)
    deltas = torch.stack([y.double() - xp.double().sum(0) for _, xp, _, y in sites])
    C = torch.stack([c.double().sum(0) if c is not None else torch.zeros(n, dtype=torch.float64)
                     for _, _, c, _ in sites])
    want = closed_form_corrections(deltas, cfg)
    scale = float(want.abs().max())
    assert torch.allclose(C, want, atol=1e-4 * scale, rtol=0), float((C - want).abs().max())


@pytest.mark.parametrize("mode", MODES)
def test_partial_sums_bounded_at_unit_gain(mode):
    P, n, N = 4, 384, 40
    x = partials(P, n, 7, spread=0.2)              # constant inputs: the adversarial sequence
    cfg = two_timescale(bits=4, residual=mode, eta=1.0)
    sites = run_sites(cfg, [x] * N, P)
    exact = x.double().sum(0)
    rho = torch.stack([y.double() - exact for _, _, _, y in sites])
    deltas = torch.stack([y.double() - xp.double().sum(0) for _, xp, _, y in sites])
    S = rho.cumsum(0)
    q = deltas.abs().amax(0)                        # elementwise max |delta_k|
    bound = (1 + mean_age(cfg)) * q
    assert torch.all(S.abs() <= bound * (1 + 1e-4) + 1e-5), float((S.abs() - bound).max())
    # without compensation the same sequence accumulates linearly: S_t = t * delta
    plain = run_sites(two_timescale(bits=4, eta=0.0), [x] * N, P)
    rho0 = torch.stack([y.double() - exact for _, _, _, y in plain])
    S0 = rho0.cumsum(0)
    assert torch.allclose(S0[-1], N * rho0[0])
    hit = rho0[0].abs() > 0
    assert float(S0[-1][hit].abs().mean()) > 5 * float(S[-1][hit].abs().mean())


def test_state_resets_each_pass_and_directions_are_separate():
    P = 4
    cfg = two_timescale(bits=4)
    xs = [partials(P, 300, 200 + k) for k in range(3)]
    a = SimulatedCommunicator(P, cfg)
    with a.pass_scope("forward"):
        first = [a.all_reduce(x) for x in xs]
    fwd_m1 = a.state("forward").m1.clone()
    with a.pass_scope("backward"):
        a.all_reduce(xs[0] * 1e-3, direction="backward")
    assert torch.equal(a.state("forward").m1, fwd_m1)       # backward leaves forward alone
    assert not torch.equal(a.state("backward").m1, fwd_m1)
    with a.pass_scope("forward"):
        again = [a.all_reduce(x) for x in xs]
    fresh = SimulatedCommunicator(P, cfg)
    fresh.new_pass()
    new = [fresh.all_reduce(x) for x in xs]
    for u, v, w in zip(first, again, new):
        assert torch.equal(u, v) and torch.equal(u, w)
    assert a.passes["forward"].sites == 3


def test_sites_of_different_sizes_keep_separate_streams():
    P = 2
    sim = SimulatedCommunicator(P, two_timescale(bits=4))
    sim.new_pass()
    sim.all_reduce(partials(P, 256, 1))
    sim.all_reduce(partials(P, 100, 2))
    sim.all_reduce(partials(P, 256, 3))
    assert set(sim.passes["forward"].streams) == {256, 100}
    with pytest.raises(ValueError):
        sim.state()                                          # ambiguous: name numel
    assert sim.state(numel=100).m1.shape == (P, 100)


def test_zero_gain_and_16_bits_leave_no_state():
    sim = SimulatedCommunicator(2, two_timescale(bits=4, eta=0.0))
    sim.new_pass()
    sim.all_reduce(partials(2, 256, 1))
    assert not sim.passes["forward"].streams
    sim16 = SimulatedCommunicator(2, two_timescale(bits=16))
    x = partials(2, 256, 1).float()
    assert torch.equal(sim16.all_reduce(x)[0], x[0] + x[1])


def test_per_site_bits_override():
    P = 2
    sim = SimulatedCommunicator(P, two_timescale(bits=4, eta=0.0))
    x = partials(P, 1024, 5).float()
    exact = x.sum(0)
    e4 = (sim.all_reduce(x, bits=4)[0] - exact).abs().mean()
    e8 = (sim.all_reduce(x, bits=8)[0] - exact).abs().mean()
    e16 = (sim.all_reduce(x, bits=16)[0] - exact).abs().max()
    assert e8 < e4 / 8 and e16 == 0


def test_simulated_telemetry_is_exact():
    P, N = 4, 6
    sim = SimulatedCommunicator(P, two_timescale(bits=4, residual="local"), telemetry=True)
    xs = [partials(P, 512, 300 + k) for k in range(N)]
    sim.new_pass()
    ys = [sim.all_reduce(x)[0] for x in xs]
    rows = sim.telemetry_summary()
    S = torch.zeros(512, dtype=torch.float64)
    for row, x, y in zip(rows, xs, ys):
        rho = y.double() - x.double().sum(0)
        S += rho
        assert row["rho_norm"] == pytest.approx(float(rho.norm()), rel=1e-9)
        assert row["partial_sum_norm"] == pytest.approx(float(S.norm()), rel=1e-9)
        # the free estimate tracks the exact injected error (independent rounding errors)
        assert row["delta_norm_est"] == pytest.approx(row["delta_norm"], rel=0.3)


def test_default_state_is_one_bf16_tensor_and_presets_keep_the_paper_pair():
    """EchoConfig(): beta1 = beta2 = 0 in bf16 (docs/results/2026-11-30-compact-state.md), so
    the communicator holds one bf16 tensor per direction and c = eta * (last u); the paper's
    fp32 two-timescale pair is the preset echo4-2ts (local) / echo4-output (paper setting)."""
    cfg = EchoConfig()
    assert (cfg.beta1, cfg.beta2, cfg.state_dtype, cfg.residual) == (0.0, 0.0, "bfloat16", "local")
    P, n = 2, 640
    sim = SimulatedCommunicator(P, cfg)
    sim.new_pass()
    x0, x1 = partials(P, n, seed=3), partials(P, n, seed=4)
    y0 = sim.all_reduce(x0)
    st = sim.state()
    assert st.compact and st.m1.dtype == torch.bfloat16 and st.m2 is st.m1
    u0 = st.m1.clone()                                # the first call's residual, in bf16
    assert bool(u0.abs().sum() > 0)
    # the next call quantizes x' = x + eta * (a u0 + (1 - a) u0) in fp32 (m1 is m2)
    y1 = sim.all_reduce(x1)
    k = CompensatorConstants.from_config(cfg)
    u = u0.float()
    x_prime = x1.float() + (u * k.a + u * k.one_minus_a) * k.eta
    want = SimulatedCommunicator(P, cfg.replace(eta=0.0)).all_reduce(x_prime)
    assert torch.equal(y1, want.to(y1.dtype))
    assert not torch.equal(y0, y1)
    for name, resid, eta in (("echo4-2ts", "local", 1.0), ("echo4-output", "output", 0.75)):
        p = EchoConfig.from_name(name)
        assert (p.beta1, p.beta2, p.a, p.state_dtype, p.residual, p.eta) == \
            (0.7, 0.3, 0.35, "float32", resid, eta)
        sim = SimulatedCommunicator(P, p)
        sim.new_pass()
        sim.all_reduce(x0)
        assert not sim.state().compact and sim.state().m1.dtype == torch.float32


def test_bad_input_gets_clear_errors():
    sim = SimulatedCommunicator(2, EchoConfig())
    with pytest.raises(ValueError, match="leading dim"):
        sim.all_reduce(torch.zeros(3, 128))
    with pytest.raises(ValueError, match="supports"):
        sim.all_reduce(torch.zeros(2, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="direction"):
        sim.all_reduce(torch.zeros(2, 128), direction="sideways")
    with pytest.raises(ValueError):
        two_timescale(eta=float("nan"))
    with pytest.raises(ValueError):
        two_timescale(residual="global")
    # NaN in one partial poisons only its groups; finite groups stay finite
    x = partials(2, 512, 9).float()
    x[1, 3] = float("nan")
    y = sim.all_reduce(x)[0]
    assert torch.isnan(y[:128]).all() and torch.isfinite(y[128:]).all()


def test_bf16_state_rounds_once_per_update():
    """A bf16 state is read exactly, updated in fp32 and rounded once (RNE) on store; the
    communicator keeps it bf16 and the correction it yields is the fp32 formula on those values."""
    from echo_tp.compensator import CompState, correction, update_
    cfg = two_timescale(bits=4, state_dtype="bfloat16")
    k = CompensatorConstants.from_config(cfg)
    g = torch.Generator().manual_seed(3)
    st = CompState(torch.randn(1000, generator=g).bfloat16(), torch.randn(1000, generator=g).bfloat16())
    m1, m2 = st.m1.float(), st.m2.float()
    u = torch.randn(1000, generator=g)
    assert torch.equal(correction(st, k), (m1 * k.a + m2 * k.one_minus_a) * k.eta)
    update_(st, u, k)
    assert st.m1.dtype == torch.bfloat16
    assert torch.equal(st.m1, (m1 * k.beta1 + u * k.one_minus_beta1).to(torch.bfloat16))
    assert torch.equal(st.m2, (m2 * k.beta2 + u * k.one_minus_beta2).to(torch.bfloat16))
    comm = SimulatedCommunicator(4, cfg)
    comm.new_pass()
    comm.all_reduce(torch.randn(4, 512, generator=g).bfloat16())
    assert comm.state().m1.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="state_dtype"):
        two_timescale(state_dtype="float16")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16])
def test_compact_state_is_bit_identical_when_betas_match(mode, sdtype):
    """beta1 == beta2: the communicator keeps one tensor (m2 is m1); y and the state equal those
    of two separate tensors bit for bit, site after site."""
    P, n = 4, 700
    cfg = two_timescale(bits=4, residual=mode, beta1=0.5, beta2=0.5,
                     state_dtype="bfloat16" if sdtype == torch.bfloat16 else "float32")
    full = CompState.zeros((P, n), "cpu", sdtype)
    compact = CompState.zeros((P, n), "cpu", sdtype, compact=True)
    assert compact.compact and not full.compact
    t = SimTransport(P)
    for site in range(5):
        x = partials(P, n, seed=40 + site)
        y_full, _ = compensated_all_reduce(x, cfg, t, state=full)
        y_comp, _ = compensated_all_reduce(x, cfg, t, state=compact)
        assert torch.equal(y_full, y_comp), site
        assert torch.equal(full.m1, full.m2) and torch.equal(compact.m1, full.m1), site
    comm = SimulatedCommunicator(P, cfg)
    comm.new_pass()
    comm.all_reduce(partials(P, n, seed=1))
    assert comm.state().compact
    paper = EchoConfig.from_name("echo4-2ts")
    comm2 = SimulatedCommunicator(P, paper)                        # paper betas: two tensors
    comm2.new_pass()
    comm2.all_reduce(partials(P, n, seed=1))
    assert not comm2.state().compact
    with pytest.raises(ValueError, match="beta1 == beta2"):
        compensated_all_reduce(partials(P, n, seed=2), paper, t,
                               state=CompState.zeros((P, n), "cpu", compact=True))


# ----- issue 15: large finite values, fp16 overflow, non-finite inputs (reference + simulated)

def _fp16_overflow_partials(P, n):
    """fp16 partials [P, n] whose exact group sums reach 64992 (fits fp16), with group minima
    below 0, so the 4-bit grid, rounded up, reaches past 65504 (issue 15 item 3: it became inf)."""
    ramp = torch.linspace(-1000.0, 64992.0, 128) / P
    return ramp.repeat(n // 128).unsqueeze(0).expand(P, n).to(torch.float16).contiguous()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("P", (2, 4))
def test_fp16_sum_near_fp16_max_stays_finite(mode, P):
    """Issue 15 item 3: y saturates at 65504 instead of overflowing to inf, the state never
    takes acc - inf, and later calls of the pass stay finite and accurate."""
    sim = SimulatedCommunicator(P, two_timescale(bits=4, residual=mode))
    sim.new_pass()
    x = _fp16_overflow_partials(P, 512)
    exact = x.double().sum(0)
    for call in range(4):
        y = sim.all_reduce(x)[0]
        assert torch.isfinite(y).all(), call
        assert float(y.float().abs().max()) <= 65504.0
        step = 66000 / sim.config.quant_spec().levels
        assert float((y.double() - exact).abs().max()) <= 1.1 * step, call   # ~one step
        st = sim.state()
        assert torch.isfinite(st.m1).all() and torch.isfinite(st.m2).all(), call


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("scale", (1e6, 1e30, 1e-30))
def test_all_reduce_error_is_scale_invariant(dtype, scale):
    """Issue 15 item 2 through the all-reduce: bf16 randn*1e6 over 4 ranks had relative error
    3.47 (the grid anchored at the group minimum under a clamped scale); now any magnitude
    gives the relative error of randn itself (within a few percent)."""
    P = 4
    g = torch.Generator().manual_seed(SEED + 15)
    base = torch.randn(P, 4096, generator=g)
    paper = two_timescale(bits=4, eta=0.0, outlier=False)

    def rel(x, cfg):
        y = SimulatedCommunicator(P, cfg).all_reduce(x)[0].double()
        exact = x.double().sum(0)
        return float((y - exact).norm() / exact.norm())

    ref = rel(base.to(dtype), paper)
    assert ref < 0.2
    assert rel((base * scale).to(dtype), paper) <= ref * 1.05 + 1e-3
    # the outlier word holds fp16 values: beyond fp16's normal range a group falls back to
    # its grid (L = 14 codes: one step 15/14 of the paper's), never to a worse answer
    word = paper.replace(outlier=True)
    assert rel((base * scale).to(dtype), word) <= ref * 1.15 + 1e-3


def test_values_near_fp32_max_saturate_and_stay_finite():
    """Partials near fp32's largest value: x' + c, the owner sum and y saturate at +-fp32 max
    instead of overflowing, so y and the state stay finite (the exact sum is not an fp32)."""
    P = 4
    fmax = torch.finfo(torch.float32).max
    sim = SimulatedCommunicator(P, two_timescale(bits=4, residual="output", eta=1.0))
    sim.new_pass()
    g = torch.Generator().manual_seed(SEED + 16)
    for call in range(3):
        x = (torch.rand(P, 512, generator=g) * 0.2 + 0.75) * fmax
        x[:, 256:] *= -1
        y = sim.all_reduce(x)[0]
        assert torch.isfinite(y).all() and torch.isfinite(sim.state().m1).all(), call
        assert bool((y[:256] > 0.9 * fmax).all() and (y[256:] < -0.9 * fmax).all())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", (float("nan"), float("inf"), -float("inf")))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_nonfinite_input_affects_only_the_call_it_entered(mode, bad, dtype):
    """Issue 15 item 4: a NaN/Inf input turns its group's outputs into NaN in the call it
    entered; the state stores 0 there, so later calls are finite, and everything outside that
    group matches, bit for bit, a run in which the bad value was a finite one."""
    P, n = 4, 1024
    cfg = two_timescale(bits=4, residual=mode)
    runs = {name: SimulatedCommunicator(P, cfg) for name in ("bad", "clean")}
    for comm in runs.values():
        comm.new_pass()
    outside = torch.ones(n, dtype=torch.bool)
    outside[384:512] = False                              # the group of element 400
    for call in range(4):
        x = partials(P, n, 500 + call).to(dtype)
        xb = x.clone()
        if call == 1:
            xb[2, 400] = bad
        yb = runs["bad"].all_reduce(xb)[0]
        yc = runs["clean"].all_reduce(x)[0]
        assert torch.equal(yb[outside], yc[outside]), call
        if call == 1:
            assert torch.isnan(yb[~outside]).all()
        else:
            assert torch.isfinite(yb).all(), call
        st = runs["bad"].state()
        assert torch.isfinite(st.m1).all() and torch.isfinite(st.m2).all(), call
        assert torch.equal(st.m1[:, outside], runs["clean"].state().m1[:, outside]), call

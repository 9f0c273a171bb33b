"""The reduce-scatter and all-gather halves of the quantized all-reduce (collective/sharded.py,
EchoCommunicator.reduce_scatter / all_gather), simulated; their gloo runs (P = 2, 4, 8: against
an independent implementation, simulated == gloo bit for bit, 16 bits == torch's collectives,
disagreeing calls) are in test_collective.py, beside the all-reduce's.

What is compared with what:
- all_gather(reduce_scatter(x)) == all_reduce(x) bit for bit where the halves meet (fp32,
  chunks of whole groups, uncompensated): the halves are the all-reduce's own steps;
- error feedback: a pass of 40 calls on constant inputs at eta = 1 keeps the partial sums of the
  observable error S_t = sum_k (y_k - exact) within (1 + mu_w) max_k |delta_k| elementwise
  (Theorem 1), for the paper's two-timescale state and the single-step one; without
  compensation the same inputs accumulate S_t = t * rho_0 (linear growth);
- states: one stream per kind and direction beside the all-reduce's, reset per pass;
  compensate=False reads and writes none;
- shapes along dim (outputs contiguous), bits=16 against the plain sums, a group of one returns
  its input exactly, and bad input gets a ValueError that says what to fix.
Where to look first: collective/sharded.py (chunk padding, own chunk, state update), then
halves.half_view (dim handling) and the transports' sum_scatter / gather_cat.
"""
import os

import pytest
import torch

from echo_tp import EchoConfig, SimulatedCommunicator
from echo_tp.collective.sharded import compensated_all_gather, compensated_reduce_scatter
from echo_tp.collective.simulated import SimTransport
from echo_tp.compensator import CompState, apply_correction, correction, mean_age
from echo_tp.config import CompensatorConstants
from harness import two_timescale

SEED = int(os.environ.setdefault("ECHO_TEST_SEED", str(int.from_bytes(os.urandom(4), "little"))))
P = 4


def test_halves_compose_to_the_all_reduce():
    """fp32, chunks of whole groups, uncompensated: all_gather(reduce_scatter(x)) is QAR."""
    cfg = EchoConfig(bits=4, eta=0.0)
    x = torch.randn(P, P * 256, 3, generator=torch.Generator().manual_seed(SEED + 1))
    rs = SimulatedCommunicator(P, cfg).reduce_scatter(x)          # dim 0: the flat order
    y = SimulatedCommunicator(P, cfg).all_gather(rs)
    assert torch.equal(y, SimulatedCommunicator(P, cfg).all_reduce(x))


def _run_pass(kind, cfg, x, n):
    """n calls of one pass on the same x (fp32; RS: [P, P*m], AG: [P, m]) with a state of the
    kind's size -> per call (rho, delta) against the exact results: rho of x, delta of x'."""
    t = SimTransport(P)
    k = CompensatorConstants.from_config(cfg)
    state = CompState.zeros(x.shape, "cpu") if cfg.compensated else None
    exact = x.double().reshape(P, P, -1).sum(0) if kind == "rs" else x.double().reshape(-1)
    out = []
    for _ in range(n):
        xp = x if state is None else apply_correction(x, correction(state, k).float())
        if kind == "rs":
            y = compensated_reduce_scatter(x, cfg, t, state=state).double()         # [P, m]
            sum_xp = xp.double().reshape(P, P, -1).sum(0)
        else:
            y = compensated_all_gather(x, cfg, t, state=state)
            assert all(torch.equal(y[0], y[r]) for r in range(P))
            y, sum_xp = y[0].double(), xp.double().reshape(-1)
        out.append((y - exact, y - sum_xp))
    return out


@pytest.mark.parametrize("kind", ("rs", "ag"))
@pytest.mark.parametrize("state", ("two_timescale", "single_step"))
def test_error_feedback_keeps_the_partial_sums_bounded(kind, state):
    """Theorem 1 for a pass of one kind: at eta = 1 the partial sums S_t of the observable
    error stay within (1 + mu_w) max_k |delta_k| elementwise; uncompensated, the same constant
    inputs accumulate S_t = t * rho_0."""
    N, m = 40, 200
    over = dict(beta1=0.0, beta2=0.0) if state == "single_step" else {}
    cfg = two_timescale(bits=4, eta=1.0, **over)
    g = torch.Generator().manual_seed(SEED + 11)
    base = torch.randn(P * m if kind == "rs" else m, generator=g)
    x = base + 0.2 * torch.randn(P, base.numel(), generator=g)     # correlated contributions
    run = _run_pass(kind, cfg, x, N)
    S = torch.stack([rho for rho, _ in run]).cumsum(0)
    q = torch.stack([d for _, d in run]).abs().amax(0)
    bound = (1 + mean_age(cfg)) * q
    # The bound holds in exact arithmetic; each call's corrected inputs, sum and stored error are
    # fp32, so S_t also carries up to ~eps32 * sum_r |x_r| of rounding per call (at most N calls).
    fp32 = 2 * N * torch.finfo(torch.float32).eps * float(x.abs().sum(0).max())
    assert torch.all(S.abs() <= bound + fp32), float((S.abs() - bound).max())
    plain = _run_pass(kind, cfg.replace(eta=0.0), x, N)
    S0 = torch.stack([rho for rho, _ in plain]).cumsum(0)
    assert torch.allclose(S0[-1], N * plain[0][0])
    hit = plain[0][0].abs() > 0
    assert float(S0[-1][hit].abs().mean()) > 5 * float(S[-1][hit].abs().mean())


def test_states_per_kind_direction_and_pass():
    sim = SimulatedCommunicator(P, EchoConfig())
    x = torch.randn(P, 2, 8, 64, generator=torch.Generator().manual_seed(SEED + 2))
    with sim.pass_scope("forward"):
        first = [sim.reduce_scatter(x, dim=1), sim.all_gather(x, dim=1), sim.all_reduce(x)]
        second = sim.reduce_scatter(x, dim=1)
        assert not torch.equal(first[0], second)               # the state fed back
        rs = sim.state(kind="reduce_scatter")
        assert rs.m1.shape == (P, 2 * 8 * 64) and sim.state(kind="all_gather").m1.shape == \
            (P, 2 * 8 * 64) and sim.state().m1 is not rs.m1
        assert sim.state("backward", numel=2 * 8 * 64, kind="all_gather") is None
        with torch.no_grad():
            sim.all_gather(x, dim=1, compensate=False)        # reads and leaves no state
        assert sim.half_passes["all_gather"]["forward"].sites == 2
    with sim.pass_scope("forward"):                          # a new pass: fresh states
        again = [sim.reduce_scatter(x, dim=1), sim.all_gather(x, dim=1), sim.all_reduce(x)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    with pytest.raises(ValueError, match="kind"):
        sim.state(kind="broadcast")


def test_shapes_bits16_and_group_of_one():
    x = torch.randn(P, 3, 8, 5, generator=torch.Generator().manual_seed(SEED + 3))
    sim = SimulatedCommunicator(P, EchoConfig(bits=16))
    y = sim.reduce_scatter(x, dim=1)
    assert y.shape == (P, 3, 2, 5) and y.is_contiguous()
    want = x.sum(0).chunk(P, dim=1)
    assert all(torch.allclose(y[r], want[r], atol=1e-6) for r in range(P))
    g = sim.all_gather(y, dim=1)
    assert g.shape == (P, 3, 8, 5) and all(torch.equal(g[r], torch.cat(list(y), 1))
                                           for r in range(P))
    assert SimulatedCommunicator(P).all_gather(x[:, :0]).shape == (P, 0, 8, 5)
    one = SimulatedCommunicator(1, EchoConfig(bits=4))
    for fn in (one.reduce_scatter, one.all_gather):
        assert torch.equal(fn(x[:1].bfloat16(), dim=2), x[:1].bfloat16())


def test_bad_input_gets_clear_errors():
    sim = SimulatedCommunicator(P)
    for call, match in ((lambda: sim.reduce_scatter(torch.zeros(P, 6, 8)), "divisible by"),
                        (lambda: sim.reduce_scatter(torch.zeros(P, 8), dim=1), "out of range"),
                        (lambda: sim.all_gather(torch.zeros(P)), "at least one dim"),
                        (lambda: sim.all_gather(torch.zeros(3, 8)), "leading dim"),
                        (lambda: sim.all_gather(torch.zeros(P, 8, dtype=torch.int32)),
                         "supports"),
                        (lambda: sim.all_gather(torch.zeros(P, 8), dim=0.5), "takes an int"),
                        (lambda: sim.reduce_scatter(torch.zeros(P, 8), direction="up"),
                         "direction"),
                        (lambda: sim.reduce_scatter(torch.zeros(P, 8), bits=5), "bits")):
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(RuntimeError, match="requires_grad"):
        sim.all_gather(torch.zeros(P, 8, requires_grad=True))
    with pytest.raises(ValueError, match="do not split"):
        compensated_reduce_scatter(torch.zeros(P, 10), EchoConfig(), SimTransport(P), state=None)

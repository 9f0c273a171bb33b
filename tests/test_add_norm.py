"""The block boundary's kernels against their pure-torch references, on the CPU under
TRITON_INTERPRET=1 (issue 18 item 2). Compared bit for bit on fresh random inputs:
  * kernels.norm_kernels.add_rmsnorm / rmsnorm (one kernel, the add on or off)  vs
    norm.add_rmsnorm_reference / rmsnorm_reference: residual_out and normed, rows of any width,
    tiny to near-max values, a zero row, an add that overflows to inf; and the composition
    rmsnorm(residual + y) == add_rmsnorm(y, residual).normed;
  * the all-reduce with the residual added where y is decoded (SimulatedFused(residual=...):
    the reduce's own segment and the tail write residual + y), then the norm-only kernel  vs
    collective.qar.compensated_all_reduce over SimTransport, then norm.add_rmsnorm_reference:
    residual_out, normed and the compensator state (m1, m2) after each of two calls; P = 2 and
    4, bf16 / fp16 / fp32, 4 and 8 bits, residual modes 'output' and 'local' and none; rows of
    H = 300 crossing group, tile and segment boundaries, a distinct residual per rank;
  * comm.all_reduce_add_rmsnorm routed to a backend that adds the residual (SimulatedFused
    standing in for P2PBackend, which needs GPUs)  vs  a reference communicator's all_reduce,
    then norm.add_rmsnorm_reference: outputs and the state after two calls.
The fused kernel and reduce_tail with a residual run in tests/test_kernels.py's concurrent
processes test (one process cannot run them for P ranks); the GPU forms in
tests/test_kernels_gpu.py and tests/test_p2p_gpu.py.
One tolerance: any NaN matches any NaN (payloads). When residual_out differs, look first at
allreduce_kernels._store_y (the add of the two dtype values in fp32, one rounding, no
saturation); when only normed differs, at norm_kernels.rmsnorm_kernel's ADD branch; when the
state differs, at the update's y (it must be the all-reduce's y, never residual + y).
"""
from __future__ import annotations

import pytest
import torch
from harness import assert_bits_equal, interpret_kernels, two_timescale

interpret_kernels()                   # before triton.jit decorates anything
pytest.importorskip("triton")

from echo_tp import norm  # noqa: E402
from echo_tp.collective.backend import COLLECTIVES, Backend  # noqa: E402
from echo_tp.collective.qar import compensated_all_reduce  # noqa: E402
from echo_tp.collective.simulated import SimTransport  # noqa: E402
from echo_tp.compensator import CompState  # noqa: E402
from echo_tp.kernels import norm_kernels as nk  # noqa: E402
from echo_tp.collective import simulated_fused as sf  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN/Inf lanes
EPS = 1e-6


@pytest.mark.parametrize("H,dtype,wdtype", [(64, torch.bfloat16, torch.float32),
                                            (300, torch.float16, torch.float16),
                                            (1000, torch.bfloat16, torch.bfloat16),
                                            (2304, torch.float32, torch.float32)])
def test_add_rmsnorm_kernel_matches_reference(H, dtype, wdtype):
    """Residual add + RMSNorm in one pass (kernels/norm_kernels.py) against norm.py's reference
    bit for bit: normed and residual_out, rows of any width (partial last chunk), values from
    tiny to near the dtype's max (the add may overflow to inf, as torch's add does), a zero
    row; the norm-only form (the add already done) on residual_out gives the same normed; and
    the reference against the models' RMSNorm (a different summation order: within one
    rounding of the output dtype)."""
    from echo_tp.models.transformer import RMSNorm
    gen = torch.Generator().manual_seed(H)
    rows = 7
    y = (torch.randn(rows, H, generator=gen) * torch.logspace(-3, 3, rows)[:, None]).to(dtype)
    res = (torch.randn(rows, H, generator=gen) * 4).to(dtype)
    res[3] = 0.0
    y[3] = 0.0                                                     # a zero row: inv = 1/sqrt(eps)
    big = torch.finfo(dtype).max
    y[5, :3] = big
    res[5, :3] = big                                               # overflows to inf, like torch
    w = (1 + 0.1 * torch.randn(H, generator=gen)).to(wdtype)
    got_n, got_r = nk.add_rmsnorm(y, res, w, EPS)
    want_n, want_r = norm.add_rmsnorm_reference(y, res, w, EPS)
    assert_bits_equal(got_r, want_r, "residual_out")
    assert_bits_equal(got_n, want_n, "normed")
    assert got_n.dtype == torch.promote_types(wdtype, dtype)
    assert_bits_equal(norm.rmsnorm_reference(res + y, w, EPS), want_n, "composed reference")
    assert_bits_equal(nk.rmsnorm(want_r, w, EPS), want_n, "norm-only kernel")
    ok = [r for r in range(rows) if r != 5]
    m = RMSNorm(H, EPS)
    m.weight.data = w.float()
    plain = m(res + y)
    tol = dict(rtol=max(2 * torch.finfo(dtype).eps, 1e-5), atol=1e-30)   # fp32: order, rsqrt
    torch.testing.assert_close(want_n.float()[ok], plain.float()[ok], **tol)


ROWS, H = 6, 300
"""Per rank [6, 300] = 1800 values: P=2 segments of 1024 (P=4: 512), 256-value tiles, so rows
cross group, tile and segment boundaries and the last segment is partly padding."""


def _boundary_inputs(P, dtype, seed):
    """Fresh (partials x [P, N], residuals [P, N], one per rank): group magnitudes spread over
    1e-2..1e2, outlier channels, a zero and a constant stretch; in the last row residuals at
    +-the dtype's max where y is about +-30 P (fp16: the add overflows to +-inf there)."""
    gen = torch.Generator().manual_seed(seed)
    n = ROWS * H
    x = torch.randn(P, n, generator=gen)
    x *= torch.exp(torch.randn(P, n // 128 + 1, generator=gen) * 1.5) \
        .repeat_interleave(128, dim=1)[:, :n]
    x[:, 5::97] *= 40.0                                            # outlier channels
    x[:, 256:384] = 0.0
    x[:, 512:640] = 3.0
    res = torch.randn(P, n, generator=gen) * 4
    big = torch.finfo(dtype).max
    x[:, 1557], x[:, 1654] = 30.0, -30.0
    res[:, 1557], res[:, 1654] = big, -big
    return x.to(dtype), res.to(dtype)


# (P, bits, dtype, residual mode; None: uncompensated): P x dtype x bits x mode spread over six
ADD_NORM_CASES = [(2, 4, torch.bfloat16, "output"), (2, 8, torch.float16, "local"),
                  (2, 4, torch.float32, None), (4, 8, torch.bfloat16, None),
                  (4, 4, torch.float16, "local"), (4, 8, torch.float32, "output")]


@pytest.mark.parametrize("P,bits,dtype,mode", ADD_NORM_CASES, ids=str)
def test_residual_in_the_all_reduce_then_rmsnorm_matches_reference(P, bits, dtype, mode):
    """SimulatedFused(residual=r) then the norm-only kernel == all_reduce then
    add_rmsnorm_reference, bit for bit, and the state after each call == the unfused call's
    (the 'output' update from y, the 'local' owner update from s - y_own: never from r + y).
    Compensated: two calls; uncompensated: one (no state carries over)."""
    cfg = two_timescale(bits=bits, residual=mode) if mode else two_timescale(bits=bits, eta=0.0)
    assert cfg.compensated == (mode is not None)
    wdtype = torch.float32 if dtype == torch.bfloat16 else dtype
    w = (1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(P + bits))).to(wdtype)
    state = CompState.zeros((P, ROWS * H), "cpu") if mode else None
    ref_state = CompState.zeros((P, ROWS * H), "cpu") if mode else None
    sim = sf.SimulatedFused(P, tile_elems=256)
    for call in range(2 if mode else 1):                  # the state feeds back
        x, res = _boundary_inputs(P, dtype, seed=1000 * P + 10 * bits + call)
        y, _ = compensated_all_reduce(x, cfg, SimTransport(P), state=ref_state)
        want_n, want_r = norm.add_rmsnorm_reference(y.view(P, ROWS, H), res.view(P, ROWS, H), w,
                                                    EPS)
        rout = sim(x, cfg, state=state, residual=res).view(P, ROWS, H)
        assert_bits_equal(rout, want_r, f"residual_out call={call}")
        assert_bits_equal(nk.rmsnorm(rout, w, EPS), want_n, f"normed call={call}")
        if mode:
            assert_bits_equal(state.m1, ref_state.m1, f"m1 call={call}")
            assert_bits_equal(state.m2, ref_state.m2, f"m2 call={call}")
    if dtype == torch.float16:                  # the add overflowed where torch's does
        assert rout[:, -1].isposinf().any() and rout[:, -1].isneginf().any()


class _AddingSimBackend(Backend):
    """SimulatedFused as a simulated communicator's backend (x [P, N]) that adds the residual
    where y is decoded, as P2PBackend does on GPUs; counts the residuals it was given."""

    name = "simulated-fused"
    offers = COLLECTIVES | {"residual"}

    def __init__(self, world_size: int):
        self.sim = sf.SimulatedFused(world_size, tile_elems=256)
        self.residuals = 0

    def run(self, x, cfg, *, state, backward, record, inplace=False, residual=None):
        self.residuals += residual is not None
        return self.sim(x, cfg, state=state, backward=backward, residual=residual), None


@pytest.mark.parametrize("mode", ["local", "output"])
def test_all_reduce_add_rmsnorm_takes_the_fused_route(mode):
    """comm.all_reduce_add_rmsnorm on a backend that adds the residual: the residual goes into
    the all-reduce (one per call), then the norm alone; outputs and the state after two calls
    equal a reference communicator's all_reduce then add_rmsnorm_reference (residual [T, H]
    broadcast over the P virtual ranks, as the TP models pass it)."""
    from echo_tp.collective.dispatch import Dispatcher
    from echo_tp.communicator import SimulatedCommunicator
    P, T = 2, 3
    cfg = two_timescale(bits=4, residual=mode)
    fused, ref = SimulatedCommunicator(P, cfg), SimulatedCommunicator(P, cfg)
    backend = _AddingSimBackend(P)
    fused.dispatcher = Dispatcher({"reference": backend}, P)
    gen = torch.Generator().manual_seed(31)
    w = torch.randn(H, generator=gen)
    with fused.pass_scope(), ref.pass_scope():
        for call in range(2):
            partial = (torch.randn(P, T, H, generator=gen) * 2).to(torch.bfloat16)
            res = (torch.randn(T, H, generator=gen) * 4).to(torch.bfloat16)
            normed, rout = fused.all_reduce_add_rmsnorm(partial, res, w, EPS)
            y = ref.all_reduce(partial)
            want_n, want_r = norm.add_rmsnorm_reference(y, res.expand(y.shape).contiguous(), w,
                                                        EPS)
            assert_bits_equal(rout, want_r, f"residual_out call={call}")
            assert_bits_equal(normed, want_n, f"normed call={call}")
            got, want = fused.state(numel=T * H), ref.state(numel=T * H)
            assert_bits_equal(got.m1, want.m1, f"m1 call={call}")
            assert_bits_equal(got.m2, want.m2, f"m2 call={call}")
    assert backend.residuals == 2
    with pytest.raises(ValueError, match="weight must be"):
        fused.all_reduce_add_rmsnorm(partial, res, w[:-1], EPS)      # refused before the call
    assert backend.residuals == 2

"""Triton kernels against the pure-torch reference, on the CPU under TRITON_INTERPRET=1.

Compared, bit for bit, on fresh random inputs (several seeds):
  * kernels.quant_kernels.encode / decode  vs  quant.encode / quant.decode: codes, scale words
    (as int16: both forms, fp16 and tagged bf16, and the NaN word), fp16 zeros, decoded fp32
    values; bits 4/8, all three policies, group sizes 8/128/256, bf16/fp16/fp32 inputs, odd
    group counts, outlier channels, constant / all-zero / far-from-zero / integer / tiny /
    huge groups, NaN and Inf groups; and groups at every scale (issue 15: +-3e6 ramps, 1e30,
    near fp32 max, 1e-35, fp32 subnormals, huge constants); with and without the outlier word
    (QuantSpec.outlier: the words compared as int16), and on the outlier word's own cases
    (harness.outlier_groups: massive values, ties, values at and past fp16's normal range,
    fp16 rounding ties, NaN/Inf beside a massive value).
  * collective.simulated_fused.SimulatedFused (entry -> reduce -> tail kernels over P per-rank
    buffers, flags included)  vs  collective.qar.compensated_all_reduce over SimTransport:
    y, m1, m2 after consecutive calls; both residual modes, bits 4/8, policies, bf16/fp16/fp32,
    P = 2/3/4, with and without backward power-of-two scaling; and call sequences with huge
    groups, fp16 sums near 65504, values near fp32 max, NaN/Inf inputs followed by clean calls
    (outputs saturate, the state stays finite: issue 15); the outlier word (OUTLIER_CASES:
    bits 4/8 x the three policies, P = 2/3/4, every input dtype, both residuals and scalings;
    a tile in steps; the issue-15 sequence), and Layout.packet's views against y.
  * the same kernels with P ranks in P concurrent processes sharing their buffers (as symmetric
    memory does), calls back to back with one rank pushing late and another reducing late: the
    flag protocol must make every wait see its peer's data (a wait that accepts a stale epoch
    fails this test); two cases with a residual (the kernels write residual + y), two with
    the outlier word (the fused kernel, reduce_tail).
The block-boundary kernels (residual add in the all-reduce, RMSNorm): tests/test_add_norm.py.
One tolerance, about bits that carry no value: NaN bit patterns (torch's NaN payload depends on
the device and on the input NaN), so NaN-ness must match position by position. Zero-points are
canonical (+0.0, both sides add 0.0 before the fp16 cast). Everything else matches bit for bit.

When a case fails, look first at: the row printed by the assertion (which group differs);
quant.py's docstring (the edge-case rules) against quant_kernels._range_params; a division that
is not tl.math.div_rn (Triton's `/` is approximate); an FMA (every launch passes
LAUNCH_OPTS = enable_fp_fusion=False); the interpreter's own casts (fp32 -> bf16 truncates under
TRITON_INTERPRET, which is why the kernels cast bf16 by bit arithmetic). For the fused test:
the rank-order sum in reduce_kernel and the residual formulas in qar._local_residual. Only
with the outlier word: quant_kernels._outlier_slots (v from lo and hi, its first index, fp16's
range, the NaN it leaves at the slot), _mark (the marker where that NaN is), _put_outlier /
_decode_regs (where the word is put back), allreduce_kernels._outlier_off against
Layout.outlier_off.
"""
from __future__ import annotations

import time

import pytest
import torch
from harness import (assert_bits_equal, edge_input, extreme_groups, interpret_kernels,
                     outlier_groups, two_timescale)

interpret_kernels()                   # before triton.jit decorates anything
pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from echo_tp import quant  # noqa: E402
from echo_tp.collective.qar import compensated_all_reduce  # noqa: E402
from echo_tp.collective.simulated import SimTransport  # noqa: E402
from echo_tp.compensator import CompState  # noqa: E402
from echo_tp.config import EchoConfig, QuantSpec  # noqa: E402
from echo_tp.kernels import allreduce_kernels as ak  # noqa: E402
from echo_tp.kernels import allreduce_plan as ap  # noqa: E402
from echo_tp.kernels import quant_kernels as qk  # noqa: E402
from echo_tp.collective import simulated_fused as sf  # noqa: E402
from echo_tp.kernels.flags import describe_error  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN/Inf lanes


def adversarial(rows: int, groups: int, g: int, dtype, seed: int, nonfinite: bool = True):
    """[rows, groups*g] values, one random 'kind' of group each (see module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups, g, generator=gen)
    x = x * torch.exp(torch.randn(rows, groups, 1, generator=gen) * 3)     # group magnitudes
    x[..., 3] *= 50.0                                                       # outlier channel
    kinds = torch.randint(0, 11 if nonfinite else 9, (rows, groups), generator=gen)
    pos = torch.randint(0, g, (rows, groups), generator=gen)
    for r in range(rows):
        for j in range(groups):
            k, v = int(kinds[r, j]), x[r, j]
            if k == 1:
                v.fill_(float(torch.randn(1, generator=gen)) * 3)           # constant
            elif k == 2:
                v.zero_()
                if r % 2:
                    v.neg_()                                                 # -0.0
            elif k == 3:
                v.mul_(1e-2).add_(1.0e4 * (1 if j % 2 else -1))              # far from zero
            elif k == 4:
                v.mul_(1e-33)                                                # tiny steps
            elif k == 5:
                v.mul_(1e36)                                                 # saturating steps
            elif k == 6:
                v.copy_(torch.randint(-8, 9, (g,), generator=gen).float())  # exact integers
            elif k == 7:
                v.copy_(torch.where(torch.rand(g, generator=gen) < 0.5, 0.25, -1.5))
            elif k == 8:
                v.mul_(1e-5)
            elif k == 9:
                v[int(pos[r, j])] = float("nan")
            elif k == 10:
                v[int(pos[r, j])] = float("inf") if j % 2 else -float("inf")
    return x.reshape(rows, groups * g).to(dtype)


@pytest.mark.parametrize("outlier", [False, True], ids=["plain", "outlier"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("quantizer", ["zero_aware", "naive", "symmetric"])
@pytest.mark.parametrize("g", [8, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_decode_bit_exact(bits, quantizer, g, dtype, outlier):
    spec = QuantSpec(bits=bits, group_size=g, quantizer=quantizer, outlier=outlier)
    for seed, (rows, groups) in enumerate([(3, 7), (1, 13), (2, 4)]):
        x = adversarial(rows, groups, g, dtype, seed=1000 * bits + 10 * g + seed)
        got, want = qk.encode(x, spec), quant.encode(x, spec)
        assert_packets_equal(got, want, spec, f"seed={seed}")


def assert_packets_equal(got, want, spec, what):
    """Codes, scale words (int16: strict, the NaN word included), zeros, outlier words (int16:
    strict) and decoded values."""
    assert_bits_equal(got.codes, want.codes, f"codes {what}")
    assert_bits_equal(got.scale.view(torch.int16), want.scale.view(torch.int16),
                      f"scale words {what}")
    if spec.has_zero:
        assert_bits_equal(got.zero, want.zero, f"zero {what}")
    else:
        assert got.zero is None
    if spec.outlier:
        assert_bits_equal(got.outlier.view(torch.int16), want.outlier.view(torch.int16),
                          f"outlier words {what}")
    else:
        assert got.outlier is None
    assert_bits_equal(qk.decode(got, spec), quant.decode(want, spec), f"decoded {what}")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("quantizer", ["zero_aware", "naive", "symmetric"])
@pytest.mark.parametrize("g", [8, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_outlier_encode_decode_bit_exact(bits, quantizer, g, dtype):
    """The outlier word (QuantSpec.outlier) on its own cases (harness.outlier_groups: massive
    values, ties of the largest |value| with equal and opposite signs, largest values at and
    just past fp16's normal range, fp16 rounding ties, massive values over constant or zero
    rests, constant / zero / -0.0 / wide groups, NaN and Inf beside a massive value): the
    packet bit for bit with quant.encode, the decode with quant.decode, and both decoders of
    each other's packets."""
    spec = QuantSpec(bits=bits, group_size=g, quantizer=quantizer, outlier=True)
    for seed, (rows, groups) in enumerate([(4, 16), (3, 11)]):
        x = outlier_groups(rows, groups, g, dtype, seed=7000 + 100 * bits + g + seed)
        got, want = qk.encode(x, spec), quant.encode(x, spec)
        assert_packets_equal(got, want, spec, f"seed={seed}")
        assert_bits_equal(quant.decode(got, spec), qk.decode(want, spec), f"cross seed={seed}")
        assert bool((want.outlier != 0).any()) and bool((want.outlier == 0).any())


@pytest.mark.parametrize("outlier", [False, True], ids=["plain", "outlier"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("quantizer", ["zero_aware", "naive", "symmetric"])
@pytest.mark.parametrize("g", [8, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_decode_bit_exact_at_every_scale(bits, quantizer, g, dtype, outlier):
    """Issue 15 item 2: both scale-word forms, saturating decodes, the fp32-overflowing width
    (with the outlier word: the bound of the whole group's grid at L = 2^b - 2 still holds)."""
    spec = QuantSpec(bits=bits, group_size=g, quantizer=quantizer, outlier=outlier)
    for seed, (rows, groups) in enumerate([(3, 11), (2, 16)]):
        x = extreme_groups(rows, groups, g, dtype, seed=5000 + 1000 * bits + 10 * g + seed)
        got, want = qk.encode(x, spec), quant.encode(x, spec)
        assert_packets_equal(got, want, spec, f"seed={seed}")
        xg = x.float().reshape(-1, g)
        fin = torch.isfinite(xg).all(-1)
        err = (qk.decode(got, spec).reshape(-1, g) - xg).abs()[fin]
        bound = _group_error_bound(xg, spec)[fin]
        assert torch.all(err <= bound), float((err - bound).max())


def _group_error_bound(xg, spec):
    """Per-element bound [G, g] from the group alone, fp32 xg [G, g]: half a step s (width / L,
    at least d / Z_MAX; max|x| / Q symmetric), widened by the scale's rounding up (< 2^-7
    relative; fp16 subnormal steps in [2^-24, 2^-14): 2^-24 absolute), plus the fp16
    zero-point's rounding and constant groups' (|x| 2^-6) and the 2^-126 floor."""
    lo, hi = xg.double().amin(-1), xg.double().amax(-1)
    if spec.quantizer == "symmetric":
        step = torch.maximum(lo.abs(), hi.abs()) / spec.qmax
    else:
        step = torch.maximum((hi - lo) / spec.levels,
                             torch.clamp_min(torch.maximum(lo, -hi), 0) / quant.Z_MAX)
    const = lo == hi
    ref = torch.where(const, lo.abs(), step)
    sub16 = ((ref >= 2 ** -24) & (ref < 2 ** -14)).double() * 2 ** -23
    step = torch.where(const, torch.zeros_like(step), step)
    return (0.5 * step * (1 + 2 ** -6) + sub16).unsqueeze(-1) + xg.double().abs() * 2 ** -6 \
        + 2 ** -126


def test_encode_shapes_and_errors():
    spec = QuantSpec(bits=4, group_size=128)
    x = torch.randn(2, 3, 256)
    p = qk.encode(x, spec)
    assert p.codes.shape == (2, 3, 128) and p.scale.shape == (2, 3, 2) and p.outlier is None
    assert qk.decode(p, spec).shape == (2, 3, 256)
    with pytest.raises(ValueError, match="multiple of group_size"):
        qk.encode(torch.randn(100), spec)
    with pytest.raises(ValueError, match="supports"):
        qk.encode(torch.randn(128, dtype=torch.float64), spec)
    ospec = QuantSpec(bits=4, group_size=128, outlier=True)
    p = qk.encode(x, ospec)
    assert p.outlier.shape == (2, 3, 2) and p.outlier.dtype == torch.float16
    assert qk.decode(p, ospec).shape == (2, 3, 256)
    with pytest.raises(ValueError, match="outlier words"):
        qk.decode(p._replace(outlier=None), ospec)


# (P, bits, quantizer, residual, dtype, backward): every bits x policy x residual at P=4, the
# other ranks counts, dtypes and scalings spread over the rest.
FUSED_CASES = [(4, b, q, r, torch.bfloat16 if (b + i) % 2 else torch.float16, i % 2 == 1)
               for i, (b, q, r) in enumerate((b, q, r) for b in (4, 8)
                                             for q in ("zero_aware", "naive", "symmetric")
                                             for r in ("output", "local"))]
FUSED_CASES += [(2, 4, "zero_aware", "output", torch.bfloat16, True),
                (2, 8, "symmetric", "local", torch.float32, False),
                (3, 4, "zero_aware", "local", torch.bfloat16, True),
                (3, 4, "naive", "output", torch.float16, False),
                (8, 4, "zero_aware", "local", torch.bfloat16, False),      # issue #7: P=8
                (8, 8, "symmetric", "output", torch.float16, True)]


def _fused_input(P, n, dtype, seed, scale):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(P, n, generator=gen) * scale
    x[:, 5::97] *= 40.0                                             # outlier channels
    x[:, 256:384] = 0.0                                             # an all-zero stretch
    x[:, 512:640] = 3.0                                             # a constant stretch
    return x.to(dtype)


def _check_fused(P, cfg, n, dtype, backward, calls, seed, state_dtype=torch.float32,
                 compact=False, tile=256, step=2048, make_input=None, after_call=None):
    """SimulatedFused against compensated_all_reduce over SimTransport: y, m1, m2 bit for bit
    over `calls` consecutive calls (the state feeds back; the flags' epoch advances).
    make_input(call) -> x [P, n] (default _fused_input); after_call(call, y, state): more checks."""
    sim = sf.SimulatedFused(P, tile_elems=tile, step_elems=step)
    ref_state = CompState.zeros((P, n), "cpu", state_dtype, compact=compact)
    state = CompState.zeros((P, n), "cpu", state_dtype, compact=compact)
    for call in range(calls):
        x = make_input(call) if make_input is not None else \
            _fused_input(P, n, dtype, seed=seed + call, scale=1e-6 if backward else 1.0)
        want, _ = compensated_all_reduce(x, cfg, SimTransport(P), state=ref_state,
                                         backward=backward)
        got = sim(x, cfg, state=state, backward=backward)
        assert_bits_equal(got, want, f"y call={call}")
        assert_bits_equal(state.m1, ref_state.m1, f"m1 call={call}")
        assert_bits_equal(state.m2, ref_state.m2, f"m2 call={call}")
        if after_call is not None:
            after_call(call, got, state)
    return state


@pytest.mark.parametrize("P,bits,quantizer,residual,dtype,backward,sdtype",
                         [(4, 4, "zero_aware", "output", torch.bfloat16, False, torch.float32),
                          (4, 4, "zero_aware", "local", torch.float16, False, torch.float32),
                          (2, 4, "naive", "local", torch.float32, False, torch.bfloat16),
                          (3, 8, "symmetric", "output", torch.float16, False, torch.bfloat16),
                          (4, 4, "symmetric", "local", torch.bfloat16, True, torch.float32),
                          (2, 8, "zero_aware", "output", torch.float32, True, torch.float32)],
                         ids=str)
def test_fused_edge_sequences_match_reference(P, bits, quantizer, residual, dtype, backward,
                                              sdtype):
    """Issue 15 through the fused kernels, bit for bit with the reference, call after call:
    huge and tiny groups (tagged scale words), fp16 sums near 65504 and values near the
    dtype's max (saturating y), NaN/Inf then clean calls (the state stays finite)."""
    cfg = two_timescale(bits=bits, quantizer=quantizer, residual=residual,
                        state_dtype="bfloat16" if sdtype == torch.bfloat16 else "float32")
    n = 1100 + 37 * P

    def finite(call, got, state):
        assert torch.isfinite(state.m1).all() and torch.isfinite(state.m2).all(), call
        if call != 1:                                   # finite input: finite y
            assert torch.isfinite(got).all(), call
    _check_fused(P, cfg, n, dtype, backward, calls=5, seed=0, state_dtype=sdtype,
                 tile=256, make_input=lambda call: edge_input(P, n, dtype, call,
                                                              seed=3100 + 10 * P + bits),
                 after_call=finite)


@pytest.mark.parametrize("P,bits,quantizer,residual,dtype,backward", FUSED_CASES, ids=str)
def test_fused_allreduce_matches_reference(P, bits, quantizer, residual, dtype, backward):
    cfg = two_timescale(bits=bits, quantizer=quantizer, residual=residual)
    # n pads to whole groups; several tiles per segment
    _check_fused(P, cfg, 1500 + 37 * P, dtype, backward, calls=2, seed=100 * P + 10 * bits)


# The outlier word through the stage kernels: (P, bits, quantizer, residual, dtype, backward,
# state: 'pair' (the paper's fp32 pair) or 'default' (one bf16 tensor)): every bits x policy,
# P = 2/3/4, each input dtype, both residuals, both scalings.
OUTLIER_CASES = [(2, 4, "zero_aware", "local", torch.bfloat16, False, "default"),
                 (2, 8, "symmetric", "output", torch.float32, True, "pair"),
                 (3, 4, "naive", "output", torch.float16, False, "pair"),
                 (3, 8, "zero_aware", "local", torch.bfloat16, True, "pair"),
                 (4, 4, "symmetric", "local", torch.float16, False, "default"),
                 (4, 8, "naive", "local", torch.float32, False, "pair"),
                 (4, 4, "zero_aware", "output", torch.bfloat16, True, "pair")]


def _outlier_config(bits, quantizer, residual, state):
    if state == "default":
        return EchoConfig(bits=bits, quantizer=quantizer, residual=residual, outlier=True)
    return two_timescale(bits=bits, quantizer=quantizer, residual=residual, outlier=True)


def _outlier_input(P, n, dtype, call, seed, backward):
    """Call `call` of an outlier sequence, [P, n]: 0 outlier_groups without NaN/Inf, 1 with
    them, 2 _fused_input (outlier channels x40); gradients scaled down (the power of two brings
    them back)."""
    if call == 2:
        return _fused_input(P, n, dtype, seed=seed, scale=1e-6 if backward else 1.0)
    g = 128
    x = outlier_groups(P, -(-n // g), g, dtype, seed=seed + call, nonfinite=call == 1)
    return (x[:, :n].float() * (1e-6 if backward else 1.0)).to(dtype)


@pytest.mark.parametrize("P,bits,quantizer,residual,dtype,backward,state", OUTLIER_CASES,
                         ids=str)
def test_fused_outlier_matches_reference(P, bits, quantizer, residual, dtype, backward, state):
    """QuantSpec.outlier through entry -> reduce -> tail: the entry's packets and the owner's
    requantization carry the outlier words (the reduce decodes them, the tail too), y and the
    state bit for bit with the reference over 3 calls (the last one's state from NaN/Inf
    groups' calls)."""
    cfg = _outlier_config(bits, quantizer, residual, state)
    n = 1500 + 37 * P
    sdt = torch.bfloat16 if state == "default" else torch.float32
    seed = 8100 + 10 * P + bits
    _check_fused(P, cfg, n, dtype, backward, calls=3, seed=0, state_dtype=sdt,
                 compact=state == "default", tile=256,
                 make_input=lambda call: _outlier_input(P, n, dtype, call, seed, backward))


def test_fused_outlier_tile_in_steps_and_edge_sequence():
    """The outlier word with a tile of 4 steps (one flag per tile), then the issue-15 call
    sequence (huge groups, sums near the dtype's max, NaN/Inf, clean calls): y and the state
    bit for bit, the state finite."""
    cfg = two_timescale(bits=4, residual="local", outlier=True)
    _check_fused(2, cfg, 3000 + 53 * 2, torch.bfloat16, False, calls=2, seed=1400,
                 tile=1024, step=256,
                 make_input=lambda call: _outlier_input(2, 3106, torch.bfloat16, call,
                                                        seed=1400, backward=False))
    n = 1100 + 37 * 3
    cfg = two_timescale(bits=8, quantizer="symmetric", residual="output", outlier=True)
    state = _check_fused(3, cfg, n, torch.float16, False, calls=5, seed=0, tile=256,
                         make_input=lambda call: edge_input(3, n, torch.float16, call,
                                                            seed=3200))
    assert torch.isfinite(state.m1).all() and torch.isfinite(state.m2).all()


@pytest.mark.parametrize("P,bits,residual,backward", [(2, 4, "local", False),
                                                      (3, 4, "output", True),
                                                      (4, 8, "local", True)])
def test_fused_bf16_state_matches_reference(P, bits, residual, backward):
    """state_dtype='bfloat16': kernels and reference read the state exactly, compute in fp32
    and round once to bf16 on store, so y and the state still match bit for bit."""
    cfg = two_timescale(bits=bits, residual=residual, state_dtype="bfloat16")
    state = _check_fused(P, cfg, 1400 + 41 * P, torch.bfloat16, backward, calls=3,
                         seed=700 + 10 * P, state_dtype=torch.bfloat16)
    assert state.m1.dtype == torch.bfloat16 and bool(state.m1.abs().sum() > 0)


@pytest.mark.parametrize("residual,sdtype", [("local", torch.bfloat16), ("output", torch.float32)])
def test_fused_compact_state_matches_reference(residual, sdtype):
    """beta1 == beta2 = 0 with one state tensor (m2 is m1): the kernels read and write the same
    addresses twice with the same values, the reference updates once; same bits."""
    cfg = two_timescale(bits=4, residual=residual, beta1=0.0, beta2=0.0,
                     state_dtype="bfloat16" if sdtype == torch.bfloat16 else "float32")
    state = _check_fused(3, cfg, 1300, torch.bfloat16, False, calls=3, seed=900,
                         state_dtype=sdtype, compact=True)
    assert state.compact
    # the p2p default for compensated calls on the stage kernels: 1024-value tiles, several
    # tiles per segment
    _check_fused(2, cfg, 5000, torch.bfloat16, False, calls=2, seed=950, state_dtype=sdtype,
                 compact=True, tile=1024)


@pytest.mark.parametrize("P,bits,residual,sdtype,backward",
                         [(2, 4, "local", torch.bfloat16, True),
                          (3, 4, "output", torch.float32, False),
                          (4, 8, "local", torch.float32, False)])   # P=8: FUSED_CASES
def test_fused_tile_in_steps_matches_reference(P, bits, residual, sdtype, backward):
    """A tile larger than a step (1024 values in 4 steps of 256: one flag and one release per
    tile, the steps' stores in flight together), last tile of each segment partial."""
    cfg = two_timescale(bits=bits, residual=residual,
                     state_dtype="bfloat16" if sdtype == torch.bfloat16 else "float32")
    _check_fused(P, cfg, 3000 + 53 * P, torch.bfloat16, backward, calls=2, seed=1300 + P,
                 state_dtype=sdtype, tile=1024, step=256)


# (P, residual, backward, residual add, half, residual layout): every stage kernel's ranks form
RANKS_CASES = [(4, "local", False, True, None, "rows"),
               (3, "output", True, False, None, "rows"),
               (3, "local", False, True, None, "columns"),
               (3, "local", True, False, "reduce_scatter", "rows"),
               (4, "local", False, False, "all_gather", "rows")]


@pytest.mark.parametrize("P,residual,backward,add,half,layout", RANKS_CASES, ids=str)
def test_ranks_in_one_launch_match_rank_by_rank(P, residual, backward, add, half, layout,
                                                monkeypatch):
    """Every simulated rank's stage in one launch (kernels/ranks_kernels.py) against the same
    stage launched rank by rank: y and the state bit for bit over consecutive calls on fresh
    inputs, and the launches counted: one per stage where the ranks' tensors lie at one stride
    (a residual given as a transposed view is copied per rank: whichever way those copies lie,
    the same bits)."""
    launched = []
    real = ap.launch
    monkeypatch.setattr(ap, "launch", lambda k, *a: (launched.append(k), real(k, *a))[1])
    cfg = two_timescale(bits=4, residual=residual, state_dtype="bfloat16")
    g = cfg.quant_spec().group_size
    n = {None: 1500 + 37 * P, "reduce_scatter": P * 3 * g, "all_gather": 3 * g}[half]
    sims = [sf.SimulatedFused(P, tile_elems=256, one_launch=one) for one in (True, False)]
    states = [CompState.zeros((P, n), "cpu", torch.bfloat16) for _ in sims]
    for call in range(3):
        x = _fused_input(P, n, torch.bfloat16, seed=700 + 10 * P + call,
                         scale=1e-6 if backward else 1.0)
        res = None
        if add:
            res = torch.randn(P, n, generator=torch.Generator().manual_seed(call))
            res = res.to(torch.bfloat16) if layout == "rows" else \
                res.t().contiguous().to(torch.bfloat16).t()               # [P, n], strided
        outs, counts = [], []
        for sim, st in zip(sims, states):
            launched.clear()
            if half is None:
                outs.append(sim(x, cfg, state=st, backward=backward, residual=res))
            else:
                outs.append(getattr(sim, half)(x, cfg, state=st, backward=backward))
            counts.append([k.fn.__name__ for k in launched])
        assert_bits_equal(outs[0], outs[1], f"y call={call}")
        assert_bits_equal(states[0].m1, states[1].m1, f"m1 call={call}")
        one, each = counts
        assert len(each) == 3 * P - (half is not None) * P, each   # amax: not through launch
        if layout == "rows":
            assert len(one) == len(each) // P and all(k.endswith("_ranks_kernel") for k in one)
    if half is None:
        want = CompState.zeros((P, n), "cpu", torch.bfloat16)
        for call in range(3):                   # and both equal the reference, as before
            x = _fused_input(P, n, torch.bfloat16, seed=700 + 10 * P + call,
                             scale=1e-6 if backward else 1.0)
            compensated_all_reduce(x, cfg, SimTransport(P), state=want, backward=backward)
        assert_bits_equal(states[0].m1, want.m1, "m1 against the reference")


def test_rank_stride_only_for_evenly_spaced_rows():
    """launch_ranks' test of the ranks' tensors: rows at one stride (a [P, n] tensor's rows, an
    expanded [P, 1], any two tensors) give it in elements; uneven spacing, a stride that is
    not whole elements, or mixed dtypes give None (then the stages go rank by rank), and so
    do plans out of rank order."""
    buf = torch.zeros(100)
    assert ap._rank_stride(tuple(torch.zeros(3, 7))) == 7
    assert ap._rank_stride(tuple(torch.ones(1, 1).expand(4, 1))) == 0
    assert ap._rank_stride((buf[0:5], buf[10:15], buf[30:35])) is None
    assert ap._rank_stride((buf[0:5], buf[40:45])) == 40
    assert ap._rank_stride((buf[0:5], buf.view(torch.uint8)[6:26])) is None
    assert ap._rank_stride((buf.view(torch.uint8)[0:4], buf.view(torch.uint8)[2:6],
                            buf.view(torch.uint8)[4:8])) == 2
    plans = sf.SimulatedFused(3, tile_elems=256).plans(torch.zeros(3, 600), EchoConfig(),
                                                       None)
    assert not ap.launch_ranks(plans[::-1], "entry")           # not in rank order: refused


@pytest.mark.parametrize("bits", [4, 8])
def test_fused_uncompensated_and_nonfinite(bits):
    """No state (eta = 0 path) and NaN/Inf inputs: y matches, NaN lands in the same places."""
    P, n = 4, 1024
    cfg = two_timescale(bits=bits, eta=0.0)
    x = _fused_input(P, n, torch.bfloat16, seed=7, scale=1.0)
    x[1, 700] = float("nan")
    x[2, 900] = float("inf")
    want, _ = compensated_all_reduce(x, cfg, SimTransport(P), state=None)
    got = sf.SimulatedFused(P, tile_elems=512)(x, cfg, state=None)
    assert_bits_equal(got, want, "y")
    assert got[:, 700].isnan().all()


@pytest.mark.parametrize("quantizer,outlier", [("zero_aware", False), ("zero_aware", True),
                                               ("symmetric", True)])
def test_gather_slots_identical_on_every_rank(quantizer, outlier):
    """Every rank holds the same owner packets after a call (everyone decodes the same bytes),
    and Layout.packet's views are where the kernels wrote them: quant.decode of owner j's
    packet is y's segment j (uncompensated fp32 call; with the outlier words, whose offset
    the kernels derive from the other two: allreduce_kernels._outlier_off)."""
    P, n = 4, 2048
    cfg = two_timescale(bits=4, quantizer=quantizer, outlier=outlier, eta=0.0)
    spec = cfg.quant_spec()
    sim = sf.SimulatedFused(P, tile_elems=512)
    x = _outlier_input(P, n, torch.float32, 0, seed=3, backward=False) if outlier else \
        _fused_input(P, n, torch.float32, seed=3, scale=1.0)
    y = sim(x, cfg, state=None)
    ws = sim.workspace(n, spec, torch.device("cpu"))
    lay = ws["lay"]
    for owner in range(P):
        first = lay.packet(ws["bufs"][0], 1, owner, spec)
        assert (first.outlier is not None) == outlier
        for r in range(1, P):
            other = lay.packet(ws["bufs"][r], 1, owner, spec)
            for a, b in zip(first, other):
                assert (a is None) == (b is None)
                assert a is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        seg = slice(owner * lay.seg, min(n, (owner + 1) * lay.seg))
        want = quant.saturate(quant.decode(first, spec), torch.float32)[:seg.stop - seg.start]
        assert_bits_equal(y[0, seg], want, f"owner {owner}")


def test_missing_peer_times_out_with_rank_stage_tile():
    """A stage whose peers never signalled records (rank, stage, tile) and the host raises."""
    P, n = 2, 1024
    sim = sf.SimulatedFused(P, tile_elems=512, timeout_polls=20)
    x = _fused_input(P, n, torch.float16, seed=1, scale=1.0)
    with pytest.raises(RuntimeError, match=r"rank 0 timed out in stage 1 .* tile 0, peer 1"):
        sim(x, two_timescale(bits=4, eta=0.0), state=None, stages=("reduce",))


@triton.jit
def _ticket_items_kernel(out_ptr, tiles, lag, RANK: tl.constexpr, P: tl.constexpr,
                         FIRST: tl.constexpr):
    k = tl.program_id(0)
    is_reduce, t, j = ak._ticket_item(k, tiles, lag, RANK, P, FIRST)
    tl.store(out_ptr + 3 * k, is_reduce.to(tl.int64))
    tl.store(out_ptr + 3 * k + 1, t.to(tl.int64))
    tl.store(out_ptr + 3 * k + 2, j.to(tl.int64))


@pytest.mark.parametrize("P,rank,tiles,lag,first", [(2, 0, 5, 0, 0), (2, 1, 5, 2, 1),
                                                    (3, 2, 4, 4, 0), (4, 1, 7, 3, 1),
                                                    (8, 5, 3, 1, 0), (2, 0, 1, 1, 1)])
def test_ticket_order_covers_every_item_once_tails_after_their_reduce(P, rank, tiles, lag,
                                                                      first):
    """reduce_tail_kernel's ticket order: every reduce tile and every (tile, owner) tail exactly
    once (owners other than the rank when first=1: the reduce wrote the own y); tile t's tails
    come after its reduce and exactly `lag` reduces later (clamped at the end); each tile's
    tails start with owner rank+first."""
    items_n = (P - first + 1) * tiles
    out = torch.full((items_n * 3,), -1, dtype=torch.int64)
    _ticket_items_kernel[(items_n,)](out, tiles, lag, RANK=rank, P=P, FIRST=first)
    items = [tuple(v) for v in out.view(-1, 3).tolist()]
    reduces = [t for r, t, _ in items if r]
    tails = [(t, j) for r, t, j in items if not r]
    assert reduces == list(range(tiles))
    assert sorted(tails) == [(t, j) for t in range(tiles) for j in range(P)
                             if not (first and j == rank)]
    pos = {("R", t): k for k, (r, t, _) in enumerate(items) if r}
    for k, (r, t, j) in enumerate(items):
        if not r:
            done = sum(1 for rr, tt, _ in items[:k] if rr)        # reduces before this tail
            assert pos[("R", t)] < k and done == min(tiles, t + 1 + lag)
    firsts = [j for k, (r, t, j) in enumerate(items)
              if not r and (k == 0 or items[k - 1][0] or items[k - 1][1] != t)]
    assert firsts == [(rank + first) % P] * tiles


def _concurrent_rank(rank, P, bufs, errs, xs, ys, m1s, m2s, cfg, programs, tile, step,
                     lag=None, rs=None):
    """One simulated rank in its own process: consecutive calls of lengths `lens` (prefixes of
    the rows) on one room, no barrier between them. programs=0: the three stage kernels
    (host-bumped epoch), or with lag: entry, then reduce and tail overlapped in one launch;
    else the fused kernel with that many programs (it bumps the epoch itself). rs [calls, P,
    n]: residuals, the kernels write rs + y."""
    torch.set_num_threads(1)
    spec = cfg.quant_spec()
    room = ap.Layout.needs(xs.shape[-1], P, spec, tile)
    table = torch.tensor([b.data_ptr() for b in bufs] + [errs[rank].data_ptr()])
    epoch = torch.zeros(2, dtype=torch.int64)
    ticket = torch.zeros(3, dtype=torch.int64)
    for call in range(xs.shape[0]):
        k = _lens(xs.shape[-1])[call]
        lay = ap.Layout.build(k, P, spec, tile_elems=tile, room=room)
        if not programs:
            epoch[:1].add_(1)
        plan = ap.CallPlan(rank=rank, lay=lay, cfg=cfg, x=xs[call, rank, :k],
                           state=CompState(m1s[rank, :k], m2s[rank, :k]), fs=None,
                           epoch=epoch, table=table, timeout=300_000, use_timer=False,
                           num_warps=4, step_elems=step,
                           residual=None if rs is None else rs[call, rank, :k])
        time.sleep(0.6 if rank == call % P else 0.0)          # one rank pushes late,
        y = ys[call, rank, :k]
        if programs:
            plan.fused(y, programs)
            continue
        plan.entry()
        time.sleep(0.6 if rank == (call + 1) % P else 0.0)    # another reduces late
        if lag is not None:
            plan.reduce_tail(y, ticket, lag)
            continue
        plan.reduce(y)
        plan.tail(y)
    assert epoch.tolist() == [xs.shape[0], 0] and ticket[2] == 0, (epoch, ticket)


LENS = (1.0, 0.4, 1.0)
"""The concurrent test's call lengths, as fractions of n: a shorter call between two full ones
(fewer tiles on the same room: the counters must start each call afresh)."""


def _lens(n: int) -> list[int]:
    return [int(f * n) for f in LENS]

@pytest.mark.parametrize("P,residual,programs,tile,step,lag,add,outlier",
                         [(2, "local", 0, 256, 256, None, False, False),
                          (3, "output", 0, 256, 256, None, False, False),
                          (2, "output", 2, 256, 256, None, False, False),
                          (3, "local", 1, 256, 256, None, False, False),
                          (2, "local", 2, 512, 256, None, False, False),
                          (4, "local", 0, 256, 256, 50, False, False),
                          (2, "output", 2, 256, 256, None, True, False),
                          (2, "local", 0, 256, 256, 1, True, False),
                          (3, "local", 2, 256, 256, None, False, True),
                          (2, "output", 0, 256, 256, 1, True, True)])
def test_fused_ranks_in_concurrent_processes(P, residual, programs, tile, step, lag, add,
                                             outlier):
    """The flag protocol with real concurrency: P processes share their buffers (as symmetric
    memory would), each runs 3 calls back to back; every wait must see its peer's data and no
    rank may overwrite a slot a slower peer still reads. programs > 0: the single fused kernel,
    each program looping over several tiles (4-5 tiles here). lag: the reduce and tail
    overlapped in one launch (overlap 'launch'; tails `lag` tiles behind; 50 > tiles: every
    reduce first). add: a residual per call and rank, the kernels write residual + y (the
    block boundary's add; the forms SimulatedFused cannot run in one process: the fused
    kernel, and reduce_tail with the reduce's own y), the state as without it. outlier: the
    outlier word (QuantSpec.outlier) in those two forms."""
    import torch.multiprocessing as mp
    cfg = two_timescale(bits=4, residual=residual, outlier=outlier)
    calls, n = 3, 1000 if not programs and lag is None else 2300
    lay = ap.Layout.build(n, P, cfg.quant_spec(), tile_elems=tile)
    assert lay.tiles > ap.Layout.build(_lens(n)[1], P, cfg.quant_spec(), tile_elems=tile).tiles
    bufs = [torch.randint(0, 256, (lay.nbytes,), dtype=torch.uint8).share_memory_()
            for _ in range(P)]
    for b in bufs:
        lay.flag_words(b).zero_()
    errs = [torch.zeros(8, dtype=torch.int64).share_memory_() for _ in range(P)]
    xs = torch.stack([_outlier_input(P, n, torch.bfloat16, c, seed=50, backward=False)
                      if outlier else _fused_input(P, n, torch.bfloat16, seed=50 + c, scale=1.0)
                      for c in range(calls)]).share_memory_()
    ys = torch.empty_like(xs).share_memory_()
    m1s, m2s = torch.zeros(P, n).share_memory_(), torch.zeros(P, n).share_memory_()
    rs = None
    if add:
        gen = torch.Generator().manual_seed(60 + P)
        rs = (torch.randn(calls, P, n, generator=gen) * 3).to(torch.bfloat16).share_memory_()
    mp.start_processes(_concurrent_rank, args=(P, bufs, errs, xs, ys, m1s, m2s, cfg, programs,
                                               tile, step, lag, rs),
                       nprocs=P, start_method="spawn")
    for r in range(P):
        assert describe_error(errs[r]) is None, describe_error(errs[r])
    ref = CompState.zeros((P, n), "cpu")
    for call in range(calls):
        k = _lens(n)[call]
        want, _ = compensated_all_reduce(xs[call, :, :k], cfg, SimTransport(P),
                                         state=CompState(ref.m1[:, :k], ref.m2[:, :k]))
        if add:
            want = rs[call, :, :k] + want                  # torch's add: one bf16 rounding
        assert_bits_equal(ys[call, :, :k], want, f"y call={call}")
    assert_bits_equal(m1s, ref.m1, "m1")
    assert_bits_equal(m2s, ref.m2, "m2")


def test_layout_alignment():
    spec = QuantSpec(bits=4, group_size=128)
    lay = ap.Layout.build(10_000_003, 4, spec, tile_elems=4096)
    assert lay.seg % 128 == 0 and lay.seg * 4 >= 10_000_003
    assert lay.slot % 256 == 0 and lay.scale_off % 16 == 0 and lay.zero_off % 16 == 0
    assert lay.tiles * lay.bg >= lay.groups > (lay.tiles - 1) * lay.bg
    with pytest.raises(ValueError, match="power of two"):
        ap.Layout.build(1000, 2, spec, tile_elems=384)
    for bits in (4, 8):
        for qz in ("zero_aware", "naive", "symmetric"):
            for g, numel in ((8, 1000), (128, 10_000_003), (256, 77_777)):
                plain = QuantSpec(bits=bits, group_size=g, quantizer=qz)
                ospec = QuantSpec(bits=bits, group_size=g, quantizer=qz, outlier=True)
                a = ap.Layout.build(numel, 3, plain, tile_elems=1024)
                b = ap.Layout.build(numel, 3, ospec, tile_elems=1024)
                # the kernels' rule (allreduce_kernels._outlier_off), 16-byte aligned, after
                # every other region, inside the slot
                assert b.outlier_off == (b.zero_off + (b.zero_off - b.scale_off)
                                         if plain.has_zero else b.zero_off)
                assert b.outlier_off % 16 == 0 and b.outlier_off >= b.zero_off
                assert b.outlier_off + 2 * b.groups <= b.slot
                assert (a.scale_off, a.zero_off) == (b.scale_off, b.zero_off)
                assert a.slot <= b.slot and b.slot - a.slot <= 2 * b.groups + 256
                assert ospec.packet_bytes(b.seg) <= b.slot


@pytest.mark.parametrize("outlier", [False, True], ids=["plain", "outlier"])
@pytest.mark.parametrize("residual", ["output", "local"])
@pytest.mark.parametrize("bits", [4, 8])
def test_reference_qar_with_kernel_codec_is_bit_identical(residual, bits, outlier):
    """On CUDA the reference QAR quantizes with these kernels (qar.codec_for): same y and state
    as with quant.py, over two compensated calls of P=4 virtual ranks."""
    cfg = two_timescale(bits=bits, residual=residual, outlier=outlier)
    t = SimTransport(4)
    states = {name: CompState.zeros((4, 1000), "cpu") for name in ("torch", "kernels")}
    for call in range(2):
        g = torch.Generator().manual_seed(4242 + call)
        x = (torch.randn(4, 1000, generator=g) * 3).to(torch.bfloat16)
        y_t, _ = compensated_all_reduce(x, cfg, t, state=states["torch"], codec=quant)
        y_k, _ = compensated_all_reduce(x, cfg, t, state=states["kernels"], codec=qk)
        assert_bits_equal(y_k, y_t, f"y call {call}")
        assert_bits_equal(states["kernels"].m1, states["torch"].m1, f"m1 call {call}")
        assert_bits_equal(states["kernels"].m2, states["torch"].m2, f"m2 call {call}")

"""The compiled kernels' hardware forms against torch on one GPU (skipped without CUDA).

Compiled kernels divide by a group scale with the fast path of the GPU's own IEEE division and
round fp32 -> bf16 with the conversion instruction (quant_kernels.HW_FORMS); the CPU tests
(tests/test_kernels.py, TRITON_INTERPRET=1) run the arithmetic forms instead. These tests hold
the compiled forms to torch's reference on fresh random inputs:
  * _div_by_scale against torch's tensor / tensor division (IEEE on CUDA) for EVERY positive
    fp16 scale, with dividends spread over the whole fp32 range, and for EVERY value a tagged
    (bf16) scale word of a finite group can hold, [2^-126, 2^126);
  * Triton encode/decode against quant.py (torch) on CUDA, adversarial groups included, and
    groups at every scale (both scale-word forms, fp32 subnormals, near fp32 max);
  * SimulatedFused (every stage kernel, P ranks on one GPU) against compensated_all_reduce with
    the torch quantizer (the `torch_quantizer` fixture), y and the compensator state bit for bit;
  * edge call sequences (huge groups, sums near the dtype's max, NaN/Inf then clean calls)
    through SimulatedFused against the torch reference;
  * the block boundary (norm_kernels: add + RMSNorm, norm-only; SimulatedFused with the
    residual added where y is decoded, then the norm-only kernel) against norm.py's reference
    after the reference all-reduce: outputs and state bit for bit;
  * the reduce-scatter and all-gather halves (`-k halves`): SimulatedFused.reduce_scatter /
    all_gather against collective/sharded.py with the torch quantizer, P = 2/4/8, y and state
    bit for bit over 3 calls; SimulatedCommunicator's halves on CUDA (FusedSimBackend: the
    kernels) against fused=False over a forward and a backward pass (P = 2);
  * the packet header (`-k header`): tests/header_cases.py compiled (calls of any length on one
    room, ranks whose calls differ);
  * the outlier word (QuantSpec.outlier; `-k outlier` and the cases with outlier True): every
    encode/decode test above with and without it, its own cases (harness.outlier_groups), the
    stage kernels on outlier calls (FUSED_OUTLIER), a boundary, two halves and a communicator
    case. Where only these fail, look first at quant_kernels._outlier_slots' compiled form (the
    first index's min; the min and max that must drop the slot's NaN) and
    allreduce_kernels._outlier_off.
"""
from __future__ import annotations

import pytest
import torch
from harness import bits_differ, edge_input, extreme_groups, outlier_groups, two_timescale

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _all_fp16_scales() -> torch.Tensor:
    """Every positive finite fp16 value (subnormals included) as fp32 [31743]."""
    bits = torch.arange(1, 0x7C00, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.float16).float()


def _fast_divide(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """_div_by_scale compiled: x [G, 128] / s [G] (G a multiple of 16; s broadcast per
    row, as the kernels broadcast a group's step), CUDA fp32."""
    import triton
    import triton.language as tl

    from echo_tp.kernels.quant_kernels import LAUNCH_OPTS, _div_by_scale

    @triton.jit
    def div_kernel(x_ptr, s_ptr, out_ptr, BG: tl.constexpr, GS: tl.constexpr):
        grp = tl.program_id(0) * BG + tl.arange(0, BG)
        offs = grp[:, None] * GS + tl.arange(0, GS)[None, :]
        v = _div_by_scale(tl.load(x_ptr + offs), tl.load(s_ptr + grp)[:, None])
        tl.store(out_ptr + offs, v)

    out = torch.empty_like(x)
    div_kernel[(s.numel() // 16,)](x, s, out, BG=16, GS=128, **LAUNCH_OPTS)
    return out


def test_fast_division_is_ieee_division_for_every_fp16_scale():
    s = _all_fp16_scales().cuda()
    s = torch.cat([s, s[: (-s.numel()) % 16]])                        # whole programs
    gen = torch.Generator(device="cuda").manual_seed(1234)
    for trial in range(4):
        # Dividends the quantizer can meet: |x/s| < 2^113 (s >= max(|x|/271, min(|x|, 65504)/
        # 256) clipped to [2^-24, 65504]): random sign and mantissa, quotient exponents from
        # -140 (subnormal dividends included) to 110, plus zeros and exact half-integers.
        k = torch.randint(-140, 111, (s.numel(), 128), device="cuda", generator=gen)
        x = torch.ldexp(s[:, None] * torch.randn(s.numel(), 128, device="cuda", generator=gen), k)
        x[:, :32] = s[:, None] * torch.randn(s.numel(), 32, device="cuda", generator=gen) * 20
        x[:, 32:40] = s[:, None] * (torch.randint(-400, 400, (s.numel(), 8), device="cuda",
                                                  generator=gen) + 0.5)
        x[:, 40] = 0.0
        x[:, 41] = -0.0
        out = _fast_divide(x, s)
        want = x / s[:, None]                                         # IEEE division on CUDA
        assert not out.isnan().any() and not out.isinf().any()
        # Bit-exact wherever the code round(v + z), clipped, can depend on the last bit;
        # below 2^-100 or above 2^100 the clipped code is the same for any nearby value.
        mid = (want.abs() >= 2.0 ** -100) & (want.abs() <= 2.0 ** 100)
        bad = bits_differ(out, want) & mid
        assert not bad.any(), (trial, out[bad][:5], want[bad][:5])
        assert ((out - want).abs()[want.abs() < 2.0 ** -100] < 2.0 ** -90).all()
        big = want.abs() > 2.0 ** 100
        assert (out[big].sign() == want[big].sign()).all() and (out[big].abs() > 2.0 ** 99).all()


def test_fast_division_is_ieee_division_for_every_bf16_scale_word():
    """Tagged scale words: every bf16 step in [2^-126, 2^126) (quant.scale_word's range for a
    finite group, so 1/s is a normal fp32). Dividends as the quantizer meets them there:
    |x/s| <= 271 + L (Z_MAX widening), from fp32 subnormals up to fp32 max, half-integers."""
    s = (torch.arange(0x0080, 0x7E80, dtype=torch.int32) << 16).view(torch.float32).cuda()
    s = torch.cat([s, s[: (-s.numel()) % 16]])
    fmax = torch.finfo(torch.float32).max
    gen = torch.Generator(device="cuda").manual_seed(4321)
    for trial in range(4):
        k = torch.randint(-40, 9, (s.numel(), 128), device="cuda", generator=gen)
        x = torch.ldexp(s[:, None] * torch.randn(s.numel(), 128, device="cuda", generator=gen), k)
        x[:, 32:40] = s[:, None] * (torch.randint(-270, 270, (s.numel(), 8), device="cuda",
                                                  generator=gen) + 0.5)
        x[:, 40] = 0.0
        x[:, 41] = -0.0
        x[:, 42] = 1e-45                                              # fp32 subnormals
        x[:, 43] = -3e-39
        x = x.clamp(-fmax, fmax)
        out = _fast_divide(x, s)
        want = x / s[:, None]
        assert not out.isnan().any() and not out.isinf().any()
        mid = (want.abs() >= 2.0 ** -100) & (want.abs() <= 2.0 ** 100)
        bad = bits_differ(out, want) & mid
        assert not bad.any(), (trial, x[bad][:5], s.expand(128, -1).t()[bad][:5],
                               out[bad][:5], want[bad][:5])
        assert ((out - want).abs()[want.abs() < 2.0 ** -100] < 2.0 ** -90).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_encode_decode_at_every_scale_match_torch_reference_on_gpu(dtype):
    from echo_tp import quant
    from echo_tp.config import QuantSpec
    from echo_tp.kernels import quant_kernels as qk
    for bits in (4, 8):
        for qz in ("zero_aware", "naive", "symmetric"):
            for outlier in (False, True):
                spec = QuantSpec(bits=bits, group_size=128, quantizer=qz, outlier=outlier)
                x = extreme_groups(40, 50, 128, getattr(torch, dtype), seed=77 + bits).cuda()
                _assert_packets_match(qk.encode(x, spec), quant.encode(x, spec), spec,
                                      (bits, qz, outlier))


def _assert_packets_match(got, want, spec, what):
    """Codes, scale words (int16, strict), zeros (any NaN matches), outlier words (int16,
    strict) and both decodes of the packets bit for bit (quant_kernels vs quant on CUDA)."""
    from echo_tp import quant
    from echo_tp.kernels import quant_kernels as qk
    assert not bits_differ(got.codes, want.codes).any(), (what, "codes")
    assert not bits_differ(got.scale.view(torch.int16),
                           want.scale.view(torch.int16)).any(), (what, "scale")
    if spec.has_zero:
        assert not bits_differ(got.zero, want.zero).any(), (what, "zero")
    if spec.outlier:
        assert not bits_differ(got.outlier.view(torch.int16),
                               want.outlier.view(torch.int16)).any(), (what, "outlier words")
    else:
        assert got.outlier is None
    assert not bits_differ(qk.decode(got, spec), quant.decode(want, spec)).any(), (what, "decode")
    assert not bits_differ(qk.decode(want, spec), quant.decode(got, spec)).any(), (what, "cross")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_outlier_encode_decode_match_torch_reference_on_gpu(dtype):
    """The outlier word's own cases (harness.outlier_groups: massive values, ties, fp16's
    range edges, fp16 rounding ties, NaN/Inf beside a massive value) on the compiled
    quantizer (NaN-propagating reductions, the hardware fp16 conversion) against quant.py."""
    from echo_tp import quant
    from echo_tp.config import QuantSpec
    from echo_tp.kernels import quant_kernels as qk
    for bits in (4, 8):
        for qz in ("zero_aware", "naive", "symmetric"):
            for g in (8, 128):
                spec = QuantSpec(bits=bits, group_size=g, quantizer=qz, outlier=True)
                x = outlier_groups(40, 64, g, getattr(torch, dtype), seed=99 + bits + g).cuda()
                want = quant.encode(x, spec)
                _assert_packets_match(qk.encode(x, spec), want, spec, (bits, qz, g))
                assert bool((want.outlier != 0).any()) and bool((want.outlier == 0).any())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_encode_decode_match_torch_reference_on_gpu(dtype):
    from echo_tp import quant
    from echo_tp.config import QuantSpec
    from echo_tp.kernels import quant_kernels as qk
    gen = torch.Generator().manual_seed(7)
    for bits in (4, 8):
        for qz in ("zero_aware", "naive", "symmetric"):
            groups = 6007
            x = torch.randn(groups, 128, generator=gen) \
                * torch.exp(torch.randn(groups, 1, generator=gen) * 4)
            kind = torch.randint(0, 10, (groups,), generator=gen)
            x[kind == 1] = x[kind == 1][:, :1]                             # constant groups
            x[kind == 2] = 0.0
            x[kind == 3] = x[kind == 3] * 1e-2 + 1e4                       # far from zero
            x[kind == 4] *= 1e-33
            x[kind == 5] = torch.randint(-8, 9, (int((kind == 5).sum()), 128),
                                         generator=gen).float()
            x[kind == 6, 5] = float("nan")
            x[kind == 7, 9] = float("inf")
            x = x.reshape(-1).to(getattr(torch, dtype)).cuda()
            for outlier in (False, True):
                spec = QuantSpec(bits=bits, group_size=128, quantizer=qz, outlier=outlier)
                _assert_packets_match(qk.encode(x, spec), quant.encode(x, spec), spec,
                                      (bits, qz, outlier))


# (P, bits, quantizer, residual, dtype, backward, state dtype, compact)
FUSED = [
    (4, 4, "zero_aware", "output", "bfloat16", False, "float32", False),
    (4, 4, "zero_aware", "local", "bfloat16", False, "float32", False),
    (2, 4, "zero_aware", "local", "bfloat16", False, "bfloat16", True),
    (2, 4, "naive", "output", "bfloat16", True, "bfloat16", False),
    (4, 8, "symmetric", "local", "float16", False, "float32", False),
    (3, 4, "symmetric", "output", "float32", True, "float32", False),
    (2, 8, "zero_aware", "local", "float16", True, "bfloat16", True),
]


def _fused_pair(case, n, tile, **cfg_kw):
    """A FUSED case's config and its two runs: (cfg, st, st_r, sim): the compiled stage
    kernels' state st and SimulatedFused sim, the torch reference's state st_r."""
    from echo_tp.compensator import CompState
    from echo_tp.collective.simulated_fused import SimulatedFused
    P, bits, qz, resid, dtype, backward, sdt, compact = case
    betas = dict(beta1=0.5, beta2=0.5) if compact else {}
    cfg = two_timescale(bits=bits, quantizer=qz, residual=resid, state_dtype=sdt, **betas,
                        **cfg_kw)
    sdtype = getattr(torch, sdt)
    st = CompState.zeros((P, n), "cuda", sdtype, compact=compact)
    st_r = CompState.zeros((P, n), "cuda", sdtype, compact=compact)
    return cfg, st, st_r, SimulatedFused(P, tile_elems=tile, timeout_polls=10**7)


def _fused_call(x, cfg, st, st_r, sim, backward, call):
    """One call on both paths: y and the state bit for bit; returns y."""
    from echo_tp.collective.qar import compensated_all_reduce
    from echo_tp.collective.simulated import SimTransport
    y_r, _ = compensated_all_reduce(x, cfg, SimTransport(x.shape[0]), state=st_r,
                                    backward=backward)
    y = sim(x, cfg, state=st, backward=backward)
    assert not bits_differ(y, y_r).any(), (call, "y", int(bits_differ(y, y_r).sum()))
    assert not bits_differ(st.m1, st_r.m1).any(), (call, "m1")
    assert not bits_differ(st.m2, st_r.m2).any(), (call, "m2")
    return y


@pytest.mark.parametrize("case", FUSED, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("tile", [1024, 2048])
def test_simulated_fused_matches_torch_reference_on_gpu(case, tile, torch_quantizer):
    P, dtype, backward = case[0], case[4], case[5]
    n = 300_017
    cfg, st, st_r, sim = _fused_pair(case, n, tile)
    gen = torch.Generator(device="cuda").manual_seed(hash(case) % 1000 + tile)
    for call in range(3):
        x = torch.randn(P, n, device="cuda", generator=gen)
        x *= torch.exp(torch.randn(P, n // 128 + 1, device="cuda", generator=gen) * 2) \
            .repeat_interleave(128, dim=1)[:, :n]
        x[:, 7::501] *= 30.0
        x[:, 1024:1152] = 0.0
        if backward:
            x *= 1e-7
        x = x.to(getattr(torch, dtype))
        _fused_call(x, cfg, st, st_r, sim, backward, call)


@pytest.mark.parametrize("case", FUSED[:4] + FUSED[5:], ids=lambda c: "-".join(map(str, c)))
def test_simulated_fused_edge_calls_match_torch_reference_on_gpu(case, torch_quantizer):
    """Issue 15 on the compiled kernels: huge/tiny groups, fp16 sums near 65504, values near
    the dtype's max, NaN/Inf then clean calls; y and the state bit for bit, the state finite."""
    P, dtype, backward = case[0], case[4], case[5]
    n = 40_000 + 37 * P
    cfg, st, st_r, sim = _fused_pair(case, n, 1024)
    for call in range(5):
        x = edge_input(P, n, getattr(torch, dtype), call, seed=90 + P).cuda()
        y = _fused_call(x, cfg, st, st_r, sim, backward, call)
        assert torch.isfinite(st.m1).all() and torch.isfinite(st.m2).all(), call
        if call != 1:
            assert torch.isfinite(y).all(), call


# The outlier word (QuantSpec.outlier) on the compiled stage kernels; fields as FUSED.
FUSED_OUTLIER = [
    (2, 4, "zero_aware", "local", "bfloat16", False, "bfloat16", True),
    (4, 4, "symmetric", "output", "float16", False, "float32", False),
    (3, 8, "naive", "local", "float32", True, "float32", False),
    (4, 8, "zero_aware", "output", "bfloat16", True, "bfloat16", False),
    (2, 4, "naive", "output", "float32", False, "float32", False),
    (3, 4, "symmetric", "local", "bfloat16", True, "float32", False),
]


@pytest.mark.parametrize("case", FUSED_OUTLIER, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("tile", [1024, 2048])
def test_simulated_fused_outlier_matches_torch_reference_on_gpu(case, tile, torch_quantizer):
    """The outlier word through the compiled entry, reduce and tail (every packet carries its
    outlier words; the reduce decodes and requantizes with them) against compensated_all_reduce
    with the torch quantizer: 4 calls (harness.outlier_groups without NaN/Inf, then with them;
    randn with massive channels x3000; the edge call with huge groups, NaN and Inf), y
    and the state bit for bit after each, the state finite, y finite without NaN/Inf input."""
    P, bits, dtype, backward = case[0], case[1], case[4], case[5]
    n, dt = 100_003, getattr(torch, dtype)
    cfg, st, st_r, sim = _fused_pair(case, n, tile, outlier=True)
    gen = torch.Generator(device="cuda").manual_seed(31 * P + bits + tile)
    for call in range(4):
        if call < 2:
            x = outlier_groups(P, -(-n // 128), 128, dt, seed=500 + 10 * P + call,
                               nonfinite=call == 1)[:, :n].cuda()
        elif call == 2:
            x = torch.randn(P, n, device="cuda", generator=gen)
            x[:, 7::501] *= 3000.0
            x[:, 1024:1152] = 0.0
            x = x.to(dt)
        else:
            x = edge_input(P, n, dt, 1, seed=95 + P).cuda()
        if backward:
            x = (x.float() * 1e-7).to(dt)
        y = _fused_call(x, cfg, st, st_r, sim, backward, call)
        assert torch.isfinite(st.m1).all() and torch.isfinite(st.m2).all(), call
        if call in (0, 2):
            assert torch.isfinite(y).all(), call


@pytest.mark.parametrize("H,dtype,wdtype", [(4096, "bfloat16", "float32"),
                                            (5120, "bfloat16", "bfloat16"),
                                            (8192, "float16", "float16"),
                                            (1000, "float32", "float32")])
@pytest.mark.parametrize("rows", [1, 8, 2048])
def test_add_rmsnorm_kernel_matches_reference_on_gpu(H, dtype, wdtype, rows):
    """The compiled residual add + RMSNorm (and the norm-only form on residual_out) against
    norm.py's reference on CUDA, bit for bit (decode and prefill row counts; torch's CUDA sqrt
    and divisions are IEEE)."""
    from echo_tp import norm
    from echo_tp.kernels import norm_kernels as nk
    gen = torch.Generator(device="cuda").manual_seed(H + rows)
    dt, wdt = getattr(torch, dtype), getattr(torch, wdtype)
    y = (torch.randn(rows, H, device="cuda", generator=gen)
         * torch.logspace(-3, 3, rows, device="cuda")[:, None]).to(dt)
    res = (torch.randn(rows, H, device="cuda", generator=gen) * 4).to(dt)
    w = (1 + 0.1 * torch.randn(H, device="cuda", generator=gen)).to(wdt)
    got_n, got_r = nk.add_rmsnorm(y, res, w, 1e-6)
    want_n, want_r = norm.add_rmsnorm_reference(y, res, w, 1e-6)
    assert not bits_differ(got_r, want_r).any(), "residual_out"
    assert not bits_differ(got_n, want_n).any(), (int(bits_differ(got_n, want_n).sum()), "normed")
    only = nk.rmsnorm(want_r, w, 1e-6)                         # the norm-only form
    assert not bits_differ(only, want_n).any(), (int(bits_differ(only, want_n).sum()), "rmsnorm")


@pytest.mark.parametrize("P,cfg_name,dtype,outlier", [(4, "echo4", torch.bfloat16, False),
                                                      (8, "echo4-output", torch.bfloat16, False),
                                                      (8, "4", torch.float16, False),
                                                      (4, "echo4", torch.bfloat16, True)])
def test_simulated_communicator_on_gpu_runs_the_fused_kernels_bit_for_bit(P, cfg_name, dtype,
                                                                          outlier):
    """SimulatedCommunicator on CUDA (FusedSimBackend: the p2p kernels of every virtual rank)
    against fused=False (the reference): y and the compensator states after a forward and a
    backward pass of 6 sites each, bit for bit; outlier: the config with the outlier word
    (kernels/fits takes it: the kernels run)."""
    from echo_tp import SimulatedCommunicator
    from echo_tp.config import EchoConfig
    cfg = EchoConfig.from_name(cfg_name).replace(outlier=outlier)
    g = torch.Generator(device="cuda").manual_seed(P)
    fast, ref = SimulatedCommunicator(P, cfg), SimulatedCommunicator(P, cfg, fused=False)
    assert fast.dispatcher.backends["reference"].name == "simulated-fused"
    for direction in ("forward", "backward"):
        for comm in (fast, ref):
            comm.new_pass(direction)
        for site in range(6):
            x = (torch.randn(P, 3, 1037, generator=g, device="cuda") *  # one state stream
                 (1 + 50 * (site % 2))).to(dtype)
            y1 = fast.all_reduce(x, direction=direction)
            y2 = ref.all_reduce(x, direction=direction)
            assert int(bits_differ(y1, y2).sum()) == 0, (direction, site)
        if cfg.compensated:
            for n, s1 in fast.passes[direction].streams.items():
                s2 = ref.passes[direction].streams[n]
                assert int(bits_differ(s1.m1, s2.m1).sum()) == 0
                assert int(bits_differ(s1.m2, s2.m2).sum()) == 0


# (P, bits, quantizer, residual mode or None: uncompensated, dtype, state dtype, compact,
# outlier word)
ADD_NORM = [
    (4, 4, "zero_aware", "local", "bfloat16", "bfloat16", True, False),   # the default config
    (4, 4, "zero_aware", "output", "bfloat16", "float32", False, False),
    (2, 8, "symmetric", "local", "float16", "float32", False, False),
    (2, 4, "naive", None, "float32", "float32", False, False),
    (4, 8, "zero_aware", None, "float16", "float32", False, False),
    (4, 4, "zero_aware", "local", "bfloat16", "bfloat16", True, True),
]


@pytest.mark.parametrize("case", ADD_NORM, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("rows,H", [(75, 4000), (8, 4096)])
def test_residual_in_the_all_reduce_then_rmsnorm_on_gpu(case, rows, H, torch_quantizer):
    """The block boundary with the add where y is decoded, compiled:
    SimulatedFused(residual=r) (tile 1024: rows cross tiles and segments) then the norm-only
    kernel, against the reference all-reduce (torch quantizer) then add_rmsnorm_reference on
    CUDA: residual_out, normed and the state bit for bit over 3 calls (compensated) or 1."""
    from echo_tp import norm
    from echo_tp.collective.qar import compensated_all_reduce
    from echo_tp.collective.simulated import SimTransport
    from echo_tp.compensator import CompState
    from echo_tp.kernels import norm_kernels as nk
    from echo_tp.collective.simulated_fused import SimulatedFused
    P, bits, qz, mode, dtype, sdt, compact, outlier = case
    betas = dict(beta1=0.5, beta2=0.5) if compact else {}
    cfg = two_timescale(bits=bits, quantizer=qz, residual=mode, state_dtype=sdt,
                        outlier=outlier, **betas) \
        if mode else two_timescale(bits=bits, quantizer=qz, eta=0.0, outlier=outlier)
    n, dt = rows * H, getattr(torch, dtype)
    st = CompState.zeros((P, n), "cuda", getattr(torch, sdt), compact=compact) if mode else None
    st_r = CompState.zeros((P, n), "cuda", getattr(torch, sdt), compact=compact) if mode else None
    sim = SimulatedFused(P, tile_elems=1024, timeout_polls=10**7)
    gen = torch.Generator(device="cuda").manual_seed(hash(case) % 1000 + rows)
    w = (1 + 0.1 * torch.randn(H, device="cuda", generator=gen)).to(
        torch.float32 if dt == torch.bfloat16 else dt)
    for call in range(3 if mode else 1):
        x = torch.randn(P, n, device="cuda", generator=gen)
        x *= torch.exp(torch.randn(P, n // 128 + 1, device="cuda", generator=gen) * 2) \
            .repeat_interleave(128, dim=1)[:, :n]
        x[:, 7::501] *= 30.0
        x = x.to(dt)
        res = (torch.randn(P, n, device="cuda", generator=gen) * 4).to(dt)
        y_r, _ = compensated_all_reduce(x, cfg, SimTransport(P), state=st_r)
        want_n, want_r = norm.add_rmsnorm_reference(y_r.view(P, rows, H), res.view(P, rows, H),
                                                    w, 1e-6)
        rout = sim(x, cfg, state=st, residual=res).view(P, rows, H)
        normed = nk.rmsnorm(rout, w, 1e-6)
        assert not bits_differ(rout, want_r).any(), (call, "residual_out",
                                                     int(bits_differ(rout, want_r).sum()))
        assert not bits_differ(normed, want_n).any(), (call, "normed",
                                                       int(bits_differ(normed, want_n).sum()))
        if mode:
            assert not bits_differ(st.m1, st_r.m1).any(), (call, "m1")
            assert not bits_differ(st.m2, st_r.m2).any(), (call, "m2")


# (P, bits, quantizer, dtype, state: None | 'pair' (paper, fp32) | 'default', backward,
# outlier word)
HALVES = [                 # few: every rank of every case is a cold compile per stage kernel
    (2, 8, "symmetric", "float32", None, False, False),
    (4, 4, "zero_aware", "bfloat16", "pair", True, False),
    (8, 4, "zero_aware", "bfloat16", "default", True, False),
    (4, 4, "naive", "float16", "default", False, True),
    (2, 8, "symmetric", "bfloat16", "pair", True, True),
]


@pytest.mark.parametrize("case", HALVES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
def test_halves_match_sharded_reference_on_gpu(kind, case):
    """The compiled halves: SimulatedFused.reduce_scatter / all_gather
    against collective/sharded.py with the torch quantizer (codec=quant), chunks of 257
    groups (partial tiles), y and the state bit for bit over 3 calls; all-gather rows equal."""
    from echo_tp import quant
    from echo_tp.collective.sharded import compensated_all_gather, compensated_reduce_scatter
    from echo_tp.collective.simulated import SimTransport
    from echo_tp.compensator import CompState
    from echo_tp.config import EchoConfig
    from echo_tp.collective.simulated_fused import SimulatedFused
    P, bits, qz, dtype, state, backward, outlier = case
    cfg = EchoConfig(bits=bits, quantizer=qz, eta=0.0) if state is None else \
        two_timescale(bits=bits, quantizer=qz) if state == "pair" else \
        EchoConfig(bits=bits, quantizer=qz)
    cfg = cfg.replace(outlier=outlier)
    m = 257 * 128
    n = P * m if kind == "reduce_scatter" else m
    sdt = torch.bfloat16 if state == "default" else torch.float32
    st = CompState.zeros((P, n), "cuda", sdt, compact=state == "default") if state else None
    st_r = CompState.zeros((P, n), "cuda", sdt, compact=state == "default") if state else None
    sim = SimulatedFused(P, tile_elems=1024, step_elems=1024, timeout_polls=10**7)
    ref = compensated_reduce_scatter if kind == "reduce_scatter" else compensated_all_gather
    gen = torch.Generator(device="cuda").manual_seed(hash(case) % 1000 + len(kind))
    for call in range(3):
        x = torch.randn(P, n, device="cuda", generator=gen)
        x *= torch.exp(torch.randn(P, n // 128, device="cuda", generator=gen) * 2) \
            .repeat_interleave(128, dim=1)
        x[:, 7::501] *= 30.0
        x[:, 1024:1152] = 0.0
        if outlier:                                # massive values, a tie of the largest |x|
            x[:, 13::1001] = 3000.0
            x[:, 2048 + 5], x[:, 2048 + 77] = 4096.0, -4096.0
        x = (x * (1e-7 if backward else 1.0)).to(getattr(torch, dtype))
        y = getattr(sim, kind)(x, cfg, state=st, backward=backward)
        y_r = ref(x, cfg, SimTransport(P), state=st_r, backward=backward, codec=quant)
        assert not bits_differ(y, y_r).any(), (call, "y", int(bits_differ(y, y_r).sum()))
        if state:
            assert not bits_differ(st.m1, st_r.m1).any(), (call, "m1")
            assert not bits_differ(st.m2, st_r.m2).any(), (call, "m2")
        if kind == "all_gather":
            assert all(not bits_differ(y[0], y[r]).any() for r in range(P)), call


@pytest.mark.parametrize("P,cfg_name", [(2, "echo4")])
def test_simulated_communicator_halves_on_gpu_run_the_kernels(P, cfg_name):
    """SimulatedCommunicator's reduce_scatter / all_gather on CUDA (FusedSimBackend: the stage
    kernels) against fused=False (the reference with the Triton quantizer, bit-identical to
    the torch one): sequence-parallel boundaries (RS of [P, T, H] along the tokens, then AG
    of the result) over a forward and a backward pass of 4 sites each, y and the states bit
    for bit, and the kernels did run."""
    from echo_tp import SimulatedCommunicator
    from echo_tp.config import EchoConfig
    cfg = EchoConfig.from_name(cfg_name)
    g = torch.Generator(device="cuda").manual_seed(10 + P)
    fast, ref = SimulatedCommunicator(P, cfg), SimulatedCommunicator(P, cfg, fused=False)
    backend = fast.dispatcher.backends["reference"]
    assert backend.name == "simulated-fused"
    for direction in ("forward", "backward"):
        for comm in (fast, ref):
            comm.new_pass(direction)
        for site in range(4):
            x = (torch.randn(P, 8 * P, 1024, generator=g, device="cuda")
                 * (1 + 50 * (site % 2)) * (1e-6 if direction == "backward" else 1.0)
                 ).to(torch.bfloat16)
            h = [c.reduce_scatter(x, direction=direction) for c in (fast, ref)]
            assert int(bits_differ(h[0], h[1]).sum()) == 0, (direction, site, "rs")
            z = [c.all_gather(h[1], direction=direction) for c in (fast, ref)]
            assert int(bits_differ(z[0], z[1]).sum()) == 0, (direction, site, "ag")
        for kind in ("reduce_scatter", "all_gather"):
            for n, s1 in fast.half_passes[kind][direction].streams.items():
                s2 = ref.half_passes[kind][direction].streams[n]
                assert int(bits_differ(s1.m1, s2.m1).sum()) == 0, (direction, kind)
                assert int(bits_differ(s1.m2, s2.m2).sum()) == 0, (direction, kind)
    assert backend._sims, "the halves did not run through the kernels"


# ----- the packet header: every call's length and width, checked by the kernels -------------

@pytest.mark.parametrize("what", ["shared room", "length", "longer", "bits", "quantizer", "dtype",
                                  "one of three", "reduce_scatter", "all_gather"])
def test_header_cases_compiled_on_gpu(what):
    """tests/header_cases.py compiled on one GPU (the interpreter runs them in
    tests/test_call_header.py): calls of any length on one room bit for bit, and ranks whose
    calls differ recorded on every rank with NaN outputs."""
    import header_cases as hc
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    if what == "shared room":
        hc.shared_room(seed, "cuda")
    elif what in ("reduce_scatter", "all_gather"):
        hc.half_mismatch(what, seed, "cuda")
    else:
        hc.mismatch(what, seed, "cuda")

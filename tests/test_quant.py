"""Quantizer reference (echo_tp.quant) against SPEC.md §3, on fresh random inputs.

Compared: quant_dequant(x) with x itself (error within the step bound), with hand-built groups
(constant, all-zero, tiny, huge, NaN/Inf) and with the packing layout written out by hand; the
scale word's two forms (fp16, or tagged bf16 for steps outside fp16's range) and its bits.
If a bound fails, look first at group_params (scale rounding up, Z_MAX widening, zero blend)
and scale_word / scale_value (which form a group's step takes, and how it is read back).
"""
import pytest
import torch

from echo_tp import quant
from echo_tp.config import QuantSpec

POLICIES = ("zero_aware", "naive", "symmetric")


def _groups(x, spec):
    return x.to(torch.float32).reshape(-1, spec.group_size)


def step_bound(x, spec):
    """Per-element bound: (1/2 + |z16 - z| <= 2^-11 |z16| + tiny) steps, plus fp32 slack."""
    xg = _groups(x, spec)
    s, z = quant.group_params(xg, spec)
    sf = quant.scale_value(s).unsqueeze(-1)
    extra = 0.0 if z is None else (z.float().abs() * 2.0 ** -11 + 2.0 ** -20).unsqueeze(-1)
    return sf * (0.5 + extra) + xg.abs() * 2.0 ** -22


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_round_trip_within_half_step(policy, bits, dtype):
    spec = QuantSpec(bits=bits, quantizer=policy)
    for seed in range(3):
        g = torch.Generator().manual_seed(1000 * bits + seed)
        x = torch.randn(16, 8 * 128, generator=g)
        x[:, 5::97] *= 40.0                       # outlier channels
        x[3] += 7.0                               # a row of groups far from zero
        x = x.to(dtype)
        err = (quant.quant_dequant(x, spec) - x.float()).abs().reshape(-1, spec.group_size)
        assert torch.all(err <= step_bound(x, spec)), float((err - step_bound(x, spec)).max())


@pytest.mark.parametrize("policy", ("zero_aware", "symmetric"))
@pytest.mark.parametrize("bits", (4, 8))
def test_zero_is_exact(policy, bits):
    spec = QuantSpec(bits=bits, quantizer=policy)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(bits))
    idx = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(7))
    x[torch.arange(64), idx] = 0.0
    xh = quant.quant_dequant(x, spec)
    assert torch.all(xh[torch.arange(64), idx] == 0.0)


def test_naive_zero_is_not_exact():
    # the ablation baseline: the grid is anchored at the minimum, so 0 usually falls between codes
    spec = QuantSpec(bits=4, quantizer="naive")
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    x[:, 0] = 0.0
    assert (quant.quant_dequant(x, spec)[:, 0] != 0).sum() > 32


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_degenerate_groups_exact(policy, bits, dtype):
    spec = QuantSpec(bits=bits, quantizer=policy)
    g = torch.Generator().manual_seed(11)
    # constant groups with values fp16 can hold (random magnitudes and signs), plus all-zero
    v = (torch.randn(40, generator=g) * 10.0 ** torch.randint(-4, 4, (40,), generator=g))
    v = v.to(torch.float16).to(dtype)
    v[0] = 0.0
    v[1] = -0.0
    x = v.unsqueeze(1).expand(40, 128).contiguous()
    assert torch.equal(quant.quant_dequant(x, spec), x.float())


@pytest.mark.parametrize("policy", POLICIES)
def test_tiny_groups_keep_their_values(policy):
    # scales below fp16's normal range (2^-14): subnormal fp16 steps, still within the step bound
    spec = QuantSpec(bits=4, quantizer=policy)
    x = (torch.randn(8, 128, generator=torch.Generator().manual_seed(5)) * 1e-5)
    x = x.to(torch.bfloat16)
    s, _ = quant.group_params(_groups(x, spec), spec)
    assert torch.all(quant.scale_value(s) < 2.0 ** -14)
    xh = quant.quant_dequant(x, spec)
    assert torch.all((xh - x.float()).abs().reshape(-1, 128) <= step_bound(x, spec))
    assert torch.all(xh.abs().amax(-1) > 0)          # not flushed to zero
    # below fp16's finest step a bf16 scale word keeps the error relative to the group's width
    t = torch.full((1, 128), 1e-7) + torch.linspace(0, 1e-9, 128)
    assert float((quant.quant_dequant(t, spec) - t).abs().max()) <= 2.0 ** -29  # was 2^-25
    assert torch.all((quant.quant_dequant(t, spec) - t).abs() <= step_bound(t, spec))
    assert quant.range_report(t, spec) == {"wide": 0, "tiny": 1, "floored": 0, "nonfinite": 0}
    # fp32 subnormal groups: the step is floored at 2^-126 (absolute error <= 2^-127)
    sub = torch.linspace(-1e-40, 1e-40, 128).unsqueeze(0)
    assert float((quant.quant_dequant(sub, spec) - sub).abs().max()) <= 2.0 ** -127
    assert quant.range_report(sub, spec)["floored"] == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_values_beyond_fp16_range(policy):
    spec = QuantSpec(bits=4, quantizer=policy)
    g = torch.Generator().manual_seed(9)
    x = (torch.rand(8, 128, generator=g) * 2e5 + 1e5).to(torch.bfloat16)  # all > 65504
    xh = quant.quant_dequant(x, spec)
    assert torch.isfinite(xh).all()
    assert torch.all((xh - x.float()).abs().reshape(-1, 128) <= step_bound(x, spec))
    # a group wider than 65504 * L takes a bf16 scale word: within its step, and reported
    w = torch.linspace(-3e7, 3e7, 128, dtype=torch.float32).unsqueeze(0).to(torch.bfloat16)
    wh = quant.quant_dequant(w, spec)
    assert torch.all((wh - w.float()).abs().reshape(-1, 128) <= step_bound(w, spec))
    assert quant.range_report(w, spec) == {"wide": 1, "tiny": 0, "floored": 0, "nonfinite": 0}


def _wide_and_tiny_groups(dtype, seed):
    """[40, 128] groups of every scale: +-3e6 ramps (issue 15), 1e30 and near-fp32-max groups
    (fp32/bf16), tiny ones (1e-12 .. 1e-35), one-sided and far-from-zero wide groups."""
    g = torch.Generator().manual_seed(seed)
    big = 3.0e38 if dtype != torch.float16 else 6.0e4
    mags = [3e6, 1e7, 1e30, 1e-12, 1e-20, 1e-35, 1e36, big, 1e5, 7e4] \
        if dtype != torch.float16 else [6e4, 3e4, 1e-5, 1e-7, 6e4, 1e4, 1e-6, 6e4, 1e3, 2e4]
    rows = [torch.linspace(-3e6, 3e6, 128) if dtype != torch.float16
            else torch.linspace(-6e4, 6e4, 128)]
    for i in range(39):
        m = mags[i % len(mags)]
        r = torch.randn(128, generator=g) * m / 4
        if i % 4 == 1:
            r = r.abs() + m / 2                    # one-sided
        elif i % 4 == 2:
            r = r * 1e-2 + m / 2                   # far from zero
        elif i % 4 == 3:
            r = r.clamp(-m, m) * 0 + m * 0.9       # constant
        rows.append(r.clamp(-big, big))
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32, torch.float16))
def test_every_finite_group_is_within_its_step(policy, bits, dtype):
    """Issue 15 item 2: groups wider than 65504 * L (and narrower than 2^-24 * L) used to keep
    the grid anchored at lo under a clamped scale (+-3e6 decoded into [-3.01e6, -2.03e6]);
    now every finite group's error is within its own step, symmetric around 0."""
    spec = QuantSpec(bits=bits, quantizer=policy)
    ramp = quant.quant_dequant(torch.linspace(-3e6, 3e6, 128), spec)
    assert float(ramp.min()) < -2.5e6 and float(ramp.max()) > 2.5e6
    for seed in range(3):
        x = _wide_and_tiny_groups(dtype, seed)
        xh = quant.quant_dequant(x, spec)
        assert torch.isfinite(xh).all()
        err = (xh - x.float()).abs().reshape(-1, spec.group_size)
        bound = step_bound(x, spec)
        assert torch.all(err <= bound), float((err - bound).max())
        # and that step is the group's own (width / L, or d / Z_MAX), rounded up by < 2^-7
        xg = _groups(x, spec).double()
        lo, hi = xg.amin(-1), xg.amax(-1)
        if policy == "symmetric":
            want = torch.maximum(lo.abs(), hi.abs()) / spec.qmax
        else:
            want = torch.maximum((hi - lo) / spec.levels,
                                 torch.clamp_min(torch.maximum(lo, -hi), 0) / quant.Z_MAX)
        s = quant.scale_value(quant.group_params(xg.float(), spec)[0]).double()
        vary = lo != hi
        assert torch.all(s[vary] >= want[vary] * (1 - 2 ** -22))
        assert torch.all(s[vary] <= want[vary] * (1 + 2 ** -7) + 2 ** -24)


def test_scale_word_forms_and_bits():
    """The scale word: fp16 (sign bit 0) inside [2^-24, 65504], unchanged bits; outside, sign
    bit 1 and the bf16 pattern of the step rounded up; fp16 NaN for non-finite groups."""
    s = torch.tensor([1.0, 65504.0, 2.0 ** -24, 65504.5, 1e30, 2.0 ** -25, 1e-40, 3.0, 1.0])
    finite = torch.tensor([True] * 8 + [False])
    w = quant.scale_word(s, finite)
    assert w.dtype == torch.float16
    bits = w.view(torch.int16).to(torch.int32) & 0xFFFF
    assert bits[[0, 1, 2, 7]].tolist() == [0x3C00, 0x7BFF, 0x0001, 0x4200]
    assert bits[8].item() == quant.NAN_WORD
    assert torch.all(bits[3:7] >= 0x8000)
    v = quant.scale_value(w)
    assert v[[0, 1, 2, 7]].tolist() == [1.0, 65504.0, 2.0 ** -24, 3.0] and v[8].isnan()
    assert torch.all(v[3:6] >= s[3:6]) and torch.all(v[3:6] <= s[3:6] * (1 + 2 ** -7))
    assert v[3].item() == 65536.0                                  # bf16 just above 65504
    assert v[6].item() == 2.0 ** -126                              # the floor
    assert ((bits[4] & 0x7FFF) << 16).item() == \
        quant.round_up_bf16_bits(torch.tensor([1e30])).item() << 16


@pytest.mark.parametrize("policy", POLICIES)
def test_normal_range_packets_keep_their_bits(policy):
    """Groups whose step fits fp16 encode exactly as before the tagged form existed: the scale
    word is round_up_fp16(s) itself (what the old format sent), codes and zeros follow."""
    spec = QuantSpec(bits=4, quantizer=policy)
    g = torch.Generator().manual_seed(21)
    x = torch.randn(64, 1024, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 2)
    xg = _groups(x, spec)
    s, _ = quant.group_params(xg, spec)
    lo, hi = xg.amin(-1), xg.amax(-1)
    if policy == "symmetric":
        old = torch.maximum(lo.abs(), hi.abs()) / spec.qmax
    else:
        old = torch.maximum((hi - lo) / spec.levels, torch.clamp_min(torch.maximum(lo, -hi), 0)
                            / quant.Z_MAX)
    assert bool(((old >= 2 ** -24) & (old <= 65504)).all())
    assert torch.equal(s.view(torch.int16), quant.round_up_fp16(old).view(torch.int16))
    assert bool((s.view(torch.int16) >= 0).all())                 # sign bit clear: fp16 form


@pytest.mark.parametrize("policy", POLICIES)
def test_extreme_groups_saturate_instead_of_overflowing(policy):
    """Groups at fp32's limits: the width hi - lo overflows fp32, the grid rounded up passes
    fp32 max; decoded values saturate at +-fp32 max, constant groups stay exact."""
    spec = QuantSpec(bits=4, quantizer=policy)
    fmax = torch.finfo(torch.float32).max
    x = torch.stack([torch.linspace(-1, 1, 128) * fmax, torch.linspace(0, 1, 128) * fmax,
                     torch.full((128,), torch.finfo(torch.bfloat16).max), torch.full((128,), -1e38),
                     torch.full((128,), 2.0 ** -130)])
    xh = quant.quant_dequant(x, spec)
    assert torch.isfinite(xh).all()
    err = (xh - x).abs().reshape(-1, spec.group_size)
    assert torch.all(err[:2] <= step_bound(x[:2], spec) + fmax * 2 ** -20)
    bf = x[2:4].to(torch.bfloat16).float()                       # constant bf16 values: exact
    assert torch.equal(quant.quant_dequant(bf, spec), bf)
    assert float(err[4].max()) <= 2.0 ** -127
    # every finite group's step lies in [2^-126, 2^126): 1/s is a normal fp32 (the kernels'
    # division by a scale relies on it)
    s = quant.scale_value(quant.group_params(torch.cat([x, bf]), spec)[0])
    assert bool(((s >= 2.0 ** -126) & (s < 2.0 ** 126)).all())


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bad", (float("nan"), float("inf"), float("-inf")))
def test_nonfinite_propagates_within_its_group(policy, bad):
    spec = QuantSpec(bits=4, quantizer=policy)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    x[1, 17] = bad
    xh = quant.quant_dequant(x.reshape(1, -1), spec).reshape(3, 128)
    assert torch.isnan(xh[1]).all()
    assert torch.isfinite(xh[0]).all() and torch.isfinite(xh[2]).all()


def test_pack4_layout():
    codes = torch.tensor([[1, 2, 15, 0, 7, 9]], dtype=torch.uint8)
    packed = quant.pack4(codes)
    assert packed.tolist() == [[0x21, 0x0F, 0x97]]
    assert torch.equal(quant.unpack4(packed), codes)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bits", (4, 8))
def test_wire_format_round_trip(policy, bits):
    spec = QuantSpec(bits=bits, quantizer=policy, group_size=256)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(2))
    p = quant.encode(x, spec)
    buf = quant.to_bytes(p)
    assert buf.shape == (3, spec.packet_bytes(1024))
    q = quant.from_bytes(buf, 1024, spec)
    assert torch.equal(quant.decode(q, spec), quant.decode(p, spec))
    if bits == 4 and policy != "symmetric":
        assert QuantSpec(bits=4, quantizer=policy).packet_bytes(128) == 68  # SPEC §2


def test_codes_use_the_documented_ranges():
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(4))
    sym = QuantSpec(bits=4, quantizer="symmetric")
    codes = quant.unpack4(quant.encode(x, sym).codes)
    assert codes.min() >= 1 and codes.max() <= 15   # -2^(b-1) never used
    asym = QuantSpec(bits=8, quantizer="zero_aware")
    codes = quant.encode(x, asym).codes
    assert codes.min() == 0 and codes.max() == 255


def test_spec_validation():
    with pytest.raises(ValueError):
        QuantSpec(bits=3)
    with pytest.raises(ValueError):
        QuantSpec(group_size=100)
    with pytest.raises(ValueError):
        QuantSpec(quantizer="fancy")
    with pytest.raises(ValueError):
        quant.encode(torch.zeros(100), QuantSpec())


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bits", (4, 8))
def test_outlier_word_semantics(policy, bits):
    """QuantSpec.outlier (module docstring): the largest |value| (+v before -v) travels as
    fp16 (RNE) at a marked slot, the grid spans the rest; no outlier (word 0, no marker, the grid over
    every value) outside fp16's normal range; NaN/Inf groups decode to NaN in every element,
    also where their codes (0) are the symmetric marker."""
    spec = QuantSpec(bits=bits, quantizer=policy, group_size=8, outlier=True)
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, -2.0, 3.0, -1024.5, 4.0, 1024.5, 0.5, 0.25],    # tie: +v takes it
                      [1.0, 2.0, 3.0, 65505.0, 4.0, 5.0, 6.0, 7.0],         # past fp16: none
                      [1e-5, 2e-5, -3e-5, 2.0 ** -15, 0.0, 0.0, 0.0, 1e-6],  # below 2^-14
                      [1.0, 2.0, nan, 300.0, 4.0, 5.0, 6.0, 7.0],
                      [1.0, 2.0, -inf, 300.0, 4.0, 5.0, 6.0, 7.0],
                      [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]])            # constant
    p = quant.encode(x, spec)
    codes = p.codes if bits == 8 else quant.unpack4(p.codes)
    codes = codes.reshape(6, 8)
    assert p.outlier.tolist() == [[1024.0], [0.0], [0.0], [0.0], [0.0], [3.0]]  # RNE
    assert (codes[0] == spec.marker).nonzero().flatten().tolist() == [5]
    assert (codes[5] == spec.marker).nonzero().flatten().tolist() == [0]
    assert not bool((codes[1:3] == spec.marker).any())
    y = quant.decode(p, spec)
    assert float(y[0, 5]) == 1024.0 and float(y[5, 0]) == 3.0
    assert y[3:5].isnan().all(), y[3:5]
    assert torch.equal(y[5], x[5])                                       # the rest: constant
    rest = [0, 1, 2, 3, 4, 6, 7]            # row 0 without its slot: the grid spans [-1024.5, 4]
    if policy == "symmetric":
        step = 1024.5 / spec.qmax
    else:
        assert spec.levels == (1 << bits) - 2
        step = (1024.5 + 4.0) / spec.levels
    assert bool(((y[0, rest] - x[0, rest]).abs() <= 0.6 * step).all())
    buf = quant.to_bytes(p)
    assert buf.shape == (6, spec.packet_bytes(8))
    assert torch.equal(quant.decode(quant.from_bytes(buf, 8, spec), spec).isnan(), y.isnan())

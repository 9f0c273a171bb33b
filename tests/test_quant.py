"""Quantizer reference (echo_tp.quant) against SPEC.md §3, on fresh random inputs.

Compared: quant_dequant(x) with x itself (error within the step bound), with hand-built groups
(constant, all-zero, tiny, huge, NaN/Inf) and with the packing layout written out by hand.
If a bound fails, look first at group_params (scale rounding up, Z_MAX widening, zero blend).
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
    sf = s.float().unsqueeze(-1)
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
    assert torch.all(s.float() < 2.0 ** -14)
    xh = quant.quant_dequant(x, spec)
    assert torch.all((xh - x.float()).abs().reshape(-1, 128) <= step_bound(x, spec))
    assert torch.all(xh.abs().amax(-1) > 0)          # not flushed to zero
    # below fp16's finest step the absolute error stays under 2^-25 (documented floor)
    t = torch.full((1, 128), 1e-7) + torch.linspace(0, 1e-9, 128)
    assert float((quant.quant_dequant(t, spec) - t).abs().max()) <= 2.0 ** -25 + 1e-12
    assert quant.range_report(t, spec)["floored"] == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_values_beyond_fp16_range(policy):
    spec = QuantSpec(bits=4, quantizer=policy)
    g = torch.Generator().manual_seed(9)
    x = (torch.rand(8, 128, generator=g) * 2e5 + 1e5).to(torch.bfloat16)  # all > 65504
    xh = quant.quant_dequant(x, spec)
    assert torch.isfinite(xh).all()
    assert torch.all((xh - x.float()).abs().reshape(-1, 128) <= step_bound(x, spec))
    # a group wider than 65504 * L saturates: finite, clipped to the grid, and reported
    w = torch.linspace(-3e7, 3e7, 128, dtype=torch.float32).unsqueeze(0).to(torch.bfloat16)
    wh = quant.quant_dequant(w, spec)
    assert torch.isfinite(wh).all() and wh.abs().max() > 1e5
    assert quant.range_report(w, spec)["saturated"] == 1


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

"""The outlier word (QuantSpec.outlier, quant.py's module docstring) against its definition, on
fresh random inputs with massive values.

Compared: quant_dequant(x) with x itself (the outlier slot carries x's fp16 rounding, every
other value lies within half a step of the grid built from the other g-1 values), the marked
slots with each group's largest |value| (+|v| before -|v|, then the first index), the wire layout with packet_bytes, the
groups that take no outlier (zero, tiny, beyond fp16, NaN/Inf) with their defined answers,
and the quantized all-reduce with the word on simulated ranks against real gloo ranks, bit for
bit. If the grid bound fails, look first at quant.outlier_slots (which slot) and
group_params(..., slots) (lo, hi of the other values); if the wire fails, to_bytes/from_bytes.
"""
import pytest
import torch

from echo_tp import EchoConfig, SimulatedCommunicator, quant
from echo_tp.config import QuantSpec
from harness import run_ranks

POLICIES = ("zero_aware", "naive", "symmetric")


def massive(rows: int, n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Gaussian rows with a few channels 100-1000x larger (as LLM massive activations)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    ch = torch.randperm(n, generator=g)[: n // 100 + 1]
    x[:, ch] *= 100.0 + 900.0 * torch.rand(len(ch), generator=g)
    return x.to(dtype)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_outlier_slot_and_grid(policy, bits, dtype):
    spec = QuantSpec(bits=bits, quantizer=policy, outlier=True)
    for seed in range(3):
        x = massive(8, 1024, 100 * bits + seed, dtype)
        xg = x.float().reshape(-1, spec.group_size)
        slots = quant.outlier_slots(xg)
        # the largest |value| of every (finite, normal-range) group, +|v| before -|v|, then
        # its first index
        m = xg.abs().amax(-1, keepdim=True)
        v = torch.where((xg == m).any(-1, keepdim=True), m, -m)
        first = (xg == v).to(torch.uint8).argmax(-1)
        assert torch.equal(slots.float().argmax(-1), first) and torch.all(slots.sum(-1) == 1)
        y = quant.quant_dequant(x, spec).reshape(xg.shape)
        assert torch.equal(y[slots], xg[slots].half().float())
        scale, zero = quant.group_params(xg, spec, slots)
        step = quant.scale_value(scale).unsqueeze(-1).expand_as(xg)
        rest = ~slots
        slack = 0.5 + (0.0 if zero is None else 2.0 ** -10)
        assert torch.all((y - xg).abs()[rest] <= step[rest] * slack + xg.abs()[rest] * 2.0 ** -20)


@pytest.mark.parametrize("policy", POLICIES)
def test_outlier_cuts_the_error_of_massive_groups(policy):
    x = massive(16, 2048, 7)
    plain = QuantSpec(bits=4, quantizer=policy)
    word = QuantSpec(bits=4, quantizer=policy, outlier=True)
    e_plain = (quant.quant_dequant(x, plain) - x).norm()
    e_word = (quant.quant_dequant(x, word) - x).norm()
    assert e_word < 0.5 * e_plain


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bits", (4, 8))
def test_outlier_wire_layout(policy, bits):
    spec = QuantSpec(bits=bits, quantizer=policy, outlier=True)
    x = massive(3, 512, 11)
    p = quant.encode(x, spec)
    buf = quant.to_bytes(p)
    assert buf.shape[-1] == spec.packet_bytes(512) == quant.packet_nbytes(512, spec)
    assert spec.packet_bytes(512) == QuantSpec(bits=bits, quantizer=policy).packet_bytes(512) \
        + 2 * 512 // spec.group_size
    back = quant.from_bytes(buf, 512, spec)
    assert torch.equal(quant.decode(back, spec), quant.decode(p, spec))
    codes = quant.unpack4(p.codes) if bits == 4 else p.codes
    marked = codes.reshape(3, -1, spec.group_size) == spec.marker
    assert torch.all(marked.sum(-1) == 1)
    assert spec.levels == ((1 << bits) - 2 if spec.has_zero else (1 << bits) - 1)


def test_groups_without_outlier():
    spec = QuantSpec(bits=4, outlier=True)
    g = spec.group_size
    x = torch.zeros(6, g)
    x[1] = 3.0                                   # constant: exact
    x[2, 5] = 1e-6                               # below fp16's normal range: no word
    x[3] = torch.linspace(-1, 1, g) * 1e6        # beyond fp16: no word, tagged bf16 scale
    x[4, 7] = float("nan")                       # NaN group: all NaN
    x[5, 9] = float("inf")
    y = quant.quant_dequant(x.reshape(-1), spec).reshape(x.shape)
    assert torch.equal(y[0], x[0]) and torch.equal(y[1], x[1])
    p = quant.encode(x.reshape(-1), spec)
    words = p.outlier.float()
    assert words[0] == 0 and words[2] == 0 and words[3] == 0 and words[4] == 0
    assert (y[2] - x[2]).abs().max() <= 1e-6 / spec.levels
    assert torch.isfinite(y[3]).all() and ((y[3] - x[3]).abs().max() <= 2e6 / spec.levels)
    assert torch.isnan(y[4]).all() and torch.isnan(y[5]).all()
    tie = torch.zeros(g)
    tie[[3, 40]] = -2.0                          # a tie: the first index takes the word
    assert quant.outlier_slots(tie.reshape(1, g))[0].nonzero().flatten().tolist() == [3]
    tie[50] = 2.0                                # +v and -v: +v takes it, wherever it sits
    assert quant.outlier_slots(tie.reshape(1, g))[0].nonzero().flatten().tolist() == [50]
    tie[60] = 2.0
    assert quant.outlier_slots(tie.reshape(1, g))[0].nonzero().flatten().tolist() == [50]


def test_outlier_config_and_spec():
    cfg = EchoConfig(bits=4, outlier=True)
    assert cfg.quant_spec().outlier and cfg.quant_spec().packet_bytes(128) == 64 + 6
    with pytest.raises(TypeError):
        EchoConfig(outlier=1)


def _qar_worker(rank, world, seed):
    import torch.distributed as dist
    from echo_tp import EchoCommunicator
    comm = EchoCommunicator.from_group(None, EchoConfig(bits=4, outlier=True))
    xs = massive(world, 3000, seed)
    out = []
    with comm.pass_scope("forward"):
        for k in range(3):
            out.append(comm.all_reduce(xs[rank] * (k + 1)))
    dist.barrier()
    return torch.stack(out)


def test_outlier_real_ranks_equal_simulated():
    seed = int(torch.randint(0, 10_000, ()))
    real = run_ranks(3, _qar_worker, seed)
    comm = SimulatedCommunicator(3, EchoConfig(bits=4, outlier=True))
    xs = massive(3, 3000, seed)
    with comm.pass_scope("forward"):
        sim = torch.stack([comm.all_reduce(xs * (k + 1)) for k in range(3)])
    for r in range(3):
        assert torch.equal(real[r], sim[:, r]), (seed, r)
        assert torch.equal(sim[:, r], sim[:, 0])
    exact = xs.sum(0)
    assert (sim[0, 0] - exact).norm() < 0.1 * exact.norm()

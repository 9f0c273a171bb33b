"""The simulated fast path (parallelize(..., sim_path='batched'), tp/batched.py) against the
per-shard path (sim_path='shards', the reference) and the single-device model, on the CPU.

What is compared with what:
- batched vs shards, the same model (fresh random weights, norms and biases away from 1 / 0) and
  batch, one training step (forward, cross-entropy backward, partial-grad sync), at bits 16, 4
  (the paper's fp32 pair, output residual) and 8 (the default state, local residual): logits,
  every virtual rank's gradients, the compensator state of both directions after the step, and
  every collective call of the step (direction, bits, the [P, ...] input it was given and the
  output it returned), bit for bit. Cases: Llama (with and without attention bias), Qwen3 (q/k
  norm) at P = 2, 4, 8 (kv heads replicated over 2 ranks at 8) and 2 kv heads over 4 ranks. The
  batched path must really run: the shards' own forwards are never called. Both compute at a
  rank's intra-op thread count (echo_tp.threads), whatever this process's.
- batched at 16 bits vs the single-device model: logits and every rank's slice of every
  gradient within tests/test_tp.py's tolerances (TP sums the same products in another grouping).
- `echo-tp train --simulate 2 --sim-path batched` vs `--sim-path shards`, bf16 autocast: the same
  losses, validation loss and per-row held-out NLLs (val_rows.json) at 16 bits and Echo 4-bit;
  with --compile (torch.compile swapped to the aot_eager backend: inductor takes half a minute
  per graph here) the block functions compile into one graph each, with the eager losses.
  The telemetry of sampled steps (--telemetry-every) is every call's row, finite.
- where the batched path cannot run (a KV cache while generating, sequence parallelism, a real
  rank), the shard loop runs (the same tokens / logits), or a ValueError says why.
On GPUs the batched matmuls may round differently (another cuBLAS kernel): there the paths agree
within float tolerance, which benchmarks/train_speed.py measures. Where to look first when the
bits differ: tp/batched.py (an op that is not the shard's op with a rank dim in front), then
SimExpand in tp/sites.py (the backward site's [P, ...] stack).
"""
import copy
import csv
import json
import os
import types

import pytest
import torch
import torch.nn.functional as F
from harness import perturbed_model, token_batch, two_timescale

from echo_tp import EchoConfig, SimulatedCommunicator
from echo_tp.models import ModelConfig
from echo_tp.models.transformer import MLP, Attention
from echo_tp.tp import batched, parallelize, rank_parameters, sync_partial_grads
from test_train_tools import data, train  # noqa: F401  (the token-file fixture)

CASES = [("tiny-llama", {}, 2), ("tiny-llama", {"attention_bias": True}, 2),
         ("tiny-qwen3", {}, 2), ("tiny-qwen3", {}, 4), ("tiny-qwen3", {}, 8),
         ("tiny-qwen3", {"n_kv_heads": 2}, 4)]
CONFIGS = [dict(bits=16), dict(bits=4),
           dict(bits=8, beta1=0.0, beta2=0.0, state_dtype="bfloat16")]
LOGIT_ATOL, GRAD_ATOL, GRAD_RTOL = 1e-5, 2e-6, 1e-4


def build(preset: str, over: dict) -> torch.nn.Module:
    return perturbed_model(preset, over, 21)


def batch():
    return token_batch(23)


def run_step(model):
    x, y = batch()
    logits = model(x)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    if getattr(model, "echo_tp", None) is not None:
        sync_partial_grads(model)
    return logits.detach()


def recorded(comm) -> list:
    """Every all-reduce of comm, as (direction, bits, input, output), from now on."""
    calls = []
    real = comm._all_reduce

    def spy(x, direction, bits, inplace, boundary=None, output_map=None):
        r = real(x, direction, bits, inplace, boundary, output_map=output_map)
        calls.append((direction, bits, x.clone(), r.out.clone()))
        return r
    comm._all_reduce = spy
    return calls


@pytest.mark.parametrize("preset,over,P", CASES,
                         ids=[f"{p}{'-' + '-'.join(o) if o else ''}-P{P}" for p, o, P in CASES])
def test_batched_is_the_shard_loop_bit_for_bit(preset, over, P, monkeypatch):
    shard_calls = []
    for cls in (Attention, MLP):
        real = cls.forward
        monkeypatch.setattr(cls, "forward", lambda self, *a, _real=real, **k:
                            (shard_calls.append(1), _real(self, *a, **k))[1])
    for cfg in CONFIGS:
        got = {}
        for path in ("shards", "batched"):
            model = build(preset, over)
            comm = SimulatedCommunicator(P, two_timescale(**cfg))
            parallelize(model, comm, sim_path=path)
            calls = recorded(comm)
            shard_calls.clear()
            logits = run_step(model)
            ran_shards = len(shard_calls)
            grads = {r: {n: p.grad for n, p in rank_parameters(model, r).items()}
                     for r in range(P)}
            states = {d: {n: (s.m1, s.m2) for n, s in comm.passes[d].streams.items()}
                      for d in ("forward", "backward")}
            got[path] = logits, grads, states, calls, ran_shards
        (la, ga, sa, ca, na), (lb, gb, sb, cb, nb) = got["shards"], got["batched"]
        assert na == 2 * P * len(model.model.layers) and nb == 0, (cfg, na, nb)
        assert torch.equal(la, lb), cfg
        for r in range(P):
            assert ga[r].keys() == gb[r].keys()
            for name in ga[r]:
                assert torch.equal(ga[r][name], gb[r][name]), (cfg, r, name)
        for d in sa:
            assert sa[d].keys() == sb[d].keys()
            for n in sa[d]:
                assert all(torch.equal(a, b) for a, b in zip(sa[d][n], sb[d][n])), (cfg, d)
        assert len(ca) == len(cb) == 4 * len(model.model.layers)
        for k, (a, b) in enumerate(zip(ca, cb)):
            assert a[:2] == b[:2], (cfg, k)
            assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3]), (cfg, k, a[:2])


@pytest.mark.parametrize("P", [2, 4])
def test_batched_16_bits_matches_the_single_device_model(P):
    ref = build("tiny-qwen3", {})
    want = run_step(ref)
    ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    model = parallelize(build("tiny-qwen3", {}), SimulatedCommunicator(P, EchoConfig(bits=16)),
                        sim_path="batched")
    torch.testing.assert_close(run_step(model), want, atol=LOGIT_ATOL, rtol=0)
    tp = model.echo_tp
    for r in range(P):
        for name, p in rank_parameters(model, r).items():
            full = ref_grads[name]
            if name in tp.shards:
                dim, idx, _ = tp.shards[name]
                full = full.index_select(dim, idx[r])
            torch.testing.assert_close(p.grad, full, atol=GRAD_ATOL, rtol=GRAD_RTOL)


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("comm", ["16", "echo4"])
def test_trainer_sim_path_batched_gives_the_shard_losses(data, tmp_path, comm):  # noqa: F811
    args = ("--steps", "4", "--amp", "--device", "cpu", "--simulate", "2", "--comm", comm,
            "--bos", "--eval-every", "2")
    shards = train(data, tmp_path / "s", *args)
    fast = train(data, tmp_path / "b", *args, "--sim-path", "batched", "--telemetry-every", "3")
    assert [r["loss"] for r in fast] == [r["loss"] for r in shards]
    assert [r["val_loss"] for r in fast] == [r["val_loss"] for r in shards]
    assert [r["grad_norm"] for r in fast] == [r["grad_norm"] for r in shards]
    got = json.loads((tmp_path / "b/val_rows.json").read_text())
    assert got == json.loads((tmp_path / "s/val_rows.json").read_text())
    nll, tokens = torch.tensor(got["nll"]), torch.tensor(got["tokens"])
    assert got["step"] == 4 and len(nll) == 2 * 4                # 2 eval batches of 4 rows
    means = [float(nll[i:i + 4].sum() / tokens[i:i + 4].sum()) for i in (0, 4)]
    assert sum(means) / 2 == pytest.approx(float(fast[-1]["val_loss"]), rel=1e-6)
    assert json.loads((tmp_path / "b/train_config.json").read_text())["sim_path"] == "batched"
    tel = _rows(tmp_path / "b/telemetry.csv")
    L = ModelConfig.from_name("tiny-llama").n_layers
    assert sorted({int(r["step"]) for r in tel}) == [1, 4]       # steps 0 and 3 (0-based)
    for step in (1, 4):
        calls = [r for r in tel if int(r["step"]) == step]
        assert [r["direction"] for r in calls] == ["forward"] * 2 * L + ["backward"] * 2 * L
        assert all(float(r["rho_norm"]) >= 0 and float(r["y_sq"]) > 0 for r in calls)
    if comm == "echo4":                              # the rounding error is measured, not 0
        assert all(float(r["rho_norm"]) > 0 for r in tel)


def test_trainer_batched_compile_compiles_the_block_functions(data, tmp_path,  # noqa: F811
                                                               monkeypatch):
    compiled = []
    real = torch.compile

    def aot_eager(fn, **kw):
        compiled.append(fn.__name__)
        return real(fn, backend="aot_eager", **kw)
    monkeypatch.setattr(torch, "compile", aot_eager)
    args = ("--steps", "3", "--amp", "--device", "cpu", "--simulate", "2", "--comm", "echo4",
            "--sim-path", "batched", "--eval-every", "3")
    eager = train(data, tmp_path / "e", *args)
    assert compiled == []
    comp = train(data, tmp_path / "c", *args, "--compile")
    assert sorted(compiled) == ["add_norm_grads", "attention_partials", "mlp_partials"]
    for a, b in zip(comp, eager, strict=True):
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-6)
    assert float(comp[-1]["val_loss"]) == pytest.approx(float(eager[-1]["val_loss"]), rel=1e-6)


def test_where_the_batched_path_cannot_run(caplog):
    prompt = batch()[0][:, :4]
    ref = build("tiny-qwen3", {})
    cfg = two_timescale(bits=4)
    shards = parallelize(copy.deepcopy(ref), SimulatedCommunicator(2, cfg)).eval()
    fast = parallelize(copy.deepcopy(ref), SimulatedCommunicator(2, cfg), sim_path="batched")
    fast.eval()
    with caplog.at_level("INFO", logger="echo_tp.tp.parallelize"):
        assert torch.equal(fast.generate(prompt, 4), shards.generate(prompt, 4))
    assert any("KV cache" in why for why in fast.echo_tp.sim_fallbacks)
    assert sum("shard by shard" in r.message for r in caplog.records) == 1   # logged once
    x = torch.randint(0, 256, (2, 8))
    sp = [parallelize(copy.deepcopy(ref), SimulatedCommunicator(2, cfg), sim_path=path,
                      sequence_parallel=True) for path in ("shards", "batched")]
    assert torch.equal(sp[0](x), sp[1](x))
    assert sp[1].echo_tp.sim_fallbacks == {"sequence parallelism"}
    assert batched.block_kind(torch.nn.Linear(2, 2)) is None
    with pytest.raises(ValueError, match="sim_path must be one of"):
        parallelize(copy.deepcopy(ref), SimulatedCommunicator(2, cfg), sim_path="fast")
    real_rank = types.SimpleNamespace(world_size=2, simulated=False, config=cfg)
    with pytest.raises(ValueError, match="a real rank runs its own shard"):
        parallelize(copy.deepcopy(ref), real_rank, 0, sim_path="batched")
    with pytest.raises(ValueError, match="sim_path must be one of"):
        from echo_tp.train import TrainOptions
        TrainOptions(model="tiny-llama", train_data="x", sim_path="fast")


def test_rank_parameters_sees_reassigned_parameters():
    model = parallelize(build("tiny-qwen3", {}), SimulatedCommunicator(2, EchoConfig()),
                        sim_path="batched")
    name = "model.layers.0.mlp.gate_proj.weight"
    old = rank_parameters(model, 1)[name]
    shard = model.model.layers[0].mlp.shards[1].gate_proj
    shard.weight = torch.nn.Parameter(old.detach() * 2)
    assert rank_parameters(model, 1)[name] is shard.weight
    assert rank_parameters(model, 0)[name] is model.model.layers[0].mlp.shards[0].gate_proj.weight


@pytest.mark.parametrize("rdt,wdt", [(torch.float32, torch.float32),
                                     (torch.float32, torch.bfloat16),
                                     (torch.bfloat16, torch.bfloat16)])
def test_add_norm_grads_written_out_match_autograd(rdt, wdt):
    """The boundary backward the compiled batched path runs (sites.add_norm_grads, one graph)
    against the autograd form every other path runs, on fresh random inputs at mixed scales:
    the same dtypes, equal within float rounding (sums in another order)."""
    from echo_tp.tp.sites import _add_norm_backward, add_norm_grads
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    rows, h = 37, 96
    rout = (torch.randn(rows, h, generator=gen)
            * torch.exp(torch.randn(rows, 1, generator=gen) * 2)).to(rdt)
    weight = (1 + 0.3 * torch.randn(h, generator=gen)).to(wdt).requires_grad_()
    dnormed = torch.randn(rows, h, generator=gen).to(torch.promote_types(rdt, wdt))
    want_r, want_w = _add_norm_backward(rout, weight, 1e-6, dnormed, None)
    got_r, got_w = add_norm_grads(rout, weight.detach(), 1e-6, dnormed)
    assert got_r.dtype == want_r.dtype and got_w.dtype == want_w.dtype
    rtol = 2e-2 if rdt == torch.bfloat16 else 1e-5          # one bf16 rounding / fp32 sums
    for got, want in ((got_r, want_r), (got_w, want_w)):
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol,
                                   atol=rtol * want.float().abs().max().item())


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_column_product_is_the_batched_product_of_an_expanded_input(amp, monkeypatch):
    """batched.column_linear (one GEMM of the ranks' shared input, ColumnProduct) against
    batched.linear (the bmm over the rank dim) on fresh inputs: output, the input's gradient per
    rank and every rank's weight and bias gradients, bit for bit, in fp32 and under bf16
    autocast (the gradients in the inputs' fp32). An input that is not one row expanded goes to
    `linear` itself (ColumnProduct is not called)."""
    from echo_tp.tp import batched
    P, N, D, out = 4, 96, 64, 24
    gen = torch.Generator().manual_seed(11)
    x0 = torch.randn(N, D, generator=gen)
    w0 = [torch.randn(out, D, generator=gen) for _ in range(P)]
    b0 = [torch.randn(out, generator=gen) for _ in range(P)]
    g = torch.randn(P, N, out, generator=gen)

    def run(fn, xs_of, bias=False):
        x = x0.clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in w0]
        bs = [b.clone().requires_grad_() for b in b0] if bias else None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            xs = xs_of(x)
            xs.retain_grad()
            y = fn(xs, ws, bs)
        (y.float() * g).sum().backward()
        return [y.detach(), xs.grad, *[w.grad for w in ws], *[b.grad for b in bs or []]]

    def expanded(x):
        return SimExpandLike.apply(x, P)

    calls = []
    real = batched.ColumnProduct.apply
    monkeypatch.setattr(batched.ColumnProduct, "apply",
                        lambda *a: (calls.append(1), real(*a))[1])
    got = run(batched.column_linear, expanded)
    assert calls, "the column product did not run"
    want = run(batched.linear, expanded)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), k
    calls.clear()
    rows = run(batched.column_linear, lambda x: torch.stack([x * (r + 1) for r in range(P)]))
    biased = run(batched.column_linear, expanded, bias=True)
    assert not calls
    want = run(batched.linear, lambda x: torch.stack([x * (r + 1) for r in range(P)]))
    assert all(torch.equal(a, b) for a, b in zip(rows, want))
    want = run(batched.linear, expanded, bias=True)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(biased, want))


class SimExpandLike(torch.autograd.Function):
    """x [N, D] -> [P, N, D] expanded (stride 0 over P), as tp/sites.SimExpand gives it; the
    test reads the per-rank gradient with retain_grad (the backward here just sums it)."""

    @staticmethod
    def forward(ctx, x, P):
        return x.unsqueeze(0).expand(P, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.sum(0), None

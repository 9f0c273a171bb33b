"""echo_tp.vllm's sites and passes without vLLM (echo_tp/vllm/passes.py), on the CPU.

Compared:
- ECHO_VLLM's parsing (comm_spec): unset or empty is off; a bad spec, or a telemetry policy,
  is one ValueError naming the flag.
- Schedule.build against the TP engine's widths (tp.policy.site_width): a Llama-like module list
  (the embedding, then o_proj / down_proj per layer) gives 1 + 2L calls, the embedding at 16
  bits and site s at site_width's width under echo4, naive 4, 16 and early8; module lists it
  cannot number (a second embedding, an embedding after a layer, a third reducer in a layer, a
  layer out of order) are refused with the reason.
- PassRouter with a recording communicator: one pass_scope per forward, the calls' widths in
  schedule order, a fresh count per forward, calls outside a forward to the fallback (logged
  once), too many or too few calls per forward a RuntimeError, and a forward that raises leaves
  no pass open.
- PassRouter over a real EchoCommunicator on 2 gloo ranks: a forward's echo4 results equal the
  same calls made by hand in a pass_scope at the schedule's widths, bit for bit, and a second
  forward of the same inputs repeats them (fresh compensator state per forward).
- Post-norm families: the calls of sites behind a norm carry it (NormOutput), the embedding's
  none.
Where to look first: Schedule.build (numbering, widths), PassRouter.forward / all_reduce.
"""
import contextlib
import logging

import pytest
import torch

from echo_tp import EchoCommunicator
from echo_tp.tp.policy import parse_comm_spec, site_width
from echo_tp.vllm.passes import EMBEDDING, REDUCE, PassRouter, Schedule, comm_spec, layer_index
from harness import assert_bits_equal, run_ranks

L = 3


def llama_modules(n_layers: int = L, embedding: bool = True) -> list:
    """The TP-reducing modules of a vLLM Llama, in registration order."""
    mods = [("model.embed_tokens", EMBEDDING)] if embedding else []
    for layer in range(n_layers):
        mods += [(f"model.layers.{layer}.self_attn.o_proj", REDUCE),
                 (f"model.layers.{layer}.mlp.down_proj", REDUCE)]
    return mods


def schedule(spec: str = "echo4", modules=None, n_layers: int = L) -> Schedule:
    s = parse_comm_spec(spec)
    return Schedule.build(model="Llama", modules=llama_modules() if modules is None else modules,
                          n_layers=n_layers, plan=s.widths, bits=s.config.bits)


def test_comm_spec_from_the_flag(monkeypatch):
    monkeypatch.delenv("ECHO_VLLM", raising=False)
    assert comm_spec() is None
    monkeypatch.setenv("ECHO_VLLM", " ")
    assert comm_spec() is None
    monkeypatch.setenv("ECHO_VLLM", "echo4:eta=0")
    spec = comm_spec()
    assert spec.config.bits == 4 and spec.config.eta == 0 and spec.label == "echo4:eta=0"
    for bad, why in (("echo5", "unknown comm config 'echo5'"), ("echo4:foo=1", "unknown key"),
                     ("echo4:policy=telemetry@5.0", "calibration pass")):
        monkeypatch.setenv("ECHO_VLLM", bad)
        with pytest.raises(ValueError, match=f"ECHO_VLLM='{bad}'.*{why}"):
            comm_spec()


@pytest.mark.parametrize("spec", ["echo4", "4", "16", "early8", "echo4:edge_bits=0"])
def test_schedule_widths_are_the_tp_engines(spec):
    s, parsed = schedule(spec), parse_comm_spec(spec)
    plan = parsed.widths.resolved(L)
    sites = [site_width(plan, i, bits=parsed.config.bits, n_layers=L) for i in range(2 * L)]
    assert s.calls == 1 + 2 * L and s.embedding
    assert s.widths == (16, *sites)
    assert [s.site(k) for k in range(s.calls)] == [None, *range(2 * L)]
    if spec == "echo4":
        assert s.widths == (16, 8, None, None, None, None, 8)
    if spec == "4":
        assert s.widths == (16,) + (None,) * 6
    without = schedule(spec, llama_modules(embedding=False))
    assert without.widths == tuple(sites) and without.site(0) == 0
    with pytest.raises(IndexError):
        s.site(s.calls)


def test_schedules_it_cannot_number_are_refused():
    mods = llama_modules()
    cases = [
        (mods + [("lm_head_embed", EMBEDDING)], "at most one vocab-parallel embedding"),
        (mods[1:3] + mods[:1] + mods[3:], "at most one vocab-parallel embedding"),
        (mods + [("model.layers.2.mlp.experts", REDUCE)], "7 reducing row-parallel linears"),
        (mods[:1] + mods[3:5] + mods[1:3] + mods[5:], "expected one in layer 0"),
        ([(n.replace("layers.", "layers.0."), k) for n, k in mods], "'model.layers.0.0.self_"),
    ]
    for modules, why in cases:
        with pytest.raises(ValueError, match=why):
            schedule(modules=modules)
    assert layer_index("model.layers.12.mlp.down_proj") == 12
    assert layer_index("model.norm") is None and layer_index("a.1.b.2") is None


class Recorder:
    """A communicator that records passes and widths; its sum is x + 1."""

    def __init__(self, bits: int = 4):
        self.config = parse_comm_spec(str(bits)).config
        self.log = []
        self.open = False

    @contextlib.contextmanager
    def pass_scope(self, direction="forward"):
        assert not self.open
        self.open = True
        self.log.append("pass")
        try:
            yield self
        finally:
            self.open = False

    def all_reduce(self, x, *, bits=None, output_map=None):
        assert self.open
        self.log.append(bits)
        self.maps = getattr(self, "maps", []) + [output_map]
        return x + 1


def test_router_passes_and_widths(caplog):
    comm, fallback_calls = Recorder(), []
    router = PassRouter(comm, lambda x: fallback_calls.append(x) or x * 2)
    s = schedule()

    def forward(x, n=s.calls):
        for _ in range(n):
            x = router.all_reduce(x)
        return x

    x = torch.zeros(2, 8)
    assert torch.equal(router.forward(s, forward, x), x + s.calls)
    assert torch.equal(router.forward(s, forward, x), x + s.calls)
    assert comm.log == 2 * ["pass", *s.widths]
    with caplog.at_level(logging.WARNING, logger="echo_tp.vllm"):
        assert torch.equal(router.all_reduce(x + 1), x + 2)
        router.all_reduce(x)
    assert len(fallback_calls) == 2
    assert sum("outside a model forward" in r.message for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="made 6 TP all-reduces; its schedule has 7"):
        router.forward(s, forward, x, n=6)
    with pytest.raises(RuntimeError, match="made more than 7 TP all-reduces"):
        router.forward(s, forward, x, n=8)
    assert router.schedule is None and not comm.open

    def broken(x):
        router.all_reduce(x)
        raise KeyError("model failed")
    with pytest.raises(KeyError):
        router.forward(s, broken, x)
    assert router.schedule is None and not comm.open
    assert torch.equal(router.forward(s, forward, x), x + s.calls)


def test_post_norm_sites_pass_their_norm():
    """A post-norm family (Gemma's sandwich norms): each site's call carries the norm after it
    as a NormOutput (the error feedback's map into the residual stream); the embedding none."""
    norms = {site: torch.nn.RMSNorm(8) for site in range(2 * L)}
    spec = parse_comm_spec("echo4")
    s = Schedule.build(model="Gemma", modules=llama_modules(), n_layers=L, plan=spec.widths,
                       bits=spec.config.bits, norms=norms)
    assert s.norms == (None, *[norms[i] for i in range(2 * L)])
    assert schedule().norms == ()
    comm = Recorder()
    router = PassRouter(comm, fallback=None)

    def forward(x):
        for _ in range(s.calls):
            x = router.all_reduce(x)
        return x
    router.forward(s, forward, torch.zeros(2, 8))
    assert comm.maps[0] is None
    assert all(m is not None and torch.equal(m.gain, torch.ones(8)) for m in comm.maps[1:])


def _real_ranks(rank, world):
    spec = parse_comm_spec("echo4")
    s = Schedule.build(model="Llama", modules=llama_modules(), n_layers=L, plan=spec.widths,
                       bits=spec.config.bits)
    torch.manual_seed(rank)
    xs = [torch.randn(5, 256, dtype=torch.bfloat16) for _ in range(s.calls)]
    router = PassRouter(EchoCommunicator.from_group(None, spec.config), fallback=None)
    calls = iter(xs)

    def forward():
        return [router.all_reduce(next(calls)) for _ in range(s.calls)]
    first = router.forward(s, forward)
    calls = iter(xs)
    again = router.forward(s, forward)
    by_hand = EchoCommunicator.from_group(None, spec.config)
    with by_hand.pass_scope("forward"):
        want = [by_hand.all_reduce(x, bits=w) for x, w in zip(xs, s.widths)]
    return first, again, want


def test_router_over_a_real_communicator():
    for first, again, want in run_ranks(2, _real_ranks):
        for k, (a, b, w) in enumerate(zip(first, again, want)):
            assert_bits_equal(a, w, f"call {k}")
            assert_bits_equal(b, w, f"call {k}, second forward")

"""The routing policy (collective/routing.route) on the CPU: the decisions that matter, read
against the measured tables (collective/tuning.py), not restated from them.

  * never slower than the 16-bit path where measured: below a measured crossover no eager call
    takes p2p, from it every one does; a state size never measured faster stays on NCCL;
  * graph capture: uncompensated calls take p2p at every size past the one-shot cap (under
    'auto' the fused kernel thus runs only for captured uncompensated calls between the
    one-shot cap and the fused cap), compensated ones route as eagerly;
  * fallbacks carry their reason (no fast path, CPU tensors, unfit tensors or configs) and the
    dispatcher logs each decision once; a block boundary's residual goes only to a backend
    that adds it (p2p);
  * kernel plans: fused up to the fused cap, staged above; reduce/tail overlap only where
    measured (never compensated); tiles powers of two within the table's bounds;
  * every table entry names a record that exists in docs/results; the two user overrides;
  * reduce-scatter / all-gather calls (sequence parallelism, routing.route of a half's Call):
    p2p (staged,
    overlap off, the all-reduce's tile for the P*m values of the layout) for every quantized
    GPU call the kernels take under 'auto' and 'p2p', captured or not; the reference, saying
    why, for the rest (mode 'reference', no fast path, CPU tensors, bits 16, a chunk that is
    not whole quantization groups); the dispatcher routes, caches, logs once and hands the
    route to the backend's half.
Look first at collective/routing.route (_route_half for the halves) when a decision test fails,
at collective/tuning.py when a table test does.
"""
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from echo_tp.collective import routing, tuning
from echo_tp.collective.dispatch import Dispatcher, build_dispatcher
from echo_tp.collective.backend import COLLECTIVES, Backend
from echo_tp.collective.routing import Call, route
from echo_tp.communicator import SimulatedCommunicator
from echo_tp.config import EchoConfig
from harness import two_timescale

MiB = 1 << 20
FAST = {"p2p": None, "oneshot": None}               # an intra-node GPU group with both
SIZES = [1 << k for k in range(10, 32)] + [3 * MiB + 5, 65 * MiB - 2]
UNCOMP = two_timescale(bits=4, eta=0.0)
DEFAULT = EchoConfig()                              # one bf16 state tensor
FP32_PAIR = EchoConfig(beta1=0.7, beta2=0.3, state_dtype="float32")


def call(nbytes: int, cfg: EchoConfig = DEFAULT, P: int = 2, **kw) -> Call:
    kw.setdefault("on_gpu", True)
    return Call.of(nbytes // 2, 2, cfg, P, **kw)     # bf16


def test_never_p2p_below_a_measured_crossover_always_from_it():
    for (P, sb), m in tuning.P2P_MIN_BYTES.entries.items():
        cfg = {0: UNCOMP, 4: DEFAULT, 8: EchoConfig(beta1=0.7, beta2=0.3), 16: FP32_PAIR}[sb]
        assert routing.state_bytes(cfg) == sb
        for n in SIZES:
            r = route(call(n, cfg, P), "auto", FAST)
            fast = m.value is not None and n >= m.value
            assert (r.backend == "p2p") == fast, (P, sb, n, r)
            if not fast:
                assert r.backend in ("oneshot", "plain"), r        # exact 16-bit paths
                assert m.source in r.reason or "one-shot" in r.reason, r


def test_unmeasured_world_sizes_read_p2_and_unmeasured_states_stay_on_nccl():
    for P in (3, 4, 8):
        gate = tuning.P2P_MIN_BYTES.entries[(2, 0)].value
        assert route(call(gate, UNCOMP, P), "auto", FAST).backend == "p2p"
        assert route(call(gate // 2, UNCOMP, P), "auto", FAST).backend != "p2p"
    fp64 = EchoConfig(state_dtype="float64")              # no kernel keeps an fp64 state
    r = route(call(1 << 30, fp64), "auto", FAST)
    assert r.backend == "plain" and "float64" in r.reason
    one_fp32 = EchoConfig(state_dtype="float32")          # 8 bytes: measured at P=2
    assert route(call(1 << 30, one_fp32, 4), "auto", FAST).backend == "p2p"


def test_oneshot_takes_small_messages_of_any_bits():
    cap = tuning.ONESHOT_MAX_BYTES.entries[2].value
    for cfg in (DEFAULT, UNCOMP, EchoConfig(bits=16), EchoConfig(bits=8)):
        assert route(call(cap, cfg), "auto", FAST).backend == "oneshot"
        assert route(call(cap + 2, cfg), "auto", FAST).backend != "oneshot"
    assert route(call(2 * MiB, P=8), "auto", FAST).backend == "plain"   # unmeasured P: 1 MiB
    no_one = {"p2p": None, "oneshot": "one-shot cap 0"}
    assert route(call(4096), "auto", no_one).backend == "plain"
    assert route(call(1 << 30, EchoConfig(bits=16)), "auto", FAST).backend == "plain"


def test_graph_capture_takes_p2p_uncompensated_at_every_size():
    cap = tuning.ONESHOT_MAX_BYTES.entries[2].value
    fused_max = tuning.FUSED_MAX_BYTES.entries[2].value
    eager_fused = set()
    for n in SIZES:
        eager = route(call(n, UNCOMP), "auto", FAST)
        cap_r = route(call(n, UNCOMP, capturing=True), "auto", FAST)
        want = "oneshot" if n <= cap else "p2p"
        assert cap_r.backend == want, (n, cap_r)
        if eager.form == "fused":
            eager_fused.add(n)
        if cap_r.form == "fused":
            assert cap < n <= fused_max
        for cfg in (DEFAULT, FP32_PAIR):                   # compensated: as eagerly
            assert route(call(n, cfg, capturing=True), "auto", FAST).backend == \
                route(call(n, cfg), "auto", FAST).backend
    assert not eager_fused            # at P=2 eager 'auto' never reaches the fused kernel


def test_fallbacks_name_their_reason():
    r = route(call(1 << 30), "auto", {"p2p": "the group spans several nodes"})
    assert r.backend == "reference" and "several nodes" in r.reason
    r = route(call(1 << 30, on_gpu=False), "auto", FAST)
    assert r.backend == "reference" and "GPU" in r.reason
    r = route(call(1 << 30, tensor_unfit="x is not a contiguous 1-D tensor"), "auto", FAST)
    assert r.backend == "plain" and "contiguous" in r.reason
    r = route(call(1 << 30), "reference", FAST)
    assert r.backend == "reference" and "'reference'" in r.reason
    with pytest.raises(ValueError, match="mode"):
        route(call(1024), "fastest", FAST)


def test_forced_p2p_takes_every_call_its_kernels_can():
    for n in SIZES:
        for cfg in (DEFAULT, UNCOMP, FP32_PAIR):
            r = route(call(n, cfg), "p2p", FAST)
            assert r.backend == "p2p" and r.form in ("fused", "staged"), (n, r)
    assert route(call(4096, EchoConfig(bits=16)), "p2p", FAST).backend == "reference"
    assert route(call(4096, tensor_unfit="dtype torch.int8"), "p2p", FAST).backend == \
        "reference"


def test_kernel_plans():
    fused_max = tuning.FUSED_MAX_BYTES.entries[2].value
    shape = tuning.DEFAULT.shape
    for n in SIZES:
        for cfg in (DEFAULT, UNCOMP, two_timescale(bits=8, eta=0.0)):
            r = route(call(n, cfg), "p2p", FAST)
            assert r.form == ("fused" if n <= fused_max else "staged"), (n, r)
            assert r.num_warps == shape.num_warps[r.form == "fused"].value
            if r.form == "fused" or cfg.compensated:
                assert r.overlap == "off", (n, r)
            else:
                cap, _ = tuning.OVERLAP_LAUNCH_MAX_BYTES.lookup(cfg.bits)
                assert r.overlap == ("launch" if cap is None or n <= cap else "off"), (n, r)
            assert r.tile & (r.tile - 1) == 0 and r.step <= r.tile
            assert r.tile <= max(r.step, shape.tile_max.value) and r.tile >= cfg.group_size
    forced = routing.p2p_route(call(1 << 30), tuning.DEFAULT, "t", form="fused")
    assert forced.form == "fused" and forced.overlap == "off"
    with pytest.raises(ValueError, match="overlap"):
        routing.p2p_route(call(1 << 30, UNCOMP), tuning.DEFAULT, "t", overlap="stream")


def test_tile_shape_by_segment_length():
    """Powers of two between the step and tile_max, at least tiles_per_segment of them where
    the segment allows; larger segments never get smaller tiles."""
    shape = tuning.DEFAULT.shape
    for comp in (False, True):
        for fused in (False, True):
            prev = 0
            for seg in (1, 777, 100_000, 3_000_017, 16 << 20, 1 << 30):
                tile, step = routing.tile_shape(seg, comp, fused)
                assert step == shape.step_elems[comp].value
                assert tile & (tile - 1) == 0 and step <= tile <= max(step, shape.tile_max.value)
                assert tile == step or seg // tile >= shape.tiles_per_segment[fused].value
                assert tile >= prev
                prev = tile


def test_every_table_entry_names_an_existing_record():
    results = Path(__file__).resolve().parents[1] / "docs" / "results"
    entries = tuning.entries()
    assert len(entries) >= 15
    for name, m in entries:
        assert (results / m.source).is_file(), (name, m.source)
        assert m.measured, name


def test_user_overrides(monkeypatch):
    from echo_tp import envs
    t = tuning.DEFAULT.with_overrides(p2p_min_bytes=0, oneshot_max_bytes=0)
    assert route(call(4096, FP32_PAIR), "auto", FAST, t).backend == "p2p"
    assert "ECHO_P2P_MIN_BYTES" in route(call(4096, FP32_PAIR), "auto", FAST, t).reason
    for flag, read in (("ECHO_P2P_MIN_BYTES", envs.p2p_min_bytes),
                       ("ECHO_ONESHOT_MAX_BYTES", envs.oneshot_max_bytes)):
        monkeypatch.delenv(flag, raising=False)
        assert read() is None
        monkeypatch.setenv(flag, "123")
        assert read() == 123
        monkeypatch.setenv(flag, "-3")
        with pytest.raises(ValueError, match=flag):
            read()


def test_state_bytes():
    sb = routing.state_bytes
    assert sb(UNCOMP) == 0
    assert sb(FP32_PAIR) == 16                              # fp32 m1 + m2, read + write
    assert sb(EchoConfig(beta1=0.7, beta2=0.3)) == 8        # bf16 pair
    assert sb(EchoConfig(state_dtype="float32")) == 8       # one fp32 tensor
    assert sb(DEFAULT) == 4                                 # the default: one bf16 tensor


class _Recorder(Backend):
    def __init__(self, name):
        self.name, self.calls = name, []

    def run(self, x, cfg, *, state, backward, record, inplace=False, route=None):
        self.calls.append(route)
        return x, None


def test_dispatcher_routes_caches_and_logs_once(caplog):
    backends = {n: _Recorder(n) for n in ("reference", "plain", "p2p")}
    d = Dispatcher(backends, 2, mode="auto", available={"p2p": None, "oneshot": "off"},
                   device=torch.device("cpu"))
    x = torch.zeros(1024, dtype=torch.bfloat16)   # a CPU tensor: routed to the reference
    with caplog.at_level("INFO", logger="echo_tp.collective.dispatch"):
        for _ in range(3):
            d.run(x, DEFAULT, state=None, backward=False, record=False)
    assert len(backends["reference"].calls) == 3 and d.last_backend == "reference"
    assert sum("-> reference" in m for m in caplog.messages) == 1
    assert len(d._routes) == 1
    assert "not on this rank's GPU" in d.last_route.reason
    only = Dispatcher({"reference": backends["reference"]}, 2)   # no routing at all
    only.run(x, DEFAULT, state=None, backward=False, record=False)
    assert backends["reference"].calls[-1] is None and only.last_route is None


class _Adder(_Recorder):
    """A backend that adds the residual where it decodes y (as P2PBackend does)."""

    offers = COLLECTIVES | {"residual"}

    def run(self, x, cfg, *, state, backward, record, inplace=False, route=None, residual=None):
        self.calls.append((route, residual))
        return x if residual is None else residual + x, None


def test_dispatcher_gives_a_residual_only_to_backends_that_add_it():
    """adds_residual follows the route: a GPU call routed to p2p (a backend that adds it) says
    True and gets the residual; a CPU call (the reference) says False, and passing it one
    anyway is refused before anything runs; a dispatcher without routing asks its one
    backend."""
    backends = {"reference": _Recorder("reference"), "p2p": _Adder("p2p")}
    d = Dispatcher(backends, 2, mode="p2p", available={"p2p": None},
                   device=torch.device("cpu"))
    x, r = torch.ones(1024, dtype=torch.bfloat16), torch.full((1024,), 2.0, dtype=torch.bfloat16)
    assert not d.adds_residual(x, DEFAULT)                 # CPU tensor: the reference
    with pytest.raises(ValueError, match="does not add a residual"):
        d.run(x, DEFAULT, state=None, backward=False, record=False, residual=r)
    assert backends["reference"].calls == []
    p2p = routing.p2p_route(call(2048), tuning.DEFAULT, "as on a GPU")
    d.route = lambda x, cfg: p2p                           # the route a CUDA x gets
    assert d.adds_residual(x, DEFAULT)
    out, _ = d.run(x, DEFAULT, state=None, backward=False, record=False, residual=r)
    route, got = backends["p2p"].calls[-1]
    assert got is r and route.backend == "p2p" and torch.equal(out, r + x)
    assert Dispatcher({"reference": _Adder("reference")}, 2).adds_residual(x, DEFAULT)
    assert not Dispatcher({"reference": _Recorder("reference")}, 2).adds_residual(x, DEFAULT)


@pytest.fixture
def gloo_world():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_auto_on_cpu_is_the_reference(gloo_world, monkeypatch):
    monkeypatch.delenv("ECHO_BACKEND", raising=False)
    d = build_dispatcher(None, "auto")
    assert list(d.backends) == ["reference"]
    assert isinstance(d.available["p2p"], str) and d.available["p2p"]    # the reason
    with pytest.raises(RuntimeError, match="p2p.*unavailable"):
        build_dispatcher(None, "p2p")
    with pytest.raises(ValueError):
        build_dispatcher(None, "fastest")
    monkeypatch.setenv("ECHO_BACKEND", "reference")
    assert build_dispatcher(None, "auto").mode == "reference"


def half_call(kind: str, m: int, cfg: EchoConfig = DEFAULT, P: int = 2, **kw) -> Call:
    """The Call of a half's input on one rank: P*m values (reduce-scatter) or m (all-gather),
    bf16."""
    kw.setdefault("on_gpu", True)
    return Call.of(P * m if kind == "reduce_scatter" else m, 2, cfg, P, kind=kind, **kw)


def test_half_calls_take_p2p_where_the_kernels_take_them():
    """A quantized GPU half the kernels take goes to p2p under 'p2p' at every size, and under
    'auto' where the all-reduce of its P*m values would (from the measured crossover; inside
    capture uncompensated at every size), else to 'plain' (NCCL's 16-bit half, exact): staged,
    overlap off, the tile shape of the all-reduce of P*m values, so a reduce-scatter and an
    all-gather of one chunk size share their tile."""
    for P in (2, 4, 8):
        for m in (128, 3 * 128, 4096 * 257, 1 << 24):
            for cfg in (DEFAULT, UNCOMP, FP32_PAIR, EchoConfig(bits=8)):
                ar = Call.of(P * m, 2, cfg, P, on_gpu=True)
                want = routing.p2p_route(ar, tuning.DEFAULT, "the all-reduce of P*m values",
                                         form="staged", overlap="off")
                for kind in routing.HALVES:
                    for mode in ("auto", "p2p"):
                        for capturing in (False, True):
                            r = route(half_call(kind, m, cfg, P, capturing=capturing), mode,
                                      FAST)
                            ar_route = route(dataclasses.replace(ar, capturing=capturing),
                                             "auto", {"p2p": None})
                            if mode == "auto" and ar_route.backend != "p2p":
                                assert r.backend == "plain", (P, m, kind, r, ar_route)
                                assert "crossover" in r.reason or "never" in r.reason, r
                                continue
                            assert r.backend == "p2p", (P, m, kind, mode, r)
                            assert (r.form, r.overlap) == ("staged", "off"), r
                            assert (r.tile, r.step, r.num_warps) == \
                                (want.tile, want.step, want.num_warps), (P, m, kind, r)
                            assert kind.replace("_", "-") in r.reason
    r = route(half_call("all_gather", 4096, P=4), "p2p", FAST)
    assert "'p2p'" in r.reason


def test_half_calls_fall_back_to_the_reference_and_say_why():
    from echo_tp.kernels.fits import fits
    for kind in routing.HALVES:
        name = kind.replace("_", "-")
        c = half_call(kind, 4096)
        for mode, available, why in (("reference", FAST, "'reference'"),
                                     ("auto", {"p2p": "the group spans several nodes"},
                                      "several nodes"),
                                     ("p2p", {}, "not built")):
            r = route(c, mode, available)
            assert r.backend == "reference" and why in r.reason and name in r.reason, r
        for bad, why in ((half_call(kind, 4096, on_gpu=False), "GPU"),
                         (half_call(kind, 4096, EchoConfig(bits=16)), "bits=16")):
            for mode in ("auto", "p2p"):
                r = route(bad, mode, FAST)
                assert r.backend == "reference" and why in r.reason, (mode, r)
        # what the kernels cannot take: 'p2p' -> the quantized reference, 'auto' -> plain
        for bad, why in ((half_call(kind, 4096, EchoConfig(state_dtype="float64")), "float64"),
                         (half_call(kind, 4096, tensor_unfit="dtype torch.int8"), "int8")):
            for mode, backend in (("auto", "plain"), ("p2p", "reference")):
                r = route(bad, mode, FAST)
                assert r.backend == backend and why in r.reason, (mode, r)
        # a chunk of 300 values is not whole 128-value groups: the kernels' own reason
        x = torch.zeros(2 * 300 if kind == "reduce_scatter" else 300, dtype=torch.bfloat16)
        unfit = fits(kind, x, DEFAULT, world_size=2)
        assert unfit is not None and "whole number" in unfit, unfit
        r = route(half_call(kind, 300, tensor_unfit=unfit), "p2p", FAST)
        assert r.backend == "reference" and "whole number of 128-value groups" in r.reason, r
    with pytest.raises(ValueError, match="kind"):
        route(dataclasses.replace(half_call("all_gather", 128), kind="broadcast"))
    with pytest.raises(ValueError, match="mode"):
        route(half_call("all_gather", 128), "fastest", FAST)


class _HalfRecorder(_Recorder):
    def reduce_scatter(self, x, cfg, *, state, backward, route=None):
        self.calls.append(("reduce_scatter", route))
        return x[: x.numel() // 2]

    def all_gather(self, x, cfg, *, state, backward, route=None):
        self.calls.append(("all_gather", route))
        return torch.cat([x, x])


def test_dispatcher_routes_the_halves_and_logs_once(caplog):
    """CPU halves route to the reference (cached, logged once per decision); a route to p2p
    (as a GPU call's) reaches the p2p backend's half with its route; the simulated
    communicator's halves go to its one backend, saying why."""
    backends = {n: _HalfRecorder(n) for n in ("reference", "p2p", "plain")}
    d = Dispatcher(backends, 2, mode="auto", available={"p2p": None},
                   device=torch.device("cpu"))
    x = torch.zeros(1024, dtype=torch.bfloat16)
    with caplog.at_level("INFO", logger="echo_tp.collective.dispatch"):
        for _ in range(3):
            for kind in routing.HALVES:
                d.run_half(kind, x, DEFAULT, state=None, backward=False)
    assert [k for k, _ in backends["reference"].calls] == list(routing.HALVES) * 3
    assert all(r.backend == "reference" and "GPU" in r.reason
               for _, r in backends["reference"].calls)
    assert sum("-> reference" in m for m in caplog.messages) == 2    # once per kind
    assert len(d._routes) == 2 and d.last_backend == "reference"
    p2p = route(half_call("reduce_scatter", 512), "p2p", FAST)
    d.route = lambda x, cfg, kind="all_reduce", state=None: p2p     # the route a CUDA x gets
    y = d.run_half("reduce_scatter", x, DEFAULT, state=None, backward=False)
    assert backends["p2p"].calls == [("reduce_scatter", p2p)] and y.numel() == 512
    assert d.last_backend == "p2p" and d.last_route is p2p
    plain = route(half_call("all_gather", 512), "auto", FAST)
    assert plain.backend == "plain" and "crossover" in plain.reason  # small: NCCL's 16-bit
    d.route = lambda x, cfg, kind="all_reduce", state=None: plain
    y = d.run_half("all_gather", x, DEFAULT, state=None, backward=False)
    assert backends["plain"].calls == [("all_gather", plain)] and y.numel() == 2048
    sim = SimulatedCommunicator(2)
    caplog.clear()
    with caplog.at_level("INFO", logger="echo_tp.collective.dispatch"):
        for _ in range(2):
            sim.reduce_scatter(torch.zeros(2, 256))
    assert sum("reduce_scatter calls" in m and "-> reference" in m
               for m in caplog.messages) == 1
    assert sim.dispatcher.last_route.backend == "reference"   # simulated: its transport
    assert sim.dispatcher.last_backend == "simulated"


def test_every_backend_keeps_the_contract():
    """The five backends subclass collective/backend.Backend and say what they offer: the
    reference, plain and simulated-fused ones the three collectives, p2p the residual add too,
    the one-shot backend the all-reduce and the whole boundary; declining names the op, an
    unknown op is refused, and an op not offered raises instead of running."""
    from echo_tp.collective.backend import OFFERS
    from echo_tp.collective.dispatch import PlainBackend, TransportBackend
    from echo_tp.collective.oneshot import OneShotBackend
    from echo_tp.collective.p2p import P2PBackend
    from echo_tp.collective.simulated import SimTransport
    from echo_tp.collective.simulated_fused import FusedSimBackend
    offers = {TransportBackend: COLLECTIVES, PlainBackend: COLLECTIVES,
              FusedSimBackend: COLLECTIVES, P2PBackend: COLLECTIVES | {"residual"},
              OneShotBackend: {"all_reduce", "add_rmsnorm"}}
    for cls, want in offers.items():
        assert Backend in cls.__mro__ and cls.offers == want and want <= set(OFFERS), cls
    ref = TransportBackend(SimTransport(2))
    x = torch.zeros(2, 256)
    assert ref.declines("all_reduce", x, DEFAULT) is None
    assert "does not offer residual" in ref.declines("residual", x, DEFAULT)
    with pytest.raises(ValueError, match="op must be one of"):
        ref.declines("broadcast", x, DEFAULT)
    with pytest.raises(NotImplementedError, match="add_rmsnorm"):
        ref.run_add_rmsnorm(x, x, torch.ones(256), 1e-6)

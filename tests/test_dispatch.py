"""Backend dispatch on the CPU: the measured p2p crossover table and its override, and what
'auto' / 'p2p' / 'reference' build on a gloo group (p2p disables itself with a reason; asking
for it explicitly is a clear error). The GPU side (auto never slower than NCCL) is measured in
benchmarks/allreduce.py. Look first at collective/dispatch.build_dispatcher when this fails."""
import pytest
import torch.distributed as dist

from echo_tp.collective import p2p
from echo_tp.collective.dispatch import build_dispatcher
from harness import two_timescale


def test_crossover_table(monkeypatch):
    from echo_tp.config import EchoConfig
    monkeypatch.delenv("ECHO_P2P_MIN_BYTES", raising=False)
    sb = p2p.state_bytes
    assert sb(two_timescale(bits=4, eta=0.0)) == 0
    pair = dict(beta1=0.7, beta2=0.3)
    assert sb(EchoConfig(bits=4, **pair, state_dtype="float32")) == 16   # fp32 m1 + m2, r + w
    assert sb(EchoConfig(bits=4, **pair)) == 8                           # bf16 pair
    assert sb(EchoConfig(bits=4, state_dtype="float32")) == 8            # one fp32 tensor
    assert sb(EchoConfig(bits=4)) == 4                   # the default: one bf16 tensor
    assert p2p.crossover_bytes(2, 0) == 64 << 20
    assert p2p.crossover_bytes(2, 16) is None            # fp32 state: HBM-bound, never 5% faster
    assert p2p.crossover_bytes(2, 8) == p2p.crossover_bytes(2, 4) == 64 << 20   # bf16 states
    assert p2p.crossover_bytes(4, 0) == p2p.crossover_bytes(2, 0)   # unmeasured P
    assert p2p.crossover_bytes(2, 2) is None             # unmeasured state size: never
    monkeypatch.setenv("ECHO_P2P_MIN_BYTES", "0")
    assert p2p.crossover_bytes(2, 16) == 0
    monkeypatch.setenv("ECHO_P2P_MIN_BYTES", "lots")
    with pytest.raises(ValueError, match="ECHO_P2P_MIN_BYTES"):
        p2p.crossover_bytes(2, 0)


def test_overlap_policy(monkeypatch):
    """reduce and tail overlap only where measured faster (one launch: uncompensated 8-bit,
    and 4-bit up to 128 MiB); ECHO_P2P_OVERLAP forces a mode."""
    from echo_tp import envs
    mode, MB = p2p.overlap_mode, 1 << 20
    assert mode(two_timescale(bits=8, eta=0.0), 1024 * MB) == "launch"
    assert mode(two_timescale(bits=4, eta=0.0), 64 * MB) == "launch"      # one launch fewer
    assert mode(two_timescale(bits=4, eta=0.0), 128 * MB) == "launch"
    assert mode(two_timescale(bits=4, eta=0.0), 256 * MB) == "off"        # the tail's occupancy
    assert mode(two_timescale(bits=8), 1024 * MB) == "off"                 # compensated
    assert mode(two_timescale(bits=4), 64 * MB) == "off"
    for cfg in (two_timescale(bits=b, eta=e) for b in (4, 8) for e in (0.0, 0.75)):
        for nbytes in (MB, 1024 * MB):
            assert mode(cfg, nbytes) in envs.OVERLAP_MODES
    monkeypatch.delenv("ECHO_P2P_OVERLAP", raising=False)
    assert envs.p2p_overlap() is None
    for v in envs.OVERLAP_MODES:
        monkeypatch.setenv("ECHO_P2P_OVERLAP", v)
        assert envs.p2p_overlap() == v
    monkeypatch.setenv("ECHO_P2P_OVERLAP", "auto")
    assert envs.p2p_overlap() is None
    monkeypatch.setenv("ECHO_P2P_OVERLAP", "yes")
    with pytest.raises(ValueError, match="ECHO_P2P_OVERLAP"):
        envs.p2p_overlap()


def test_tile_shape_by_segment_length():
    """Tiles (values per flag and release) grow with the segment, between the step and
    TILE_MAX, powers of two, at least TILES_PER_SEGMENT of them when the segment allows."""
    ts = p2p.tile_shape
    assert ts(100_000, False, False) == (2048, 2048)           # small: the step
    assert ts(100_000, True, False) == (1024, 1024)            # compensated: 1024-value steps
    assert ts(16 << 20, False, False) == (8192, 2048)          # 64 MiB bf16 at P=2: 2048 tiles
    assert ts(256 << 20, True, False) == (p2p.TILE_MAX, 1024)  # 1 GiB at P=2: capped
    assert ts(4 << 20, False, True) == (16384, 2048)           # fused: 256 tiles per segment
    for seg in (1, 777, 3_000_017, 1 << 30):
        for comp in (False, True):
            for fused in (False, True):
                tile, step = ts(seg, comp, fused)
                assert tile & (tile - 1) == 0 and step <= tile <= max(step, p2p.TILE_MAX)
                assert tile == step or seg // tile >= p2p.TILES_PER_SEGMENT[fused]


def test_oneshot_cap_table(monkeypatch):
    from echo_tp.collective import oneshot
    monkeypatch.delenv("ECHO_ONESHOT_MAX_BYTES", raising=False)
    assert oneshot.max_bytes(2) == 16 << 20
    assert oneshot.max_bytes(8) == 1 << 20                  # unmeasured P: small cap
    monkeypatch.setenv("ECHO_ONESHOT_MAX_BYTES", "0")
    assert oneshot.max_bytes(2) == 0
    monkeypatch.setenv("ECHO_ONESHOT_MAX_BYTES", "-3")
    with pytest.raises(ValueError, match="ECHO_ONESHOT_MAX_BYTES"):
        oneshot.max_bytes(2)


def test_p2p_fused_env(monkeypatch):
    from echo_tp import envs
    monkeypatch.delenv("ECHO_P2P_FUSED", raising=False)
    assert envs.p2p_fused() is None
    monkeypatch.setenv("ECHO_P2P_FUSED", "0")
    assert envs.p2p_fused() is False
    monkeypatch.setenv("ECHO_P2P_FUSED", "maybe")
    with pytest.raises(ValueError, match="ECHO_P2P_FUSED"):
        envs.p2p_fused()


@pytest.fixture
def gloo_world():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_auto_on_cpu_is_the_reference(gloo_world, monkeypatch):
    monkeypatch.delenv("ECHO_BACKEND", raising=False)
    d = build_dispatcher(None, "auto")
    assert [b.name for b in d.backends] == ["reference"]
    with pytest.raises(RuntimeError, match="p2p.*unavailable"):
        build_dispatcher(None, "p2p")
    with pytest.raises(ValueError):
        build_dispatcher(None, "fastest")


def test_dispatcher_orders_state_calls_after_deferred_updates():
    """A backend that defers its compensator update (p2p, residual 'output') is waited for
    before any call that carries state, whichever backend then takes it; stateless calls
    don't wait."""
    import torch

    from echo_tp.collective.dispatch import Dispatcher
    calls = []

    class Deferring:
        name = "deferring"

        def wait_pending(self):
            calls.append("wait")

        def should_use(self, x, cfg):
            return False

        def close(self):
            pass

    class Taker:
        name = "taker"

        def should_use(self, x, cfg):
            return True

        def run(self, x, cfg, *, state, backward, record, inplace=False):
            calls.append("run")
            return x, None

        def close(self):
            pass

    d = Dispatcher([Deferring(), Taker()], 2)
    x, cfg = torch.zeros(4), two_timescale(bits=4)
    d.run(x, cfg, state=object(), backward=False, record=False)
    assert calls == ["wait", "run"] and d.last_backend == "taker"
    calls.clear()
    d.run(x, cfg, state=None, backward=False, record=False)
    assert calls == ["run"]

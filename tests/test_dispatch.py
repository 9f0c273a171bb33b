"""Backend dispatch on the CPU: the measured p2p crossover table and its override, and what
'auto' / 'p2p' / 'reference' build on a gloo group (p2p disables itself with a reason; asking
for it explicitly is a clear error). The GPU side (auto never slower than NCCL) is measured in
benchmarks/allreduce.py. Look first at collective/dispatch.build_dispatcher when this fails."""
import pytest
import torch.distributed as dist

from echo_tp.collective import p2p
from echo_tp.collective.dispatch import build_dispatcher


def test_crossover_table(monkeypatch):
    from echo_tp.config import EchoConfig
    monkeypatch.delenv("ECHO_P2P_MIN_BYTES", raising=False)
    sb = p2p.state_bytes
    assert sb(EchoConfig(bits=4, eta=0.0)) == 0
    assert sb(EchoConfig(bits=4)) == 16                  # fp32 m1 + m2, read and written
    assert sb(EchoConfig(bits=4, state_dtype="bfloat16")) == 8
    assert sb(EchoConfig(bits=4, beta1=0.0, beta2=0.0)) == 8             # one fp32 tensor
    assert sb(EchoConfig(bits=4, beta1=0.0, beta2=0.0, state_dtype="bfloat16")) == 4
    assert p2p.crossover_bytes(2, 0) == 64 << 20
    assert p2p.crossover_bytes(2, 16) is None            # fp32 state lost at every size
    assert p2p.crossover_bytes(4, 0) == p2p.crossover_bytes(2, 0)   # unmeasured P
    assert p2p.crossover_bytes(2, 2) is None             # unmeasured state size: never
    monkeypatch.setenv("ECHO_P2P_MIN_BYTES", "0")
    assert p2p.crossover_bytes(2, 16) == 0
    monkeypatch.setenv("ECHO_P2P_MIN_BYTES", "lots")
    with pytest.raises(ValueError, match="ECHO_P2P_MIN_BYTES"):
        p2p.crossover_bytes(2, 0)


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

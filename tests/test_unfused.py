"""The unfused compensator (collective/unfused.py: torch ops around an uncompensated all-reduce)
is the same computation as the fused output-residual path: y and the state match
compensated_all_reduce bit for bit over consecutive sites, on fresh random inputs."""
import os

import pytest
import torch

from echo_tp.collective.qar import compensated_all_reduce
from echo_tp.collective.simulated import SimTransport
from echo_tp.collective.unfused import unfused_output_compensated
from echo_tp.compensator import CompState
from harness import two_timescale

SEED = int(os.environ.setdefault("ECHO_TEST_SEED", str(int.from_bytes(os.urandom(4), "little"))))


@pytest.mark.parametrize("P,dtype,sdtype", [(2, torch.bfloat16, torch.float32),
                                            (4, torch.float16, torch.bfloat16)])
def test_unfused_output_residual_is_bit_identical(P, dtype, sdtype):
    n = 1000
    cfg = two_timescale(bits=4, residual="output", eta=0.75,
                     state_dtype="bfloat16" if sdtype == torch.bfloat16 else "float32")
    plain = cfg.replace(eta=0.0)
    t = SimTransport(P)
    fused, unfused = (CompState.zeros((P, n), "cpu", sdtype) for _ in range(2))
    g = torch.Generator().manual_seed(SEED + P)           # ECHO_TEST_SEED reproduces a failure
    for site in range(4):
        x = (torch.randn(P, n, generator=g) * torch.exp(torch.randn(P, 1, generator=g))).to(dtype)
        want, _ = compensated_all_reduce(x, cfg, t, state=fused)
        got = unfused_output_compensated(
            lambda xp: compensated_all_reduce(xp, plain, t, state=None)[0], x, cfg, unfused, P)
        assert got.dtype == x.dtype and torch.equal(got, want), site
        assert torch.equal(unfused.m1, fused.m1) and torch.equal(unfused.m2, fused.m2), site
    with pytest.raises(ValueError, match="output"):
        unfused_output_compensated(lambda v: v, x, cfg.replace(residual="local"), unfused, P)

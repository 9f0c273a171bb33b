"""Benchmark scaffolding that can be checked without GPUs: e2e.py's compute-only stand-in must
accept every keyword the TP sites pass to a communicator (a missing one crashed a device run),
and the all-reduce benchmark's table/plot helpers work on rows of the recorded shape."""
import inspect
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_identity_comm_takes_the_communicator_keywords():
    e2e = pytest.importorskip("e2e")
    from echo_tp.communicator import EchoCommunicator
    want = {n for n, p in inspect.signature(EchoCommunicator.all_reduce).parameters.items()
            if p.kind == p.KEYWORD_ONLY}
    have = set(inspect.signature(e2e.IdentityComm.all_reduce).parameters)
    assert want <= have, want - have
    x = object()
    assert e2e.IdentityComm(2).all_reduce(x, direction="backward", bits=8, inplace=True) is x


def test_allreduce_tables_and_plot(tmp_path):
    ar = pytest.importorskip("allreduce")
    rows = [{"bytes": b, "method": m, "ms": ms, "speedup": 1.0 / ms if m != "nccl16" else 1.0,
             "busbw_GBps": 1.0} for b in (1 << 20, 1 << 30)
            for m, ms in (("nccl16", 1.0), ("p2p4", 0.5), ("auto4", 0.9))]
    rows[-1]["backend"] = "p2p"
    md = ar.markdown(rows, 2)
    assert "| 1024 MB |" in md and "[p2p]" in md and "(2.00x)" in md
    assert ar.crossover(rows) == 1 << 20
    ar.plot(rows, 2, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000

"""Benchmark scaffolding that can be checked without GPUs: e2e.py's compute-only stand-in must
accept every keyword the TP sites pass to a communicator (a missing one crashed a device run),
the all-reduce and e2e benchmarks' table/plot helpers work on rows of the recorded shape, and
the one-GPU stage profile and the block-boundary benchmark run (under TRITON_INTERPRET on the
CPU)."""
import inspect
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")    # before triton.jit decorates anything

import pytest  # noqa: E402

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
    assert ar.small_iters(64 << 10, 50) == ar.SMALL_ITERS and ar.small_iters(1 << 30, 50) == 50
    md = ar.markdown(rows, 2)
    assert "| 1024 MB |" in md and "[p2p]" in md and "(2.00x)" in md
    assert ar.crossover(rows) == 1 << 20
    ar.plot(rows, 2, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_allreduce_method_table():
    """Every named method is one row of the table: a known kind, and for the p2p kinds a
    route the routing policy builds at every benchmarked size (forced form / overlap kept)."""
    ar = pytest.importorskip("allreduce")
    from echo_tp.collective import routing, tuning
    kinds = {"nccl", "oneshot", "reference", "p2p", "graph", "unfused", "auto"}
    assert set(ar.DEFAULT_METHODS) <= set(ar.METHODS)
    for name, m in ar.METHODS.items():
        assert m.kind in kinds, name
        if m.kind in ("p2p", "graph", "unfused", "reference", "auto"):
            assert m.cfg is not None, name
        if m.kind not in ("p2p", "graph"):
            continue
        for nbytes in ar.SIZES:
            call = routing.Call.of(nbytes // 2, 2, m.cfg, 4, on_gpu=True)
            r = routing.p2p_route(call, tuning.DEFAULT, "b", form=m.form, overlap=m.overlap)
            assert r.backend == "p2p" and (m.form is None or r.form == m.form), (name, r)
            if m.overlap and r.form == "staged":
                assert r.overlap == m.overlap, (name, r)
    with pytest.raises(SystemExit, match="unknown methods"):
        ar.main(world=2, methods=("p2p4@o2",))


def test_e2e_table_and_plot_with_a_subset_of_comms(tmp_path):
    e2e = pytest.importorskip("e2e")
    row = {"model": "llama-3-8b", "kind": "prefill", "batch": 4, "msg_mb": 64.0, "load": 0.0,
           "no-ar": 90.0, "nccl16": 100.0, "echo4bf": 95.0, "ar_share": 0.1,
           "amdahl_bound": 1.11, "speedup_nccl16": 1.0, "speedup_echo4bf": 100 / 95}
    meta = {"world_size": 2, "date": "2026-11-30", "gpus": "2x H200", "torch": "t",
            "triton": "t", "nccl": "n", "command": "c"}
    timed_calls = dict(row, ar_ms_nccl16=20.54, ar_ms_echo4=12.31)     # --call-times
    md = e2e.markdown([row, timed_calls], meta)
    assert "| 1.05 |" in md and "| - |" in md          # echo4bf shown, absent comms as '-'
    assert "| 20.5 / 12.3 |" in md and md.count("| 1.11 |  |") == 1   # blank without
    e2e.plot([row], meta, tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").stat().st_size > 0


def test_stage_profile_runs_on_the_cpu():
    """The all-reduce's stages and its two halves' (the reduce-scatter, the all-gather), and
    the routing's shape."""
    sp = pytest.importorskip("stage_profile")
    row = sp.stage_times(2, 4096, "c4-loc-bf16c", 1024, 4, reps=1, dev="cpu", step=256)
    assert row["step"] == 256 and row["sum_ms"] > 0 and row["part"] == "all_reduce"
    assert row["outlier"] is True                             # EchoConfig's default packet
    off = sp.stage_times(2, 1024, "u4", 512, 4, reps=1, dev="cpu", outlier=False)
    assert off["outlier"] is False and off["sum_ms"] > 0
    assert row["sum_ms"] == pytest.approx(row["entry_ms"] + row["reduce_ms"] + row["tail_ms"],
                                          abs=1e-3)
    for part, stages in (("reduce_scatter", ("entry", "reduce")), ("all_gather",
                                                                   ("encode", "tail"))):
        row = sp.stage_times(2, 1024, "u4", 512, 4, reps=1, dev="cpu", part=part)
        assert row["part"] == part and all(row[f"{s}_ms"] > 0 for s in stages), row
        assert row["sum_ms"] == pytest.approx(sum(row[f"{s}_ms"] for s in stages), abs=1e-3)
    tile, warps, step = sp.route_shape(4, 1 << 29, "c4-loc-bf16c")
    assert tile >= step > 0 and warps > 0


def test_stage_sass_counts_the_stage_kernels_with_and_without_the_outlier_word():
    """benchmarks/stage_sass.py compiles the entry for sm_90 without a GPU (a fresh
    interpreter without TRITON_INTERPRET: the compiled forms) and counts registers and
    main-path instructions per value; the outlier word costs instructions."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    rows = {}
    for word in ("on", "off"):
        proc = subprocess.run([sys.executable, str(root / "benchmarks" / "stage_sass.py"),
                               "--configs", "u4", "--stages", "entry", "--outlier", word],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows[word] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rows["on"]["outlier"] is True and rows["off"]["outlier"] is False
    assert rows["on"]["stage"] == "entry" and rows["on"]["registers"] > 0
    assert rows["on"]["per_value"] > rows["off"]["per_value"] > 0


def test_add_norm_boundary_runs_on_the_cpu():
    """benchmarks/add_norm.py's block-boundary part, tiny, under TRITON_INTERPRET: its
    exactness check holds (the all-reduce with the residual added where y is decoded, then the
    norm alone, == the all-reduce then add + RMSNorm, outputs and state) and every method is
    timed."""
    an = pytest.importorskip("add_norm")
    row = an.boundary_row(2, 2, 384, "c4", iters=1, dev="cpu")
    assert row["fused_equals_kernel"] and row["torch_residual_out_equal"], row
    assert row["torch_normed_max_diff"] < 0.05, row
    assert all(row[f"{m}_eager_ms"] > 0 for m in an.METHODS), row


def test_gpu_telemetry_matches_samples_to_phases(tmp_path):
    gt = pytest.importorskip("gpu_telemetry")
    smi = tmp_path / "smi.csv"
    smi.write_text("2026/11/30 03:46:20.100, 0, 1500, 3201, 690.5, 100, 40, 0x0000000000000004\n"
                   "2026/11/30 03:46:20.200, 0, 1700, 3201, 650.0, 100, 40, 0x0000000000000000\n"
                   "2026/11/30 03:46:21.100, 0, 1900, 3201, 300.0, 0, 40, 0x0000000000000001\n"
                   "garbage line\n")
    t0 = 1796010380.0   # 2026-11-30 03:46:20 UTC
    log = tmp_path / "e2e.log"
    log.write_text("noise\n" + json.dumps({"phase": "a", "t0": t0, "t1": t0 + 0.5}) + "\n"
                   + json.dumps({"phase": "b", "t0": t0 + 1.0, "t1": t0 + 1.2}) + "\n")
    rows = gt.summarize(gt.read_samples(str(smi)), gt.read_phases(str(log)))
    assert [(r["phase"], r["samples"]) for r in rows] == [("a", 2), ("b", 1)]
    assert rows[0]["sm_mhz"] == 1600 and rows[0]["throttled"] == 0.5
    assert rows[1]["throttled"] == 0.0                     # idle (bit 0) does not count
    assert "| a | 0 | 2 | 1600 | 670 | 50% |" in gt.markdown(rows)

"""benchmarks/perf_model.py (CPU, pure Python, reads docs/results/raw/): the fitted model holds
the P=2 calibration points within its stated error, its fitted rates are physical, its
predictions behave (monotone in size and link rate), and the bytes and kernel forms it assumes
are the ones the code moves and routes."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pm = pytest.importorskip("perf_model")
MiB = 1 << 20


@pytest.fixture(scope="module")
def model():
    floors = pm.Floors()
    points = pm.p2_points()
    params = pm.fit(floors, points)
    return floors, points, params


def _stated(nbytes):
    return pm.STATED_ERROR.get(nbytes, pm.STATED_ERROR["larger"])


def test_calibration_points_within_stated_error(model):
    floors, points, params = model
    rows = pm.calibration(params, floors, points)
    fitted = [r for r in rows if r["fitted"]]
    assert len(fitted) == params["points"] == 15      # 3 configs x 5 sizes, all present
    checked = 0
    for r in rows:
        if (r["config"], r["form"], r["bytes"]) == ("u8", "serial", 64 * MiB):
            continue   # one run, slower than its own 128 MiB call (named in STATED_ERROR)
        assert abs(r["rel_err"]) <= _stated(r["bytes"]), r
        checked += 1
    assert checked == len(rows) - 1 >= 24


def test_fit_is_physical(model):
    _, _, p = model
    sm = pm.link_ceilings()["sm_push_GBps"]
    assert 0.85 * sm <= p["R"] <= pm.link_ceilings()["ce_push_GBps"]  # at the measured link
    assert 0.0 < p["L"] < 0.1                                         # ms per call
    assert 0.8 < p["k_unc"] < 1.1 and 0.6 < p["k_comp"] < p["k_unc"]
    assert p["rms_rel_err"] < 0.07


def test_the_sum_form_needs_an_impossible_link(model):
    """Why the stage is max(floor, link): floor + link fits P=2 only with a link faster than
    the one measured, and at the measured link rate it fits worse."""
    _, points, p = model
    s = pm.fit(pm.Floors(), points, "sum")
    assert s["R"] > pm.link_ceilings()["ce_push_GBps"]
    held = pm.fit(pm.Floors(), points, "sum", pm.link_ceilings()["sm_push_GBps"])
    assert held["rms_rel_err"] > 1.5 * p["rms_rel_err"]


def test_predictions_monotone_in_size_and_link_rate(model):
    floors, points, p = model
    for P in pm.WORLDS:
        nccl = [pm.nccl_predict(P, s * MiB, points) for s in pm.SIZES_MIB]
        assert nccl == sorted(nccl) and len(set(nccl)) == len(nccl)
        for cfg in pm.CONFIGS:
            ms = [pm.predict(P, s * MiB, cfg, p, floors) for s in pm.SIZES_MIB]
            assert all(a < b for a, b in zip(ms, ms[1:])), (P, cfg, ms)
            for s in pm.SIZES_MIB:
                fast = pm.predict(P, s * MiB, cfg, {**p, "R": 2 * p["R"]}, floors)
                slow = pm.predict(P, s * MiB, cfg, {**p, "R": p["R"] / 2}, floors)
                base = pm.predict(P, s * MiB, cfg, p, floors)
                assert fast <= base < slow        # halving the link always shows at P>=2
                st = pm.stage_times(P, s * MiB, cfg, p, floors)
                assert st["entry"] >= st["link_ms"] and st["reduce"] >= st["link_ms"]


def test_nccl_ring_assumption(model):
    _, points, _ = model
    t2 = pm.nccl_predict(2, 1 << 30, points)
    assert t2 == points[("nccl", None, 1 << 30)]["median"]
    assert pm.nccl_predict(4, 1 << 30, points) == pytest.approx(1.5 * t2)
    assert pm.nccl_predict(8, 1 << 30, points) == pytest.approx(1.75 * t2)


def test_link_bytes_are_the_wire_bytes():
    from echo_tp.collective.qar import wire_bytes
    from echo_tp.config import QuantSpec
    for bits in (4, 8):
        for P in pm.WORLDS:
            for n in (32 << 20, 512 << 20, 3_000_017):
                assert 2 * pm.link_bytes(P, n, bits) == wire_bytes(n, P, QuantSpec(bits=bits))
    assert pm.packet_bytes(128, 4) == 68 and pm.packet_bytes(128, 8) == 132


def test_forms_are_the_routed_ones():
    """The model's one-launch / serial choice is routing's for every predicted call."""
    from echo_tp.collective import routing, tuning
    from echo_tp.config import EchoConfig
    assert pm.OVERLAP_LAUNCH_MAX == {b: m.value for b, m in
                                     tuning.OVERLAP_LAUNCH_MAX_BYTES.entries.items()}
    cfgs = {"u4": EchoConfig(bits=4, eta=0.0), "u8": EchoConfig(bits=8, eta=0.0),
            "c4": EchoConfig(bits=4)}
    for P in pm.WORLDS:
        for s in pm.SIZES_MIB:
            for name, cfg in cfgs.items():
                call = routing.Call.of(s * MiB // 2, 2, cfg, P, on_gpu=True)
                r = routing.route(call, "auto", {"p2p": None, "oneshot": None})
                assert (r.backend, r.form) == ("p2p", "staged"), (P, s, name, r)
                want = "launch" if r.overlap == "launch" else "serial"
                assert pm.route_form(s * MiB, name) == want, (P, s, name)


def test_old_floors_are_slower_and_extrapolation_is_marked(model):
    floors, _, _ = model
    for cfg in pm.CONFIGS:
        new, _ = floors.floor(2, 1 << 28, cfg, "new")
        old, _ = floors.floor(2, 1 << 28, cfg, "old")
        assert all(o < n for o, n in zip(old, new))          # issue 15 made every stage slower
        assert 1.05 < sum(new) / sum(old) < 1.25
    assert not floors.floor(8, 1 << 29, "u4")[1]
    assert floors.floor(8, 1 << 29, "u8")[1] and floors.floor(8, 1 << 29, "c4")[1]
    with pytest.raises(ValueError):
        floors.floor(4, 1 << 29, "u4", "old")


def test_cli_writes_json_and_markdown(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["perf_model.py", "--out", str(tmp_path)])
    pm.main()
    res = json.loads((tmp_path / "perf_model.json").read_text())
    assert len(res["predictions"]) == len(pm.WORLDS) * len(pm.SIZES_MIB) * len(pm.CONFIGS)
    md = (tmp_path / "perf_model.md").read_text()
    assert "| 4 | 1 GiB | " in md and "(ring)" in md and "| 8 | 64 MiB | " in md

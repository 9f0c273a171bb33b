"""The training study's tools on the CPU: studies/train_schedule_report.py on fabricated runs
whose held-out changes are known, and a dry run of benchmarks/train_speed.py on a tiny model.

What is compared with what:
- the report against the numbers the runs were made with: per-row held-out NLLs of 16-bit
  runs (two seeds) and of configs scaled by known factors (+1.0%, +0.2%, +0.6%, and one with
  row noise wide enough to straddle +0.5%): each change vs the same seed's 16-bit run, its
  paired-bootstrap interval containing the true factor, the verdict ('yes' / 'no' / 'not
  resolved'), a run stopped early marked, and the curves / telemetry PNGs written;
- train_speed.py's dry run (P=2, tiny-qwen3, CPU): every asked variant timed with positive
  tokens/s, the equivalence check bit for bit on the CPU (one step's logits and gradients, two
  steps' losses), the JSON written.
- train_real_llm.py's profile stage (tiny testbed-like rows, plain and simulated TP=2, on the
  CPU): both rows profiled over the asked steps with positive times, their categories summing to
  the row's total, the TP row compared with the plain one, profile.json merged over calls and
  profile.txt written.
Where to look first: train_schedule_report.summarize / change_vs (pairing by seed and rows),
then verdict; for the benchmark echo_tp.train.train_step / prepare_forward; for the profile
echo_tp/train/profile.py (the window), then train_real_llm.kernel_summary / compare.
"""
import csv
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "studies"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_schedule_report as report  # noqa: E402

ROWS, STEPS = 400, 120


def fake_run(root: Path, comm: str, seed: int, factor: float, noise: float = 0.0,
             steps: int = STEPS, telemetry: bool = False) -> Path:
    d = root / f"{comm}-{factor}-s{seed}"
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(100 + seed)
    tokens = torch.randint(300, 512, (ROWS,), generator=g).double()
    base = tokens * (4.0 + 0.3 * torch.rand(ROWS, generator=g, dtype=torch.float64))
    scale = factor + noise * torch.randn(ROWS, generator=torch.Generator().manual_seed(7 + seed),
                                         dtype=torch.float64)
    (d / "train_config.json").write_text(json.dumps(
        {"comm": comm, "seed": seed, "lr": 2e-3, "steps": STEPS, "sim_path": "batched"}))
    (d / "val_rows.json").write_text(json.dumps(
        {"step": steps, "nll": (base * scale).tolist(), "tokens": tokens.long().tolist()}))
    with open(d / "log.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "tokens", "lr", "loss", "grad_norm", "val_loss", "elapsed_s"])
        for s in range(1, steps + 1):
            w.writerow([s, s, 1e-3, (5 - s / steps) * factor, 1.0,
                        4.0 if s % 40 == 0 else "", s])
    if telemetry:
        with open(d / "telemetry.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "pass", "direction", "site", "bits", "y_sq", "rho_norm"])
            for s in (1, 51, 101):
                for direction in ("forward", "backward"):
                    for site in range(5):
                        w.writerow([s, 0, direction, site, 4, 100.0, 0.1 * (site + 1)])
    return d


def test_report_numbers_and_verdicts(tmp_path):
    runs = [fake_run(tmp_path, "16", s, 1.0) for s in (0, 1)]
    runs += [fake_run(tmp_path, "4", s, 1.01) for s in (0, 1)]
    good = [fake_run(tmp_path, "echo4", s, 1.002, noise=0.002, telemetry=s == 0)
            for s in (0, 1)]
    out = tmp_path / "report"
    summary = report.main([*map(str, runs + good), "--out-dir", str(out)])
    cfgs = summary["configs"]
    assert list(cfgs) == ["16", "4", "echo4"]
    for s in (0, 1):
        assert cfgs["4"]["seeds"][s]["change_pct"] == pytest.approx(1.0, abs=1e-9)
        lo, hi = cfgs["echo4"]["seeds"][s]["change_ci"]
        assert lo < 0.2 < hi and hi - lo < 0.1            # the true change, a tight interval
        assert cfgs["echo4"]["seeds"][s]["tail100_change_pct"] == pytest.approx(0.2)
    assert summary["verdict"].startswith("yes")
    assert cfgs["4"]["seed_range_pct"] == pytest.approx((1.0, 1.0))
    table = (out / "table.md").read_text()
    assert "| 4 | " in table and "+1.000%" in table and "within 0.5% of 16-bit: yes" in table
    assert (out / "curves.png").stat().st_size > 5000 and (out / "telemetry.png").is_file()
    tel = summary["telemetry"]["echo4 seed 0"]
    assert tel["forward"]["median_rel"] == pytest.approx([0.03, 0.03])
    assert tel["forward"]["max_rel"] == pytest.approx([0.05, 0.05])
    assert tel["backward"]["steps"] == [1, 101]

    bad = [fake_run(tmp_path / "bad", "echo4", s, 1.006) for s in (0, 1)]
    got = report.main([*map(str, runs[:2] + bad), "--out-dir", str(tmp_path / "r2")])
    assert got["verdict"].startswith("no")
    wide = [fake_run(tmp_path / "wide", "echo4", 0, 1.004, noise=0.08),
            fake_run(tmp_path / "wide", "echo4", 1, 1.004, noise=0.08, steps=STEPS - 20)]
    got = report.main([*map(str, runs[:2] + wide), "--out-dir", str(tmp_path / "r3")])
    assert got["verdict"].startswith("not resolved") and "stopped" in got["verdict"]
    assert "(stopped at 100/120)" in (tmp_path / "r3" / "table.md").read_text()
    with pytest.raises(ValueError, match="no 16-bit run"):
        report.main([*map(str, good), "--out-dir", str(tmp_path / "r4")])


def test_train_speed_dry_run(tmp_path):
    import train_speed
    out = tmp_path / "speed.json"
    result = train_speed.main(["--device", "cpu", "--model", "tiny-qwen3", "--simulate", "2",
                               "--batch-size", "2", "--seq-len", "16", "--warmup", "1",
                               "--windows", "1", "--window-steps", "1", "--check-steps", "2",
                               "--variants", "shards", "batched", "plain", "batched+graph",
                               "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert [r["variant"] for r in result["rows"]] == ["shards", "batched", "plain",
                                                      "batched+graph"]
    assert all(r["tokens_per_s"] > 0 and r["steps"] == 2 for r in result["rows"])
    assert result["rows"][1]["speedup_over_shards"] > 0
    assert result["rows"][0]["last_loss"] == result["rows"][1]["last_loss"]   # bit for bit
    # no CUDA device: the graph variant runs eagerly, says why, and trains the same
    assert "CUDA device" in result["rows"][3]["cuda_graph"]
    assert result["rows"][3]["last_loss"] == result["rows"][1]["last_loss"]
    eq = result["equivalence"][0]
    assert eq["logits_bit_identical"] and eq["grads_bit_identical"] and eq["comm"] == "echo4"
    assert len(eq["losses"]["batched"]) == 2 and eq["max_loss_rel_diff"] == 0


def test_real_llm_study_dry_run(tmp_path, monkeypatch):
    """studies/train_real_llm.py's probe and study stages on the CPU with the tiny GGUF Llama
    (converted to a folder, as `prep` does): the probe picks the LR of the lowest final held-out
    loss, every run trains, saves, and is evaluated with 16-bit communication and its own on the
    held-out tokens and on a text file."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    sys.path.insert(0, str(ROOT / "tests"))
    import train_real_llm as study
    from tiny_gguf import write_tiny_llama

    from echo_tp import cli
    from echo_tp.hf import gguf_to_hf
    write_tiny_llama(tmp_path / "m.gguf")
    gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf")
    words = "the quick brown fox jumps over the lazy dog and a cat sat on the mat".split()
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 16), ("val", 4)):
        (tmp_path / split).mkdir()
        for i in range(n):
            picks = torch.randint(0, len(words), (60,), generator=g).tolist()
            (tmp_path / split / f"d{i}.txt").write_text(" ".join(words[j] for j in picks))
        assert cli.main(["tokenize", str(tmp_path / split), "--tokenizer", str(tmp_path / "hf"),
                         "--out", str(tmp_path / f"smol-{split}.bin")]) == 0
    (tmp_path / "wiki.valid.raw").write_text((tmp_path / "val" / "d0.txt").read_text() * 4)
    for name, value in dict(DATA=tmp_path, MODEL=tmp_path / "hf", SEQ=32, ROWS=4,
                            CONFIGS=("16", "echo4"), SEEDS=(0,), PROBE_LRS=(1e-4, 3e-3),
                            PROBE_STEPS=6, TP=2, COMPILE=False, EVAL_WINDOWS=4,
                            TELEMETRY_EVERY=2).items():
        monkeypatch.setattr(study, name, value)
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    lr = study.probe(out)
    probe = json.loads((out / "probe.json").read_text())
    assert probe["lr"] == lr == min(study.PROBE_LRS, key=lambda v: probe["val_loss"][str(v)])
    study.study(out, lr, steps=4, budget=None)
    table = json.loads((out / "study.json").read_text())
    assert sorted(table) == ["16-s0", "echo4-s0"]
    assert set(table["echo4-s0"]) >= {"heldout_16", "heldout_echo4", "wiki_16", "wiki_echo4"}
    assert table["16-s0"]["steps"] == 4 and "heldout_echo4" not in table["16-s0"]
    assert (out / "echo4-s0" / "telemetry.csv").is_file()
    # the report: configs named without an LR factor (the study's LR is the base), evaluations
    study.main(["report", str(out / "16-s0"), str(out / "echo4-s0"), "--out-dir",
                str(tmp_path / "report")])
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert sorted(summary["configs"]) == ["16", "echo4"]
    evals = (tmp_path / "report" / "evals.md").read_text().splitlines()
    assert [r.split(" | ")[0] for r in evals[2:]] == ["| 16-s0", "| echo4-s0"]
    assert "-" not in [c.strip() for c in evals[3].split("|")[1:-1]]   # every cell filled
    # a second call adds its runs' rows to study.json
    study.study(out, lr, steps=2, budget=None, configs=("4",), seeds=(1,))
    table = json.loads((out / "study.json").read_text())
    assert sorted(table) == ["16-s0", "4-s1", "echo4-s0"] and table["4-s1"]["steps"] == 2
    # speed rows, some per call, merged; the testbed-like rows read the ids mod 8,192
    tiny = ["--model", "tiny-qwen3", "--model-field", "vocab_size=8192"]
    monkeypatch.setattr(study, "SPEED", {
        "smollm2-plain": (["--init-from", str(tmp_path / "hf")], 1, "16", False),
        "smollm2-tp3-graph": (["--init-from", str(tmp_path / "hf")], 2, "echo4", True),
        "testbed-plain": (tiny, 1, "16", False)})
    speed = out / "speed"
    study.speed(speed, 4, models=("testbed",), source=tmp_path / "smol-train.bin")
    rows = study.speed(speed, 4, models=("smollm2",), source=tmp_path / "smol-train.bin")
    assert sorted(rows) == ["smollm2-plain", "smollm2-tp3-graph", "testbed-plain"]
    assert rows["testbed-plain"]["ratio_to_plain"] == 1.0
    assert rows["smollm2-tp3-graph"]["ratio_to_plain"] > 0
    assert "CUDA device" in rows["smollm2-tp3-graph"]["cuda_graph"]   # eager on the CPU
    assert all(r["steps"] == 4 and r["steady_from_step"] == 1 for r in rows.values())


def test_real_llm_profile_dry_run(tmp_path, monkeypatch):
    """studies/train_real_llm.py's profile stage on the CPU: the graph rows of SPEED (on the CPU
    they run eagerly, the reason recorded), each with its last steps under the profiler."""
    import numpy as np

    import train_real_llm as study
    from echo_tp.models.tokenize import write_tokens
    source = tmp_path / "tokens.bin"
    write_tokens(np.random.default_rng(0).integers(1, 8192, 40_000), source, vocab_size=8192,
                 meta={"eos_id": 0})
    tiny = ["--model", "tiny-qwen3", "--model-field", "vocab_size=8192"]
    monkeypatch.setattr(study, "SPEED", {
        "testbed-plain": (tiny, 1, "16", False),             # not a graph row: not profiled
        "testbed-plain-graph": (tiny, 1, "16", True),
        "testbed-tp2-graph": (tiny, 2, "echo4", True)})
    for name, value in dict(SEQ=32, ROWS=4, COMPILE=False, PROFILE_AFTER=1, TOP=5).items():
        monkeypatch.setattr(study, name, value)
    monkeypatch.chdir(ROOT)
    out = tmp_path / "profile"
    table = study.profile(out, steps=2, models=("testbed",), source=Path(study.RANDOM))
    rows = table["rows"]
    assert sorted(rows) == ["testbed-plain-graph", "testbed-tp2-graph"]
    for row in rows.values():
        assert row["device"] == "cpu" and row["steps"] == 2 and "CUDA device" in row["cuda_graph"]
        assert row["device_ms"] > 0 and row["wall_ms"] > 0 and row["kernels"] > 0
        assert len(row["top"]) == 5 and row["top"][0]["ms"] >= row["top"][-1]["ms"] > 0
        assert sum(c["ms"] for c in row["categories"].values()) == pytest.approx(row["device_ms"])
        assert row["categories"]["matmul"]["ms"] > 0 and 0 <= row["small"]["ms"] <= row["device_ms"]
    tp, plain = rows["testbed-tp2-graph"], rows["testbed-plain-graph"]
    c = table["compare"]["testbed-tp2-graph"]
    assert list(table["compare"]) == ["testbed-tp2-graph"] and c["plain"] == "testbed-plain-graph"
    assert c["device_ratio"] == pytest.approx(tp["device_ms"] / plain["device_ms"])
    assert tp["kernels"] > plain["kernels"]               # the simulated collectives' operators
    text = (out / "profile.txt").read_text()
    assert "testbed-tp2-graph vs testbed-plain-graph" in text and "matmul" in text
    # a second call adds its rows to profile.json
    monkeypatch.setattr(study, "SPEED", {"smollm2-plain-graph": (tiny, 1, "16", True)})
    table = study.profile(out, steps=1, models=("smollm2",), source=source)
    assert sorted(table["rows"]) == ["smollm2-plain-graph", "testbed-plain-graph",
                                     "testbed-tp2-graph"]
    assert table["rows"]["smollm2-plain-graph"]["steps"] == 1
    with pytest.raises(SystemExit, match="testbed rows only"):      # random ids: no SmolLM2 row
        study.profile(out, steps=1, models=("smollm2",), source=Path(study.RANDOM))


def test_speed_rows_by_model_or_name():
    import train_real_llm as study
    assert study.rows_named(("smollm2",)) == [n for n in study.SPEED if n.startswith("smollm2")]
    assert study.rows_named(("smollm2-tp3-graph", "testbed"), graph_only=True) == [
        "smollm2-tp3-graph", "testbed-plain-graph", "testbed-tp4-graph"]
    assert study.rows_named(("smollm2-plain-graph", "smollm2-tp3-graph")) == [
        "smollm2-plain-graph", "smollm2-tp3-graph"]


@pytest.mark.parametrize("at_once", [1, 2])
def test_launch_runs_at_most_at_once_commands(tmp_path, at_once):
    """The probe's and study's runs go at most `at_once` at a time (two or three SmolLM2 runs
    side by side ran out of an 80 GB GPU), each with its own log and return code."""
    import train_real_llm as study
    trace = tmp_path / "trace"
    step = ("import sys, time; t = open(sys.argv[1], 'a'); t.write('+'); t.flush(); "
            "time.sleep(0.3); t.write('-'); t.close(); sys.exit(int(sys.argv[2]))")
    runs = {f"r{i}": [sys.executable, "-c", step, str(trace), str(i % 2)] for i in range(4)}
    codes = study.launch(runs, tmp_path / "logs", at_once)
    assert codes == {"r0": 0, "r1": 1, "r2": 0, "r3": 1}
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [f"r{i}.log" for i in range(4)]
    depth = peak = 0
    for c in trace.read_text():
        depth += 1 if c == "+" else -1
        peak = max(peak, depth)
    assert peak <= at_once and depth == 0

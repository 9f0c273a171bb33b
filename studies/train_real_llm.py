"""Continued pretraining of a real LLM (SmolLM2-135M) at simulated TP=3 under Echo: the speed
record and the study, on one GPU.

    python studies/train_real_llm.py prep  --gguf /tmp/m/smollm2-135m-instruct-q4_1.gguf
    python studies/train_real_llm.py speed --out OUT        # plain vs TP=3, eager/graph
    python studies/train_real_llm.py profile --out OUT [--steps N]   # the graphed step's kernels
    python studies/train_real_llm.py probe --out OUT        # the LR, by held-out loss (16-bit)
    python studies/train_real_llm.py study --out OUT --lr LR [--steps N]
    python studies/train_real_llm.py report RUNS... --out-dir docs/results/raw/DATE-train-llm

Data (made on the CPU machine, carried in .work/data; `prep` unpacks what is xz-packed):
  smol-train.bin: 96 Gutenberg books (../shared/data/gutenberg.tar.xz) tokenized with
  SmolLM2's tokenizer (15.38M tokens); smol-val.bin: the 12 books held out (1.33M tokens, whole
  books, the tokenizer's seeded choice); wiki.valid.raw: WikiText-2 validation text. Made by
    python studies/fetch_models.py --only smollm2 --hf --split-mib 40
    echo-tp tokenize GUTENBERG_DIR --tokenizer .work/models/smollm2-135m-instruct-q4_1 \
      --out .work/data/smol-train.bin --val-fraction 0.08 --seed 0
  then smol-train.val.{bin,json} renamed smol-val.{bin,json}, `xz -k smol-train.bin`, and the
  unpacked smol-train.bin moved out of .work/data (the folder travels whole).

prep converts the GGUF once into an HF folder (float32, the dequantized values exactly) that
every run reads with --init-from. Every run: seq 1024, 16 rows a step (16,384 tokens), bf16
autocast, AdamW, warmup then cosine to lr/10 at the last step; the simulated runs on the batched
path, compiled, with --cuda-graph.
- speed: one run at a time (the GPU alone), a short schedule each, steady tokens/s after step 1;
  the plain model (16 bits: no communication) against simulated TP=3 at the default Echo, each
  with and without the CUDA graph; the testbed at TP=4 likewise (random init, its 8k vocabulary:
  the token file's ids mod 8,192). Tokens/s counted after step 1, with a graph after its first
  replay. Writes speed.json (merged: `--models` runs some rows per call).
- profile: the graph rows of SPEED (plain and TP), one run at a time, each PROFILE_AFTER steps
  (compile, warm-up, capture, a replay) then --steps N (default PROFILE_STEPS) under
  torch.profiler (`train --profile-steps`); per row the device time per step, its kernels by
  CATEGORIES, the small ones (SMALL_US) and the TOP longest; per TP row its ratio to the plain
  row. Writes profile.json
  (merged, as speed.json) and profile.txt (the same, to read).
- probe: 16-bit TP=3 runs of PROBE_STEPS at each LR in PROBE_LRS, --at-once of them at a time
  (default 1: a graphed SmolLM2 run peaks at ~23 GiB allocated, and two or three side by side
  ran out of an H100's 80 GB); the LR with the lowest final held-out loss is the study's.
  Writes probe.json.
- study: comm configs 16, 4 (naive) and echo4 (the default) x seeds 0, 1 (the data order),
  --at-once at a time (the graphed steps are GPU-bound: side by side gains little), held-out
  loss every quarter, per-site error telemetry every TELEMETRY_EVERY steps, a bf16 checkpoint at
  the end; then every final checkpoint evaluated on the held-out books and on WikiText-2 with
  16-bit communication and with its own. Writes study.json and the run folders.
- report: studies/train_schedule_report.py's table (paired bootstrap over held-out rows against
  the same seed's 16-bit run), curves and telemetry plots, plus evals.md: each run's final
  checkpoint evaluated with 16-bit communication and with its own.
"""
from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(".work/data")
MODEL = Path("/tmp/m/smol-hf")
SEQ, ROWS = 1024, 16
CONFIGS = ("16", "4", "echo4")
SEEDS = (0, 1)
PROBE_LRS = (1e-4, 3e-4, 1e-3)
PROBE_STEPS = 150
STUDY_TOKENS = 10_000_000
TELEMETRY_EVERY = 100
TP = 3
COMPILE = True
RANDOM = "random"
"""--speed-data value: the testbed rows on seeded random ids (no token file)."""
EVAL_WINDOWS = 256
EVAL_TAGS = ("heldout", "wiki")
"""study: the evaluations' files, eval-TAG.json: the held-out books, WikiText-2."""
EVALS_AT_ONCE = 4
"""study: evaluations run side by side (each a few GiB; no compile)."""
SPEED = {  # name -> (model args, simulate, comm, graph)
    "smollm2-plain": (["--init-from", str(MODEL)], 1, "16", False),
    "smollm2-plain-graph": (["--init-from", str(MODEL)], 1, "16", True),
    "smollm2-tp3": (["--init-from", str(MODEL)], TP, "echo4", False),
    "smollm2-tp3-graph": (["--init-from", str(MODEL)], TP, "echo4", True),
    "testbed-plain": (["--model", "studies/testbed/model.json"], 1, "16", False),
    "testbed-plain-graph": (["--model", "studies/testbed/model.json"], 1, "16", True),
    "testbed-tp4": (["--model", "studies/testbed/model.json"], 4, "echo4", False),
    "testbed-tp4-graph": (["--model", "studies/testbed/model.json"], 4, "echo4", True),
}
PROFILE_STEPS = 3
PROFILE_AFTER = 5
"""profile: unprofiled steps first: the compile, graphed.WARM_STEPS (3) warm-up steps, the
capture and the first replay."""
TOP = 40
SMALL_US = 5.0
"""profile: kernels whose mean duration is below this many microseconds count as small (their
number, more than their time, says what launch gaps cost)."""
CATEGORIES = (  # (category, regex searched in a kernel's or CPU operator's name, any case):
    # the first that matches names the category; the echo ones are the package's Triton kernels
    ("echo all-reduce", r"^(entry|reduce|tail|reduce_tail|fused|amax|next_call|oneshot|"
                        r"quantize|dequantize)_kernel$"),
    ("echo add+norm", r"^rmsnorm_kernel$"),
    ("matmul", r"gemm|nvjet|cutlass|cublas|xmma|wgmma|splitk|gemv|^triton_tem_|"
               r"^aten::(mm|bmm|addmm|baddbmm|addbmm)$"),
    ("compiled fused", r"^triton_(poi|red|per)_"),   # inductor's elementwise, norm, reductions
    ("attention", r"flash|fmha|sdpa|attention|fort_native"),
    ("optimizer+clip", r"multi_tensor_apply|adam|_foreach_|lpnorm"),
    ("copy/cast/cat/fill", r"memcpy|memset|copy|cat|stack|fill|index|gather|scatter|zero_"),
    ("elementwise/norm", r"elementwise|reduce|norm|softmax|cross_entropy|nll_loss|embedding|"
                         r"^aten::"),
    ("other", r""),
)


def train_args(out: Path, *, model: list[str], simulate: int, comm: str, steps: int, lr: float,
               seed: int = 0, graph: bool = True, extra: tuple = (),
               data: tuple[Path, Path] | None = None) -> list[str]:
    train, val = data or (DATA / "smol-train.bin", DATA / "smol-val.bin")
    args = [sys.executable, "-m", "echo_tp.cli", "train", *model,
            "--train-data", str(train), "--val-data", str(val),
            "--seq-len", str(SEQ), "--batch-size", str(ROWS), "--steps", str(steps),
            "--lr", str(lr), "--warmup", str(max(1, min(10, steps // 20))), "--bos",
            *(["--compile"] if COMPILE else []), "--comm", comm, "--seed", str(seed),
            "--save-dtype", "bfloat16", "--out-dir", str(out), "--no-progress", *extra]
    if simulate > 1:
        args += ["--simulate", str(simulate), "--sim-path", "batched"]
    if graph:
        args.append("--cuda-graph")
    return args


def testbed_tokens(source: Path, out: Path, tokens: int = 2_000_000) -> Path:
    """The testbed's vocabulary is 8,192: its speed rows read the source's ids mod 8,192 (the
    content does not matter to tokens/s); source `random` (RANDOM): `tokens` seeded random
    ids, so the testbed rows need no data carried."""
    import numpy as np

    from echo_tp.models.tokenize import load_tokens, write_tokens
    if str(source) == RANDOM:
        ids = np.random.default_rng(0).integers(0, 8192, tokens, dtype=np.int64)
    else:
        ids = load_tokens(source).numpy().astype(np.int64) % 8192
    write_tokens(ids, out, vocab_size=8192, meta={"eos_id": 0, "source": Path(source).name})
    return out


def launch(runs: dict[str, list[str]], logs: Path, at_once: int = 1) -> dict[str, int]:
    """Run the commands, at most `at_once` at a time, in order -> name: return code."""
    logs.mkdir(parents=True, exist_ok=True)
    codes: dict[str, int] = {}
    running: dict[str, subprocess.Popen] = {}

    def reap(name: str) -> None:
        codes[name] = running.pop(name).wait()
        print(f"{name}: rc {codes[name]}", flush=True)

    for name, cmd in runs.items():
        while len(running) >= max(1, at_once):
            reap(next(iter(running)))
        with open(logs / f"{name}.log", "w") as f:
            running[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    while running:
        reap(next(iter(running)))
    return codes


def result(out: Path) -> dict:
    path = out / "result.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def prep(gguf: str) -> None:
    for packed in DATA.glob("*.xz"):
        target = packed.with_suffix("")
        if not target.exists():
            with lzma.open(packed) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
    if not (MODEL / "model.safetensors").is_file():
        from echo_tp.hf import gguf_to_hf
        gguf_to_hf(gguf, MODEL)
    print("prep done:", sorted(p.name for p in DATA.iterdir()), flush=True)


def rows_named(models: tuple[str, ...], graph_only: bool = False) -> list[str]:
    """SPEED rows picked by model ("smollm2": all its rows) or by name ("smollm2-tp3-graph")."""
    return [n for n in SPEED if (n in models or n.split("-")[0] in models)
            and (SPEED[n][3] or not graph_only)]


def row_data(out: Path, models: tuple[str, ...], source: Path | None) -> dict:
    """model -> (train, val) token files of its SPEED rows (source: default smol-train.bin;
    `random`: the testbed rows only, on random ids)."""
    source = source or DATA / "smol-train.bin"
    models = tuple({n.split("-")[0] for n in models})
    if str(source) == RANDOM and "smollm2" in models:
        raise SystemExit("--speed-data random serves the testbed rows only (--models testbed)")
    data = {"smollm2": (source, source)}
    if "testbed" in models:
        out.mkdir(parents=True, exist_ok=True)
        tb = testbed_tokens(source, out / "testbed-tokens.bin")
        data["testbed"] = (tb, tb)
    return data


def row_runs(out: Path, names: list[str], data: dict, steps: int, extra: tuple) -> dict:
    """SPEED rows -> their train commands (out/NAME, `steps` steps, data: row_data's)."""
    return {name: train_args(out / name, model=SPEED[name][0], simulate=SPEED[name][1],
                             comm=SPEED[name][2], steps=steps, lr=1e-4, graph=SPEED[name][3],
                             extra=extra, data=data[name.split("-")[0]])
            for name in names}


def speed(out: Path, steps: int, models: tuple[str, ...] = ("smollm2", "testbed"),
          source: Path | None = None) -> dict:
    """The SPEED rows of `models`, one run at a time (source: the token file read, default
    smol-train.bin); merged into OUT/speed.json, each row's ratio to the faster of its model's
    plain rows (with and without the graph)."""
    names = rows_named(models)
    runs = row_runs(out, names, row_data(out, models, source), steps, ("--eval-batches", "1"))
    launch(runs, out / "logs")
    path = out / "speed.json"
    rows = json.loads(path.read_text()) if path.is_file() else {}
    for name in names:
        rows[name] = {k: result(out / name).get(k) for k in
                      ("steady_tokens_per_s", "steady_from_step", "tokens_per_s", "steps",
                       "cuda_graph", "peak_gpu_mib", "seconds")}
    for model in ("smollm2", "testbed"):
        plain = max((r["steady_tokens_per_s"] or 0 for n, r in rows.items()
                     if n.startswith(f"{model}-plain")), default=0)
        for name, row in rows.items():
            if name.startswith(model) and plain and row["steady_tokens_per_s"]:
                row["ratio_to_plain"] = row["steady_tokens_per_s"] / plain
    path.write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps(rows, indent=2), flush=True)
    return rows


def category(name: str) -> str:
    return next(c for c, pattern in CATEGORIES if re.search(pattern, name, re.IGNORECASE))


def kernel_summary(raw: dict, cuda_graph: str | None) -> dict:
    """A run's profile.json (train/profile.py: totals over its window) -> per step: device and
    wall ms, kernels, the small ones (ms, calls), CATEGORIES (ms, calls), the TOP longest."""
    n, total = raw["steps"], raw["time_us"]
    cats = {c: {"ms": 0.0, "calls": 0.0} for c, _ in CATEGORIES}
    for r in raw["rows"]:
        cat = cats[category(r["name"])]
        cat["ms"] += r["us"] / 1e3 / n
        cat["calls"] += r["calls"] / n
    small = [r for r in raw["rows"] if r["us"] < SMALL_US * r["calls"]]
    top = [{"name": r["name"], "category": category(r["name"]), "calls": r["calls"] / n,
            "ms": r["us"] / 1e3 / n, "share": r["us"] / total if total else 0.0}
           for r in raw["rows"][:TOP]]
    return {"device": raw["device"], "steps": n, "cuda_graph": cuda_graph,
            "device_ms": total / 1e3 / n, "wall_ms": raw["wall_s"] * 1e3 / n,
            "kernels": sum(r["calls"] for r in raw["rows"]) / n,
            "small": {"ms": sum(r["us"] for r in small) / 1e3 / n,
                      "calls": sum(r["calls"] for r in small) / n},
            "categories": {c: v for c, v in cats.items() if v["calls"]}, "top": top}


def compare(rows: dict) -> dict:
    """TP row -> its model's plain row, the ratios of device and wall ms per step, and the ms
    per step each category adds."""
    out = {}
    for name, row in rows.items():
        model = name.split("-")[0]
        plain = next((n for n in rows if n.startswith(f"{model}-plain")), None)
        if plain is None or name == plain:
            continue
        p = rows[plain]
        out[name] = {"plain": plain, "device_ratio": row["device_ms"] / p["device_ms"],
                     "wall_ratio": row["wall_ms"] / p["wall_ms"],
                     "added_ms": {c: row["categories"].get(c, {}).get("ms", 0.0)
                                  - p["categories"].get(c, {}).get("ms", 0.0)
                                  for c, _ in CATEGORIES}}
    return out


def profile_text(table: dict) -> str:
    """profile.json to read: each TP row against its plain row by category, then every row's
    TOP kernels."""
    rows, lines = table["rows"], []
    unit = "device" if any(r["device"] == "cuda" for r in rows.values()) else "CPU self"
    lines.append(f"Kernel profile per training step ({unit} time; wall between two device "
                 f"syncs), {PROFILE_AFTER} unprofiled steps, then the profiled ones")
    for name, c in table["compare"].items():
        p, t = rows[c["plain"]], rows[name]
        lines += ["", f"{name} vs {c['plain']}: {unit} {t['device_ms']:.2f} / "
                      f"{p['device_ms']:.2f} ms = {c['device_ratio']:.2f}x; wall "
                      f"{t['wall_ms']:.2f} / {p['wall_ms']:.2f} ms = {c['wall_ratio']:.2f}x; "
                      f"kernels {t['kernels']:.0f} / {p['kernels']:.0f}",
                  f"  {'category':20} {'plain ms':>9} {'calls':>7} {'TP ms':>9} {'calls':>7} "
                  f"{'TP-plain':>9}"]
        for cat, _ in CATEGORIES:
            a, b = p["categories"].get(cat), t["categories"].get(cat)
            if a or b:
                a, b = a or {"ms": 0.0, "calls": 0}, b or {"ms": 0.0, "calls": 0}
                lines.append(f"  {cat:20} {a['ms']:9.3f} {a['calls']:7.0f} {b['ms']:9.3f} "
                             f"{b['calls']:7.0f} {c['added_ms'][cat]:+9.3f}")
        lines.append(f"  {'total':20} {p['device_ms']:9.3f} {p['kernels']:7.0f} "
                     f"{t['device_ms']:9.3f} {t['kernels']:7.0f} "
                     f"{t['device_ms'] - p['device_ms']:+9.3f}")
        lines.append(f"  {f'(< {SMALL_US:g} us each)':20} {p['small']['ms']:9.3f} "
                     f"{p['small']['calls']:7.0f} {t['small']['ms']:9.3f} "
                     f"{t['small']['calls']:7.0f} {t['small']['ms'] - p['small']['ms']:+9.3f}")
    for name, r in rows.items():
        lines += ["", f"{name} ({r['device']}, graph: {r['cuda_graph']}, {r['steps']} steps): "
                      f"{r['device_ms']:.3f} ms {unit}, {r['wall_ms']:.3f} ms wall, "
                      f"{r['kernels']:.0f} kernels per step; top {len(r['top'])}",
                  f"  {'ms':>8} {'share':>6} {'calls':>6}  {'category':20} name"]
        lines += [f"  {k['ms']:8.3f} {k['share']:6.1%} {k['calls']:6.1f}  {k['category']:20} "
                  f"{k['name'][:120]}" for k in r["top"]]
    return "\n".join(lines) + "\n"


def profile(out: Path, steps: int = PROFILE_STEPS,
            models: tuple[str, ...] = ("smollm2", "testbed"), source: Path | None = None) -> dict:
    """The graph rows of SPEED of `models` (plain and TP), one run at a time, their last `steps`
    steps under the profiler (module docstring); merged into OUT/profile.json, written out as
    OUT/profile.txt."""
    names = rows_named(models, graph_only=True)
    runs = row_runs(out, names, row_data(out, models, source), PROFILE_AFTER + steps,
                    ("--eval-batches", "1", "--profile-steps", str(steps)))
    for name in names:                     # a run that fails leaves no earlier run's file
        (out / name / "profile.json").unlink(missing_ok=True)
    launch(runs, out / "logs")
    path = out / "profile.json"
    rows = json.loads(path.read_text())["rows"] if path.is_file() else {}
    for name in names:
        raw = out / name / "profile.json"
        if raw.is_file():
            rows[name] = kernel_summary(json.loads(raw.read_text()),
                                        result(out / name).get("cuda_graph"))
    table = {"rows": rows, "compare": compare(rows)}
    path.write_text(json.dumps(table, indent=1) + "\n")
    text = profile_text(table)
    (out / "profile.txt").write_text(text)
    print(text, flush=True)
    return table


def probe(out: Path, at_once: int = 1) -> float:
    runs = {f"lr{lr:g}": train_args(out / f"lr{lr:g}", model=["--init-from", str(MODEL)],
                                    simulate=TP, comm="16", steps=PROBE_STEPS, lr=lr,
                                    extra=("--eval-every", str(PROBE_STEPS // 3)))
            for lr in PROBE_LRS}
    launch(runs, out / "logs", at_once)
    losses = {lr: result(out / f"lr{lr:g}").get("val_loss") for lr in PROBE_LRS}
    best = min((v, lr) for lr, v in losses.items() if v is not None and math.isfinite(v))[1]
    (out / "probe.json").write_text(json.dumps({"val_loss": {str(k): v for k, v in
                                                             losses.items()}, "lr": best}) + "\n")
    print("probe:", losses, "->", best, flush=True)
    return best


def study(out: Path, lr: float, steps: int, budget: float | None,
          configs: tuple[str, ...] | None = None, seeds: tuple[int, ...] | None = None,
          at_once: int = 1) -> None:
    """The runs of configs x seeds (default CONFIGS x SEEDS), `at_once` at a time, then their
    evaluations; their rows merged into OUT/study.json (a call may run some of the runs)."""
    extra = ["--eval-every", str(steps // 4)]
    if budget:
        extra += ["--time-budget", str(budget)]
    runs = {}
    for comm in configs or CONFIGS:
        for seed in SEEDS if seeds is None else seeds:
            tel = ["--telemetry-every", str(TELEMETRY_EVERY)] if comm != "16" else []
            runs[f"{comm}-s{seed}"] = train_args(
                out / f"{comm}-s{seed}", model=["--init-from", str(MODEL)], simulate=TP,
                comm=comm, steps=steps, lr=lr, seed=seed, extra=(*extra, *tel))
    t0 = time.time()
    launch(runs, out / "logs", at_once)
    print(f"training: {time.time() - t0:.0f} s", flush=True)
    evals = {}
    for name in runs:
        comm = name.rsplit("-s", 1)[0]
        ck = out / name / "checkpoints"
        last = max(ck.glob("step-*"), key=lambda p: int(p.name.split("-")[1]), default=None)
        if last is None:
            continue
        comms = ["16"] if comm == "16" else ["16", comm]
        for data, tag in ((DATA / "smol-val.bin", "heldout"), (DATA / "wiki.valid.raw", "wiki")):
            evals[f"{name}-{tag}"] = [
                sys.executable, "-m", "echo_tp.cli", "eval", "--model", str(last), "--data",
                str(data), "--bos", "--context", str(SEQ), "--comms", *comms, "--simulate",
                str(TP), "--batch-size", "8", "--max-windows", str(EVAL_WINDOWS), "--no-progress",
                "--out", str(out / name / f"eval-{tag}.json")]
    launch(evals, out / "logs", at_once=EVALS_AT_ONCE)
    merged = out / "study.json"
    table = json.loads(merged.read_text()) if merged.is_file() else {}
    for name in runs:
        r = result(out / name)
        row = {k: r.get(k) for k in ("steps", "tokens", "val_loss", "tail_loss",
                                     "steady_tokens_per_s", "stopped_by", "cuda_graph",
                                     "peak_gpu_mib", "seconds")}
        for tag in EVAL_TAGS:
            for label, res in evaluations(out / name, tag).items():
                row[f"{tag}_{label}"] = {"nll": res["nll"], "ppl": res["ppl"]}
        table[name] = row
    merged.write_text(json.dumps(table, indent=2) + "\n")
    print(json.dumps(table, indent=2), flush=True)


def evaluations(run: Path, tag: str) -> dict:
    """A run folder's eval-TAG.json -> comm label: its result (empty when it did not run)."""
    path = run / f"eval-{tag}.json"
    return {r["label"]: r for r in json.loads(path.read_text())["results"]} \
        if path.is_file() else {}


def evals_table(runs: list[Path]) -> str:
    """The study's evaluations (each run folder's eval-heldout.json / eval-wiki.json) as one
    markdown table: perplexity and mean NLL with 16-bit communication and with the run's own."""
    lines = ["| run | held-out ppl, 16-bit comm | held-out ppl, own comm | WikiText-2 ppl, "
             "16-bit comm | WikiText-2 ppl, own comm |", "|---|---|---|---|---|"]
    for run in runs:
        cells = []
        for tag in EVAL_TAGS:
            res = evaluations(run, tag)
            own = next((r for k, r in res.items() if k != "16"), res.get("16"))
            cells += [f"{r['ppl']:.3f} (NLL {r['nll']:.4f})" if r else "-"
                      for r in (res.get("16"), own)]
        lines.append(f"| {run.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("prep", "speed", "profile", "probe", "study", "report"))
    p.add_argument("runs", nargs="*")
    p.add_argument("--gguf", default="/tmp/m/smollm2-135m-instruct-q4_1.gguf")
    p.add_argument("--out", default="/tmp/train-llm")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--steps", type=int, default=None,
                   help="study: its steps (default: STUDY_TOKENS); profile: the steps profiled "
                        f"(default {PROFILE_STEPS})")
    p.add_argument("--speed-steps", type=int, default=40)
    p.add_argument("--budget", type=float, default=None)
    p.add_argument("--models", nargs="+", default=["smollm2", "testbed"],
                   choices=("smollm2", "testbed", *SPEED),
                   help="speed, profile: the rows of these models, or rows by name")
    p.add_argument("--speed-data", type=Path, default=None,
                   help="speed, profile: the token file read (default "
                        ".work/data/smol-train.bin; 'random': the testbed rows on random ids)")
    p.add_argument("--at-once", type=int, default=1,
                   help="probe, study: training runs at a time (default 1)")
    p.add_argument("--configs", nargs="+", default=None, help="study: a subset of CONFIGS")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="study: a subset of SEEDS")
    a = p.parse_args(argv)
    out = Path(a.out)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if a.stage == "prep":
        prep(a.gguf)
    elif a.stage == "speed":
        speed(out, a.speed_steps, tuple(a.models), a.speed_data)
    elif a.stage == "profile":
        profile(out, a.steps or PROFILE_STEPS, tuple(a.models), a.speed_data)
    elif a.stage == "probe":
        probe(out, a.at_once)
    elif a.stage == "study":
        lr = a.lr
        if lr is None:
            lr = json.loads((out / "probe.json").read_text())["lr"]
        steps = a.steps or math.ceil(STUDY_TOKENS / (SEQ * ROWS))
        study(out, lr, steps, a.budget, a.configs and tuple(a.configs),
              a.seeds and tuple(a.seeds), a.at_once)
    else:
        first = Path(a.runs[0]) / "train_config.json"      # the study's LR: every run's
        lr = a.lr or (json.loads(first.read_text())["lr"] if first.is_file() else None)
        out_dir = Path(a.out_dir or out / "report")
        subprocess.run([sys.executable, "studies/train_schedule_report.py", *a.runs,
                        "--out-dir", str(out_dir), *(["--base-lr", str(lr)] if lr else [])],
                       check=True)
        text = evals_table([Path(r) for r in a.runs])
        (out_dir / "evals.md").write_text(text)
        print(text, end="", flush=True)


if __name__ == "__main__":
    main()

"""Training study (paper Table 7 in kind) + the demo model, in one device call.

Every run trains the same model from the same init on the same batches with the same schedule
and steps; only the comm config (and, for one run, the peak LR) differs. Runs use simulated TP=4
(bit-identical to 4 real ranks, tests/test_tp.py), so each GPU hosts whole runs side by side.
The step count is set once from a short calibration so that every run ends inside the budget.

    python studies/train_study.py --data .work/data --out $OUT/train --budget-s 330

Writes OUT/<run>/log.csv (+ loss.png, checkpoints/step-N of the final weights), OUT/summary.json
and OUT/loss_curves.png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RUNS = [  # (name, comm spec, lr factor)
    ("16bit", "16", 1.0),
    ("echo4-output", "echo4-output", 1.0),                # the paper's setting
    ("echo4", "echo4", 1.0),                              # the default
    ("naive4", "4", 1.0),
    ("echo4-lr115", "echo4", 1.15),
]
MODEL, SEQ, BATCH, LR, WARMUP = "qwen3-100m-8k", 512, 16, 1e-3, 100
DEMO = dict(model="qwen3-demo-8k", comm="16", seq=512, batch=32, lr=2e-3)


DEVICE = "cuda"


def train_cmd(*, model, comm, steps, seq, batch, lr, data, out, simulate, eval_every):
    return [sys.executable, "-m", "echo_tp.cli", "train", "--model", model,
            "--train-data", str(data / "gut8k.bin"), "--val-data", str(data / "gut8k.val.bin"),
            "--comm", comm, "--steps", str(steps), "--seq-len", str(seq), "--batch-size",
            str(batch), "--lr", str(lr), "--warmup", str(min(WARMUP, steps // 10)),
            "--eval-every", str(eval_every), "--eval-batches", "20", "--out-dir", str(out),
            "--simulate", str(simulate), "--device", DEVICE, "--no-progress", "--seed", "0"]


def parse_run(text: str) -> tuple[str, str, float]:
    """'NAME=SPEC[@LR_FACTOR]' -> (name, comm spec, lr factor)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"--run {text!r}: expected NAME=SPEC[@LR_FACTOR]")
    spec, _, f = rest.partition("@")
    return name, spec, float(f) if f else 1.0


def calibrate(data: Path, out: Path, steps: int = 12) -> float:
    """Seconds per step of one echo4 run alone (second half of a short run)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = train_cmd(model=MODEL, comm="echo4", steps=steps, seq=SEQ, batch=BATCH, lr=LR,
                    data=data, out=out / "calib", simulate=4, eval_every=0)
    subprocess.run(cmd, check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
                   stdout=subprocess.DEVNULL)
    import csv
    rows = list(csv.DictReader(open(out / "calib" / "log.csv")))
    t = [float(r["elapsed_s"]) for r in rows]
    half = len(t) // 2
    return (t[-1] - t[half]) / (len(t) - 1 - half)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=330.0, help="wall time for training")
    ap.add_argument("--gpus", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="skip calibration")
    ap.add_argument("--demo-steps", type=int, default=1500, help="0: no demo model")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run of the whole script")
    ap.add_argument("--run", action="append", default=None, metavar="NAME=SPEC[@LR_FACTOR]",
                    help="train these runs instead of RUNS (repeatable), e.g. "
                         "--run 16bit=16 --run single=echo4:beta1=0,beta2=0")
    ap.add_argument("--contention", type=float, default=1.6,
                    help="slow-down of a run when GPUs host several runs at once")
    a = ap.parse_args()
    import torch
    global MODEL, SEQ, BATCH, DEVICE, RUNS
    if a.run:
        RUNS = [parse_run(r) for r in a.run]
    if a.smoke:
        MODEL, SEQ, BATCH, DEVICE = "tiny-qwen3", 32, 2, "cpu"
        DEMO.update(model="tiny-qwen3", seq=32, batch=2)
    gpus = a.gpus or max(1, torch.cuda.device_count())
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if a.steps is None:
        per_step = calibrate(a.data, a.out)
        per_gpu = -(-len(RUNS) // gpus)
        steps = int(a.budget_s / (per_step * max(1.0, a.contention * per_gpu / 2)))
        steps = max(100, min(steps, 5000))
        print(f"calibration: {per_step:.3f} s/step alone; {per_gpu} runs per GPU -> {steps} steps",
              flush=True)
    else:
        steps = a.steps
    procs = []
    for i, (name, comm, f) in enumerate(RUNS):
        cmd = train_cmd(model=MODEL, comm=comm, steps=steps, seq=SEQ, batch=BATCH, lr=LR * f,
                        data=a.data, out=a.out / name, simulate=4, eval_every=max(1, steps // 5))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(i % gpus)}
        procs.append((name, subprocess.Popen(cmd, env=env, stdout=open(a.out / f"{name}.txt", "w"),
                                             stderr=subprocess.STDOUT)))
    d = DEMO
    if a.demo_steps:
        demo_cmd = train_cmd(model=d["model"], comm=d["comm"], steps=a.demo_steps, seq=d["seq"],
                             batch=d["batch"], lr=d["lr"], data=a.data, out=a.out / "demo-model",
                             simulate=1, eval_every=max(1, a.demo_steps // 5))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(len(RUNS) % gpus)}
        procs.append(("demo-model", subprocess.Popen(demo_cmd, env=env,
                                                     stdout=open(a.out / "demo-model.txt", "w"),
                                                     stderr=subprocess.STDOUT)))
    status = {name: p.wait() for name, p in procs}
    summary = {"model": MODEL, "steps": steps, "seq_len": SEQ, "batch_size": BATCH, "lr": LR,
               "warmup": min(WARMUP, steps // 10), "simulated_tp": 4, "gpus": gpus,
               "seconds": time.time() - t0, "runs": {}}
    import csv
    extra = [("demo-model", DEMO["comm"], 1.0)] if a.demo_steps else []
    for name, comm, f in RUNS + extra:
        log = a.out / name / "log.csv"
        if status[name] != 0 or not log.exists():
            summary["runs"][name] = {"comm": comm, "failed": status[name]}
            continue
        rows = list(csv.DictReader(open(log)))
        losses = [float(r["loss"]) for r in rows]
        vals = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
        tail = losses[-100:]
        summary["runs"][name] = {"comm": comm, "lr_factor": f, "steps": len(rows),
                                 "tail100_loss": sum(tail) / len(tail),
                                 "final_val_loss": vals[-1][1] if vals else None,
                                 "val_curve": vals, "loss": losses}
    base = summary["runs"].get("16bit", {}).get("tail100_loss")
    for r in summary["runs"].values():
        if base and "tail100_loss" in r:
            r["tail100_vs_16bit_pct"] = 100 * (r["tail100_loss"] - base) / base
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, a.out / "loss_curves.png")
    for name, r in summary["runs"].items():
        print(name, {k: v for k, v in r.items() if k not in ("loss", "val_curve")}, flush=True)


def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in summary["runs"].items():
        if "loss" not in r or name == "demo-model":
            continue
        loss = r["loss"]
        w = 25
        smooth = [sum(loss[max(0, i - w + 1):i + 1]) / len(loss[max(0, i - w + 1):i + 1])
                  for i in range(len(loss))]
        ax.plot(range(1, len(loss) + 1), smooth, label=f"{name} (tail {r['tail100_loss']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (25-step mean)")
    ax.set_title(f"{summary['model']}, simulated TP=4, {summary['steps']} steps")
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

"""Training curves of several `echo-tp train` runs in one PNG, and their final held-out losses.

    python studies/train_curves.py --out curves.png 16=runs/16/log.csv echo4=runs/echo4/log.csv ...

Top: each run's training loss (running mean of 10 steps). Bottom: that mean relative to the
first run's (the 16-bit baseline), in percent. Prints each run's final validation loss and its
change against the first run's.
"""
from __future__ import annotations

import argparse
import csv


def read(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: float(v) if v != "" else None for k, v in r.items()} for r in csv.DictReader(f)]


def running_mean(v: list[float], k: int = 10) -> list[float]:
    return [sum(v[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(v))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", metavar="LABEL=LOG_CSV")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [(s.partition("=")[0], read(s.partition("=")[2])) for s in a.runs]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    base = running_mean([r["loss"] for r in runs[0][1]])
    base_val = runs[0][1][-1]["val_loss"]
    for label, rows in runs:
        steps = [r["step"] for r in rows]
        mean = running_mean([r["loss"] for r in rows])
        top.plot(steps, mean, lw=1.2, label=label)
        n = min(len(mean), len(base))
        bottom.plot(steps[:n], [100 * (m / b - 1) for m, b in zip(mean[:n], base[:n])], lw=1.2,
                    label=label)
        val = rows[-1]["val_loss"]
        change = "" if val is None or base_val is None else f" ({100 * (val / base_val - 1):+.2f}%)"
        print(f"{label}: final val loss {val}{change}")
    top.set_ylabel("train loss (10-step mean)")
    top.set_title(a.title)
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.set_ylabel(f"vs {runs[0][0]} (%)")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()

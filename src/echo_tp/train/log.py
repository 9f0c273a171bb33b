"""Loss log of a training run: a CSV written row by row, and a PNG plot of it; the collective's
per-call telemetry of sampled steps (TelemetryLog)."""
from __future__ import annotations

import csv
from pathlib import Path

from matplotlib.figure import Figure

from echo_tp.paths import writing

COLUMNS = ("step", "tokens", "lr", "loss", "grad_norm", "val_loss", "elapsed_s")


class LossLog:
    """Rows of COLUMNS; val_loss is empty on steps without an evaluation."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        with self.path.open("w", newline="") as f:
            csv.writer(f).writerow(COLUMNS)

    def append(self, **row) -> None:
        self.rows.append(row)
        with writing(self.path), self.path.open("a", newline="") as f:
            csv.writer(f).writerow(["" if row.get(c) is None else row[c] for c in COLUMNS])

    def set_val(self, val_loss: float) -> None:
        """Attach a validation loss to the last row (rewrites the file)."""
        self.rows[-1]["val_loss"] = val_loss
        with writing(self.path), self.path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(COLUMNS)
            for row in self.rows:
                w.writerow(["" if row.get(c) is None else row[c] for c in COLUMNS])


TELEMETRY_COLUMNS = ("step", "pass", "direction", "site", "bits", "numel", "x_sq", "y_sq",
                     "sent_err_sq", "requant_err_sq", "corr_sq", "delta_norm_est", "rho_norm",
                     "delta_norm", "partial_sum_norm", "exact_sum_norm")
"""One row per collective call of a sampled step: comm.telemetry_summary()'s fields
(echo_tp.telemetry; the last five simulated only). `site` numbers the calls of a pass in call
order: forward call k is site k, backward call k site 2L-1-k (tp/sites.py)."""


class TelemetryLog:
    """Rows of TELEMETRY_COLUMNS, appended a sampled step at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", newline="") as f:
            csv.writer(f).writerow(TELEMETRY_COLUMNS)

    def append(self, step: int, rows: list[dict]) -> None:
        with self.path.open("a", newline="") as f:
            w = csv.writer(f)
            for row in rows:
                row = {**row, "step": step}
                w.writerow(["" if row.get(c) is None else row[c] for c in TELEMETRY_COLUMNS])


def plot_losses(rows: list[dict], out: str | Path, title: str = "") -> Path:
    """Training loss per step (and its 20-step running mean) with validation points."""
    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    k = max(1, min(20, len(loss) // 10))
    mean = [sum(loss[max(0, i - k + 1):i + 1]) / len(loss[max(0, i - k + 1):i + 1])
            for i in range(len(loss))]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    fig = Figure(figsize=(7, 4))             # no pyplot: no global backend state
    ax = fig.subplots()
    ax.plot(steps, loss, lw=0.6, alpha=0.4, label="train loss")
    ax.plot(steps, mean, lw=1.5, label=f"train, {k}-step mean")
    if val:
        ax.plot(*zip(*val), "o-", ms=4, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    return out

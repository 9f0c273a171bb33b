"""The training study's table, curves and verdict from the `train-schedule` job outputs.

    python studies/train_schedule_report.py runs/*.tgz --out-dir docs/results/raw/2026-12-0x-train
    (or the unpacked run folders: each holds train_config.json, log.csv, val_rows.json and,
    for an Echo run, telemetry.csv)

Runs are grouped by config (comm spec, LR factor) and seed; the reference is the 16-bit run
(comm '16', LR factor 1) of the same seed.
- Held-out loss: the final model's mean NLL per scored token over every held-out row
  (val_rows.json: the same rows in every run; log.csv's val_loss averages the batches' means
  instead, so it can differ in the last digits).
- Against 16-bit, per seed: the change in percent with a 95% paired-bootstrap interval over the
  held-out rows (windows of 512 tokens, eval/stats.py: both runs scored on the same resampled
  rows); over seeds: the mean change and the seeds' range. Also the last 100 steps' training
  loss and its change.
- Verdict for the default (echo4, LR factor 1): 'yes' when every seed's interval lies below
  +0.5%, 'no' when every seed's change is above it, else 'not resolved'.
- Runs that stopped before their schedule's end (time budget) are marked; a verdict on them is
  not a verdict on the schedule.
Writes OUT_DIR/table.md, summary.json, curves.png (training loss, 25-step mean; below: against
the same seed's 16-bit run) and, where runs have telemetry, telemetry.png (log10 of each call's
||y - sum x|| / ||y|| by site and sampled step, forward and backward: drift shows as a trend
along the steps).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import tarfile
import tempfile
from pathlib import Path

import torch

from echo_tp.eval.stats import bootstrap_draws, interval
from train_curves import running_mean

DEFAULT = "echo4"
LIMIT_PCT = 0.5
BASE_LR = 2e-3
"""The recipe's peak LR (studies/testbed/recipe.sh): a run's LR factor is its lr over this."""


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def load_run(path: Path, scratch: Path, base_lr: float = BASE_LR) -> dict:
    """A run folder or its .tgz -> {config, seed, label, log, nll, tokens, telemetry, ...}."""
    if path.suffix == ".tgz":
        dest = scratch / path.stem
        with tarfile.open(path) as tar:
            tar.extractall(dest, filter="data")
        path = dest
    cfg = json.loads((path / "train_config.json").read_text())
    log = _rows(path / "log.csv")
    val = json.loads((path / "val_rows.json").read_text())
    tel = path / "telemetry.csv"
    lr_factor = round(cfg["lr"] / base_lr, 3)
    label = cfg["comm"] + ("" if lr_factor == 1 else f" (LR x{lr_factor:g})")
    return {"dir": str(path), "comm": cfg["comm"], "lr_factor": lr_factor, "label": label,
            "seed": cfg["seed"], "planned_steps": cfg["steps"], "steps": int(log[-1]["step"]),
            "sim_path": cfg.get("sim_path"), "log": log,
            "nll": torch.tensor(val["nll"], dtype=torch.float64),
            "tokens": torch.tensor(val["tokens"], dtype=torch.float64),
            "telemetry": _rows(tel) if tel.exists() else None}


def held_out(run: dict) -> float:
    return float(run["nll"].sum() / run["tokens"].sum())


def tail_loss(run: dict, n: int = 100) -> float:
    losses = [float(r["loss"]) for r in run["log"]][-n:]
    return sum(losses) / len(losses)


def change_vs(run: dict, ref: dict, draws: torch.Tensor) -> tuple[float, tuple[float, float]]:
    """(change of the held-out loss in percent, its 95% paired-bootstrap interval)."""
    if run["nll"].shape != ref["nll"].shape or not torch.equal(run["tokens"], ref["tokens"]):
        raise ValueError(f"{run['dir']} and {ref['dir']} were not scored on the same held-out "
                         "rows")
    cnt = run["tokens"][draws].sum(-1)
    rel = (run["nll"][draws].sum(-1) / cnt) / (ref["nll"][draws].sum(-1) / cnt)
    return 100 * (held_out(run) / held_out(ref) - 1), interval((rel - 1) * 100)


def summarize(runs: list[dict], seed: int = 0) -> dict:
    refs = {r["seed"]: r for r in runs if r["comm"] == "16" and r["lr_factor"] == 1}
    if not refs:
        raise ValueError("no 16-bit run (comm '16', LR factor 1) among the runs: it is the "
                         "reference of every comparison")
    n_rows = next(iter(refs.values()))["nll"].numel()
    draws = bootstrap_draws(n_rows, seed=seed)
    configs: dict[str, dict] = {}
    for r in sorted(runs, key=lambda r: (r["comm"] != "16", r["label"], r["seed"])):
        c = configs.setdefault(r["label"], {"comm": r["comm"], "lr_factor": r["lr_factor"],
                                            "seeds": {}})
        row = {"held_out": held_out(r), "tail100": tail_loss(r), "steps": r["steps"],
               "planned_steps": r["planned_steps"], "complete": r["steps"] == r["planned_steps"],
               "sim_path": r["sim_path"]}
        ref = refs.get(r["seed"])
        if ref is not None and r is not ref:
            row["change_pct"], row["change_ci"] = change_vs(r, ref, draws)
            row["tail100_change_pct"] = 100 * (row["tail100"] / tail_loss(ref) - 1)
        c["seeds"][r["seed"]] = row
    for c in configs.values():
        ch = [s["change_pct"] for s in c["seeds"].values() if "change_pct" in s]
        if ch:
            c["mean_change_pct"] = sum(ch) / len(ch)
            c["seed_range_pct"] = (min(ch), max(ch))
    out = {"configs": configs, "verdict": verdict(configs.get(DEFAULT)),
           "reference_seed_spread_pct": None}
    if len(refs) > 1:
        vals = [held_out(r) for r in refs.values()]
        out["reference_seed_spread_pct"] = 100 * (max(vals) / min(vals) - 1)
    return out


def verdict(c: dict | None) -> str:
    if c is None:
        return f"no {DEFAULT} run"
    seeds = [s for s in c["seeds"].values() if "change_ci" in s]
    if not seeds:
        return f"no {DEFAULT} run with a 16-bit run of the same seed"
    note = "" if all(s["complete"] for s in seeds) else " (a run stopped before its schedule's end)"
    if all(s["change_ci"][1] < LIMIT_PCT for s in seeds):
        return f"yes: every seed's interval lies below +{LIMIT_PCT}%" + note
    if all(s["change_pct"] > LIMIT_PCT for s in seeds):
        return f"no: every seed is above +{LIMIT_PCT}%" + note
    return f"not resolved: an interval crosses +{LIMIT_PCT}%" + note


def markdown(summary: dict) -> str:
    seeds = sorted({s for c in summary["configs"].values() for s in c["seeds"]})
    head = ["config"] + [f"seed {s}: held-out loss, vs 16-bit [95% CI]" for s in seeds] + \
        ["mean vs 16-bit (seed range)", "tail-100 train loss vs 16-bit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, c in summary["configs"].items():
        cells = [label]
        for s in seeds:
            r = c["seeds"].get(s)
            if r is None:
                cells.append("-")
                continue
            mark = "" if r["complete"] else f" (stopped at {r['steps']}/{r['planned_steps']})"
            if "change_pct" in r:
                lo, hi = r["change_ci"]
                cells.append(f"{r['held_out']:.4f}, {r['change_pct']:+.3f}% "
                             f"[{lo:+.3f}, {hi:+.3f}]{mark}")
            else:
                cells.append(f"{r['held_out']:.4f}{mark}")
        if "mean_change_pct" in c:
            lo, hi = c["seed_range_pct"]
            cells.append(f"{c['mean_change_pct']:+.3f}% ({lo:+.3f} .. {hi:+.3f})")
        else:
            cells.append("-")
        tails = [r["tail100_change_pct"] for r in c["seeds"].values() if "tail100_change_pct" in r]
        cells.append(", ".join(f"{t:+.3f}%" for t in tails) if tails else "-")
        lines.append("| " + " | ".join(cells) + " |")
    spread = summary["reference_seed_spread_pct"]
    lines.append("")
    if spread is not None:
        lines.append(f"16-bit seed to seed: {spread:.3f}% apart.")
    lines.append(f"Default ({DEFAULT}) within {LIMIT_PCT}% of 16-bit: {summary['verdict']}.")
    return "\n".join(lines) + "\n"


def plot_curves(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    refs = {r["seed"]: r for r in runs if r["comm"] == "16" and r["lr_factor"] == 1}
    labels = sorted({r["label"] for r in runs}, key=lambda s: (s != "16", s))
    colors = {lab: f"C{i}" for i, lab in enumerate(labels)}
    first_seed = min(r["seed"] for r in runs)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    for r in sorted(runs, key=lambda r: (r["label"], r["seed"])):
        steps = [int(x["step"]) for x in r["log"]]
        mean = running_mean([float(x["loss"]) for x in r["log"]], 25)
        style = "-" if r["seed"] == first_seed else "--"
        top.plot(steps, mean, style, lw=1.1, color=colors[r["label"]],
                 label=f"{r['label']} seed {r['seed']}")
        val = [(int(x["step"]), float(x["val_loss"])) for x in r["log"] if x["val_loss"]]
        if val:
            top.plot(*zip(*val), "o", ms=3, color=colors[r["label"]])
        ref = refs.get(r["seed"])
        if ref is not None and ref is not r:
            base = running_mean([float(x["loss"]) for x in ref["log"]], 25)
            n = min(len(mean), len(base))
            bottom.plot(steps[:n], [100 * (m / b - 1) for m, b in zip(mean[:n], base[:n])],
                        style, lw=1.1, color=colors[r["label"]])
    top.set_ylabel("training loss (25-step mean); dots: held-out")
    top.legend(fontsize=7, ncol=2)
    top.grid(alpha=0.3)
    bottom.axhline(LIMIT_PCT, color="grey", lw=0.8, ls=":")
    bottom.axhline(0, color="grey", lw=0.8)
    bottom.set_ylabel("vs 16-bit, same seed (%)")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def telemetry_grid(rows: list[dict], direction: str) -> tuple[list[int], torch.Tensor]:
    """(sampled steps, [sites, steps] log10 ||rho|| / ||y||) of the first pass of each step;
    backward call k is static site 2L-1-k (tp/sites.py)."""
    rows = [r for r in rows if r["direction"] == direction and r["pass"] == "0"
            and r["rho_norm"] not in ("", None)]
    steps = sorted({int(r["step"]) for r in rows})
    n_sites = 1 + max(int(r["site"]) for r in rows)
    grid = torch.full((n_sites, len(steps)), float("nan"), dtype=torch.float64)
    for r in rows:
        k = int(r["site"])
        site = k if direction == "forward" else n_sites - 1 - k
        rel = float(r["rho_norm"]) / max(math.sqrt(float(r["y_sq"])), 1e-30)
        grid[site, steps.index(int(r["step"]))] = math.log10(max(rel, 1e-30))
    return steps, grid


def telemetry_summary(run: dict) -> dict:
    """Per direction: the median and max over sites of ||rho|| / ||y|| at the first and the last
    sampled step (drift shows as a change between them)."""
    out = {}
    for d in ("forward", "backward"):
        steps, grid = telemetry_grid(run["telemetry"], d)
        if not steps:
            continue
        first, last = (10 ** grid[:, 0]), (10 ** grid[:, -1])
        out[d] = {"steps": [steps[0], steps[-1]],
                  "median_rel": [float(first.nanmedian()), float(last.nanmedian())],
                  "max_rel": [float(first.nan_to_num(0).max()), float(last.nan_to_num(0).max())]}
    return out


def plot_telemetry(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(runs), 2, figsize=(10, 3.2 * len(runs)), squeeze=False)
    for row, r in zip(axes, runs):
        for ax, d in zip(row, ("forward", "backward")):
            steps, grid = telemetry_grid(r["telemetry"], d)
            if not steps:
                ax.set_visible(False)
                continue
            im = ax.imshow(grid.numpy(), aspect="auto", origin="lower", cmap="viridis",
                           extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, grid.shape[0] - 0.5))
            ax.set_title(f"{r['label']} seed {r['seed']}: {d}", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("site")
            ax.yaxis.get_major_locator().set_params(integer=True)
            fig.colorbar(im, ax=ax, label="log10 ||y - sum x|| / ||y||")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders or their .tgz")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--base-lr", type=float, default=BASE_LR,
                    help="the schedule's LR: a run's LR factor is its lr over this (default: "
                         "the testbed recipe's)")
    a = ap.parse_args(argv)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        runs = [load_run(p, Path(scratch), a.base_lr) for p in a.runs]
    summary = summarize(runs)
    with_tel = [r for r in runs if r["telemetry"]]
    summary["telemetry"] = {f"{r['label']} seed {r['seed']}": telemetry_summary(r)
                            for r in with_tel}
    summary["runs"] = [{k: r[k] for k in ("dir", "label", "seed", "steps", "planned_steps",
                                          "sim_path")} for r in runs]
    table = markdown(summary)
    (a.out_dir / "table.md").write_text(table)
    (a.out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_curves(runs, a.out_dir / "curves.png")
    if with_tel:
        plot_telemetry(with_tel, a.out_dir / "telemetry.png")
    print(table, end="")
    for name, t in summary["telemetry"].items():
        for d, v in t.items():
            print(f"telemetry {name} {d}: median ||rho||/||y|| {v['median_rel'][0]:.3g} at step "
                  f"{v['steps'][0]} -> {v['median_rel'][1]:.3g} at step {v['steps'][1]} "
                  f"(max {v['max_rel'][0]:.3g} -> {v['max_rel'][1]:.3g})")
    return summary


if __name__ == "__main__":
    main()

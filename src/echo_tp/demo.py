"""`echo-tp demo`: one pass of N model-like all-reduce sites on P gloo ranks, through 16-bit,
8-bit, 4-bit without compensation and Echo 4-bit (both residual modes); then, with the shipped
trained model (assets/models/demo-8k, trained by studies/train_study.py), the perplexity of
held-out text (assets/text) under the same configs at simulated TP=4.

Each site k gives rank i a partial x_{k,i} [tokens, hidden]: a component shared by the ranks that
drifts slowly from site to site (correlated across sites, like a residual stream's inputs), a
per-rank part, and a few outlier channels 20x larger. The net error of a call is
rho_k = y_k - sum_i x_{k,i}; the residual stream accumulates S_t = sum_{k<=t} rho_k. Printed:
the final deviation ||S_N|| / ||sum_k sum_i x_{k,i}||, max_t ||S_t|| and the mean |rho_k|.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from matplotlib.figure import Figure
from tqdm import tqdm

from .communicator import EchoCommunicator
from .config import EchoConfig
from .eval.runner import main as eval_main
from .launch import run_ranks
from .paths import check_file_target, writing

ASSETS = Path(__file__).resolve().parent / "assets"
DEMO_MODEL = ASSETS / "models" / "demo-8k"
HELDOUT_TEXT = ASSETS / "text" / "heldout_rowlandson.txt"
PPL_CONFIGS = ["16", "8", "4", "echo4-output", "echo4"]

DEMO_CONFIGS = {
    "16-bit": EchoConfig(bits=16),
    "8-bit": EchoConfig.from_name("8"),                   # naive: the paper's packet
    "4-bit (no compensation)": EchoConfig.from_name("4"),
    "Echo 4-bit (paper: output, eta .75)": EchoConfig.from_name("echo4-output"),
    "Echo 4-bit (default: local, eta 1)": EchoConfig(bits=4),
}


@dataclass(frozen=True, kw_only=True)
class DemoShape:
    sites: int = 64
    tokens: int = 32
    hidden: int = 1024
    outliers: int = 8
    seed: int = 0


def site_partials(shape: DemoShape, world_size: int):
    """Yields x [P, tokens, hidden] fp32-valued bf16 partials for sites 0..N-1 (deterministic)."""
    g = torch.Generator().manual_seed(shape.seed)
    outlier = torch.randperm(shape.hidden, generator=g)[:shape.outliers]
    gain = torch.ones(shape.hidden)
    gain[outlier] = 20.0
    shared = torch.randn(shape.tokens, shape.hidden, generator=g)
    for _ in range(shape.sites):
        shared = 0.9 * shared + math.sqrt(1 - 0.81) * torch.randn(shape.tokens, shape.hidden,
                                                                   generator=g)
        own = torch.randn(world_size, shape.tokens, shape.hidden, generator=g)
        yield ((0.5 * shared + own) * gain).to(torch.bfloat16)


def _rank_main(rank: int, world_size: int, shape: DemoShape, names: list[str], progress: bool):
    bar = None
    if progress and rank == 0:
        bar = tqdm(total=len(names) * shape.sites, desc="demo", unit="site")
    results = {}
    for name in names:
        comm = EchoCommunicator.from_group(None, DEMO_CONFIGS[name])
        comm.new_pass("forward")
        S = torch.zeros(shape.tokens, shape.hidden, dtype=torch.float64)
        total = torch.zeros_like(S)
        norms, rho_abs = [], []
        for x in site_partials(shape, world_size):
            y = comm.all_reduce(x[rank])
            exact = x.double().sum(0)
            rho = y.double() - exact
            S += rho
            total += exact
            norms.append(float(S.norm()))
            rho_abs.append(float(rho.abs().mean()))
            if bar is not None:
                bar.update(1)
        results[name] = {"partial_sum_norms": norms,
                         "final_deviation": float(S.norm() / total.norm()),
                         "max_partial_sum": max(norms),
                         "mean_abs_rho": sum(rho_abs) / len(rho_abs)}
        comm.close()
    if bar is not None:
        bar.close()
    return results if rank == 0 else None


def run(*, world_size: int = 4, shape: DemoShape = DemoShape(), names: list[str] | None = None,
        progress: bool = True) -> dict:
    names = list(DEMO_CONFIGS) if names is None else names
    unknown = [n for n in names if n not in DEMO_CONFIGS]
    if unknown:
        raise ValueError(f"unknown demo configs {unknown}; known: {list(DEMO_CONFIGS)}")
    return run_ranks(world_size, _rank_main, shape, names, progress)[0]


def format_table(results: dict) -> str:
    w = max(len(n) for n in results)
    head = f"{'config':<{w}} {'final dev |S_N|/|sum|':>22} {'max_t |S_t|':>12} {'mean |rho|':>11}"
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        lines.append(f"{name:<{w}} {r['final_deviation']:>22.3e} {r['max_partial_sum']:>12.3f} "
                     f"{r['mean_abs_rho']:>11.4f}")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    fig = Figure(figsize=(7, 4.5))           # no pyplot: no global backend state
    ax = fig.subplots()
    for name, r in results.items():
        t = range(1, len(r["partial_sum_norms"]) + 1)
        ax.plot(t, r["partial_sum_norms"], label=name)
    ax.set_xlabel("site t")
    ax.set_ylabel("||S_t|| (accumulated net error)")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_title("Echo demo: partial sums of injected errors along one pass")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with writing(path):
        fig.savefig(path, dpi=120)


def perplexity(*, model: str | Path = DEMO_MODEL, text: str | Path = HELDOUT_TEXT,
               simulate: int = 4, context: int = 256, max_windows: int | None = 64,
               progress: bool = True) -> list[dict]:
    """Held-out perplexity of a trained model under PPL_CONFIGS at simulated TP (CPU, fp32)."""
    print(f"\nperplexity of {Path(text).name} (held out from training), model {Path(model).name}, "
          f"simulated TP={simulate}:")
    return eval_main(model=str(model), data=str(text), comms=PPL_CONFIGS, context=context,
                     batch_size=8, max_windows=max_windows, simulate=simulate, device="cpu",
                     dtype="float32", tokenizer="gutenberg-8k", progress=progress)


def main(*, world_size: int = 4, sites: int = 64, tokens: int = 32, hidden: int = 1024,
         out: str = "echo_demo.png", progress: bool = True, with_model: bool = True) -> dict:
    for name, v in (("--world-size", world_size), ("--sites", sites), ("--tokens", tokens),
                    ("--hidden", hidden)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    check_file_target(out, "--out")        # before the run
    results = run(world_size=world_size, shape=DemoShape(sites=sites, tokens=tokens,
                                                         hidden=hidden), progress=progress)
    print(format_table(results))
    plot(results, out)
    print(f"plot: {out}")
    if with_model and (DEMO_MODEL / "config.json").is_file():
        results["perplexity"] = perplexity(progress=progress)
    return results

"""Error bars that can rank comm configs: a paired bootstrap over evaluation windows.

Every config is scored on the same windows, so the figures of two configs are compared on the
same resampled windows (paired): the noise of which text was drawn cancels in their difference.

    nll   [C, W] float64   summed NLL of window w under config c
    count [W]    int64     scored tokens of window w (the same for every config)
    draw  [R, W]           R resamples of W window indices, with replacement (seeded)
    ppl*  [C, R]           exp(sum_w nll[c, draw] / sum_w count[draw])

Gap closed by config x (the share of the uncompensated 4-bit loss recovered):
    (ppl_4 - ppl_x) / (ppl_4 - ppl_16), per resample, then its 2.5 / 97.5 percentiles.
Per-token means (the KL divergence from the 16-bit model): sum_w v[draw] / sum_w count[draw].
"""
from __future__ import annotations

import torch

RESAMPLES = 2000
LEVEL = 0.95


def bootstrap_draws(n: int, *, resamples: int = RESAMPLES, seed: int = 0) -> torch.Tensor:
    """[resamples, n] int64 indices into n items, drawn with replacement (seeded)."""
    if n < 1:
        raise ValueError("the bootstrap needs at least one window")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (resamples, n), generator=gen)


def interval(samples: torch.Tensor, level: float = LEVEL) -> tuple[float, float]:
    """The central `level` percentile interval of samples [R]."""
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(samples.double(), q).tolist()
    return lo, hi


def resampled_ppl(nll: torch.Tensor, count: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """nll [C, W], count [W], draws [R, W] -> perplexities [C, R]."""
    tot = nll.double()[:, draws].sum(-1)                 # [C, R]
    cnt = count.double()[draws].sum(-1)                  # [R]
    return torch.exp(tot / cnt)


def gap_closed_table(nll: torch.Tensor, count: torch.Tensor, ref16: int, ref4: int, *,
                     resamples: int = RESAMPLES, seed: int = 0) -> list[dict]:
    """Per config c: the perplexity change against ref16 in percent and the gap closed, each as
    the point value and a paired-bootstrap interval. Gap figures are None where the 4-bit gap
    is not positive on the full set (nothing to close)."""
    draws = bootstrap_draws(nll.shape[1], resamples=resamples, seed=seed)
    full = torch.exp(nll.double().sum(-1) / count.double().sum())      # [C]
    ppl = resampled_ppl(nll, count, draws)                              # [C, R]
    rel = (ppl / ppl[ref16] - 1) * 100
    gap = ppl[ref4] - ppl[ref16]
    full_gap = float(full[ref4] - full[ref16])
    out = []
    for c in range(nll.shape[0]):
        row = {"ppl_change_pct": float((full[c] / full[ref16] - 1) * 100),
               "ppl_change_pct_ci": interval(rel[c])}
        if full_gap > 0:
            row["gap_closed"] = float((full[ref4] - full[c]) / full_gap)
            row["gap_closed_ci"] = interval((ppl[ref4] - ppl[c]) / gap)
        else:
            row["gap_closed"] = row["gap_closed_ci"] = None
        out.append(row)
    return out


def paired_difference(hits: torch.Tensor, ref: int, *, resamples: int = RESAMPLES,
                      seed: int = 0) -> list[dict]:
    """hits [C, K] bool (item k right under config c) -> per config: accuracy, and its
    difference to config `ref` in points with a paired-bootstrap interval."""
    k = hits.shape[1]
    if k == 0:
        return [{"accuracy": None, "diff_pts": None, "diff_pts_ci": None}
                for _ in range(hits.shape[0])]
    draws = bootstrap_draws(k, resamples=resamples, seed=seed)
    acc = hits.double()[:, draws].mean(-1) * 100                       # [C, R]
    full = hits.double().mean(-1) * 100
    return [{"accuracy": float(full[c]), "diff_pts": float(full[c] - full[ref]),
             "diff_pts_ci": interval(acc[c] - acc[ref])} for c in range(hits.shape[0])]


def mean_per_token(values: torch.Tensor, count: torch.Tensor, *, resamples: int = RESAMPLES,
                   seed: int = 0) -> tuple[float, tuple[float, float]]:
    """values [W] (a per-window sum, e.g. of KL), count [W] -> (sum / tokens, its bootstrap
    interval over windows)."""
    draws = bootstrap_draws(values.shape[0], resamples=resamples, seed=seed)
    v, c = values.double(), count.double()
    return float(v.sum() / c.sum()), interval(v[draws].sum(-1) / c[draws].sum(-1))

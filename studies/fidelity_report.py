"""Tables of the fidelity study (issue 19) from `echo-tp eval --out` JSON files.

    python studies/fidelity_report.py tp8.json [tp8-rot.json ...] [--refs tp8.json] > table.md

Rows of rotated models and of sequence-parallel runs are tagged so. Each file's rows carry
per-window NLLs (the same windows in every file of one model and data),
so rows of several files are compared on the same resampled windows: the gap closed is
(ppl_4 - ppl_x) / (ppl_4 - ppl_16) with the 16-bit and naive 4-bit rows of --refs (default: the
first file), a paired bootstrap (eval/stats.py) over windows giving the 95% interval; rows
scored with --kl show their mean KL divergence from the 16-bit model, with its interval.
"""
from __future__ import annotations

import argparse
import json

import torch

from echo_tp.eval.stats import gap_closed_table


def load_rows(paths: list[str]) -> list[tuple[str, dict]]:
    out = []
    for p in paths:
        rec = json.loads(open(p).read())
        tag = " (rotated)" if rec.get("rotate") is not None else ""
        tag += " (SP)" if rec.get("sequence_parallel") else ""
        out.extend((r["label"] + tag, r) for r in rec["results"])
    return out


def table(rows: list[tuple[str, dict]], ref_rows: list[tuple[str, dict]]) -> str:
    refs = {label: r for label, r in ref_rows}
    allrows = [("16 (ref)", refs["16"]), ("4 (ref)", refs["4"])] + rows
    nll = torch.tensor([r["window_nll"] for _, r in allrows], dtype=torch.float64)
    windows = nll.shape[1]
    count = torch.full((windows,), allrows[0][1]["tokens"] // windows, dtype=torch.long)
    stats = gap_closed_table(nll, count, 0, 1)
    lines = ["| config | bits/value | ppl | vs 16-bit | gap closed [95% CI] | KL from 16-bit "
             "[95% CI] | last-word acc (vs 16-bit, pts) |", "|---|---|---|---|---|---|---|"]
    for (label, r), st in list(zip(allrows, stats))[2:]:
        ci = st["ppl_change_pct_ci"]
        g = st["gap_closed"]
        gap = "" if g is None else (f"{g:.1%} [{st['gap_closed_ci'][0]:.1%}, "
                                    f"{st['gap_closed_ci'][1]:.1%}]")
        lw = ""
        if r.get("last_word_accuracy") is not None:
            d = r["last_word_diff_pts_ci"]
            lw = (f"{r['last_word_accuracy']:.2f}% ({r['last_word_diff_pts']:+.2f} "
                  f"[{d[0]:+.2f}, {d[1]:+.2f}])")
        kl = "" if r.get("kl") is None else (f"{r['kl']:.3e} [{r['kl_ci'][0]:.3e}, "
                                             f"{r['kl_ci'][1]:.3e}]")
        lines.append(f"| {label} | {r['wire_bits']:.3f} | {r['ppl']:.4f} | "
                     f"{st['ppl_change_pct']:+.3f}% [{ci[0]:+.3f}, {ci[1]:+.3f}] | {gap} | {kl} | "
                     f"{lw} |")
    first = allrows[2][1]
    lines.append("")
    lines.append(f"{first['tokens']:,} scored tokens in {windows} windows; last-word targets: "
                 f"{first.get('last_word_targets', 0):,}.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--refs", default=None, help="file with the '16' and '4' rows (default: "
                    "the first)")
    a = ap.parse_args()
    ref_rows = load_rows([a.refs or a.files[0]])
    print(table(load_rows(a.files), ref_rows))


if __name__ == "__main__":
    main()

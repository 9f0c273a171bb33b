"""Print the best stage-profile row of each (label, P, config) found under a folder (the
stages-<label>.json files of stage_profile.py), with the HBM copy of the same runs.

    python benchmarks/stage_table.py $OUT
"""
from __future__ import annotations

import glob
import json
import os
import sys


def best_rows(folder: str) -> dict:
    """(label, numel, P, config) -> the row of the smallest stage sum."""
    best = {}
    for path in sorted(glob.glob(os.path.join(folder, "stages-*.json"))):
        doc = json.load(open(path))
        if "copy" in doc:
            print(os.path.basename(path), "copy", doc["copy"])
        for r in doc["rows"]:
            if "sum_ms" not in r:
                print("error:", r)
                continue
            k = (r["label"], r["numel"], r["P"], r["config"])
            if k not in best or r["sum_ms"] < best[k]["sum_ms"]:
                best[k] = r
    return best


def main() -> None:
    best = best_rows(sys.argv[1])
    for (lab, numel, P, cfg), r in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][2],
                                                                        kv[0][3], kv[0][0])):
        print(f"{lab:16s} P={P} {cfg:13s} {r['tile']}x{r['warps']}s{r.get('step')}",
              *(f'{k}={r[k]:.3f}' for k in ("entry_ms", "reduce_ms", "tail_ms", "sum_ms")))


if __name__ == "__main__":
    main()

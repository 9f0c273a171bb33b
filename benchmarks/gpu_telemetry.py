"""GPU clocks and power per timed phase: nvidia-smi samples matched to the wall-clock windows
`benchmarks/e2e.py --phase-log` prints (rank 0's JSON lines {"phase", "t0", "t1"}).

    nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,utilization.gpu,\
temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader,nounits -lms 100 > smi.csv &
    torchrun ... benchmarks/e2e.py ... --phase-log > e2e.log
    python benchmarks/gpu_telemetry.py --smi smi.csv --phases e2e.log

Prints, per phase and GPU: samples, median SM clock (MHz), median power (W), and the share of
samples with a throttle reason other than idle (bit 0) set. nvidia-smi's timestamps are read as
UTC (the device machines run in UTC).
"""
from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime, timezone


def read_samples(path: str) -> list[dict]:
    rows = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 8:
            continue
        try:
            t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc)
            rows.append({"t": t.timestamp(), "gpu": int(parts[1]), "sm": float(parts[2]),
                         "power": float(parts[4]), "throttle": int(parts[7], 16)})
        except ValueError:
            continue
    return rows


def read_phases(path: str) -> list[dict]:
    out = []
    for line in open(path):
        if line.startswith('{"phase"'):
            out.append(json.loads(line))
    return out


def summarize(samples: list[dict], phases: list[dict]) -> list[dict]:
    rows = []
    for ph in phases:
        for gpu in sorted({s["gpu"] for s in samples}):
            got = [s for s in samples if s["gpu"] == gpu and ph["t0"] <= s["t"] <= ph["t1"]]
            if not got:
                continue
            rows.append({"phase": ph["phase"], "gpu": gpu, "samples": len(got),
                         "sm_mhz": statistics.median(s["sm"] for s in got),
                         "power_w": statistics.median(s["power"] for s in got),
                         "throttled": sum(bool(s["throttle"] & ~1) for s in got) / len(got)})
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| phase | GPU | samples | SM clock MHz (median) | power W (median) | "
           "samples throttled |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['phase']} | {r['gpu']} | {r['samples']} | {r['sm_mhz']:.0f} | "
                   f"{r['power_w']:.0f} | {100 * r['throttled']:.0f}% |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smi", required=True)
    ap.add_argument("--phases", required=True)
    a = ap.parse_args()
    print(markdown(summarize(read_samples(a.smi), read_phases(a.phases))), end="")


if __name__ == "__main__":
    main()

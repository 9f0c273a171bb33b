"""SASS of the p2p stage kernels as a call launches them, without a GPU (benchmarks/sass.py):
registers per thread and main-path instructions per value a thread holds, per stage.

The constexprs come from the same place the launches take them (allreduce_plan._static_args),
so a row is what `CallPlan` would run for (P, config, tile, step, warps) on a bf16 input;
--outlier on|off: the packet's outlier word either way (default: EchoConfig's).

    python benchmarks/stage_sass.py [--worlds 4] [--configs u4,c4-loc-bf16c]
        [--shapes 16384x4s4096] [--stages entry,reduce,tail] [--outlier on|off] [--out F]

Shapes as stage_profile.py's: TILExWARPSsSTEP.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import sass  # noqa: E402  (benchmarks/sass.py)

TYPES = {"x_ptr": "*bf16", "y_ptr": "*bf16", "res_ptr": "*bf16", "fs_ptr": "*fp32",
         "timeout": "i64"}
DIVISIBLE = ("n", "seg", "groups", "slot", "scale_off", "zero_off", "flags_off", "tiles", "stride",
             "timeout")
"""Integer arguments the JIT specializes as multiples of 16 at 2^29 values (what a 1 GiB call
passes)."""


def stage_rows(P: int, name: str, tile: int, warps: int, step: int,
               stages: tuple = ("entry", "reduce", "tail"),
               outlier: bool | None = None) -> list[dict]:
    """One row per stage kernel: registers, main-path instructions, per value a thread holds."""
    import torch
    from echo_tp.kernels import allreduce_kernels as K
    from echo_tp.kernels.allreduce_plan import Layout, _static_args
    from stage_profile import CONFIGS, config
    cfg = config(name, outlier)
    _, _, sdt, _ = CONFIGS[name]
    comp = (1 if CONFIGS[name][3] else 2) if cfg.compensated else 0
    lay = Layout.build(1 << 29, P, cfg.quant_spec(), tile)
    scal, consts, meta, per = _static_args(lay, cfg, 0, torch.bfloat16, comp, False, step,
                                           False, warps)
    st = {"float32": "*fp32", "bfloat16": "*bf16"}[sdt]
    types = dict(TYPES, m1_ptr=st, m2_ptr=st)
    own_y = not per["tail"]["OUTPUT"]
    kernels = {
        "entry": (K.entry_kernel, dict(per["entry"])),
        "reduce": (K.reduce_kernel, dict(per["reduce"], USE_TIMER=True, OWN_Y=own_y,
                                         ADD=False, HALF=0)),
        "tail": (K.tail_kernel, dict(per["tail"], USE_TIMER=True, FIRST=int(own_y),
                                     ADD=False)),
    }
    rows = []
    for stage in stages:
        kern, extra = kernels[stage]
        m = dict(meta, **extra)
        nw = m.pop("num_warps")
        ck = sass.compile_kernel(kern, types, m, num_warps=nw, divisible=DIVISIBLE)
        cubin = ck.asm["cubin"]
        main = sass.main_path(sass.disassemble(cubin))
        vt = m["VT"]
        rows.append({"P": P, "config": name, "tile": tile, "stage": stage, "warps": nw,
                     "step": m["SG"] * m["GS"], "VT": vt, "registers": sass.registers(cubin),
                     "outlier": getattr(cfg, "outlier", False), "main_path": main["total"],
                     "per_value": round(main["total"] / vt, 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="4")
    ap.add_argument("--configs", default="u4,c4-loc-bf16c")
    ap.add_argument("--shapes", default="16384x4s4096")
    ap.add_argument("--stages", default="entry,reduce,tail")
    ap.add_argument("--outlier", default="default", choices=("default", "on", "off"),
                    help="the packet's outlier word (default: EchoConfig's)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    outlier = {"on": True, "off": False}.get(args.outlier)
    rows = []
    for P in map(int, args.worlds.split(",")):
        for name in args.configs.split(","):
            for shape in args.shapes.split(","):
                tile, rest = shape.split("x")
                warps, _, step = rest.partition("s")
                for row in stage_rows(P, name, int(tile), int(warps), int(step or tile),
                                      tuple(args.stages.split(",")), outlier):
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

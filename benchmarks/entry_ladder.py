"""Where the entry stage's per-value work goes: a ladder of Triton kernels on its tiling.

Each rung is one kernel over n bf16 values in groups of 128, on the entry's tiling
(quant_kernels: steps of SG groups as [V, SG, T, 8], VT values a thread, one step a program),
writing a packet's bytes (4-bit codes, a 16-bit scale and zero word per group), and each adds
one feature of the real entry to the rung before it:

    0 copy        load x, store the top nibble of each value as its "code", a group's first
                  value as its scale and zero words: the entry's bytes, no arithmetic
    1 min/max     + each group's NaN-propagating min and max (stored as the two words)
    2 quantize    + s = (hi - lo)/15, z = -lo/s (fp32 params, rounded to fp16 for the words),
                  codes clip(rint(x/s + z), 0, 15) by the IEEE division, packed
    3 packet      + the scale word (fp16 rounded up, or the tagged bf16), the zero-aware
                  zero-point, constant/far/overflowing groups, NaN groups: quant.encode bit
                  for bit (the real uncompensated entry's numerics)
    4 feedback    + error feedback with the default state (one bf16 tensor m): x' = x +
                  eta*(a*m + (1-a)*m) saturated, the packet of x', and m updated from x' - x^
                  (the compensated entry, residual 'local')

For every rung: the bytes it must move (bf16 x in, the packet out; rung 4: m in and out),
GB/s against the HBM copy of the same run, and the SASS instructions per value of its main
path (sass.main_path over the values a thread holds: Triton compiles the kernel for sm_90 and
its bundled cuobjdump disassembles it; on any machine, no GPU needed).

    python benchmarks/entry_ladder.py --out $OUT [--numel 402653184] [--vt 32,16]
    python benchmarks/entry_ladder.py --device cpu     # interpreter: rung 3 == quant.encode
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from echo_tp.kernels.quant_kernels import (KMAGIC, LAUNCH_OPTS, _cast_sat, _codes, _div_by_scale,
                                           _group_max_nan, _group_min_nan, _group_params,
                                           _groups, _lanes, _load_f32, _sat, _store_codes,
                                           F32_MAX)

sys.path.insert(0, os.path.dirname(__file__))
import sass  # noqa: E402

RUNGS = ("copy", "min/max", "quantize", "packet", "feedback")
GS = 128


@triton.jit
def ladder_kernel(x_ptr, m_ptr, codes_ptr, scale_ptr, zero_ptr, n_groups, eta, a, oma, b1, omb1,
                  RUNG: tl.constexpr, SG: tl.constexpr, GS: tl.constexpr, VT: tl.constexpr):
    """One step of SG groups a program; rung RUNG of the module docstring."""
    grp = _groups(tl.program_id(0).to(tl.int64) * SG, SG)         # [1, SG, 1, 1]
    gmask = grp < n_groups
    e = grp * GS + _lanes(GS, VT)                                  # [V, SG, T, 8]
    x = _load_f32(x_ptr + e, gmask, 2)
    if RUNG == 4:
        m = _load_f32(m_ptr + e, gmask, 2)
        xp = x + (m * a + m * oma) * eta
        x = tl.where(tl.abs(x) <= F32_MAX, _sat(xp, F32_MAX), xp)
    if RUNG == 0:
        t = ((x.to(tl.uint32, bitcast=True) >> 28) | 0x4B400000).to(tl.float32, bitcast=True)
        w0 = tl.load(x_ptr + grp * GS, mask=gmask, other=0.0)        # a group's first value
        sw = w0.to(tl.int16, bitcast=True)
        z16 = w0.to(tl.float16)
    elif RUNG == 1:
        lo = _group_min_nan(x)
        hi = _group_max_nan(x)
        t = ((x.to(tl.uint32, bitcast=True) >> 28) | 0x4B400000).to(tl.float32, bitcast=True)
        sw = lo.to(tl.float16).to(tl.int16, bitcast=True)
        z16 = hi.to(tl.float16)
    elif RUNG == 2:
        lo = _group_min_nan(x)
        hi = _group_max_nan(x)
        s16 = tl.math.div_rn(hi - lo, tl.full(lo.shape, 15.0, tl.float32)).to(tl.float16)
        sf = tl.where(s16 == 0.0, 1.0, s16.to(tl.float32))
        z16 = tl.math.div_rn(lo * -1.0, sf).to(tl.float16)
        v = _div_by_scale(x, sf)
        t = tl.minimum(tl.maximum(v + z16.to(tl.float32), 0.0), 15.0) + KMAGIC
        sw = s16.to(tl.int16, bitcast=True)
    else:
        sw, sf, z16, zf, finite = _group_params(x, 0, 15.0, 7.0)
        t = _codes(x, sf, zf, finite, 0, 15.0, 7.0)
        if RUNG == 4:
            err = x - _sat(sf * ((t - KMAGIC) - zf), F32_MAX)
            u = m * b1 + err * omb1
            tl.store(m_ptr + e, _cast_sat(tl.where(tl.abs(u) <= F32_MAX, u, 0.0), 2),
                     mask=gmask)
    _store_codes(codes_ptr, grp, gmask, t, GS, 4, VT)
    tl.store(scale_ptr.to(tl.pointer_type(tl.int16)) + grp, sw, mask=gmask)
    tl.store(zero_ptr + grp, z16, mask=gmask)


def _warps(vt: int, sg: int) -> int:
    return max(1, sg * (GS // vt) // 32)


def launch(rung: int, x, m, codes, scale, zero, vt: int, sg: int) -> None:
    n_groups = x.numel() // GS
    ladder_kernel[(triton.cdiv(n_groups, sg),)](
        x, m, codes, scale, zero, n_groups, 1.0, 0.35, 0.65, 0.5, 0.5,
        RUNG=rung, SG=sg, GS=GS, VT=vt, num_warps=_warps(vt, sg), **LAUNCH_OPTS)


def sass_per_value(rung: int, vt: int, sg: int) -> dict:
    """Main-path SASS instructions of a rung's kernel, per value a thread holds."""
    types = {"x_ptr": "*bf16", "m_ptr": "*bf16", "codes_ptr": "*u8", "scale_ptr": "*fp16",
             "zero_ptr": "*fp16", "n_groups": "i32"}
    ck = sass.compile_kernel(ladder_kernel, types, dict(RUNG=rung, SG=sg, GS=GS, VT=vt),
                             _warps(vt, sg))
    m = sass.main_path(sass.disassemble(ck.asm["cubin"]))
    return {"sass_per_value": round(m["total"] / vt, 2), "sass_total": m["total"],
            "sass_classes": sass.classes(m["by_op"]),
            "registers": sass.registers(ck.asm["cubin"])}


def nbytes(rung: int, n: int) -> int:
    """Bytes a rung must move: x in, codes + two words per group out (rung 4: + m in and out)."""
    b = 2 * n + n // 2 + 4 * (n // GS)
    return b + (4 * n if rung == 4 else 0)


def check_cpu() -> None:
    """Under the interpreter: rung 3's packet is quant.encode's, bit for bit."""
    from echo_tp import quant
    from echo_tp.config import QuantSpec
    spec = QuantSpec(bits=4, group_size=GS)
    x = (torch.randn(64 * GS) * 3).to(torch.bfloat16)
    x[:GS] = float("nan")
    codes = torch.empty(x.numel() // 2, dtype=torch.uint8)
    scale = torch.empty(x.numel() // GS, dtype=torch.float16)
    zero = torch.empty_like(scale)
    launch(3, x, x, codes, scale, zero, 32, 32)
    want = quant.encode(x, spec)
    ok = (torch.equal(codes, want.codes) and torch.equal(scale.view(torch.int16),
                                                         want.scale.view(torch.int16))
          and torch.equal(zero.isnan(), want.zero.isnan())
          and torch.equal(zero[~zero.isnan()], want.zero[~want.zero.isnan()]))
    print(json.dumps({"rung3_equals_quant_encode": ok}))
    if not ok:
        raise SystemExit("rung 3 differs from quant.encode")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--numel", type=int, default=3 << 27,
                    help="values (default: the entry's share at P=4 of 1 GiB bf16 per rank)")
    ap.add_argument("--vt", default="32,16", help="values per thread to try")
    ap.add_argument("--sg", type=int, default=32, help="groups per program")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.device == "cpu":
        check_cpu()
        return
    os.makedirs(args.out, exist_ok=True)
    n = args.numel
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    m = (torch.randn(n, device="cuda") * 1e-2).to(torch.bfloat16)
    codes = torch.empty(n // 2, dtype=torch.uint8, device="cuda")
    scale = torch.empty(n // GS, dtype=torch.float16, device="cuda")
    zero = torch.empty_like(scale)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.reps):
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    src = torch.empty(2 * n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = timed(lambda: dst.copy_(src))
    rows = [{"what": "hbm copy", "bytes": 4 * n, "ms": round(copy_ms, 4),
             "GBps": round(4 * n / copy_ms / 1e6, 1)}]
    print(json.dumps(rows[0]), flush=True)
    for vt in map(int, args.vt.split(",")):
        for rung, name in enumerate(RUNGS):
            mm = m.clone() if rung == 4 else m
            ms = timed(lambda: launch(rung, x, mm, codes, scale, zero, vt, args.sg))
            row = {"rung": rung, "what": name, "vt": vt, "sg": args.sg, "n": n,
                   "bytes": nbytes(rung, n), "ms": round(ms, 4),
                   "GBps": round(nbytes(rung, n) / ms / 1e6, 1),
                   "floor_ms": round(nbytes(rung, n) / (4 * n / copy_ms), 4),
                   **sass_per_value(rung, vt, args.sg)}
            row["x_floor"] = round(ms / row["floor_ms"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "entry-ladder.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"entry_ladder: {time.time() - t0:.1f} s", file=sys.stderr)

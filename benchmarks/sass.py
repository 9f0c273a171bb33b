"""SASS of a Triton kernel without launching it: compile for a GPU target (sm_90 by default)
on any machine, CPU included, disassemble with the cuobjdump Triton bundles, count.

    sass_text(kernel, types, constexprs, num_warps=4) -> str
    count(sass) -> {"total": N, "by_op": {opcode: n}, ...}

`types` maps argument names to Triton signature types ("*bf16", "i32", "fp32", ...); arguments
it does not name are typed by their name (`*_ptr`: "*i64", the compensator constants: "fp32",
the rest: "i32"). Pointers are specialized as 16-byte aligned (what torch's allocations give
and the JIT specializes on). Used by entry_ladder.py and the kernel record; on the GPU machine
the same counts come from the launched kernel (`compiled.asm["cubin"]`).
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

FLOATS = {"eta", "a", "oma", "b1", "omb1", "b2", "omb2"}
_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def _type_of(name: str, types: dict) -> str:
    if name in types:
        return types[name]
    if name.endswith("_ptr"):
        return "*i64"
    return "fp32" if name in FLOATS else "i32"


def compile_kernel(kernel, types: dict, constexprs: dict, num_warps: int = 4,
                   num_stages: int = 3, arch: int = 90, divisible: tuple = ()):
    """The compiled kernel (triton's CompiledKernel) for target sm_<arch>, no GPU needed.
    divisible: integer arguments the launch passes as multiples of 16 (the JIT specializes
    those as such: e.g. the layout's segment length and byte offsets)."""
    sig, attrs = {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        else:
            sig[p.name] = _type_of(p.name, types)
            if sig[p.name].startswith("*") or p.name in divisible:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=dict(constexprs), attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       enable_fp_fusion=False))


def disassemble(cubin: bytes) -> str:
    """cubin -> SASS text, through the cuobjdump in triton's nvidia backend."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                             check=True)
    return out.stdout


def sass_text(kernel, types: dict, constexprs: dict, num_warps: int = 4, **kw) -> str:
    """SASS listing of the kernel compiled as compile_kernel does."""
    return disassemble(compile_kernel(kernel, types, constexprs, num_warps, **kw).asm["cubin"])


def count(sass: str) -> dict:
    """Instructions of a SASS listing: total (NOPs excluded), by opcode (its first word)."""
    ops = collections.Counter()
    for line in sass.splitlines():
        m = _INSN.search(line)
        if m:
            op = m.group(2)
            if op != "NOP":
                ops[op] += 1
    return {"total": sum(ops.values()), "by_op": dict(ops.most_common())}


def classes(by_op: dict) -> dict:
    """Opcode counts folded into classes (memory, shuffles, float, int/logic, convert,
    control, other)."""
    rules = [("global", ("LDG", "STG", "LD", "ST", "RED", "ATOM", "ATOMG")),
             ("shared", ("LDS", "STS", "ATOMS", "LDSM")),
             ("shuffle", ("SHFL",)),
             ("barrier", ("BAR", "MEMBAR", "FENCE", "ERRBAR", "CCTL")),
             ("float", ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK", "MUFU",
                        "FSET", "HADD2", "HMUL2", "HFMA2", "HSETP2", "HMNMX2")),
             ("convert", ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP", "FRND")),
             ("move/select", ("MOV", "SEL", "PRMT", "UMOV", "CS2R", "S2R", "S2UR", "LDC",
                              "ULDC", "R2UR", "P2R", "R2P")),
             ("int/logic", ("IADD3", "IMAD", "LOP3", "SHF", "LEA", "ISETP", "IMNMX", "IABS",
                            "VIADD", "VIMNMX", "UIADD3", "ULOP3", "USHF", "UIMAD", "ULEA",
                            "UISETP", "PLOP3", "FLO", "POPC", "BREV", "IMUL", "ISCADD",
                            "SGXT", "BMSK", "LOP", "UPRMT", "USEL", "IDP", "VABSDIFF")),
             ("control", ("BRA", "EXIT", "BSYNC", "BSSY", "RET", "CALL", "WARPSYNC", "YIELD",
                          "VOTE", "VOTEU", "BPT", "JMP", "NANOSLEEP"))]
    out = collections.Counter()
    for op, n in by_op.items():
        base = op.split(".")[0]
        for name, members in rules:
            if base in members:
                out[name] += n
                break
        else:
            out["other"] += n
    return dict(out)


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def main_path(sass: str, skip_rare: bool = True) -> dict:
    """The instructions a thread executes on the common path, as far as a static listing
    tells: from the entry to the last EXIT of the kernel body (the IEEE division's slow-path
    subroutine after it is left out), without the blocks a predicated branch jumps over when
    they only call that subroutine, and (skip_rare) without blocks of over 100 instructions a
    predicated forward branch jumps over: the stages' recomputation of a step that is not tame
    (allreduce_kernels.TAME_*). Loops counted once. -> count() of those."""
    insns = []
    for line in sass.splitlines():
        m = _LINE.search(line)
        if m:
            insns.append((int(m.group(1), 16), m.group(3), m.group(4)))
    end = max((a for a, op, _ in insns if op == "EXIT"), default=None)
    body = [(a, op, rest) for a, op, rest in insns if end is None or a <= end]
    skip = set()
    for i, (a, op, rest) in enumerate(body):
        if op == "BRA":
            tgt = re.search(r"0x([0-9a-f]+)", rest)
            if tgt:
                t = int(tgt.group(1), 16)
                block = [b for b in body if a < b[0] < t]
                if block and (any(b[1].startswith("CALL") for b in block)
                              or (skip_rare and len(block) > 100 and t > a)):
                    skip.update(b[0] for b in block)
    ops = collections.Counter(op for a, op, _ in body if a not in skip and op != "NOP")
    return {"total": sum(ops.values()), "by_op": dict(ops.most_common())}


def registers(cubin: bytes) -> int | None:
    """Registers per thread of the (one) kernel in a cubin (cuobjdump's resource usage)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    m = re.search(r"REG:(\d+)", out.stdout)
    return int(m.group(1)) if m else None

"""Peak CPU memory of loading a transformers checkpoint: from_pretrained (whole model) vs
echo_tp.hf.load_hf_tp for each rank of P real gloo ranks (issue 16, item 1).

    python benchmarks/hf_load_memory.py [--dir /tmp/echo_hf_mem] [--world 4] [--out FILE.md]

1. Builds (once; reused when --dir already holds it) a random Llama-style checkpoint with
   transformers' own save_pretrained: hidden 768, 6 layers, 12 heads / 4 kv heads, MLP 2048,
   vocab 8192, tied embeddings, fp32 (~176 MB of safetensors, 44M parameters).
2. Every measurement runs in a FRESH interpreter (subprocess): `from_pretrained` in one, and
   `load_hf_tp` on each of P gloo ranks (P processes, one rank each, gloo group for real).
3. Metric: peak resident set growth of the load, VmHWM (ru_maxrss) minus VmRSS just before it,
   VmHWM reset there (/proc/self/clear_refs). Why RSS and not tracemalloc: tracemalloc sees only
   Python's allocator, not torch's CPU allocator nor safetensors' reads (it misses the tensors
   entirely), and torch has no CPU max_memory_allocated. RSS counts every byte the process holds:
   anonymous tensor storage and the safetensors file pages it mapped. Two things would make RSS
   measure something else, and both are removed:
   - first-use code pages: the first load touches pages of libtorch / transformers code and
     imports modeling modules (~100-150 MiB of RSS that no tensor owns). Each process first
     loads a tiny checkpoint of the same family the same way (warm-up), then measures.
   - lazily mapped weights: from_pretrained keeps fp32 tensors as views of the mmapped file,
     resident only once read (its load alone grows RSS by ~3 MiB). After the load every
     parameter is read once (a sum), so each kind holds what it needs to compute.
   The split (RssAnon: allocated tensor bytes, RssFile: mapped file pages) is printed too.
Ratio = per-rank peak growth / from_pretrained peak growth; target <= 0.6 at P = 4.
--mmap: load_hf_tp with safetensors' mmap backend (what it used before pread), for comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

CONFIG = dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
              num_attention_heads=12, num_key_value_heads=4, head_dim=64,
              max_position_embeddings=2048, tie_word_embeddings=True)


def _status() -> dict[str, int]:
    """VmRSS / VmHWM / RssAnon / RssFile of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _reset_hwm() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs), so the peak is the load's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def build_checkpoint(path: Path) -> int:
    import torch
    import transformers
    if (path / "config.json").is_file():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIG)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path)  # fp32 safetensors
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def tiny_dir(path: Path) -> Path:
    return path.parent / (path.name + "-tiny")


def build_tiny(path: Path) -> None:
    """The warm-up checkpoint: same family and code path, 4 heads (splits over P <= 4)."""
    import torch
    import transformers
    if (path / "config.json").is_file():
        return
    torch.manual_seed(0)
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=16, vocab_size=256, num_hidden_layers=2)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CONFIG, **small})
                                  ).save_pretrained(path)


def _measure(kind: str, path: str, mmap: bool) -> dict:
    """Runs inside a fresh interpreter: warm-up load, then one load, its peak RSS growth."""
    import torch
    import transformers
    torch.set_num_threads(1)
    comm = rank = None
    if kind == "tp":
        import torch.distributed as dist
        from echo_tp import EchoCommunicator, EchoConfig
        from echo_tp.hf import load, load_hf_tp
        if mmap:
            from safetensors import safe_open
            load._open = lambda f: safe_open(str(f), framework="pt", device="cpu")
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        comm = EchoCommunicator.from_group(None, EchoConfig(bits=16))

    def run(p):
        if kind == "full":
            return transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
        return load_hf_tp(p, comm, rank, dtype=torch.float32)

    run(tiny_dir(Path(path)))  # warm-up: code pages, imports (the model is dropped)
    _reset_hwm()
    before = _status()
    t0 = time.perf_counter()
    model = run(path)
    seconds = time.perf_counter() - t0
    loaded = _status()
    params = list({id(p): p for p in model.parameters()}.values())
    with torch.no_grad():
        for p in params:
            p.sum()  # every weight resident (mmap-backed ones are read here)
    after = _status()
    out = dict(kind=kind, rank=rank, seconds=seconds, baseline_rss=before["VmRSS"],
               load_growth=loaded["VmHWM"] - before["VmRSS"],
               peak_growth=after["VmHWM"] - before["VmRSS"],
               anon_growth=after["RssAnon"] - before["RssAnon"],
               file_growth=after["RssFile"] - before["RssFile"],
               param_bytes=sum(p.numel() * p.element_size() for p in params))
    if kind == "tp":
        dist.barrier()
        dist.destroy_process_group()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(kind: str, path: Path, env: dict | None = None, mmap: bool = False
           ) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--child", kind, "--dir", str(path)] + ["--mmap"] * mmap
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"measurement process failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/echo_hf_mem")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    ap.add_argument("--mmap", action="store_true",
                    help="load_hf_tp through safetensors' mmap backend (the old reads)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_measure(a.child, a.dir, a.mmap)))
        return
    path = Path(a.dir)
    size = build_checkpoint(path)
    build_tiny(tiny_dir(path))
    full = _result(_child("full", path))
    port = str(_free_port())
    procs = [_child("tp", path, dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r),
                                     WORLD_SIZE=str(a.world), LOCAL_RANK=str(r)), a.mmap)
             for r in range(a.world)]
    ranks = [_result(p) for p in procs]
    import torch
    import transformers
    mib = 2 ** 20
    print(f"checkpoint {path}: {size / mib:.1f} MiB safetensors | torch {torch.__version__}, "
          f"transformers {transformers.__version__}, python {platform.python_version()}")
    print(f"reads: load_hf_tp through safetensors' {'mmap' if a.mmap else 'pread'} backend")
    print(f"{'load':<22} {'peak growth MiB':>15} {'load only':>9} {'anon MiB':>9} "
          f"{'file MiB':>9} {'params MiB':>10} {'ratio':>6} {'s':>6}")
    for r in [full] + ranks:
        name = ("from_pretrained" if r["kind"] == "full"
                else f"load_hf_tp rank {r['rank']}/{a.world}")
        print(f"{name:<22} {r['peak_growth'] / mib:>15.1f} {r['load_growth'] / mib:>9.1f} "
              f"{r['anon_growth'] / mib:>9.1f} "
              f"{r['file_growth'] / mib:>9.1f} {r['param_bytes'] / mib:>10.1f} "
              f"{r['peak_growth'] / full['peak_growth']:>6.2f} {r['seconds']:>6.1f}")
    worst = max(r["peak_growth"] for r in ranks) / full["peak_growth"]
    print(f"worst rank / from_pretrained: {worst:.2f} (target <= 0.6)")
    if a.out:
        Path(a.out).write_text(json.dumps(dict(checkpoint_bytes=size, mmap=a.mmap, full=full,
                                               ranks=ranks, worst_ratio=worst), indent=2) + "\n")


if __name__ == "__main__":
    main()

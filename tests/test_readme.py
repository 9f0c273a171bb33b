"""The README and the usage pages as a newcomer reads them: the commands and every ```python
block run as written.

Compared: each python block of README.md and docs/usage/*.md runs to completion in a fresh
interpreter (a block whose first line says `torchrun --nproc-per-node N` runs under torchrun
with N gloo ranks; `path/to/hf_dir` and `path/to/model.gguf` are tiny random checkpoints
written first); the README opens with the two set-up commands `make demo` and `make test`;
and the one claim the usage pages make about 16-bit bit-identity (simulated == gloo at P = 2,
not promised at P >= 3; docs/usage/collectives.md) holds as stated.
Where to look when it fails: the block's stderr printed in the assertion; a README edit that
renamed or dropped an API (grep the name in src/echo_tp); for the torchrun case, ECHO timeouts
and a free port (--standalone picks one).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from echo_tp import EchoCommunicator, EchoConfig, SimulatedCommunicator
from harness import bits_differ, run_ranks

README = Path(__file__).resolve().parents[1] / "README.md"
USAGE = sorted((README.parent / "docs" / "usage").glob("*.md"))
TORCHRUN = re.compile(r"torchrun --nproc-per-node (\d+)")


def python_blocks() -> list[str]:
    """Every python block of the README, then of each usage page (in name order)."""
    return [b for page in [README, *USAGE]
            for b in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]


def test_readme_opens_with_the_two_commands():
    first = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs(index, tmp_path):
    code = python_blocks()[index]
    if "path/to/hf_dir" in code:
        _tiny_checkpoint(tmp_path / "path" / "to" / "hf_dir")
    if "path/to/model.gguf" in code:
        pytest.importorskip("gguf")
        from tiny_gguf import write_tiny_llama
        (tmp_path / "path" / "to").mkdir(parents=True, exist_ok=True)
        write_tiny_llama(tmp_path / "path" / "to" / "model.gguf")
    script = tmp_path / f"block{index}.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=str(README.parent / "src"), OMP_NUM_THREADS="1")
    launch = TORCHRUN.search(code.splitlines()[0])
    if launch:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={launch.group(1)}", str(script)]
    else:
        cmd = [sys.executable, str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"README block {index} failed:\n{code}\n{proc.stderr[-3000:]}"


def _tiny_checkpoint(path: Path) -> None:
    """A random 2-layer Llama (transformers' own classes) saved as an HF checkpoint dir."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(path)


def _plain_sums(rank, world, xs):
    comm = EchoCommunicator.from_group(None, EchoConfig(bits=16))
    return comm.all_reduce(xs[rank].clone())


@pytest.mark.parametrize("world", [2, 4])
def test_sixteen_bit_identity_holds_where_the_readme_says(world):
    torch.manual_seed(world)
    xs = torch.randn(world, 4096) * torch.logspace(-3, 3, 4096)
    sim = SimulatedCommunicator(world, EchoConfig(bits=16)).all_reduce(xs)[0]
    real = run_ranks(world, _plain_sums, xs)
    differ = int(bits_differ(real[0], sim).sum())
    if world == 2:
        assert differ == 0
    else:
        # not promised: gloo's order differs, so only rounding may differ (a few fp32 ulps of
        # the largest |x_i| summed, since catastrophic cancellation sits in the input)
        scale = xs.abs().sum(0)
        assert bool(((real[0] - sim).abs() <= 4 * 2.0 ** -23 * scale).all())


def test_results_index_has_a_row_for_every_record_and_whole_rows():
    """docs/results/README.md: every dated record has its index row, and every row of its tables
    has the header's number of columns (a merge once broke rows apart)."""
    index = README.parent / "docs" / "results" / "README.md"
    text = index.read_text()
    for record in sorted(index.parent.glob("20*.md")):
        assert re.search(rf"^\| [0-9-]+ \| \[{re.escape(record.name)}\]", text, flags=re.M), \
            f"no index row for {record.name}"
    width = None
    for line in text.splitlines():
        if not line.startswith("|"):
            width = None
            continue
        n = len(re.findall(r"(?<!\\)\|", line)) - 1
        width = n if width is None else width
        assert n == width, line[:120]


GROUP_LIFETIME = """
import os, sys
import torch.distributed as dist
import echo_tp  # noqa: F401   (what the README's blocks import first)

def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:%d")
import torch.distributed._shard.sharded_tensor  # noqa: F401  (transformers' loaders import it)
dist.destroy_process_group()
print(before, threads())
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_destroy_process_group_ends_gloo_after_echo_tp_and_transformers():
    """README block 10's occasional SIGABRT at exit: torch.distributed.nn.functional binds
    group.WORLD as a default argument when first imported; transformers' loaders import it
    (through FSDP's sharded tensors) after the user's init_process_group, so the default group
    outlived destroy_process_group and gloo's worker threads raced the interpreter's exit.
    With echo_tp imported first, destroy_process_group ends the group: its threads are gone."""
    from echo_tp.launch import _free_port
    code = GROUP_LIFETIME % _free_port()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(README.parent / "src")))
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after = map(int, proc.stdout.split())
    assert after == before, f"{after - before} threads of the destroyed group still run"

"""Echo inside vLLM (echo_tp.vllm) on vLLM's CPU build, TP=2: the engine users serve with, its
workers loading the plugin through the vllm.general_plugins entry point. Skipped where vLLM is
not importable (the main suite); `make test-vllm` runs it in its own environment (.venv-vllm).

The model: the package's trained demo model (a 6-layer Qwen3, hidden 256) with its tokenizer,
saved as a plain HF folder; four prompts from the package's held-out text, served in one batch
with max_num_batched_tokens=128, so the engine runs prefill, decode and mixed forwards. Each
configuration is one engine run in its own process (tests/vllm_driver.py: prompt logprobs and
16 greedy tokens with their logprobs), eager unless said.

Compared:
- ECHO_VLLM unset (the plugin loaded, inert) vs vLLM without the plugin (VLLM_PLUGINS naming
  none): every token and logprob bit for bit. In process: register() with the switch unset
  replaces nothing.
- ECHO_VLLM=16 (every all-reduce through the EchoCommunicator at 16 bits) vs vLLM's own (the
  switch unset): bit for bit, eager and with the model traced by torch.compile (vLLM's default;
  here Dynamo with its eager backend, as vLLM's CPU CI runs it; Inductor's: docs/usage/vllm.md).
- ECHO_VLLM=echo4 vs naive '4': the mean |prompt logprob - 16-bit prompt logprob| of echo4 is
  below half of naive 4's (measured 2026-12-04: 0.045 vs 0.128); each worker logs its
  schedule: 13 calls per forward, the embedding at 16 bits, echo4's first and last sites at 8
  (edge_bits), naive 4 everywhere at 4.
- ECHO_VLLM=echo5: one ValueError naming the flag, at engine start, before any worker starts.
Where to look first: a 16-bit or unset mismatch -> echo_tp/vllm/plugin.py (what attach
replaces); a miscount RuntimeError -> Schedule.build / schedule_of; widths -> tp/policy.py.
"""
import json
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", exc_type=ImportError)

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "src" / "echo_tp" / "assets"
DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The model folder and the prompts file, built once."""
    from transformers import PreTrainedTokenizerFast
    d = tmp_path_factory.mktemp("vllm")
    model = d / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(ASSETS / "models" / "demo-8k" / name, model / name)
    PreTrainedTokenizerFast(tokenizer_file=str(ASSETS / "tokenizers" / "gutenberg-8k" /
                                               "tokenizer.json"),
                            eos_token="<|endoftext|>").save_pretrained(model)
    words = (ASSETS / "text" / "heldout_rowlandson.txt").read_text().split()
    prompts = [" ".join(words[start:start + n]) for start, n in
               ((2000, 240), (5000, 120), (9000, 60), (14000, 180))]
    (d / "prompts.json").write_text(json.dumps(prompts))
    return d


@cache
def _run(work: Path, spec: str | None, plugins: bool = True, mode: str = "eager"):
    """One engine run: (rows, returncode, its output: stdout and stderr). mode 'compile': the
    model traced by Dynamo, run by its eager backend (VLLM_CPU_CI_ENV=1: vLLM's CPU CI setting,
    which skips Inductor's code generation)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="1",
               VLLM_CPU_CI_ENV="1", PYTHONPATH=str(ROOT / "src"))
    env.pop("ECHO_VLLM", None)
    if spec is not None:
        env["ECHO_VLLM"] = spec
    if not plugins:
        env["VLLM_PLUGINS"] = "none"
    out = work / f"out-{spec}-{plugins}-{mode}.json"
    proc = subprocess.run([sys.executable, str(DRIVER), str(work / "model"),
                           str(work / "prompts.json"), str(out), mode], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    rows = json.loads(out.read_text()) if proc.returncode == 0 else None
    return rows, proc.returncode, proc.stdout


def run(work, spec, plugins=True, mode="eager"):
    rows, rc, err = _run(work, spec, plugins, mode)
    assert rc == 0, f"engine run ECHO_VLLM={spec!r} ({mode}) failed:\n{err[-4000:]}"
    return rows, err


def prompt_gap(rows, ref) -> float:
    """Mean |prompt logprob - the reference's| over every prompt token."""
    diffs = [abs(a - b) for r, q in zip(rows, ref)
             for a, b in zip(r["prompt_logprobs"], q["prompt_logprobs"])]
    return sum(diffs) / len(diffs)


def test_unset_is_vllm_without_the_plugin(work, monkeypatch):
    own, err = run(work, None, plugins=False)
    unset, err_unset = run(work, None)
    assert "echo-tp" not in err and "echo-tp" not in err_unset
    assert unset == own
    assert len(own) == 4 and all(len(r["token_ids"]) == 16 for r in own)
    # in process: the entry point with the switch unset replaces nothing
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from echo_tp.vllm import register
    monkeypatch.delenv("ECHO_VLLM", raising=False)
    before = BaseModelLoader.__dict__["load_model"]
    register()
    assert BaseModelLoader.__dict__["load_model"] is before


def test_16_bits_is_vllms_own(work):
    own, _ = run(work, None, plugins=False)
    rows, err = run(work, "16")
    assert "Qwen3ForCausalLM at TP=2, ECHO_VLLM='16': 13 all-reduces per forward" in err
    assert rows == own


def test_torch_compile_16_bits_is_vllms_own(work):
    own, _ = run(work, None, mode="compile")
    rows, err = run(work, "16", mode="compile")
    assert "Qwen3ForCausalLM at TP=2, ECHO_VLLM='16': 13 all-reduces per forward" in err
    assert rows == own


def test_echo4_is_closer_than_naive_4(work):
    ref, _ = run(work, "16")
    echo, err_echo = run(work, "echo4")
    naive, err_naive = run(work, "4")
    widths = lambda sites: f"13 all-reduces per forward at widths {[16, *sites]}"  # noqa: E731
    assert widths([8] + [None] * 10 + [8]) in err_echo
    assert widths([None] * 12) in err_naive
    g_echo, g_naive = prompt_gap(echo, ref), prompt_gap(naive, ref)
    assert 0 < g_echo < g_naive / 2, (g_echo, g_naive)


def test_a_bad_spec_is_one_error_at_engine_start(work):
    rows, rc, err = _run(work, "echo5")
    assert rc != 0 and rows is None
    assert "ValueError: ECHO_VLLM='echo5': unknown comm config 'echo5'" in err
    assert "Worker" not in err          # raised in the front end, before any worker started


def test_the_extra_installs_a_tested_vllm():
    import tomllib

    import vllm

    from echo_tp.vllm.plugin import TESTED_VERSIONS
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["vllm"]
    assert extra == [f"vllm-cpu=={vllm.__version__}"] and vllm.__version__ in TESTED_VERSIONS


def test_refusals():
    from echo_tp.vllm.plugin import refusal

    def config(pp=1, ep=False, fuse=False):
        return SimpleNamespace(
            parallel_config=SimpleNamespace(pipeline_parallel_size=pp, enable_expert_parallel=ep),
            compilation_config=SimpleNamespace(cudagraph_mode=None,
                                               pass_config=SimpleNamespace(
                                                   fuse_allreduce_rms=fuse)))
    assert refusal(config()) is None
    assert "pipeline parallelism" in refusal(config(pp=2))
    assert "expert parallelism" in refusal(config(ep=True))
    assert "fuse_allreduce_rms" in refusal(config(fuse=True))

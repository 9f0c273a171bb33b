"""torch.distributed transport for the quantized all-reduce: one all-to-all of packets and one
all-gather of owner packets (the reduce-scatter and all-gather halves: one each). Works on any
backend with those collectives (gloo on CPU, NCCL on GPUs, also across nodes). This is the
reference backend every faster one is compared with.

A collective that fails while waiting on a peer (the group's timeout ran out, a peer died)
raises PeerWaitError naming this rank and the stage of the call it was in; groups echo-tp
builds wait ECHO_COLLECTIVE_TIMEOUT_S, a user's group its own timeout
(docs/usage/defined-answers.md; `group_wait_s` reads it where torch exposes it).

With a CallLengths (the communicator's), quantized CPU calls carry their length in-band: packet
rows padded to a width class with the call's numel in a header, checked on every rank after each
collective (collective/inband.py); CUDA tensors, the plain 16-bit collectives (bit for bit
torch's own) and transports without one send the bare rows.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
# torch.distributed.nn.functional binds `group.WORLD` as its functions' default argument when it
# is first imported. Imported after init_process_group (transformers' loaders import it through
# FSDP and sharded tensors), it holds the default group past destroy_process_group: gloo's
# worker threads then outlive the group and can race the interpreter's exit (SIGABRT,
# "terminate called without an active exception"). Imported with echo_tp, before the group
# exists, it binds None.
import torch.distributed.nn.functional  # noqa: F401

from .. import envs
from .inband import (OPS, CallLengthMismatch, CallLengths, Widths, byte_numels, byte_row,
                     check_numels, wire_len)

log = logging.getLogger(__name__)


# torch >= 2.13 names them *_single; older releases only have the *_tensor forms
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class PeerWaitError(RuntimeError):
    """A collective of the reference transport failed waiting on its peers."""


class DistTransport:
    """Moves packet bytes between the ranks of `group` (tensors carry no virtual-rank batch)."""

    name = "reference"

    def __init__(self, group: dist.ProcessGroup | None = None,
                 lengths: CallLengths | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "dist.init_process_group first (or use SimulatedCommunicator)")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.lengths = lengths
        self.widths = Widths()
        """The widest rows this group agreed on (collective/inband.py)."""

    def _wait(self, stage: str, collective, /, *args, **kw) -> None:
        """collective(*args, group=..., **kw), a failure re-raised with this rank and stage."""
        try:
            collective(*args, group=self.group, **kw)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PeerWaitError(
                f"echo-tp rank {self.rank} of {self.world_size}: the {stage} failed waiting on "
                f"its peers ({first}). A peer skipped this call, failed or died. echo-tp's own "
                f"groups wait ECHO_COLLECTIVE_TIMEOUT_S={envs.collective_timeout_s():g} s; a "
                "group you build waits its own timeout (pass timeout=echo_tp.launch."
                "group_timeout())") from e

    def own(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.rank]

    def replace_own(self, t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[self.rank] = v
        return t

    def _numel(self, t: torch.Tensor) -> int | None:
        """The call's numel when this collective carries it in-band (a CPU tensor, a length
        set), else None."""
        if self.lengths is None or self.lengths.numel is None or t.is_cuda:
            return None
        return self.lengths.numel

    def _settle(self, op: str, width: int, numel: int) -> None:
        """Agree on a row wider than any `op` sent before (a 3-integer all-gather), before any
        rank sends it: gloo aborts on collectives whose sizes differ."""
        if self.widths.knows(op, width):
            return
        got = self.all_gather_ints([OPS.index(op), width, numel], device=torch.device("cpu"),
                                   stage=f"width agreement of the {op}")
        if any(g != got[0] for g in got):
            raise CallLengthMismatch([g[2] for g in got], op)
        self.widths.add(op, width)

    def all_to_all(self, buf: torch.Tensor) -> torch.Tensor:
        stage = "all-to-all of packets (QAR step 1)"
        n = self._numel(buf)
        if n is None:
            out = torch.empty_like(buf)
            self._wait(stage, dist.all_to_all_single, out, buf.contiguous())
            return out
        nb = buf.shape[-1]
        w = wire_len(nb)
        self._settle("all_to_all", w, n)
        wire = byte_row(buf, w, n)                          # [P(owner), w + header]
        out = torch.empty_like(wire)                        # [P(sender), w + header]
        self._wait(stage, dist.all_to_all_single, out, wire)
        check_numels(byte_numels(out, w), "all_to_all")
        return out[:, :nb].contiguous()

    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        stage = "all-gather of owner codes (QAR step 3)"
        n = self._numel(buf)
        if n is None:
            out = torch.empty((self.world_size, *buf.shape), dtype=buf.dtype, device=buf.device)
            self._wait(stage, dist.all_gather, list(out.unbind(0)), buf.contiguous())
            return out
        nb = buf.shape[-1]
        w = wire_len(nb)
        self._settle("all_gather", w, n)
        wire = byte_row(buf, w, n)                          # [w + header]
        out = wire.new_empty(self.world_size, wire.shape[-1])
        self._wait(stage, dist.all_gather, list(out.unbind(0)), wire)
        check_numels(byte_numels(out, w), "all_gather")
        return out[:, :nb].contiguous()

    def all_max(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        self._wait("max all-reduce of the backward scale", dist.all_reduce, t,
                   op=dist.ReduceOp.MAX)
        return t

    def all_sum(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        y = x if inplace else x.clone()
        self._wait("plain 16-bit all-reduce", dist.all_reduce, y)
        return y

    def sum_scatter(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[-1] // self.world_size)
        self._wait("plain 16-bit reduce-scatter", _REDUCE_SCATTER, out, x.contiguous())
        return out

    def gather_cat(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[-1] * self.world_size)
        self._wait("plain 16-bit all-gather", _ALL_GATHER, out, x.contiguous())
        return out

    def all_gather_ints(self, values: list[int], *, device, stage: str) -> list[tuple]:
        """A few integers from every rank: [(rank 0's), (rank 1's), ...]."""
        t = torch.tensor(values, dtype=torch.int64, device=device)
        out = torch.empty((self.world_size, len(values)), dtype=torch.int64, device=device)
        self._wait(stage, dist.all_gather, list(out.unbind(0)), t)
        return [tuple(row) for row in out.tolist()]


def group_wait_s(group: dist.ProcessGroup | None = None) -> float | None:
    """How long the group's collectives wait on a peer, in seconds, where torch exposes it (the
    backend's options._timeout, gloo and NCCL); None where it does not."""
    try:
        pg = group if group is not None else dist.group.WORLD
        device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        timeout = pg._get_backend(device).options._timeout
        return float(timeout.total_seconds())
    except (AttributeError, RuntimeError, ValueError, TypeError):
        return None


def warn_if_long_wait(group: dist.ProcessGroup | None = None) -> None:
    """Log one warning (per group and timeout, per process) when the group waits on a peer
    longer than ECHO_COLLECTIVE_TIMEOUT_S: a rank that dies leaves the others waiting that
    long (torch's default is 30 minutes)."""
    wait = group_wait_s(group)
    if wait is not None and wait > envs.collective_timeout_s():
        _warn_long_wait(id(group if group is not None else dist.group.WORLD), wait,
                        envs.collective_timeout_s())


@functools.lru_cache(maxsize=None)
def _warn_long_wait(group_id: int, wait: float, limit: float) -> None:
    log.warning("echo-tp: this process group waits %g s on a peer, longer than "
                "ECHO_COLLECTIVE_TIMEOUT_S=%g s: a rank that dies leaves the others waiting "
                "that long. Build it with timeout=echo_tp.launch.group_timeout() "
                "(torch's default is 30 minutes)", wait, limit)

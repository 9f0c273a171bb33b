"""How a tool (eval, train) runs its TP group: three modes, one entry point.

    result = launch(fn, opts, simulate=P)       # P virtual ranks in this process
    result = launch(fn, opts, world_size=P)     # P gloo processes on CPU (echo_tp.launch)
    result = launch(fn, opts)                   # under torchrun: rank from the environment,
                                                # NCCL on GPUs (cuda:LOCAL_RANK), else gloo

fn(rank, world_size, opts) runs on every rank (rank None when simulated) and must be defined at
module level (spawned processes import it). `launch` returns rank 0's result and whether this
process is the one that should print (rank 0, or the only process).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from echo_tp.communicator import EchoCommunicator, SimulatedCommunicator
from echo_tp.launch import group_timeout, run_ranks
from echo_tp.options import cli


@dataclass(frozen=True, kw_only=True)
class Group:
    """How a tool's TP group runs (the `--simulate` / `--world-size` options of eval and train;
    under torchrun neither)."""

    simulate: int | None = field(default=None, metadata=cli(metavar="P", group="tp"))
    """P virtual ranks in this process (bit-identical to --world-size P at 4/8 bits: both
    compute at ECHO_RANK_THREADS intra-op threads, default 1; P = 1: the plain model)."""
    world_size: int | None = field(default=None, metadata=cli(metavar="P", group="tp"))
    """Spawn P gloo processes on CPU."""


@dataclass(frozen=True)
class Launched:
    result: object
    is_main: bool


def in_torchrun() -> bool:
    """True when the environment names this process's rank (torchrun / torch.distributed.run)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def check_group_args(*, simulate: int | None = None, world_size: int | None = None) -> None:
    """ValueError for a TP-group choice launch() refuses (tools check it before other work)."""
    if simulate is not None and world_size is not None:
        raise ValueError("choose either --simulate P (one process) or --world-size P (gloo)")
    if simulate is not None and simulate < 1:
        raise ValueError(f"--simulate needs P >= 1 virtual ranks, got {simulate}")
    if world_size is not None and world_size < 1:
        raise ValueError(f"--world-size needs P >= 1 processes, got {world_size}")


def launch(fn, opts, *, simulate: int | None = None, world_size: int | None = None) -> Launched:
    check_group_args(simulate=simulate, world_size=world_size)
    if simulate is not None:
        return Launched(fn(None, simulate, opts), True)
    if world_size is not None:
        if in_torchrun() or dist.is_initialized():
            raise ValueError("--world-size spawns its own processes; under torchrun leave it out")
        return Launched(run_ranks(world_size, fn, opts)[0], True)
    if in_torchrun():
        owned = not dist.is_initialized()
        if owned:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=group_timeout())
        try:
            rank, ws = dist.get_rank(), dist.get_world_size()
            return Launched(fn(rank, ws, opts), rank == 0)
        finally:
            if owned:
                dist.destroy_process_group()
    raise ValueError("no TP group: pass --simulate P (one process), --world-size P (gloo on CPU) "
                     "or start under torchrun")


def rank_device(requested: str | None, rank: int | None) -> torch.device:
    """The device of a rank: under NCCL cuda:LOCAL_RANK; gloo ranks CPU; simulated: requested,
    default CUDA when available."""
    if rank is not None and dist.is_initialized():
        if dist.get_backend() == "nccl":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_comm(rank: int | None, world_size: int, config, *, telemetry: bool = False):
    """The communicator of this rank (a SimulatedCommunicator of world_size when rank is None)."""
    if rank is None:
        return SimulatedCommunicator(world_size, config, telemetry=telemetry)
    return EchoCommunicator.from_group(None, config, telemetry=telemetry)

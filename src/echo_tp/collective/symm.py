"""Symmetric-memory plumbing of the intra-node fast path: can it run here, and the buffers.

`fast_path_unavailable_reason(group)` says why a group cannot take the p2p / one-shot kernels
(None when it can); `SymmetricBuffer` is one rank's byte buffer in CUDA symmetric memory with
the device table of every rank's buffer address (what the kernels store to). NVLink multicast is
never used.
"""
from __future__ import annotations

import logging
import socket

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

def _local_reason() -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e})"
    try:
        from torch.distributed import _symmetric_memory as symm
        symm.empty, symm.rendezvous  # noqa: B018
    except (ImportError, AttributeError) as e:
        return f"torch.distributed._symmetric_memory is unavailable ({e})"
    if not dist.is_available() or not dist.is_initialized():
        return "torch.distributed is not initialized"
    return None


def fast_path_unavailable_reason(group: dist.ProcessGroup | None = None) -> str | None:
    """None when the p2p backend can run on `group`, else why not. Cheap, and safe anywhere:
    without CUDA/triton/symmetric memory it answers before any communication; otherwise it is
    a collective (every rank of the group must call it) and all ranks get the same answer."""
    reason = _local_reason()
    if reason is not None:
        return reason
    world = dist.get_world_size(group)
    if world < 2:
        return "a group of one rank needs no all-reduce"
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        return f"process group backend {backend!r} is not NCCL"
    dev = torch.cuda.current_device()
    infos: list = [None] * world
    dist.all_gather_object(infos, (socket.gethostname(), dev), group=group)
    local = None
    if len({h for h, _ in infos}) > 1:
        local = "the group spans several nodes"
    elif len({d for _, d in infos}) < world:
        local = "two ranks share one GPU"
    else:
        for _, d in infos:
            if d != dev and d < torch.cuda.device_count() \
                    and not torch.cuda.can_device_access_peer(dev, d):
                local = f"GPU {dev} has no peer access to GPU {d}"
                break
    reasons: list = [None] * world
    dist.all_gather_object(reasons, local, group=group)
    return next((f"rank {r}: {m}" for r, m in enumerate(reasons) if m is not None), None)


class SymmetricBuffer:
    """One rank's symmetric byte buffer and the device table [P+1] int64 of the P buffers'
    addresses as this rank sees them, then the address of the error record. `flags` (a slice of
    the buffer's words) is zeroed and the ranks barrier once, before any peer can push."""

    def __init__(self, nbytes: int, flags_off: int, group, rank: int, world: int, device,
                 err: torch.Tensor):
        from torch.distributed import _symmetric_memory as symm
        self.buf = symm.empty(nbytes, dtype=torch.uint8, device=device)
        self.buf[flags_off:].view(torch.int64).zero_()
        torch.cuda.synchronize(device)
        self.handle = symm.rendezvous(self.buf, group if group is not None else dist.group.WORLD)
        offset = self.buf.data_ptr() - int(self.handle.buffer_ptrs[rank])
        peers = [self.handle.get_buffer(r, (nbytes,), torch.uint8, storage_offset=offset)
                 for r in range(world)]
        if peers[rank].data_ptr() != self.buf.data_ptr():
            raise RuntimeError("symmetric memory: the local view does not match the buffer")
        self.peers = peers                            # keep the views (and mappings) alive
        self.table = torch.tensor([p.data_ptr() for p in peers] + [err.data_ptr()],
                                  dtype=torch.int64, device=device)
        dist.barrier(group=group)                     # every flag is zero before any push


def select_symm_backend(device) -> str | None:
    """Prefer torch's own CUDA symmetric-memory backend (plain cudaMalloc/VMM + IPC, no NVSHMEM
    bootstrap) when nothing chose one yet; leave an earlier choice alone. -> the backend."""
    from torch.distributed import _symmetric_memory as symm
    try:
        if symm.get_backend(device) is None:
            symm.set_backend("CUDA")
    except Exception as e:  # noqa: BLE001 - older torch, or a backend already in use
        log.debug("echo-tp: symmetric memory backend left as is: %s", e)
    try:
        return symm.get_backend(device)
    except Exception:  # noqa: BLE001
        return None


def agreed_sm_count(group, device) -> int:
    """The smallest SM count over the group (one MIN all-reduce, at set-up)."""
    sms = torch.tensor([torch.cuda.get_device_properties(device).multi_processor_count],
                       dtype=torch.int64, device=device)
    dist.all_reduce(sms, op=dist.ReduceOp.MIN, group=group)
    return int(sms.item())

"""Collective backends. Each moves bytes for collective/qar.py (the algorithm, written once):
reference.py over torch.distributed, simulated.py for P virtual ranks in one process, and p2p.py
for intra-node GPUs over symmetric memory (fused Triton kernels)."""
from .qar import compensated_all_reduce, qar, segment_len, wire_bytes
from .reference import DistTransport
from .simulated import SimTransport

__all__ = ["compensated_all_reduce", "qar", "segment_len", "wire_bytes", "DistTransport",
           "SimTransport"]

"""Collective backends. Each moves bytes for collective/qar.py (the algorithm, written once):
reference.py over torch.distributed, simulated.py for P virtual ranks in one process, and on
intra-node GPUs p2p.py (fused Triton kernels over symmetric memory, symm.py) and oneshot.py
(16-bit, small messages). routing.py decides per call which one runs, from the measured tables
of tuning.py; dispatch.py builds the backends a group can have and runs each call's route."""
from .qar import compensated_all_reduce, qar, segment_len, wire_bytes
from .reference import DistTransport
from .simulated import SimTransport

__all__ = ["compensated_all_reduce", "qar", "segment_len", "wire_bytes", "DistTransport",
           "SimTransport"]

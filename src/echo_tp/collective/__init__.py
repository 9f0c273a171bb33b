"""Collective backends. Each moves bytes for collective/qar.py (the algorithm, written once):
reference.py over torch.distributed, simulated.py for P virtual ranks in one process, and on
intra-node GPUs p2p.py (fused Triton kernels over symmetric memory, symm.py) and oneshot.py
(16-bit, small messages). routing.py decides per call which one runs, from the measured tables
of tuning.py; dispatch.py builds the backends a group can have and runs each call's route.
sharded.py: the algorithm's two halves (reduce-scatter, all-gather) as collectives of their own."""
from .qar import compensated_all_reduce, qar, segment_len, wire_bytes
from .reference import DistTransport
from .sharded import compensated_all_gather, compensated_reduce_scatter
from .simulated import SimTransport

__all__ = ["compensated_all_reduce", "compensated_reduce_scatter", "compensated_all_gather",
           "qar", "segment_len", "wire_bytes", "DistTransport", "SimTransport"]

"""Triton kernels of the p2p fast path: the group quantizer (quant_kernels), the fused
compensated all-reduce stages (allreduce_kernels), cross-GPU flags (flags) and P simulated ranks
running those stages in one process (simulated_fused). Importing needs triton; every kernel also
runs on the CPU under TRITON_INTERPRET=1 (set it before the first import)."""

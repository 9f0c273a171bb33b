"""Triton kernels of the fast path, each beside its pure-torch reference and a bit-exact test:
the group quantizer (quant_kernels; reference quant.py), the fused compensated all-reduce
stages (allreduce_kernels: device code; ranks_kernels: each stage of P simulated ranks in one
launch; allreduce_plan: buffer layout and per-call launches; reference collective/qar.py), the residual add + RMSNorm (norm_kernels; reference
norm_reference.py), the 16-bit one-shot all-reduce (oneshot_kernels), cross-GPU flags (flags)
and the JIT-bypassing launcher (launcher); `fits` says which calls they take. Importing a
kernel module needs triton (fits does not); every kernel also runs on the CPU under
TRITON_INTERPRET=1 (set it before the first import). Nothing here imports echo_tp.collective:
the backends that run the kernels (collective/p2p.py, oneshot.py, simulated_fused.py) sit
above them."""

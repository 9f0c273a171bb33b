"""Triton kernels of the fast path, each beside its pure-torch reference and a bit-exact test:
the group quantizer (quant_kernels; reference quant.py), the fused compensated all-reduce
stages (allreduce_kernels: device code; allreduce_plan: buffer layout and per-call launches;
reference collective/qar.py), the 16-bit one-shot all-reduce (oneshot_kernels), cross-GPU flags
(flags), the JIT-bypassing launcher (launcher) and P simulated ranks running the stages in one
process (simulated_fused). Importing needs triton; every kernel also runs on the CPU under
TRITON_INTERPRET=1 (set it before the first import)."""

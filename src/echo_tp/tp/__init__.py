"""Tensor parallelism applied to the single-device models from a table (STYLE habit 1).

    plan.py         TP_PLAN: module path pattern -> Colwise / Rowwise / BlockInput / ...
    sites.py        autograd sites: forward all-reduce "g", backward all-reduce "f", pass marks
    parallelize.py  parallelize(model, comm[, rank]): real rank or P simulated virtual ranks
    batched.py      simulated fast path (sim_path='batched'): the virtual ranks as a batch dim
    sequence.py     sequence parallelism (parallelize(..., sequence_parallel=True))
    blocks.py       how a block's input, extra outputs and head attributes are found
    policy.py       site widths (WidthPlan, site_width); comm spec strings ('echo4:eta=0.9')
    grads.py        partial-gradient sync, global grad norm / clipping, gathering whole weights
    runtime.py      how a tool runs: torchrun env, gloo spawn on CPU, or simulated in-process
    styles.py       Echo ParallelStyles for torch's parallelize_module (import it explicitly:
                    it loads torch.distributed.tensor)
transformers' own models: echo_tp.hf.parallelize_hf (their plan table, this engine).
"""
from .grads import clip_grad_norm_, full_state_dict, grad_norm, sync_partial_grads, unshard
from .parallelize import (SIM_PATHS, RowwiseLinear, SimTPBlock, parallelize, rank_parameters,
                          set_comm)
from .plan import TP_PLAN, BlockInput, Colwise, PartialGradReplicate, Rowwise
from .policy import (POLICIES, CommSpec, WidthPlan, make_policy, parse_comm_spec,
                     parse_comm_specs, site_width)

__all__ = [
    "TP_PLAN", "SIM_PATHS", "Colwise", "Rowwise", "BlockInput", "PartialGradReplicate",
    "parallelize",
    "set_comm", "rank_parameters", "RowwiseLinear", "SimTPBlock", "sync_partial_grads",
    "grad_norm", "clip_grad_norm_", "full_state_dict", "unshard", "make_policy", "POLICIES",
    "CommSpec", "parse_comm_spec", "parse_comm_specs", "WidthPlan", "site_width",
]

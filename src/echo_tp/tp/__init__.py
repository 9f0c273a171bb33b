"""Tensor parallelism applied to the single-device models from a table (STYLE habit 1).

    plan.py         TP_PLAN: module path pattern -> Colwise / Rowwise / BlockInput / ...
    sites.py        autograd sites: forward all-reduce "g", backward all-reduce "f", pass marks
    parallelize.py  parallelize(model, comm[, rank]): real rank or P simulated virtual ranks
    policy.py       per-site bit policies; comm spec strings ('echo4:eta=0.9,quantizer=naive')
    grads.py        partial-gradient sync, global grad norm / clipping, gathering whole weights
    runtime.py      how a tool runs: torchrun env, gloo spawn on CPU, or simulated in-process
"""
from .grads import clip_grad_norm_, full_state_dict, grad_norm, sync_partial_grads, unshard
from .parallelize import RowwiseLinear, SimTPBlock, parallelize, rank_parameters, set_comm
from .plan import TP_PLAN, BlockInput, Colwise, PartialGradReplicate, Rowwise
from .policy import POLICIES, CommSpec, make_policy, parse_comm_spec, parse_comm_specs

__all__ = [
    "TP_PLAN", "Colwise", "Rowwise", "BlockInput", "PartialGradReplicate", "parallelize",
    "set_comm", "rank_parameters", "RowwiseLinear", "SimTPBlock", "sync_partial_grads",
    "grad_norm", "clip_grad_norm_", "full_state_dict", "unshard", "make_policy", "POLICIES",
    "CommSpec", "parse_comm_spec", "parse_comm_specs",
]

"""Echo for transformers' own models (issue 16): the TP plan comes from the model's config.

    plan.py         base_model_tp_plan (transformers style names) -> echo_tp.tp plan table
    parallelize.py  parallelize_hf(model, comm[, rank]): shard in place, Echo at every site

transformers is imported by the caller (the model object), never by this package.
"""
from .parallelize import ShardCache, parallelize_hf, split_cache
from .plan import SUPPORTED, base_plan, head_layout, hf_plan

__all__ = ["parallelize_hf", "hf_plan", "base_plan", "head_layout", "SUPPORTED", "split_cache",
           "ShardCache"]

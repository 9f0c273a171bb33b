"""Echo for transformers' own models: the TP plan comes from the model's config.

    plan.py         base_model_tp_plan (transformers style names) -> echo_tp.tp plan table
    parallelize.py  parallelize_hf(model, comm[, rank]): shard in place, Echo at every site
    load.py         load_hf_tp(dir, comm[, rank]): meta build, each rank reads only its slices
    gguf.py         GGUF files through transformers' GGUF loader: load_hf_tp("x.gguf", ...),
                    gguf_to_hf(file, dir) -> a plain HF folder (the gguf extra)
    save.py         save_hf(model, dir): gathered whole weights -> an unsharded HF checkpoint

transformers is imported lazily: by the caller (parallelize_hf gets a model object), or by
load_hf_tp when it builds one; `import echo_tp.hf` alone does not import it.
"""
from .gguf import gguf_to_hf, is_gguf, load_gguf_model, load_gguf_tokenizer
from .load import load_hf_tp
from .parallelize import ShardCache, parallelize_hf, split_cache
from .plan import SUPPORTED, base_plan, head_layout, hf_plan
from .save import save_hf

__all__ = ["parallelize_hf", "load_hf_tp", "save_hf", "hf_plan", "base_plan", "head_layout",
           "SUPPORTED", "split_cache", "ShardCache", "gguf_to_hf", "is_gguf", "load_gguf_model",
           "load_gguf_tokenizer"]

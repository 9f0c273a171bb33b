"""Save a parallelized transformers model as a plain HF checkpoint: `save_hf(model, path)`.

    parallelize_hf(model, comm[, rank])            # or model = load_hf_tp(dir, comm[, rank])
    ...                                             # train / evaluate
    save_hf(model, "out_dir")                       # every rank calls it; rank 0 writes

The whole weights are gathered from the shards (tp.full_state_dict: an all-gather on real ranks,
the virtual ranks' slices when simulated) under the unsharded model's parameter names and written
by the model's own save_pretrained (config.json, generation_config.json, *.safetensors; a tied
lm_head is not stored, as transformers does). AutoModelForCausalLM.from_pretrained(out_dir) then
builds an ordinary unsharded model with the original weights. Memory: rank 0 holds the whole
state once while writing.
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from echo_tp.tp import full_state_dict


def save_hf(model: nn.Module, path: str | Path, **save_pretrained_kwargs) -> None:
    """Gather a parallelize_hf'd model's weights and save them as an unsharded HF checkpoint
    (collective on real ranks: call it on every rank; rank 0 writes)."""
    tp = getattr(model, "echo_tp", None)
    if tp is None:
        raise ValueError(f"{type(model).__name__} is not parallelized (parallelize_hf / "
                         "load_hf_tp); save an unsharded model with model.save_pretrained(path)")
    if not hasattr(model, "save_pretrained"):
        raise ValueError(f"{type(model).__name__} has no save_pretrained: save_hf writes "
                         "transformers models; for echo_tp.models use models.save_hf_checkpoint")
    state = full_state_dict(model)  # name -> whole tensor; collective on real ranks
    if tp.simulated or tp.rank == 0:
        model.save_pretrained(path, state_dict=state, **save_pretrained_kwargs)

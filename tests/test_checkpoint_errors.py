"""Issue 28, item 1: a checkpoint whose config.json disagrees with its weights, or whose files are
broken, is refused with a ValueError naming what is wrong, by both loaders, before any slice is
read.

Compared: for each config.json edit of a tiny Llama checkpoint (a field smaller or larger than
the tensors it sizes, one per field that sizes a tensor: intermediate_size, num_key_value_heads,
head_dim, vocab_size, hidden_size; layers past num_hidden_layers), what the project's loader
(models.load_hf_checkpoint) and the rank-sliced transformers loader (hf.load_hf_tp, P=2
simulated, the same code a real rank runs) raise: the tensor's name, its shape in the file, the
shape config.json implies and the field. For broken files (a shard truncated among several, a
shard the index lists but the directory lacks, a corrupt index, a config.json that is not JSON,
a file that is not safetensors): the file's name, from both loaders and from
models.checkpoint.check_shards (what the tools run before they build anything). A checkpoint
whose config matches loads (the control). A Llama-3.1+ config ('llama3' RoPE scaling, which the
project's Transformer does not implement): load_hf_checkpoint's ValueError names the exact
echo_tp.hf.load_hf_tp call, and that call, run as written, loads it (from_pretrained's logits).
Where to look first: models/checkpoint.py (check_shape, implied_field, shard_errors), then
hf/load.py and models/hf.py (where they call it).
"""
import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from echo_tp import EchoConfig, SimulatedCommunicator
from echo_tp.hf import load_hf_tp
from echo_tp.models import load_hf_checkpoint
from echo_tp.models.checkpoint import check_shards, implied_field

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{'one': a single-file checkpoint, 'sharded': the same split over several files}."""
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    model.save_pretrained(root / "one")
    model.save_pretrained(root / "sharded", max_shard_size="12KB")
    assert len(list((root / "sharded").glob("*.safetensors"))) >= 3
    return root


def _copy(saved, tmp_path, name="one", **config):
    dst = tmp_path / name
    shutil.copytree(saved / name, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _load(loader: str, path):
    if loader == "echo":
        return load_hf_checkpoint(path, dtype=torch.float32)
    return load_hf_tp(path, SimulatedCommunicator(2, EchoConfig(bits=16)), dtype=torch.float32)


# (config.json edit, the field the message names, the kind of tensor it sizes)
MISMATCHES = [
    (dict(intermediate_size=32), "intermediate_size", "mlp."),
    (dict(intermediate_size=128), "intermediate_size", "mlp."),
    (dict(num_key_value_heads=1), "num_key_value_heads * head_dim", "_proj"),
    (dict(num_key_value_heads=4), "num_key_value_heads * head_dim", "_proj"),
    (dict(head_dim=16), "head_dim", "self_attn."),
    (dict(vocab_size=80), "vocab_size", ""),
    (dict(vocab_size=48), "vocab_size", ""),
    (dict(hidden_size=48, head_dim=8), "hidden_size", ""),
]
MESSAGE = re.compile(r"checkpoint tensor (\S+) in (\S+) has shape (\(.*?\)), but config.json "
                     r"implies (\(.*?\)) \(")


def _implied_shape(config_dir, key):
    """The shape transformers' model of config_dir gives tensor `key` (built on meta)."""
    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return tuple(dict(model.named_parameters(remove_duplicate=False))[key].shape)


@pytest.mark.parametrize("loader", ["echo", "transformers"])
@pytest.mark.parametrize("edit,field,tensor", MISMATCHES,
                         ids=[",".join(f"{k}={v}" for k, v in e.items()) for e, *_ in MISMATCHES])
def test_config_and_weights_disagree(saved, tmp_path, loader, edit, field, tensor):
    path = _copy(saved, tmp_path, **edit)
    with pytest.raises(ValueError) as e:
        _load(loader, path)
    msg = str(e.value)
    m = MESSAGE.search(msg)
    assert m and tensor in m.group(1) and field in msg, msg
    assert "config.json and the weights disagree" in msg, msg
    key, file = m.group(1), m.group(2)
    with safe_open(file, framework="pt") as f:
        assert m.group(3) == str(tuple(f.get_slice(key).get_shape())), msg
    assert m.group(4) == str(_implied_shape(path, key)) != m.group(3), msg


@pytest.mark.parametrize("loader", ["echo", "transformers"])
def test_layers_past_the_config_are_refused(saved, tmp_path, loader):
    path = _copy(saved, tmp_path, num_hidden_layers=1)
    with pytest.raises(ValueError, match="num_hidden_layers|unexpected"):
        _load(loader, path)


@pytest.mark.parametrize("loader", ["echo", "transformers"])
def test_a_matching_checkpoint_loads(saved, loader):
    model = _load(loader, saved / "sharded")
    model = model[0] if isinstance(model, tuple) else model
    assert sum(p.numel() for p in model.parameters()) > 0


def _truncate(path):
    f = sorted(path.glob("*.safetensors"))[1]
    f.write_bytes(f.read_bytes()[: f.stat().st_size - 100])
    return f.name


def _drop_shard(path):
    f = sorted(path.glob("*.safetensors"))[-1]
    f.unlink()
    return f.name


def _corrupt_index(path):
    (path / "model.safetensors.index.json").write_text('{"weight_map": ')
    return "model.safetensors.index.json"


def _not_safetensors(path):
    f = sorted(path.glob("*.safetensors"))[0]
    f.write_bytes(b"this is not a safetensors file")
    return f.name


def _config_not_json(path):
    (path / "config.json").write_text("{ not json")
    return "config.json"


BROKEN = {"truncated shard": _truncate, "missing shard": _drop_shard,
          "corrupt index": _corrupt_index, "not safetensors": _not_safetensors}


@pytest.mark.parametrize("check", ["echo", "transformers", "check_shards"])
@pytest.mark.parametrize("kind", list(BROKEN))
def test_broken_files_are_named(saved, tmp_path, kind, check):
    path = _copy(saved, tmp_path, "sharded")
    name = BROKEN[kind](path)
    with pytest.raises(ValueError) as e:
        check_shards(path) if check == "check_shards" else _load(check, path)
    assert name in str(e.value), (kind, check, str(e.value))


def test_a_config_that_is_not_json_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path, "sharded")
    _config_not_json(path)
    with pytest.raises(ValueError, match="config.json"):
        check_shards(path)


def test_the_field_is_named_by_search_where_the_table_has_none():
    config = dict(TINY, moe_intermediate_size=96)
    assert implied_field(config, "model.layers.0.mlp.experts.0.w1.weight", 0, 96) == \
        "moe_intermediate_size"
    assert implied_field(config, "model.layers.0.mlp.up_proj.weight", 0, 64) == \
        "intermediate_size"
    assert implied_field(config, "model.layers.0.self_attn.q_proj.weight", 0, 32) == \
        "num_attention_heads * head_dim = 4 * 8"
    assert implied_field(config, "x.weight", 0, 12345) == "fields"


def test_a_llama3_rope_checkpoint_is_refused_with_the_call_that_loads_it(tmp_path):
    """Llama-3.1+ ('llama3' RoPE scaling): load_hf_checkpoint refuses it, naming the exact
    echo_tp.hf.load_hf_tp call; that call, run as written, loads transformers' own model, whose
    logits are from_pretrained's bit for bit."""
    import echo_tp
    import echo_tp.hf
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=32)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=rope)).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] \
        == "llama3"
    with pytest.raises(ValueError) as err:
        load_hf_checkpoint(tmp_path, dtype=torch.float32)
    text = str(err.value)
    call = (f"echo_tp.hf.load_hf_tp({str(tmp_path)!r}, echo_tp.SimulatedCommunicator(1, "
            "echo_tp.EchoConfig(bits=16)), dtype=torch.float32)")
    assert str(tmp_path) in text and "'llama3'" in text and f"`{call}`" in text, text
    model = eval(call, {"echo_tp": echo_tp, "torch": torch})
    want = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = torch.randint(0, TINY["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x).logits, want(x).logits)

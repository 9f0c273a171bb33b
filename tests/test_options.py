"""The command line of eval and train against their options dataclasses (echo_tp.options): each
field is one option with its docstring as help, the parser's defaults are the fields', and a
parsed command line builds the same options as the keyword call. Every boolean option of every
subcommand (demo's too) shows both forms, `--x, --no-x`, its help saying what `--x` does and
the default (on / off), and both forms parse. Nothing runs.
Where to look when it fails: echo_tp/options.py (add_options, from_args) for a kind of field,
the dataclass (EvalOptions, TrainOptions, tp.runtime.Group) for one option.
"""
import argparse
import dataclasses

import pytest

from echo_tp import cli
from echo_tp.eval.perplexity import EvalOptions
from echo_tp.options import field_docs, from_args
from echo_tp.tp.runtime import Group
from echo_tp.train.loop import TrainOptions


def parse(argv):
    return cli.build_parser().parse_args(argv)


@pytest.mark.parametrize("tool, cls", [("eval", EvalOptions), ("eval", Group),
                                       ("train", TrainOptions), ("train", Group)])
def test_every_field_is_an_option_with_help(tool, cls):
    assert set(field_docs(cls)) == {f.name for f in dataclasses.fields(cls)}, cls
    text = cli.build_parser()._subparsers._group_actions[0].choices[tool].format_help()
    for f in dataclasses.fields(cls):
        flag = f.metadata.get("echo_tp.cli", {}).get("flag") or \
            "--" + f.name.replace("_", "-")
        assert flag in text, (tool, f.name)


def test_defaults_are_the_fields():
    a = parse(["train", "--train-data", "x.bin"])
    assert TrainOptions(**from_args(TrainOptions, a)) == TrainOptions(train_data="x.bin")
    assert from_args(Group, a) == {"simulate": None, "world_size": None}
    a = parse(["eval", "--model", "m", "--data", "d"])
    assert EvalOptions(**from_args(EvalOptions, a)) == EvalOptions(model="m", data="d")


def test_a_command_line_builds_the_keyword_call():
    a = parse(["train", "--train-data", "x.bin", "--model-field", "n_layers=2",
               "--model-field", "dim=64", "--bos-id", "3", "--no-amp", "--no-progress",
               "--simulate", "2", "--sim-path", "batched", "--time-budget", "1.5",
               "--steps", "7", "--compile"])
    assert TrainOptions(**from_args(TrainOptions, a)) == TrainOptions(
        train_data="x.bin", model_fields=("n_layers=2", "dim=64"), bos=True, bos_id=3,
        amp=False, progress=False, sim_path="batched", time_budget=1.5, steps=7, compile=True)
    assert from_args(Group, a)["simulate"] == 2
    a = parse(["eval", "--model", "m", "--data", "d", "--comms", "16", "echo4",
               "--model-impl", "echo", "--rotate", "5", "--kl", "--out", "r.json"])
    assert EvalOptions(**from_args(EvalOptions, a)) == EvalOptions(
        model="m", data="d", comms=("16", "echo4"), impl="echo", rotate=5, kl=True,
        out="r.json")
    with pytest.raises(SystemExit):
        parse(["train", "--train-data", "x", "--sim-path", "fast"])      # choices
    with pytest.raises(SystemExit):
        parse(["eval", "--data", "d"])                                     # --model is required


def _help(tool: str) -> str:
    text = cli.build_parser()._subparsers._group_actions[0].choices[tool].format_help()
    return " ".join(text.split())     # argparse's line breaks undone


REQUIRED = {"eval": ["--model", "m", "--data", "d"], "train": ["--train-data", "x.bin"],
            "demo": [], "tokenize": ["in.txt", "--out", "o.bin"]}


@pytest.mark.parametrize("tool", sorted(REQUIRED))
def test_every_boolean_option_reads_right_in_both_forms(tool):
    sub = cli.build_parser()._subparsers._group_actions[0].choices[tool]
    bools = [a for a in sub._actions if isinstance(a, argparse.BooleanOptionalAction)]
    others = [a for a in sub._actions if a.nargs == 0 and a.dest != "help"
              and not isinstance(a, argparse.BooleanOptionalAction)]
    assert not others, (tool, [a.option_strings for a in others])   # no lone --x or --no-x
    text = _help(tool)
    for a in bools:
        pos, neg = a.option_strings
        assert neg == "--no-" + pos[2:], (tool, a.option_strings)
        assert f"{pos}, {neg}" in text, (tool, pos)
        assert "--no-" not in a.help, (tool, pos, a.help)      # says what --x does
        if a.default is not None:
            assert a.help.endswith(f"(default: {'on' if a.default else 'off'})"), a.help
        for argv, want in (([pos], True), ([neg], False), ([], a.default)):
            got = getattr(sub.parse_args(REQUIRED[tool] + argv), a.dest)
            assert got is want, (tool, argv, got)


def test_progress_and_kl_help_text():
    assert "--progress, --no-progress Show a progress bar. (default: on)" in _help("train")
    assert "--progress, --no-progress Show a progress bar. (default: on)" in _help("eval")
    assert "--kl, --no-kl Also the KL divergence" in _help("eval")
    assert "--amp, --no-amp bf16 autocast (default: on for CUDA, off on CPU)." in _help("train")
    assert "--model, --no-model add the perplexity table of the shipped trained model " \
           "(default: on)" in _help("demo")
    a = parse(["eval", "--model", "m", "--data", "d", "--progress", "--no-kl", "--kl"])
    assert a.progress is True and a.kl is True
    a = parse(["demo", "--no-progress", "--no-model"])
    assert a.progress is False and a.with_model is False

"""A tool's options written once: its kw_only dataclass drives the command line.

    @dataclass(frozen=True, kw_only=True)
    class EvalOptions:
        context: int = 1024
        '''Tokens per window.'''                   # the docstring is the --context help
        impl: str = field(default="auto", metadata=cli(flag="--model-impl", choices=IMPLS))

    add_options(parser, EvalOptions)               # one argument per field
    opts = EvalOptions(**from_args(EvalOptions, args))

Each field becomes `--field-name` (metadata `cli(flag=...)` renames it), its help the field's
docstring, read from the class's source. The type decides the argument: int / float / str
(with `| None`: default None), bool -> both forms `--flag / --no-flag` (add_bool: the help says
what `--flag` does, and the default, on or off; `bool | None`: no default, the docstring says
what None means), tuple[str, ...] -> one or more values (an empty default accumulates over
repeated flags). A field without a default is required. `cli(...)` adds
choices, metavar, an argument group, and `implied_by`: a bool that another option's being set
turns on (`--bos-id N` implies `--bos`). A new option is one new field.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing

_KEY = "echo_tp.cli"


def cli(*, flag: str | None = None, choices=None, metavar: str | None = None,
        group: str | None = None, implied_by: str | None = None) -> dict:
    """Field metadata for its command-line argument (the module docstring)."""
    return {_KEY: {"flag": flag, "choices": None if choices is None else list(choices),
                   "metavar": metavar, "group": group, "implied_by": implied_by}}


def add_options(parser, cls, groups: dict | None = None) -> None:
    """One argument per field of the dataclass `cls` on parser; fields whose cli(group=NAME)
    go to groups[NAME] (an argparse argument group)."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_KEY, {})
        target = (groups or {}).get(meta.get("group"), parser)
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        kw: dict = {"dest": f.name, "help": docs.get(f.name)}
        if meta.get("choices") is not None:
            kw["choices"] = meta["choices"]
        if meta.get("metavar"):
            kw["metavar"] = meta["metavar"]
        base, optional = _unwrap(hints[f.name])
        has_default = f.default is not dataclasses.MISSING or \
            f.default_factory is not dataclasses.MISSING
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        if base is bool:
            add_bool(target, flag, dest=f.name, default=default, help=kw["help"])
            continue
        if typing.get_origin(base) is tuple:
            item = typing.get_args(base)[0]
            kw.update(nargs="+", type=item, default=list(default) if has_default else None)
            if has_default and not default:
                kw["action"] = "extend"
        else:
            kw["type"] = base
            if has_default:
                kw["default"] = default
        if not has_default:
            kw["required"] = True
        target.add_argument(flag, **kw)


def add_bool(parser, flag: str, *, dest: str, default: bool | None, help: str | None) -> None:
    """A boolean option in both forms, `--flag` (True) and `--no-flag` (False): help says what
    `--flag` does; " (default: on)" or " (default: off)" is added unless default is None."""
    action = parser.add_argument(flag, dest=dest, default=default,
                                 action=argparse.BooleanOptionalAction)
    if help is not None and default is not None:
        help = f"{help} (default: {'on' if default else 'off'})"
    action.help = help   # argparse's own default suffix differs between Python versions


def from_args(cls, args: argparse.Namespace) -> dict:
    """The field values of `cls` in parsed args (tuples as tuples; implied bools set)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        v = getattr(args, f.name)
        if typing.get_origin(_unwrap(hints[f.name])[0]) is tuple and v is not None:
            v = tuple(v)
        out[f.name] = v
    for f in dataclasses.fields(cls):
        by = f.metadata.get(_KEY, {}).get("implied_by")
        if by is not None and out[by] is not None:
            out[f.name] = True
    return out


@functools.lru_cache(maxsize=None)
def field_docs(cls) -> dict[str, str]:
    """{field: its docstring, whitespace joined} from the source of cls (the string right
    after the field's annotated assignment)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split()).replace("%", "%%")
    return docs


def _unwrap(tp) -> tuple[object, bool]:
    """(the type, whether None is allowed) of X or X | None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False

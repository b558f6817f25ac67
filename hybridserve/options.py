"""Dataclass fields that are also command-line options: the field holds the default, the type and the help, and
`add_options` turns the fields into argparse options, so a config class and its CLI cannot drift apart."""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Sequence
from typing import Any

_NO_DEFAULT = dataclasses.MISSING


def option(default: Any = _NO_DEFAULT, help: str = "", *, flags: Sequence[str] = (), negation: Sequence[str] = (),
           choices: Sequence[Any] | None = None, metavar: str | None = None, default_help: str | None = None,
           default_factory: Any = _NO_DEFAULT) -> Any:
    """A dataclass field with a command-line option.

    `flags`: its option strings (default: --the-field-name); `negation`: for a boolean whose default is true, the
    flags that turn it off; `default_help`: the default in words, where the value (None) says nothing."""
    metadata = {"help": help, "flags": tuple(flags), "negation": tuple(negation), "choices": choices,
                "metavar": metavar, "default_help": default_help}
    if default_factory is not _NO_DEFAULT:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def option_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are command-line options."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def flags_of(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata["flags"] or (f"--{f.name.replace('_', '-')}",)


def option_flag(cls: type, name: str) -> str:
    """The command-line flag of `cls`'s option field `name` (its first), for errors that name what the user typed."""
    return flags_of(next(f for f in option_fields(cls) if f.name == name))[0]


def _value_type(annotation: Any) -> type:
    """The type an option parses to: its annotation's first member other than None (`int | None` -> int, `str |
    torch.dtype` -> str)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return typing.get_origin(annotation) or annotation


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is _NO_DEFAULT else f.default


def _shown(f: dataclasses.Field) -> str:
    default = _default(f)
    if f.metadata["default_help"] is not None:
        return f.metadata["default_help"]
    if isinstance(default, dict):
        return json.dumps(default)
    return "off" if default is None or default is False else "on" if default is True else str(default)


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One option per option field of `cls` (dest = the field name), each help ending with its default."""
    hints = typing.get_type_hints(cls)
    for f in option_fields(cls):
        kind, meta = _value_type(hints[f.name]), f.metadata
        text = f"{meta['help']} (default: {_shown(f)})"
        if kind is bool:
            group = parser.add_mutually_exclusive_group()
            group.add_argument(*flags_of(f), dest=f.name, action="store_true", default=_default(f), help=text)
            if meta["negation"]:
                group.add_argument(*meta["negation"], dest=f.name, action="store_false",
                                   help=f"the opposite of {flags_of(f)[0]}")
            continue
        parse = json.loads if kind is dict else kind
        parser.add_argument(*flags_of(f), dest=f.name, type=parse, default=_default(f), choices=meta["choices"],
                            metavar=meta["metavar"], help=text)


def option_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The parsed values of `cls`'s option fields, by field name."""
    return {f.name: getattr(args, f.name) for f in option_fields(cls)}

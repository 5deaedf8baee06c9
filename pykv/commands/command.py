"""``PykvCommand``: the click command of every ``pykv`` subcommand; it reads the raw arguments first.

- A size split in two (``--dram 16 GB``) would be 16 bytes and a stray ``GB`` (given to vLLM by
  ``serve`` and ``warm``): a size option (metavar ``SIZE``), or ``--set`` of a size key, whose value
  is followed by a unit word alone is refused in one line.
- An empty ``DIR`` (``--root ""``) or ``ROOT`` (``pykv gc "$UNSET"``) would be the current
  directory: refused.
- ``--roots A B C`` is ``--roots A --roots B --roots C``: it takes every argument up to the next
  option (so ``MODEL`` or ``PROMPTS`` go before it).
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand

from pykv.config import FIELDS
from pykv.errors import InputError
from pykv.units import is_unit_word, parse_size

SEVERAL = ("--roots",)
"""Options that take every argument up to the next option."""
SETTING = "--set"
SIZE_KEYS = frozenset(f.name for f in FIELDS if f.metadata["type"] == "size")
"""``--set KEY=VALUE`` keys whose value is a size."""


class PykvCommand(TyperCommand):
    """A typer command that checks its raw arguments (module docstring) before click parses them."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        options = {name: param for param in self.params if param.param_type_name == "option" for name in param.opts}
        args = expand_several(args, [name for name in SEVERAL if name in options])
        refuse_split_sizes(args, {name for name, p in options.items() if p.metavar == "SIZE"},
                           settings=SETTING in options)
        refuse_empty(args, {name for name, p in options.items() if p.metavar == "DIR"})
        if any(p.param_type_name == "argument" and p.metavar == "ROOT" for p in self.params):
            refuse_empty_roots(args, options)
        return super().parse_args(ctx, args)


def expand_several(args: list[str], names: list[str]) -> list[str]:
    """``--roots A B`` as ``--roots A --roots B``: the arguments after each of ``names`` up to the next
    option (one starting with ``-``) or ``--``."""
    out: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        out.append(arg)
        index += 1
        if arg == "--":
            return out + args[index:]
        name, sep, _ = arg.partition("=")
        if name not in names:
            continue
        if not sep and index < len(args):  # its first value, whatever it looks like
            out.append(args[index])
            index += 1
        while index < len(args) and not args[index].startswith("-"):
            out += [name, args[index]]
            index += 1
    return out


def refuse_split_sizes(args: list[str], flags: set[str], *, settings: bool) -> None:
    """``InputError`` for a size flag's value (or ``--set`` of a size key) followed by a unit word
    alone, when both together are a size: ``--dram 16 GB``, ``--set dram_bytes=16 G``."""
    for index, arg in enumerate(args):
        if arg == "--":
            return
        name, sep, inline = arg.partition("=")
        value, after = (inline, index + 1) if sep else (_at(args, index + 1), index + 2)
        key = None
        if name == SETTING and settings and value is not None:
            key, pair, value = value.partition("=")
            key = pair_key(key)
            if not pair or key not in SIZE_KEYS:
                continue
        elif name not in flags:
            continue
        unit = _at(args, after)
        if value is None or unit is None or not is_unit_word(unit) or not _is_size(value + unit):
            continue
        joined = f"{value.strip()}{unit}"
        where, written = (f"{name} {key}", f"{key}={joined}") if key else (name, joined)
        raise InputError(f"{where}: '{value} {unit}' is split in two arguments; write {written}")


def refuse_empty(args: list[str], flags: set[str]) -> None:
    """``InputError`` for an empty value of a directory option (it would mean the current directory)."""
    for index, arg in enumerate(args):
        if arg == "--":
            return
        name, sep, inline = arg.partition("=")
        value = inline if sep else _at(args, index + 1)
        if name in flags and value is not None and not value.strip():
            raise InputError(f"{name}: an empty path; give a directory")


def refuse_empty_roots(args: list[str], options: dict[str, Any]) -> None:
    """``InputError`` for an empty positional argument of a command whose arguments are ``ROOT``s
    (an unset variable would make the current directory the tree gc deletes from)."""
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if arg == "--":
            positional = args[index:]
        elif arg.startswith("-") and arg != "-":
            name, sep, _ = arg.partition("=")
            param = options.get(name)
            if param is not None and not sep and not (param.is_flag or getattr(param, "count", False)):
                index += 1  # its value, whatever it is
            continue
        else:
            positional = [arg]
        if any(value == "" for value in positional):  # " " may name a directory; "" never does
            raise InputError("ROOT: an empty path; give the tree's directory")
        if arg == "--":
            return


def pair_key(text: str) -> str:
    """The KEY of a ``KEY=VALUE`` option (``--set``, ``--engine-arg``) as keys are spelled: ``dram-bytes``
    is ``dram_bytes``."""
    return text.strip().lstrip("-").replace("-", "_")


def _at(args: list[str], index: int) -> str | None:
    return args[index] if index < len(args) else None


def _is_size(text: str) -> bool:
    try:
        parse_size(text)
    except InputError:
        return False
    return True


"""How commands print: rich tables for people, one JSON document for scripts, one line per error.

Everything that came from the tree (file names, ``namespace.json`` fields, error texts
that quote them) is printed as text, never as rich markup, and with control characters
and undecodable bytes shown as visible escapes (``visible``): a file named
``[red]evil`` prints as ``[red]evil``, an escape sequence cannot reach the terminal.

Every error a user can cause (a missing root, a directory that is not a tree, a
size that does not parse, a click usage error) ends as ``pykv: error: <message>``
on stderr with exit status 2; nothing else is printed and nothing was changed.
An ``OSError`` from the tree itself (permissions, I/O) is one such line with status 1.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from pykv.commands.command import pair_key
from pykv.deviceset import DeviceSet, check_roots
from pykv.errors import InputError, PykvError
from pykv.tree import KVTree
from pykv.units import format_size

USAGE_EXIT = 2
PROGRAM = "pykv"

try:  # typer >= 0.22 vendors click; older typer raises click's own exceptions
    from click import ClickException as _ClickException
    _CLI_ERRORS: tuple[type[Exception], ...] = (typer.TyperException, _ClickException)
except ImportError:  # pragma: no cover
    _CLI_ERRORS = (typer.TyperException,)


def console() -> Console:
    """A console on the current stdout (tests swap it); markup and highlighting off, so no
    text from the tree is ever read as markup."""
    return Console(file=sys.stdout, soft_wrap=False, markup=False, highlight=False, emoji=False)


_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (os.fsdecode's surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: object) -> str:
    """``text`` with control characters and undecodable bytes as visible escapes (``\\x1b``)."""
    return _UNPRINTABLE.sub(_escape, str(text))


def _visible_data(data: Any) -> Any:
    if isinstance(data, str):
        return visible(data)
    if isinstance(data, dict):
        return {key: _visible_data(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_visible_data(value) for value in data]
    return data


def _finite(data: Any) -> Any:
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(value) for value in data]
    return data


def emit(data: dict[str, Any], *, as_json: bool, render: Callable[[Console, dict[str, Any]], None]) -> None:
    """Print ``data`` as one JSON document (control characters escaped by JSON itself), or
    through ``render`` as tables, with every string made ``visible`` first."""
    if as_json:  # strict JSON: a NaN or an infinity read from a tree's metadata is null
        typer.echo(json.dumps(_finite(data), indent=2, sort_keys=False, default=str, allow_nan=False))
    else:
        render(console(), _visible_data(data))


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 block``, ``2 blocks``, ``0 blocks`` (``nouns``: an irregular plural)."""
    return f"{count} {noun}" if count == 1 else f"{count} {nouns or noun + 's'}"


def line(out: Console, text: str) -> None:
    """One line of text that the console never wraps (a long path stays copyable)."""
    out.print(Text(text), soft_wrap=True)


def warn(message: str) -> None:
    """One line on stderr that does not change the exit status."""
    typer.echo(f"{PROGRAM}: warning: {visible(message)}", err=True)


def error_line(message: str) -> str:
    return f"{PROGRAM}: error: {visible(' '.join(str(message).split()))}"


class VisibleWarnings(logging.Handler):
    """Python's last-resort log handler for the commands: a warning of pykv's own code (gc, the
    catalog) as one ``pykv: warning:`` line, control characters of the paths it names escaped;
    another library's record goes to the handler it replaced, as before. Used only where no
    handler was set up (an engine routes pykv's logs through vLLM's)."""

    def __init__(self, previous: logging.Handler | None) -> None:
        super().__init__(logging.WARNING)
        self.previous = previous

    def emit(self, record: logging.LogRecord) -> None:
        if record.name != PROGRAM and not record.name.startswith(PROGRAM + "."):
            if self.previous is not None:
                self.previous.handle(record)
            return
        try:
            text = " ".join(record.getMessage().split())
        except Exception:  # noqa: BLE001 - a message that does not format is still a line
            text = str(record.msg)
        sys.stderr.write(f"{PROGRAM}: {record.levelname.lower()}: {visible(text)}\n")


def run_guarded(main: Callable[..., Any], standalone_mode: bool, **kwargs: Any) -> Any:
    """Run a click ``main`` non-standalone, turning every user error into one line.

    Used by the app's group class, so each command, present or future, gets it.
    """
    if not isinstance(logging.lastResort, VisibleWarnings):
        logging.lastResort = VisibleWarnings(logging.lastResort)
    try:
        rv = main(standalone_mode=False, **kwargs)
    except _CLI_ERRORS as exc:
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()  # type: ignore[attr-defined]  # bare ``pykv``: the help text
        else:
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            typer.echo(error_line(exc.format_message()) + hint, err=True)  # type: ignore[attr-defined]
        rv = getattr(exc, "exit_code", USAGE_EXIT)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo(error_line("aborted"), err=True)
        rv = 130
    except PykvError as exc:
        typer.echo(error_line(str(exc)), err=True)
        rv = USAGE_EXIT
    except OSError as exc:  # the tree, not the user: permissions, a full disk, I/O errors
        typer.echo(error_line(str(exc)), err=True)
        rv = 1
    if standalone_mode:
        sys.exit(rv if isinstance(rv, int) else 0)
    return rv


def size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


def table(title: str | None, columns: list[str], rows: list[list[Any]], *, right: set[str] = frozenset()) -> Table:
    """A plain rich table; ``right`` names right-aligned (numeric) columns."""
    out = Table(title=None if title is None else Text(visible(title), style="bold"), title_justify="left",
                show_edge=False, pad_edge=False)
    for name in columns:
        numeric = name in right
        out.add_column(name, justify="right" if numeric else "left", no_wrap=numeric,
                       min_width=len(name) if numeric else None, overflow="fold")
    for row in rows:
        out.add_row(*(Text(visible(cell)) for cell in row))
    return out


# -- options shared by the reporting commands ---------------------------------------------
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")]
NoCatalogFlag = Annotated[bool, typer.Option(
    "--no-catalog", help="List every directory instead of reusing the scan cache in .pykv/catalog.db.")]
EngineArgOption = Annotated[Optional[list[str]], typer.Option(
    "--engine-arg", metavar="KEY=VALUE",
    help="vllm.LLM argument, e.g. load_format=dummy (VALUE read as JSON if it parses); repeatable.")]
EngineArgsOption = Annotated[Optional[str], typer.Option(
    "--engine-args", metavar="JSON", help="vllm.LLM arguments as one JSON object (--engine-arg wins).")]
RootArgument = Annotated[Path, typer.Argument(
    metavar="ROOT", help="The tree's root directory (holding pykv-tree.json).", show_default=False)]
RootsArgument = Annotated[list[Path], typer.Argument(
    metavar="ROOT", show_default=False,
    help="The tree's root directory (holding pykv-tree.json); several: the trees of one device set, "
         "one per device, as the engines' roots list them.")]


def open_roots(roots: list[Path]) -> DeviceSet:
    """The trees at ``ROOT...`` as one set: one root opens as ``KVTree.open`` does (its errors
    unchanged); several are refused, naming ``ROOT[i]``, when one is missing, not a tree, or
    overlaps another (``DeviceSet.open``)."""
    if len(roots) == 1:
        return DeviceSet([KVTree.open(roots[0])], field="ROOT")
    return DeviceSet.open(roots, field="ROOT")


# -- KEY=VALUE options (--engine-arg, --set) --------------------------------------------------
def parse_pairs(option: str, items: list[str], *, json_values: bool = True) -> dict[str, Any]:
    """``KEY=VALUE`` items of a repeatable option; dashes in KEY become underscores. VALUE is read
    as JSON when it parses (8192, true, {...}) and ``json_values``, else kept as text. Errors
    name ``option``."""
    values: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = pair_key(key)
        if not sep or not key:
            raise InputError(f"{option}: expected KEY=VALUE, got {item!r}")
        values[key] = value
        if json_values:
            try:
                values[key] = json.loads(value)
            except (ValueError, RecursionError):  # not JSON (or nested too deeply for it): text
                pass
    return values


def parse_settings(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items: pykv keys, VALUE as text (``PykvConfig`` parses each key itself,
    so ``--set file_mode=600`` is octal, as in ``kv_connector_extra_config``)."""
    return parse_pairs("--set", items, json_values=False)


def parse_engine_args(text: str | None, items: list[str], *, reserved: tuple[str, ...] = ("model",)) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments from ``--engine-args JSON`` and ``--engine-arg KEY=VALUE``
    (the latter win); keys in ``reserved`` are set by the command itself."""
    values: dict[str, Any] = {}
    if text:
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise InputError(f"--engine-args: not JSON: {exc}") from None
        except RecursionError:
            raise InputError("--engine-args: not JSON: nested too deeply") from None
        if not isinstance(values, dict):
            raise InputError("--engine-args: expected a JSON object of vllm.LLM arguments")
    values = {**values, **parse_pairs("--engine-arg", items)}
    for key in reserved:
        if key in values:
            raise InputError(f"--engine-arg {key}: set by the command (see its --help)")
    return values


def engine_roots(roots: list[Path]) -> list[Path]:
    """``--root`` directories as an engine gets them: absolute (a relative one is taken from the current
    directory), checked as the engine will check them (``check_roots``): each must exist."""
    absolute = absolute_roots(roots)
    check_roots(absolute, field="--root")
    return absolute


def absolute_roots(roots: list[Path]) -> list[Path]:
    """``--root`` directories made absolute against the current directory (``PykvConfig`` takes no other)."""
    return [root.absolute() for root in roots]

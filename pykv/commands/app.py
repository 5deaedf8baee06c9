"""The ``pykv`` command: one typer app; each subcommand lives in its own module.

To add a command, write ``pykv/commands/<name>.py`` with a function and register it
below with ``app.command("<name>", cls=PykvCommand)(<module>.<function>)`` (``PykvCommand``
checks sizes split in two and takes ``--roots A B``); then regenerate the
completions and docs (``python -m pykv.commands.completions --write completions/
--docs docs/cli.md``).
"""

from __future__ import annotations

import importlib.metadata
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from pykv.commands import bench, calibrate, completions, config, demo, doctor, fsck, gc, init, inspect, serve, warm
from pykv.commands.command import PykvCommand
from pykv.commands.output import run_guarded


class PykvGroup(TyperGroup):
    """Lists commands in registration order and reports errors as one line (``output``)."""

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        return run_guarded(super().main, standalone_mode, args=args, prog_name=prog_name or "pykv",
                           complete_var=complete_var, **extra)


app = typer.Typer(cls=PykvGroup, name="pykv", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Administer a pykv tree: the hash-addressed files of an external KV cache for vLLM.")

def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"pykv {package_version()}")
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_show_version,
                                                   help="Print pykv's version and exit.")] = False) -> None:
    """Administer a pykv tree: the hash-addressed files of an external KV cache for vLLM."""


def package_version() -> str:
    """The installed distribution's version (``pyproject.toml`` when run from a checkout)."""
    try:
        return importlib.metadata.version("pykv")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


app.command("demo", cls=PykvCommand)(demo.demo_command)
app.command("serve", cls=PykvCommand, context_settings=serve.PASS_THROUGH)(serve.serve_command)
app.command("inspect", cls=PykvCommand)(inspect.inspect_command)
app.command("gc", cls=PykvCommand)(gc.gc_command)
app.command("fsck", cls=PykvCommand)(fsck.fsck_command)
app.command("init", cls=PykvCommand)(init.init_command)
app.command("doctor", cls=PykvCommand)(doctor.doctor_command)
app.command("bench", cls=PykvCommand)(bench.bench_command)
app.command("config", cls=PykvCommand)(config.config_command)
app.command("calibrate", cls=PykvCommand)(calibrate.calibrate_command)
app.command("warm", cls=PykvCommand, context_settings=serve.PASS_THROUGH)(warm.warm_command)
app.command("completions", cls=PykvCommand)(completions.completions_command)

def main() -> None:
    """Console-script entry point."""
    app()

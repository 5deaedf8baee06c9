"""The ``pykv`` command: one typer app; each subcommand lives in its own module.

To add a command, write ``commands/<name>.py`` with a function and register it
below with ``app.command("<name>")(<module>.<function>)``; then regenerate the
completions and docs (``python -m pykv.commands.completions --write completions/
--docs docs/cli.md``).
"""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperGroup

from pykv.commands import bench, calibrate, config, demo, fsck, gc, init, inspect, warm
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

app.command("demo")(demo.demo_command)
app.command("inspect")(inspect.inspect_command)
app.command("gc")(gc.gc_command)
app.command("fsck")(fsck.fsck_command)
app.command("init")(init.init_command)
app.command("bench")(bench.bench_command)
app.command("config")(config.config_command)
app.command("calibrate")(calibrate.calibrate_command)
app.command("warm")(warm.warm_command)


def main() -> None:
    """Console-script entry point."""
    app()

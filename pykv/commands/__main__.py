"""``python -m pykv.commands``: the ``pykv`` command, for environments without the console script on PATH."""

from pykv.commands.app import main

main()

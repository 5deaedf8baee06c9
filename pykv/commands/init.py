"""``pykv init``: make a directory a pykv tree explicitly (``KVTree.create(adopt=True)``)."""

from __future__ import annotations

import typer

from pykv.commands.output import RootArgument
from pykv.errors import InputError
from pykv.tree import KVTree, MARKER_NAME


def init_command(root: RootArgument) -> None:
    """Make ROOT a pykv tree (writes its marker), also when it already holds other files.

    An engine refuses a root that holds files and no tree marker; this is how you say that
    such a directory is meant to be a tree. pykv never deletes what it did not create:
    'pykv fsck --repair' moves such files to .pykv/quarantine/.
    """
    if root.exists() and not root.is_dir():
        raise InputError(f"ROOT: {root} is not a directory")
    tree = KVTree.create(root, adopt=True, field="ROOT")
    typer.echo(f"{tree.root}: a pykv tree ({MARKER_NAME})")

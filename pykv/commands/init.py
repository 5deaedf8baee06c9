"""``pykv init``: make a directory a pykv tree explicitly (``create_root``, ``KVTree.create(adopt=True)``)."""

from __future__ import annotations

import typer

from pykv.commands.output import RootArgument
from pykv.errors import RootError
from pykv.roots import create_root
from pykv.tree import KVTree, MARKER_NAME


def init_command(root: RootArgument) -> None:
    """Make ROOT a pykv tree (writes its marker), creating ROOT if missing but never its parents.

    The one command that creates a root: engines and the other commands need it to exist (a
    device that did not mount must not become an empty directory). An engine refuses a root that
    holds files and no tree marker; init is also how you say that such a directory is meant to be
    a tree. A directory inside a tree (a namespace, shard or .pykv) is refused. pykv never deletes
    what it did not create: 'pykv fsck --repair' moves such files to .pykv/quarantine/.
    """
    create_root(root, field="ROOT")
    try:
        tree = KVTree.create(root, adopt=True, field="ROOT", mkdir=False)
    except OSError as exc:  # an unwritable or read-only directory, a full disk
        raise RootError(f"ROOT: cannot make {root} a tree ({exc.strerror or exc})") from None
    typer.echo(f"{tree.root}: a pykv tree ({MARKER_NAME})")

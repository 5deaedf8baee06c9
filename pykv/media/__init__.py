"""Storage media: where block files live (``base.Medium`` is the contract).

A new medium is one new module here plus one line in ``MEDIA``. ``StripedMedium`` is
not a medium of its own kind but a composition: one leaf medium per device of a set.
"""

from __future__ import annotations

from pykv.media.base import Medium, OpenSpec, WriteTarget
from pykv.media.posix import PosixMedium
from pykv.media.striped import StripedMedium
from pykv.tree import KVTree

MEDIA: dict[str, type[Medium]] = {
    "posix": PosixMedium,
}


def open_medium(name: str, tree: KVTree, **options: object) -> Medium:
    """The medium called ``name`` over ``tree`` (``options``: the medium's own, e.g. ``direct``)."""
    try:
        medium = MEDIA[name]
    except KeyError:
        raise ValueError(f"unknown medium {name!r}; one of: {', '.join(sorted(MEDIA))}") from None
    return medium(tree, **options)


__all__ = ["MEDIA", "Medium", "OpenSpec", "PosixMedium", "StripedMedium", "WriteTarget", "open_medium"]
